"""aiobasert.testing, through the real engine: the snapshot's statuses follow a request through its
life, `wait_until` returns the snapshot that met its condition and fails in engine steps, not
seconds, when none does, `hold_lane` keeps a lane taken and gives it back on every exit, and
`thread_state` sees the engine thread end and free its model once."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from held_calls import HeldCall

from aiobasert import Engine, EngineClosedError
from aiobasert._core.prepare import Preparer
from aiobasert.testing import (
    ConditionNotMet,
    build_tiny_model,
    hold_lane,
    snapshot,
    thread_state,
    wait_until,
)

pytestmark = pytest.mark.anyio


async def test_a_request_is_waiting_then_running_then_gone(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        async with hold_lane(engine) as held:
            rid = held.stream.request_id
            queued = engine.stream("queued", max_tokens=3, ignore_eos=True)
            queued.submit()
            snap = await wait_until(engine, lambda s: s.status(queued.request_id) == "waiting")
            first = snap.requests[rid]
            assert first.status == "running" and first.prefilling and first.generated == 0  # fed nothing
            assert snap.count("running") == snap.stats.active_lanes == 1 and snap.stats.waiting_requests == 1
            held.release()  # the queued request runs once the lane is free
            assert len([t async for t in queued]) == 3 and queued.finish_reason == "length"
            assert (await snapshot(engine)).status(queued.request_id) is None  # ended: gone
        assert (await snapshot(engine)).requests == {}


async def test_a_request_being_prepared_is_preparing(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with Engine.open(tiny_model_path) as engine:
        prepare = HeldCall(monkeypatch, Preparer, "prepare")  # the intake worker holds the text prompt
        s = engine.stream("a text prompt, tokenized off the engine thread", max_tokens=2)
        s.submit()
        async with prepare.holding():
            snap = await snapshot(engine)
            assert snap.status(s.request_id) == "preparing" and snap.count("preparing") == 1
        assert len([t async for t in s]) == 2


async def test_wait_until_fails_after_its_steps(tiny_model_path: Path) -> None:
    """A condition that never holds while the engine steps fails once the engine has taken `steps`
    more steps, well before the wall-clock guard."""
    async with Engine.open(tiny_model_path) as engine, engine.stream("long", max_tokens=400, ignore_eos=True) as s:
        s.submit()
        with pytest.raises(ConditionNotMet, match="within 5 engine steps") as caught:
            await wait_until(engine, lambda _: False, steps=5, timeout=600)
        last = caught.value.snapshot
        assert last is not None and last.status(s.request_id) == "running"


async def test_wait_until_fails_after_its_timeout_on_an_idle_engine(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        with pytest.raises(ConditionNotMet, match=r"in 0\.05 s"):
            await wait_until(engine, lambda _: False, steps=5, timeout=0.05)
        assert (await wait_until(engine, lambda s: s.stats.active_lanes == 0)).requests == {}


async def test_hold_lane_gives_the_lane_back_when_the_block_fails(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        with pytest.raises(RuntimeError, match="the test failed"):
            async with hold_lane(engine) as held:
                raise RuntimeError("the test failed")
        assert held.released
        await wait_until(engine, lambda s: not s.requests)  # its request was cancelled: nothing left
        # the lane is free and the step is the engine's own again: a new request runs to its end
        assert len((await engine.generate("after", max_tokens=4, ignore_eos=True)).token_ids) == 4
        assert engine._thread.runner.run.__func__ is type(engine._thread.runner).run  # type: ignore[attr-defined]


async def test_two_holds_on_one_engine(tiny_model_path: Path) -> None:
    async with (
        Engine.open(tiny_model_path, max_batch_size=2) as engine,
        hold_lane(engine) as a,
        hold_lane(engine, prompt="other") as b,
    ):
        snap = await snapshot(engine)
        assert snap.status(a.stream.request_id) == snap.status(b.stream.request_id) == "running"
        a.release()  # one released, the other still held
        assert [t async for t in a.stream][-1].finish_reason == "length"
        snap = await snapshot(engine)
        assert snap.requests[b.stream.request_id].generated == 0 and not b.released


async def test_thread_state_after_close(tiny_model_path: Path) -> None:
    engine = await Engine.open(tiny_model_path)
    with anyio.fail_after(30):
        running = thread_state(engine)
        assert running.alive and running.models_freed == 0
        await engine.generate("x", max_tokens=2)
        await engine.aclose()
    closed = thread_state(engine)
    assert not closed.alive and closed.models_freed == 1 and closed.steps >= 2
    assert (closed.requests_finished, closed.requests_cancelled, closed.requests_failed) == (1, 0, 0)
    with pytest.raises(EngineClosedError):
        await snapshot(engine)


async def test_build_tiny_model_builds_a_model_the_engine_serves(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m.base", seed=3)
    async with Engine.open(path) as engine:
        assert len((await engine.generate("hi", max_tokens=3, ignore_eos=True)).token_ids) == 3
