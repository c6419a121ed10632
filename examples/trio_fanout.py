"""agent_fanout.py written in plain trio: the SDK needs no asyncio and no anyio in your code.

    python examples/trio_fanout.py [MODEL.base] [--calls 50] [--timeout 10] [--max-tokens 48]

A nursery starts every call and `trio.fail_after` bounds each one; a call that
misses its deadline is cancelled and its engine lane freed, as under asyncio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import trio

from aiobasert import ChatMessage, Engine

TOPICS = ["the moon", "rivers", "bread", "owls", "glaciers", "chess", "bees", "volcanoes", "tea", "comets"]


@dataclass
class CallResult:
    index: int
    ok: bool
    tokens: int
    latency_s: float


async def ask(engine: Engine, index: int, timeout: float, max_tokens: int, results: list[CallResult]) -> None:
    """One agent call: a short chat request that must finish within `timeout` seconds."""
    question = f"In one sentence, what is interesting about {TOPICS[index % len(TOPICS)]}?"
    start = time.perf_counter()
    try:
        with trio.fail_after(timeout):
            completion = await engine.chat(
                [ChatMessage(role="user", content=question)], max_tokens=max_tokens, temperature=0.7, seed=index
            )
    except trio.TooSlowError:
        results.append(CallResult(index, ok=False, tokens=0, latency_s=time.perf_counter() - start))
        return
    results.append(CallResult(index, True, completion.usage.completion_tokens, time.perf_counter() - start))


async def main(model: str | None, calls: int, timeout: float, max_tokens: int) -> None:
    async with Engine.open(model, max_batch_size=8) as engine:
        results: list[CallResult] = []
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(calls):
                nursery.start_soon(ask, engine, i, timeout, max_tokens, results)
        wall = time.perf_counter() - start
        stats = await engine.stats()

    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    print(
        f"{calls} calls in {wall:.2f} s ({engine.info.max_batch_size} lanes, trio): {len(ok)} ok, "
        f"{calls - len(ok)} timed out, {tokens} tokens, {tokens / wall:.0f} tok/s"
    )
    if ok:
        latencies = sorted(r.latency_s for r in ok)
        p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
        print(f"latency of ok calls: p50 {statistics.median(latencies):.3f} s, p95 {p95:.3f} s")
    print(
        f"engine: live_sequences={stats.live_sequences} requests_finished={stats.requests_finished} "
        f"requests_cancelled={stats.requests_cancelled}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=os.environ.get("AIOBASERT_MODEL"), help="a .base bundle")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds each call may take")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    trio.run(main, args.model, args.calls, args.timeout, args.max_tokens)
