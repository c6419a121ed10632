"""Preparation isolation (issue 26): what request-sized preparation by one client costs another.

Each case is timed against a baseline taken in the same run:

* huge prompts: a short request's time to first token while four 15 MB prompts (which can never
  fit the context) are submitted just before it;
* big schemas: a trivial json_schema request's latency while six distinct ~0.7 MB schemas are
  compiled (their requests submitted just before it);
* decode: the longest gap between two tokens of a running stream while 1M ids are decoded.

    python bench/preparation_isolation.py MODEL.base   # run from the repository root to measure
                                                       # that checkout (main for "before")
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.getcwd())  # the checkout this is run from, so one script measures before and after

import anyio

from aiobasert import Engine


async def _swallow(call: Any, outcomes: list[str] | None = None) -> None:
    try:
        await call()
        what = "served"
    except Exception as exc:
        what = type(exc).__name__
    if outcomes is not None:
        outcomes.append(what)


async def _ttft(engine: Engine, prompt: str, **kw: Any) -> float:
    t = time.perf_counter()
    stream = engine.stream(prompt, max_tokens=2, **kw)
    async for _ in stream:
        break
    took = time.perf_counter() - t
    async for _ in stream:
        pass
    return took


async def huge_prompts(engine: Engine) -> tuple[float, float]:
    base = await _ttft(engine, "Hello there")
    huge = "lorem ipsum dolor " * (15_000_000 // 18)
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(_swallow, lambda: engine.generate(huge, max_tokens=1))
        await anyio.sleep(0)
        loaded = await _ttft(engine, "Hello there")
    return base, loaded


def _big_schema(seed: int) -> dict[str, Any]:
    props = {f"field_{seed}_{i}": {"type": "integer", "minimum": i} for i in range(14_000)}
    return {"type": "object", "properties": props, "required": list(props)[:10]}


async def big_schemas(engine: Engine) -> tuple[float, float, list[str], float]:
    await engine.generate("x", max_tokens=3, json_schema={"type": "integer", "minimum": 0})  # backend built
    t = time.perf_counter()
    await engine.generate("x", max_tokens=3, json_schema={"type": "integer", "minimum": 1})
    base = time.perf_counter() - t
    schemas = [_big_schema(i) for i in range(6)]
    outcomes: list[str] = []
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for schema in schemas:
            tg.start_soon(_swallow, lambda s=schema: engine.generate("x", max_tokens=1, json_schema=s), outcomes)
        await anyio.sleep(0.05)
        t = time.perf_counter()
        await engine.generate("x", max_tokens=3, json_schema={"type": "integer", "minimum": 2})
        loaded = time.perf_counter() - t
    return base, loaded, outcomes, time.perf_counter() - started


async def decode_gap(engine: Engine) -> tuple[float, float]:
    ids = (await engine.encode("The quick brown fox jumps over the lazy dog. " * 40))[:500]
    many = ids * (1_000_000 // len(ids))
    stamps: list[float] = []
    marks: list[int] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            async for _ in engine.stream("Once upon a time", max_tokens=400, ignore_eos=True):
                stamps.append(time.perf_counter())

        tg.start_soon(run)
        while len(stamps) < 50:
            await anyio.sleep(0.005)
        marks.append(len(stamps))
        await _swallow(lambda: engine.decode(many))
        marks.append(len(stamps))
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    before = sorted(gaps[: marks[0] - 1])[len(gaps[: marks[0] - 1]) // 2]
    during = max(gaps[marks[0] - 2 : marks[1] + 1])
    return before, during


async def main(model: str) -> None:
    async with Engine.open(model, max_batch_size=4, max_context=2048) as engine:
        await engine.generate("warm up", max_tokens=2)
        base, loaded = await huge_prompts(engine)
        print(f"huge prompts: short request TTFT {base * 1000:.0f} ms alone, {loaded * 1000:.0f} ms behind 4 x 15 MB")
        base, loaded, outcomes, total = await big_schemas(engine)
        print(f"big schemas: trivial json_schema {base * 1000:.0f} ms alone, {loaded * 1000:.0f} ms behind 6 x 0.7 MB"
              f" (those: {', '.join(sorted(outcomes))} after {total:.1f} s)")  # fmt: skip
        median, worst = await decode_gap(engine)
        print(f"decode 1M ids: stream gap median {median * 1000:.1f} ms, longest during decode {worst * 1000:.0f} ms")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
