"""A request's one status through its whole life on the real engine, read through
`aiobasert.testing.snapshot`: a generation moves preparing -> waiting -> running -> paused ->
running -> gone, an embedding preparing -> waiting -> running -> gone, and a cancel ends either
wherever it is (being prepared, waiting, paused), counted once, with nothing left held."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
from held_calls import HeldCall

from aiobasert import Engine
from aiobasert._core.intake import Tokenizer
from aiobasert._core.prepare import Preparer
from aiobasert.testing import EngineSnapshot, RequestStatus, hold_lane, snapshot, wait_until

pytestmark = pytest.mark.anyio

BOUND = 60.0
PROMPT = "the lamp by the door is on and the cat sleeps under it while rain falls " * 2


async def status_is(engine: Engine, rid: str, status: RequestStatus | None) -> EngineSnapshot:
    return await wait_until(engine, lambda s: s.status(rid) == status, timeout=BOUND)


async def nothing_held(engine: Engine) -> EngineSnapshot:
    snap = await wait_until(engine, lambda s: not s.requests and s.stats.live_sequences == 0, timeout=BOUND)
    stats = snap.stats
    assert stats.active_lanes == stats.waiting_requests == stats.paused_requests == stats.live_grammars == 0
    return snap


async def test_a_generation_is_preparing_waiting_running_paused_running_then_gone(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Engine.open(untied_model_path, max_batch_size=1) as engine:
        with anyio.fail_after(BOUND):
            async with hold_lane(engine) as held:  # the only lane, until released
                prepare = HeldCall(monkeypatch, Preparer, "prepare")  # the intake worker holds the text prompt
                s = engine.stream(PROMPT, max_tokens=1500, ignore_eos=True)
                rid = s.request_id
                s.submit()
                async with prepare.holding():
                    req = (await status_is(engine, rid, "preparing")).requests[rid]
                    assert req.prompt_tokens == 0 and not req.embedding  # not tokenized yet
                snap = await status_is(engine, rid, "waiting")  # prepared: queued behind the held lane
                assert snap.requests[rid].prompt_tokens > 0 and snap.stats.waiting_requests == 1
                held.release()
                await held.stream  # its end frees the lane
            snap = await wait_until(engine, lambda x: x.status(rid) == "running" and x.requests[rid].generated >= 5)
            assert snap.stats.active_lanes == 1 and snap.stats.waiting_requests == 0
            # a shorter request takes the lane back (it is held there, feeding nothing, so the
            # pause lasts until it is released): the first is paused, its sequence and KV kept
            async with hold_lane(engine, prompt="another client", max_tokens=40) as second:
                snap = await status_is(engine, rid, "paused")
                assert snap.status(second.stream.request_id) == "running" and snap.count("paused") == 1
                assert snap.stats.paused_requests == snap.stats.waiting_requests == 1
                assert snap.stats.live_sequences == 2
                second.release()
                assert len([t async for t in second.stream]) == 40  # its end gives the lane back
            await status_is(engine, rid, "running")  # the first resumes
            tokens = [t async for t in s]
            assert len(tokens) == 1500 and s.finish_reason == "length"
            assert (await snapshot(engine)).status(rid) is None  # finished: gone
            assert tokens[-1].finish_reason == "length"
        stats = (await nothing_held(engine)).stats
        assert (stats.requests_finished, stats.requests_cancelled, stats.requests_preempted) == (3, 0, 1)


async def test_an_embedding_is_preparing_waiting_running_then_gone(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = " ".join(f"word{i}" for i in range(300))  # ~1200 tokens, a token a step: it runs for many steps
    async with Engine.open(untied_model_path, max_batch_size=1, prefill_chunk=1) as engine:
        with anyio.fail_after(BOUND):
            want = await engine.embed(text)  # the embedding path is decided (and the input fits)
            got: list[np.ndarray] = []
            async with hold_lane(engine) as held, anyio.create_task_group() as tg:
                encode = HeldCall(monkeypatch, Tokenizer, "encode_text")  # the intake worker holds the text

                async def embed() -> None:
                    got.append(await engine.embed(text))

                tg.start_soon(embed)
                async with encode.holding():
                    snap = await wait_until(engine, lambda s: s.count("preparing") == 1)
                    (req,) = (r for r in snap.requests.values() if r.status == "preparing")
                    assert req.embedding and req.prompt_tokens == 0
                rid = req.request_id
                snap = await status_is(engine, rid, "waiting")
                assert snap.requests[rid].embedding and snap.requests[rid].prompt_tokens > 100
                held.release()
                await held.stream
                snap = await status_is(engine, rid, "running")  # fed a chunk a step
                assert snap.requests[rid].generated == 0 and snap.stats.active_lanes == 1
            assert (await snapshot(engine)).status(rid) is None and np.array_equal(got[0], want)
        stats = (await nothing_held(engine)).stats
        assert stats.requests_cancelled == stats.requests_failed == 0


@pytest.mark.parametrize("kind", ["generation", "embedding"])
async def test_a_request_cancelled_while_it_is_prepared_holds_its_place_until_its_preparation_returns(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    held_call = (Preparer, "prepare") if kind == "generation" else (Tokenizer, "encode_text")
    async with Engine.open(untied_model_path) as engine:
        with anyio.fail_after(BOUND):
            hold = HeldCall(monkeypatch, *held_call)
            async with anyio.create_task_group() as tg:
                if kind == "generation":
                    s = engine.stream("a text prompt, tokenized off the engine thread", max_tokens=4)
                    s.submit()
                    cancel = s.aclose
                else:
                    scope = anyio.CancelScope()

                    async def embed() -> None:
                        with scope:
                            await engine.embed("a text input, tokenized off the engine thread")

                    tg.start_soon(embed)

                    async def cancel() -> None:
                        scope.cancel()

                async with hold.holding():
                    snap = await wait_until(engine, lambda s: s.count("preparing") == 1)
                    (rid,) = snap.requests
                    assert snap.requests[rid].embedding == (kind == "embedding")
                    await cancel()
                    # answered (and, a generation, counted) at once; its place is held while it is prepared
                    snap = await wait_until(engine, lambda s: s.stats.requests_cancelled == (kind == "generation"))
                    assert snap.status(rid) == "preparing"
            snap = await nothing_held(engine)  # its preparation came back: dropped, never queued
            assert snap.stats.requests_cancelled == (kind == "generation") and snap.stats.requests_finished == 0
            # the engine serves on
            assert len((await engine.generate("after", max_tokens=3, ignore_eos=True)).token_ids) == 3


@pytest.mark.parametrize("kind", ["generation", "embedding"])
async def test_a_request_cancelled_while_it_waits_leaves_the_queue(untied_model_path: Path, kind: str) -> None:
    async with Engine.open(untied_model_path, max_batch_size=1) as engine:
        with anyio.fail_after(BOUND):
            async with hold_lane(engine) as held, anyio.create_task_group() as tg:
                if kind == "generation":
                    s = engine.stream([5, 6, 7], max_tokens=4)
                    s.submit()
                    cancel = s.aclose
                else:
                    scope = anyio.CancelScope()

                    async def embed() -> None:
                        with scope:
                            await engine.embed([5, 6, 7])

                    tg.start_soon(embed)

                    async def cancel() -> None:
                        scope.cancel()

                snap = await wait_until(engine, lambda s: s.count("waiting") == 1)
                (rid,) = (r for r, q in snap.requests.items() if q.status == "waiting")
                assert snap.requests[rid].embedding == (kind == "embedding") and snap.requests[rid].prompt_tokens == 3
                await cancel()
                snap = await status_is(engine, rid, None)  # gone from the queue at once
                assert snap.stats.waiting_requests == 0 and snap.status(held.stream.request_id) == "running"
                assert snap.stats.requests_cancelled == (kind == "generation")
        await nothing_held(engine)


async def test_a_paused_request_cancelled_frees_its_kept_sequence(untied_model_path: Path) -> None:
    async with Engine.open(untied_model_path, max_batch_size=1) as engine:
        with anyio.fail_after(BOUND):
            first = engine.stream(PROMPT, max_tokens=1500, ignore_eos=True)
            first.submit()
            rid = first.request_id
            await wait_until(engine, lambda s: s.status(rid) == "running" and s.requests[rid].generated >= 5)
            async with hold_lane(engine, prompt="another client") as second:  # takes the lane back, held there
                snap = await status_is(engine, rid, "paused")
                assert snap.stats.live_sequences == 2  # paused, its sequence and KV kept
                await first.aclose()
                snap = await status_is(engine, rid, None)
                assert snap.stats.paused_requests == 0 and snap.stats.live_sequences == 1
                assert snap.status(second.stream.request_id) == "running" and snap.stats.requests_cancelled == 1
        await nothing_held(engine)
