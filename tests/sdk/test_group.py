"""EngineGroup: several models in one process, lookup by name, idle unload with keep-alive,
lease refcounting, per-model stats (reference engine, two tiny models)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import anyio
import pytest

from aiobasert import (
    AioBaseRTError,
    Engine,
    EngineClosedError,
    EngineGroup,
    InvalidConfigError,
    InvalidRequestError,
    UnknownModelError,
)
from aiobasert.testing import thread_state

pytestmark = pytest.mark.anyio


async def greedy(engine: Engine, prompt: str = "Once upon a time") -> list[int]:
    return [t.id async for t in engine.stream(prompt, max_tokens=8, temperature=0)]


async def wait_for(condition_name: str, check: object, timeout: float = 15.0) -> None:
    """Poll an async predicate until it holds; a bounded wait (fails, never hangs)."""
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {condition_name}"
        await anyio.sleep(0.02)


async def test_models_are_named_routed_and_separate(tiny_model_path: Path, second_tiny_model_path: Path) -> None:
    async with EngineGroup.open([tiny_model_path, f"other={second_tiny_model_path}"], max_batch_size=2) as group:
        assert group.names == ["tiny", "other"]
        assert group.default == "tiny"
        async with group.lease("tiny") as a, group.lease("other") as b, group.lease(None) as default:
            assert default is a and a is not b
            assert a._thread.thread_id != b._thread.thread_id  # one engine thread per model (private: no public id)
            out_a, out_b = await greedy(a), await greedy(b)
        stats = await group.stats()
    assert out_a != out_b  # different weights: the lease really picked the named model
    async with Engine.open(second_tiny_model_path, max_batch_size=2) as solo:
        assert await greedy(solo) == out_b
    assert stats["tiny"].requests == 2 and stats["other"].requests == 1
    assert stats["other"].loaded and stats["other"].engine is not None
    assert stats["other"].engine.requests_finished == 1
    assert stats["other"].path == str(second_tiny_model_path)


async def test_unknown_model_is_a_typed_error(tiny_model_path: Path) -> None:
    async with EngineGroup.open({"a": tiny_model_path}) as group:
        with pytest.raises(UnknownModelError) as info:
            async with group.lease("gpt-4o"):
                pass
        assert isinstance(info.value, AioBaseRTError) and isinstance(info.value, LookupError)
        assert info.value.name == "gpt-4o" and info.value.known == ["a"]
        assert "gpt-4o" in str(info.value)
        assert "gpt-4o" not in group and "a" in group


def test_bad_model_lists_are_refused(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match="two models are named"):
        EngineGroup.open([tiny_model_path, tiny_model_path])
    with pytest.raises(ValueError, match="at least one model"):
        EngineGroup.open([])
    with pytest.raises(InvalidConfigError, match="not one path"):
        EngineGroup.open(str(tiny_model_path))
    with pytest.raises(ValueError, match="keep_alive"):
        EngineGroup.open([tiny_model_path], keep_alive=-1)
    # Engine options are refused at open, not at a lazily loaded model's first lease
    with pytest.raises(InvalidConfigError, match="kv_cache_dtype must be one of"):
        EngineGroup.open([tiny_model_path], preload=False, kv_cache_dtype="bf16")
    with pytest.raises(InvalidConfigError, match="max_context must be an integer"):
        EngineGroup.open([tiny_model_path], preload=False, max_context="2048")
    with pytest.raises(InvalidConfigError, match="unexpected keyword argument 'max_ctx'"):
        EngineGroup.open([tiny_model_path], preload=False, max_ctx=2048)


async def test_idle_model_unloads_and_reloads_on_next_lease(tiny_model_path: Path) -> None:
    async with EngineGroup.open([tiny_model_path], keep_alive=0.05) as group:
        async with group.lease("tiny") as first:
            before = await greedy(first)

        async def unloaded() -> bool:
            return not (await group.stats())["tiny"].loaded

        await wait_for("the idle model to unload", unloaded)
        assert first.closed and group.loaded("tiny") is None
        async with group.lease("tiny") as second:
            assert second is not first
            assert await greedy(second) == before
        stats = (await group.stats())["tiny"]
    assert stats.loads == 2 and stats.unloads >= 1 and stats.requests == 2


async def test_a_preloaded_model_nobody_uses_unloads_too(tiny_model_path: Path) -> None:
    async with EngineGroup.open([tiny_model_path], keep_alive=0.05) as group:
        assert group.loaded("tiny") is not None

        async def unloaded() -> bool:
            return not (await group.stats())["tiny"].loaded

        await wait_for("the unused model to unload", unloaded)
        stats = (await group.stats())["tiny"]
    assert stats.requests == 0 and stats.loads == 1 and stats.unloads == 1


async def test_a_leased_model_is_never_unloaded(tiny_model_path: Path) -> None:
    """keep_alive=0 unloads as soon as the last lease ends, and not a moment before."""
    async with EngineGroup.open([tiny_model_path], keep_alive=0) as group:
        async with group.lease("tiny") as engine:
            stream = engine.stream("Once upon a time", max_tokens=40, temperature=0)
            first = await anext(stream)
            # Well past keep_alive, with the reaper free to run, the leased model stays.
            for _ in range(20):
                await anyio.sleep(0.01)
            stats = (await group.stats())["tiny"]
            assert stats.loaded and stats.leases == 1 and stats.unloads == 0
            rest = [t async for t in stream]
            assert first.index == 0 and len(rest) == 39

        async def unloaded() -> bool:
            return not (await group.stats())["tiny"].loaded

        await wait_for("the released model to unload", unloaded)
        assert engine.closed


async def test_concurrent_leases_of_an_unloaded_model_load_it_once(tiny_model_path: Path) -> None:
    async with EngineGroup.open([tiny_model_path], preload=False, keep_alive=math.inf) as group:
        assert group.loaded("tiny") is None
        engines: list[Engine] = []

        async def use() -> None:
            async with group.lease("tiny") as engine:
                engines.append(engine)
                await greedy(engine)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(use)
        stats = (await group.stats())["tiny"]
    assert len({id(e) for e in engines}) == 1 and stats.loads == 1 and stats.requests == 4


async def test_close_closes_every_engine_and_refuses_leases(
    tiny_model_path: Path, second_tiny_model_path: Path
) -> None:
    async with EngineGroup.open([tiny_model_path, second_tiny_model_path]) as group:
        engines = [group.loaded(n) for n in group.names]
    assert all(e is not None and e.closed for e in engines)
    assert group.closed
    with pytest.raises(EngineClosedError):
        async with group.lease("tiny"):
            pass


async def test_leaving_on_a_timeout_aborts_an_unload_drain(tiny_model_path: Path) -> None:
    # A stream outlives its lease; keep_alive=0 unloads (drains) its engine at
    # once. Leaving the block on a timeout then aborts that drain (was: it ran the
    # stream's 2000 tokens to their end, 43 s on a real model).
    with anyio.fail_after(60):
        with anyio.CancelScope() as timeout:
            async with EngineGroup.open([tiny_model_path], keep_alive=0) as group:
                async with group.lease() as engine:
                    s = engine.stream("outlives its lease", max_tokens=2000, ignore_eos=True)
                    await s.__anext__()
                slot = group._slots[group.default]  # private on purpose: the drain is seen from its start
                while slot.unloads == 0:  # the reaper is draining the engine now
                    await anyio.sleep(0.001)
                timeout.cancel()
                await anyio.sleep(0)
    assert s.finish_reason == "aborted" and s._ticket.delivered < 2000  # private: tokens the engine made
    assert engine.closed and not thread_state(engine).alive


@pytest.mark.parametrize("bad", [5, 2.5, ["a"], {"a": 1}, b"a", (1,), object()])
async def test_wrong_types_are_typed_errors(tiny_model_path: Path, bad: object) -> None:
    if bad != ["a"]:  # a list of one path "a" is a valid model list
        with pytest.raises(InvalidConfigError):
            EngineGroup.open(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError):
        EngineGroup.open([bad])  # type: ignore[list-item]
    if not isinstance(bad, (int, float)):  # a number is a valid keep_alive
        with pytest.raises(InvalidConfigError, match="keep_alive"):
            EngineGroup.open([tiny_model_path], keep_alive=bad)  # type: ignore[arg-type]
    async with EngineGroup.open([tiny_model_path], preload=False) as group:
        with pytest.raises(InvalidRequestError, match="model name must be a str"):
            async with group.lease(bad):  # type: ignore[arg-type]
                pass
    # the body's own typed error leaves the block as itself, not in an ExceptionGroup
    with pytest.raises(UnknownModelError):
        async with EngineGroup.open([tiny_model_path], preload=False) as group, group.lease("nope"):
            pass
