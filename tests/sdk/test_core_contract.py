"""The async core's promises, one test per way they were broken (issue 8):
no hang (closing, cancelling, foreign loops), no crash of a neighbour (limits,
bad parameters, a failing lane), no leak (cancelled opens, dropped engines,
refused grammars), and right results (queue bound, stops, await, text).

Every wait on the engine is bounded, so a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from held_calls import HeldCall, HoldLane
from lifecycle_model import assert_idle_and_whole, engine_threads
from test_layering import parse_python

import aiobasert
from aiobasert import (
    AioBaseRTError,
    ContextLengthExceededError,
    Engine,
    EngineOverloadedError,
    InternalError,
    InvalidConfigError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    SamplingParams,
    StreamBusyError,
    StreamClosedError,
    TokenStream,
    WrongEventLoopError,
)
from aiobasert._core import loaded as _loaded
from aiobasert._core.intake import Intake
from aiobasert.engine_thread import EngineThread
from aiobasert.models.tiny import bytes_to_unicode, tiny_vocab
from aiobasert.testing import thread_state, wait_until

pytestmark = pytest.mark.anyio

BOUND = 30.0  # seconds any single wait below may take before it is a hang


async def wait_until_threads(expected: set[threading.Thread]) -> None:
    with anyio.fail_after(BOUND):
        while engine_threads() - expected:
            gc.collect()
            await anyio.sleep(0.01)


@contextlib.asynccontextmanager
async def reading_in_a_task(s: TokenStream) -> AsyncIterator[list[aiobasert.Token]]:
    """Another task reads `s` into the list yielded; the body runs once a token has come, and the block
    ends when the reader does (all within BOUND)."""
    got: list[aiobasert.Token] = []

    async def reader() -> None:
        async for tok in s:
            got.append(tok)

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            while not got:
                await anyio.sleep(0.001)
            yield got


# ---- hangs --------------------------------------------------------------------------


async def test_break_out_of_a_named_stream_cancels_its_lane(tiny_model_path: Path) -> None:
    with anyio.fail_after(BOUND):
        async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
            s = engine.stream("named", max_tokens=500, ignore_eos=True)
            async for _ in s:
                break
            stats = await engine.stats()  # the Cancel was posted before this call
            assert stats.active_lanes == 0 and stats.requests_cancelled == 1
            assert s.closed
            with pytest.raises(StreamClosedError):
                await s
            # a lane read once and then left unread must not hold up the drain
            unread = engine.stream("unread", max_tokens=300, ignore_eos=True)
            await unread.__anext__()
        # the drain ran it to its end without a reader; its tokens are all there
        rest = [t async for t in unread]
        assert len(rest) == 299 and rest[-1].finish_reason == "length"


async def test_drain_close_cancels_a_lane_whose_stream_is_gone(tiny_model_path: Path, hold_lane: HoldLane) -> None:
    with anyio.fail_after(BOUND):
        engine = await Engine.open(tiny_model_path, max_batch_size=2)
        held = await hold_lane(engine)  # the lane cannot end by itself: only the drain's cancel ends it
        await held.stream.aclose()
        await engine.aclose()
        closed = thread_state(engine)
        assert closed.requests_cancelled == 1 and closed.requests_finished == 0


async def test_aclose_from_another_task_wakes_the_reader(tiny_model_path: Path, hold_lane: HoldLane) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        blocker = await hold_lane(engine)
        s = engine.stream("queued behind the blocker", max_tokens=5)
        seen: list[object] = []

        async def reader() -> None:
            async for tok in s:
                seen.append(tok)
            seen.append("ended")

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await anyio.wait_all_tasks_blocked()
                assert seen == []  # the reader waits for its first token
                await s.aclose()
        assert seen == ["ended"]  # woken at once: its loop ended (StopAsyncIteration)
        with pytest.raises(StreamClosedError):
            await s
        await blocker.aclose()
        await assert_idle_and_whole(engine)


async def test_abort_after_a_timed_out_drain_escalates(tiny_model_path: Path) -> None:
    engine = await Engine.open(tiny_model_path, max_batch_size=2)
    s = engine.stream("long", max_tokens=2000, ignore_eos=True)
    async with reading_in_a_task(s) as got:
        with anyio.move_on_after(0.02):
            await engine.aclose()  # drain: far from done when the timeout hits
        await engine.aclose(abort=True)
    assert s.finish_reason == "aborted" and len(got) < 2000
    closed = thread_state(engine)
    assert not closed.alive and closed.models_freed == 1


async def test_leaving_the_block_on_a_timeout_aborts_the_drain(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once the drain has begun, the engine thread takes no step until its next
    # message: the drain cannot finish by itself, only the timeout's abort ends it.
    from aiobasert.engine_thread import EngineThread

    real = EngineThread._step

    def stalled(self: EngineThread) -> bool:
        if self._closing and not self._abort:
            self._drain(block=True)
        return real(self)

    monkeypatch.setattr(EngineThread, "_step", stalled)
    with anyio.fail_after(BOUND):
        # opened and started before the timeout, so that its only way out is the stalled drain
        engine = await Engine.open(tiny_model_path, max_batch_size=2)
        s = engine.stream("long", max_tokens=2000, ignore_eos=True)
        await s.__anext__()  # referenced, never read again: the drain would run 2000 tokens
        with anyio.move_on_after(0.3) as scope:
            async with engine:
                pass
        assert scope.cancelled_caught and engine.closed and not thread_state(engine).alive
    assert s.finish_reason == "aborted"


async def _foreign_calls(engine: Engine, stream: TokenStream) -> list[str]:
    refused: list[str] = []
    for name, call in [
        ("generate", lambda: engine.generate("x", max_tokens=2)),
        ("stats", engine.stats),
        ("encode", lambda: engine.encode("x")),
        ("aclose", engine.aclose),
        ("iterate", stream.__anext__),
        ("aclose stream", stream.aclose),
    ]:
        try:
            await call()
        except WrongEventLoopError:
            refused.append(name)
    return refused


async def test_an_engine_refuses_other_event_loops_at_once(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        stream = engine.stream("made here", max_tokens=3, ignore_eos=True)
        for backend in ("asyncio", "trio"):
            run = functools.partial(anyio.run, _foreign_calls, engine, stream, backend=backend)
            with anyio.fail_after(BOUND):
                refused = await anyio.to_thread.run_sync(run)
            assert refused == ["generate", "stats", "encode", "aclose", "iterate", "aclose stream"], backend

        def no_loop() -> None:
            with pytest.raises(WrongEventLoopError):
                engine.stream("x", max_tokens=2).submit()

        await anyio.to_thread.run_sync(no_loop)
        with anyio.fail_after(BOUND):  # the owner is unharmed, the stream still usable here
            assert len((await stream).token_ids) == 3
            assert (await engine.generate("x", max_tokens=3, ignore_eos=True)).usage.completion_tokens == 3
        await assert_idle_and_whole(engine)


async def test_two_tasks_reading_one_stream(tiny_model_path: Path, hold_lane: HoldLane) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        blocker = await hold_lane(engine)
        s = engine.stream("shared", max_tokens=4, ignore_eos=True)
        first: list[int] = []

        async def reader() -> None:
            first.extend([t.id async for t in s])

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(StreamBusyError):
                    await s.__anext__()
                with pytest.raises(StreamBusyError):
                    async for _ in s:
                        pass
                await blocker.aclose()  # frees the lane: the first reader gets its tokens
        assert len(first) == 4
        await assert_idle_and_whole(engine)


# ---- crashes of other streams ---------------------------------------------------------


async def test_batch_limit_is_read_back_from_the_engine(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=32, prefill_chunk=16) as engine:
        assert engine.info.max_batch_size == 16 and engine.info.prefill_chunk == 16
        results: list[aiobasert.Completion] = []

        async def one(i: int) -> None:
            results.append(await engine.generate(f"request {i}", max_tokens=6, ignore_eos=True))

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(one, i)
        assert len(results) == 24 and all(r.finish_reason == "length" for r in results)
        await assert_idle_and_whole(engine)


BAD_PARAMS: list[dict[str, Any]] = [
    {"penalty_window": 3.5},
    {"top_logprobs": 2.5},
    {"top_k": 2**31},
    {"top_k": 2**32 + 1},
    {"top_k": 3.0},
    {"repeat_penalty": 1e39},
    {"temperature": 1e39},
    {"top_p": 1e-50},
    {"max_tokens": 2.0},
    {"max_tokens": 2**31},
    {"seed": 1.5},
    {"logprobs": 1},
    {"ignore_eos": "yes"},
    {"stop_token_ids": [1.0]},
    {"stop_token_ids": 5},
    {"logit_bias": {5: "x"}},
    {"logit_bias": {2**40: 1.0}},
    {"logit_bias": [(5, 1.0)]},
    {"stop": [3]},
    {"json_schema": {"type": "object", "default": object()}},
    {"json_schema": {"enum": [{1, 2}]}},
]


@pytest.mark.parametrize("params", BAD_PARAMS, ids=[repr(p)[:40] for p in BAD_PARAMS])
async def test_bad_parameter_types_and_ranges_are_refused_in_the_caller(
    tiny_model_path: Path, params: dict[str, Any]
) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        neighbour = engine.stream("neighbour", max_tokens=12, ignore_eos=True)
        with anyio.fail_after(BOUND):
            await neighbour.__anext__()
            with pytest.raises(InvalidSamplingParamsError):
                engine.stream("bad", **params)
            with pytest.raises(InvalidSamplingParamsError):
                engine.stream("bad", SamplingParams(**params))
            assert len([t async for t in neighbour]) == 11


async def test_numpy_scalars_are_accepted_as_python_values(tiny_model_path: Path) -> None:
    plain = dict(
        max_tokens=5,
        temperature=0.5,
        top_k=7,
        top_p=0.5,
        seed=11,
        logprobs=True,
        ignore_eos=True,
        logit_bias={5: 1.5},
        stop_token_ids=[3],
    )
    numpy = dict(
        max_tokens=np.int32(5),
        temperature=np.float32(0.5),
        top_k=np.int64(7),
        top_p=np.float64(0.5),
        seed=np.uint64(11),
        logprobs=np.bool_(True),
        ignore_eos=np.bool_(True),
        logit_bias={np.int64(5): np.float32(1.5)},
        stop_token_ids=[np.int16(3)],
    )
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        with anyio.fail_after(BOUND):
            a = await engine.generate("numpy", **plain)
            b = await engine.generate("numpy", **numpy)
            c = await engine.generate(np.array(await engine.encode("numpy", special=True)), **plain)
        assert a.token_ids == b.token_ids == c.token_ids and a.text == b.text


@pytest.mark.parametrize("path", ["fused", "host"])
async def test_an_unexpected_error_in_one_lane_fails_only_that_lane(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    import aiobasert._core.output
    import aiobasert._core.step

    victim_seed = 666

    def boom_if_victim(lane: Any) -> None:
        if lane.spec.params.seed == victim_seed:
            raise RuntimeError("a bug that only this request's parameters reach")

    if path == "fused":
        real = aiobasert._core.step.row_sampling

        def row_sampling(lane: Any, keep: list[Any]) -> Any:
            boom_if_victim(lane)
            return real(lane, keep)

        monkeypatch.setattr(aiobasert._core.step, "row_sampling", row_sampling)
        extra: dict[str, Any] = {}
    else:
        real_process = aiobasert._core.output.OutputProcessor.process

        def process(self: Any, lane: Any, *args: Any) -> Any:
            boom_if_victim(lane)
            return real_process(self, lane, *args)

        monkeypatch.setattr(aiobasert._core.output.OutputProcessor, "process", process)
        extra = {"logprobs": True}
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        with anyio.fail_after(BOUND):
            alone = await engine.generate("neighbour", max_tokens=10, ignore_eos=True, seed=1, **extra)
            neighbours = [engine.stream("neighbour", max_tokens=10, ignore_eos=True, seed=1, **extra) for _ in range(2)]
            victim = engine.stream("victim", max_tokens=10, ignore_eos=True, seed=victim_seed, **extra)
            for s in (*neighbours, victim):
                s.submit()
            with pytest.raises(InternalError, match="internal error") as failed:
                await victim
            assert isinstance(failed.value.__cause__, RuntimeError)
            for s in neighbours:
                assert (await s).token_ids == alone.token_ids
        await assert_idle_and_whole(engine)


# ---- leaks ----------------------------------------------------------------------------


async def test_a_cancelled_open_reclaims_its_thread_and_model(tiny_model_path: Path) -> None:
    before = engine_threads()
    for _ in range(2):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await Engine.open(tiny_model_path)
        with anyio.move_on_after(0.001):  # cancelled mid-load too
            await Engine.open(tiny_model_path)
    await wait_until_threads(before)


async def test_a_cancelled_open_waits_for_its_load_which_stops_at_the_next_phase(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37 item 6: each open is cancelled while its load is in its first phase (the tokenizer
    handles, held); the phase ends when the cancel reaches the engine thread, and the load stops there:
    the open returns with its thread gone (no wait in the test), no weights ever loaded."""
    before = engine_threads()
    configured: list[int] = []
    real_describe = _loaded._describe

    def describe(*args: Any) -> Any:  # reached only once the weights are loaded
        configured.append(1)
        return real_describe(*args)

    monkeypatch.setattr(_loaded, "_describe", describe)
    holds: list[HeldCall] = []
    real_cancel = getattr(EngineThread, "cancel_load", None)

    def cancel_load(self: EngineThread) -> None:
        if real_cancel is not None:
            real_cancel(self)
        for held in holds:  # the held phase ends once the cancel has reached the thread
            held.release()

    monkeypatch.setattr(EngineThread, "cancel_load", cancel_load, raising=False)

    async def opening() -> None:
        await Engine.open(tiny_model_path)

    with anyio.fail_after(BOUND):
        for _ in range(4):
            held = HeldCall(monkeypatch, Intake, "wait_loaded")
            holds.append(held)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(opening)
                    await held.wait_entered()
                    tg.cancel_scope.cancel()
            finally:
                held.release()
            assert engine_threads() == before  # the open returned after its thread ended
    assert configured == []  # every load stopped before its weights


async def test_an_engine_dropped_without_aclose_is_reclaimed(tiny_model_path: Path) -> None:
    before = engine_threads()
    engine = await Engine.open(tiny_model_path)
    thread = engine._thread  # private on purpose: read after the engine itself is gone (no engine to ask)
    s = engine.stream("dropped", max_tokens=3, ignore_eos=True)
    with anyio.fail_after(BOUND):
        await s.__anext__()
    del engine, s
    await wait_until_threads(before)
    assert thread.models_freed == 1


async def test_a_refused_structured_request_frees_its_grammar(untied_model_path: Path, hold_lane: HoldLane) -> None:
    schema = {"type": "object"}
    async with Engine.open(untied_model_path, max_batch_size=1, max_queue=1) as engine:
        # the only lane stays taken while the waiting request's grammar is built (the host backend's
        # first build can take a second on a loaded machine) and the refusals are tried; closed below
        blocker = await hold_lane(engine)
        waiting = engine.stream("waits for the lane", max_tokens=3, json_schema=schema)
        waiting.submit()
        with anyio.fail_after(BOUND):
            # its grammar is built off the engine thread, then it waits behind the held lane
            await wait_until(engine, lambda s: s.status(waiting.request_id) == "waiting", timeout=BOUND)
            for _ in range(3):  # refused on arrival (a full queue), before its grammar is built
                with pytest.raises(EngineOverloadedError):
                    await engine.generate("refused", max_tokens=3, json_schema=schema)
            assert (await engine.stats()).live_grammars == 1  # the waiting one only
            await blocker.aclose()
            await waiting
            with pytest.raises(ContextLengthExceededError):  # refused after its grammar was built
                await engine.generate("refused", max_tokens=10**6, json_schema=schema)
            assert (await engine.stats()).live_grammars == 0
        await assert_idle_and_whole(engine)


# ---- wrong results --------------------------------------------------------------------


async def test_max_queue_counts_only_requests_waiting_for_a_lane(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=8, max_queue=2) as engine:
        streams = [engine.stream(f"burst {i}", max_tokens=3, ignore_eos=True) for i in range(6)]
        for s in streams:
            s.submit()
        with anyio.fail_after(BOUND):
            done = [await s for s in streams]
        assert [d.finish_reason for d in done] == ["length"] * 6


async def test_a_stop_string_is_one_string_not_a_set_of_characters(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        with anyio.fail_after(BOUND):
            free = await engine.generate("stop here", max_tokens=24, ignore_eos=True)
            ch = next(c for c in free.text if c.strip())
            unmatched = await engine.generate("stop here", max_tokens=24, ignore_eos=True, stop=ch + "\x01")
            assert unmatched.text == free.text and unmatched.finish_reason == "length"
            cut = await engine.generate("stop here", max_tokens=24, ignore_eos=True, stop=ch)
            assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(ch)]
            params = SamplingParams(stop=ch).normalized()
            assert params.stop == [ch]


async def test_await_after_iterating_returns_the_whole_completion(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        with anyio.fail_after(BOUND):
            whole = await engine.generate("await me", max_tokens=9, ignore_eos=True, logprobs=True)
            s = engine.stream("await me", max_tokens=9, ignore_eos=True, logprobs=True)
            toks = [t async for t in s]
            first, second = await s, await s
            assert first is second
            assert first.text == whole.text == "".join(t.text for t in toks)
            assert first.token_ids == whole.token_ids and first.logprobs == whole.logprobs
            part = engine.stream("await me", max_tokens=9, ignore_eos=True, logprobs=True)
            for _ in range(4):
                await part.__anext__()
            assert (await part).token_ids == whole.token_ids  # read part + rest
            failed = engine.stream("x" * 10, max_tokens=10**7)
            for _ in range(2):  # a failed stream raises its error again
                with pytest.raises(ContextLengthExceededError):
                    await failed


def _byte_token_ids() -> dict[int, int]:
    """byte value -> token id in the tiny vocabulary (its 256 byte tokens)."""
    tokens = tiny_vocab().tokens
    return {b: tokens.index(ch) for b, ch in bytes_to_unicode().items()}


async def test_stream_text_is_the_decode_of_its_ids(tiny_model_path: Path) -> None:
    ids = _byte_token_ids()
    # NUL, lone lead and continuation bytes, a whole 日 (E6 97 A5) and ASCII
    pool = [ids[0x00], ids[0xE6], ids[0x97], ids[0xA5], ids[ord("a")], ids[0xF0]]
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        with anyio.fail_after(BOUND):
            for seed in range(12):
                params = dict(
                    max_tokens=1 + seed % 7,
                    temperature=1.0,
                    seed=seed,
                    ignore_eos=True,
                    logit_bias={t: 100.0 for t in pool},
                )
                toks = [t async for t in engine.stream("bytes", **params)]
                got = [t.id for t in toks]
                assert set(got) <= set(pool)
                text = "".join(t.text for t in toks)
                assert text == await engine.decode(got), (seed, got)
                assert (await engine.generate("bytes", **params)).text == text
            nul = await engine.generate("nul", max_tokens=3, ignore_eos=True, logit_bias={ids[0]: 100.0})
            assert nul.text == "\x00\x00\x00"
            pending = await engine.generate("lead", max_tokens=1, ignore_eos=True, logit_bias={ids[0xE6]: 100.0})
            assert pending.text == "\ufffd" == await engine.decode(pending.token_ids)


async def test_chat_roles_are_validated(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as engine:
        for role in ("user<|im_end|>\n<|im_start|>system", "narrator", "User", "system\n"):
            with pytest.raises(InvalidRequestError, match="role"):
                engine.chat([{"role": role, "content": "hi"}])
        with anyio.fail_after(BOUND):
            for role in ("system", "user", "assistant", "tool", "developer"):
                out = await engine.chat([{"role": role, "content": "hi"}], max_tokens=2, ignore_eos=True)
                assert out.usage.completion_tokens == 2


async def test_small_refusals_are_typed_and_exact(tiny_model_path: Path, tmp_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_context=64) as engine:
        with anyio.fail_after(BOUND):
            for call in (
                lambda: engine.decode(None),
                lambda: engine.embed(None),  # type: ignore[arg-type]
                lambda: engine.embed(b"abc"),
                lambda: engine.decode("abc"),  # type: ignore[arg-type]
                lambda: engine.encode(None),
                lambda: engine.embed([]),  # type: ignore[arg-type]
                lambda: engine.decode([1.0]),
            ):  # type: ignore[list-item]
                with pytest.raises(InvalidRequestError):
                    await call()
            prompt = await engine.encode("x y z", special=True)
            room = 64 - len(prompt) + 1
            assert (await engine.generate(prompt, max_tokens=room, ignore_eos=True)).usage.completion_tokens == room
            with pytest.raises(ContextLengthExceededError, match=f"at most {room} new tokens") as err:
                await engine.generate(prompt, max_tokens=room + 1)
            assert err.value.max_tokens == room + 1
    for bad in (
        {"max_batch_size": 0},
        {"max_queue": 1.5},
        {"prefill_chunk": True},
        {"prefix_cache": 1},
        {"max_context": 2**40},
        {"kv_cache_dtype": "bf16"},
        {"kv_cache_dtype": 8},
        {"kv_cache_dtype": None},
    ):
        with pytest.raises(InvalidConfigError):
            Engine.open(tiny_model_path, **bad)
    with pytest.raises(aiobasert.ModelFileNotFoundError) as missing:
        await Engine.open(tmp_path / "missing.base")
    assert str(missing.value).count("baseRT_load_model_ex") == 1, str(missing.value)


def test_every_exception_derives_from_the_root() -> None:
    from aiobasert.models.bundle import BundleError
    from aiobasert.models.cache import ModelNotAvailableError
    from aiobasert.models.convert import ConversionError

    for cls in (
        BundleError,
        ConversionError,
        ModelNotAvailableError,
        InvalidConfigError,
        WrongEventLoopError,
        StreamBusyError,
        StreamClosedError,
    ):
        assert issubclass(cls, AioBaseRTError), cls
    for name in aiobasert.__all__:
        obj = getattr(aiobasert, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, AioBaseRTError), name


def test_the_exception_tree_in_the_errors_docstring_is_the_real_one() -> None:
    """errors.py draws the hierarchy; every exception class is in the drawing, under its real parent."""
    import re

    import aiobasert.errors

    drawn: dict[str, str] = {}
    parents: list[str] = []
    for line in (aiobasert.errors.__doc__ or "").splitlines():
        m = re.match(r"^    ([ │├└─]*)([A-Z]\w+Error)\b", line)
        if m:
            depth = len(m.group(1)) // 4
            del parents[depth:]
            if parents:
                drawn[m.group(2)] = parents[-1]
            parents.append(m.group(2))
    real = {
        name: cls.__bases__[0].__name__
        for name, cls in vars(aiobasert.errors).items()
        if isinstance(cls, type)
        and issubclass(cls, aiobasert.errors.AioBaseRTError)
        and cls is not aiobasert.errors.AioBaseRTError
    }
    assert drawn == real


async def test_embed_runs_between_steps_without_disturbing_streams(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        with anyio.fail_after(BOUND):
            alone = await engine.generate("running", max_tokens=30, ignore_eos=True)
            solo = await engine.embed("embed this text " * 20)
            s = engine.stream("running", max_tokens=30, ignore_eos=True)
            await s.__anext__()
            during = await engine.embed("embed this text " * 20)
            assert np.array_equal(solo, during)
            assert (await s).token_ids == alone.token_ids
        json.dumps(during.tolist())


# ---- misuse found by attacking the above ----------------------------------------------


async def test_leaving_a_loop_by_exception_or_timeout_frees_the_lane(tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        s = engine.stream("body raises", max_tokens=500, ignore_eos=True)
        with pytest.raises(ValueError):
            async for _ in s:
                raise ValueError("the loop body failed")
        assert (await engine.stats()).active_lanes == 0 and s.closed
        slow = engine.stream("slow reader", max_tokens=500, ignore_eos=True)
        with anyio.move_on_after(0.01):
            async for _ in slow:
                await anyio.sleep(0.002)
        assert (await engine.stats()).active_lanes == 0
        assert [t async for t in slow] == []  # over: a new loop ends at once
        await assert_idle_and_whole(engine)


async def test_two_awaiters_and_a_close_while_awaited(tiny_model_path: Path, hold_lane: HoldLane) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        blocker = await hold_lane(engine)
        s = engine.stream("awaited twice", max_tokens=5)
        outcomes: list[str] = []

        async def waiter() -> None:
            try:
                await s
                outcomes.append("completion")
            except AioBaseRTError as exc:
                outcomes.append(type(exc).__name__)

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                await s.aclose()
        assert sorted(outcomes) == ["StreamBusyError", "StreamClosedError"]
        await blocker.aclose()
        await assert_idle_and_whole(engine)


async def test_engine_abort_ends_a_reader_in_another_task(tiny_model_path: Path) -> None:
    engine = await Engine.open(tiny_model_path, max_batch_size=2)
    s = engine.stream("aborted", max_tokens=1500, ignore_eos=True)
    async with reading_in_a_task(s):
        await engine.aclose(abort=True)
    assert s.finish_reason == "aborted" and (await s).finish_reason == "aborted"


# ---- the stream contract after leaving early (issue 18, item 8) ----------------------


@pytest.mark.parametrize("leave", ["break", "aclose"])
async def test_awaiting_a_stream_left_early_raises_even_if_its_request_finished(
    tiny_model_path: Path, leave: str
) -> None:
    async with Engine.open(tiny_model_path, max_batch_size=2) as engine:
        s = engine.stream("finishes unread", max_tokens=6, ignore_eos=True)
        with anyio.fail_after(BOUND):
            first = await s.__anext__()
            await wait_until(engine, lambda _: s.finish_reason is not None)  # the request ends; 5 stay unread
            if leave == "break":
                async for _ in s:
                    break
            else:
                await s.aclose()
        assert first.text is not None and s.closed
        with pytest.raises(StreamClosedError):  # was: the 2 read tokens with the usage of 6
            await s
        # a stream read to its end is whole, however it was left
        whole = engine.stream("read to the end", max_tokens=3, ignore_eos=True)
        with anyio.fail_after(BOUND):
            got = [tok async for tok in whole]
            await whole.aclose()
            assert (await whole).token_ids == [t.id for t in got]


async def test_no_token_after_another_tasks_aclose_returned(tiny_model_path: Path) -> None:
    # Seeded interleavings: the closer yields a random number of times before
    # aclose(); once aclose() has returned, the reader must get no further token
    # (on trio one more token came in 77 of 100 runs).
    import random

    rng = random.Random(18)
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        for _ in range(100):
            s = engine.stream("race", max_tokens=200, ignore_eos=True)
            closed = [False]
            late: list[aiobasert.Token] = []

            async def reader(s: TokenStream = s, closed: list[bool] = closed, late: list[Any] = late) -> None:
                async for tok in s:
                    if closed[0]:
                        late.append(tok)

            with anyio.fail_after(BOUND):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(reader)
                    for _ in range(rng.randrange(60)):
                        await anyio.sleep(0)
                    # most runs: close in the window where tokens arrived for a
                    # reader that was woken but has not run yet
                    while rng.random() < 0.9 and not (s._buffer and s._waiting) and not s._ended:
                        await anyio.sleep(0)
                    await s.aclose()
                    closed[0] = True
            assert late == []
        await assert_idle_and_whole(engine)


async def test_await_interrupted_by_another_tasks_aclose_raises(tiny_model_path: Path) -> None:
    # Once aclose() has returned, a task in `await stream` may not get a
    # Completion any more (it would hold tokens yielded after the close).
    import random

    rng = random.Random(8)
    async with Engine.open(tiny_model_path, max_batch_size=4) as engine:
        for _ in range(60):
            s = engine.stream("collected", max_tokens=rng.choice([8, 40, 200]), ignore_eos=True)
            closed = [False]
            late: list[object] = []

            async def collector(s: TokenStream = s, closed: list[bool] = closed, late: list[object] = late) -> None:
                try:
                    done = await s
                except StreamClosedError:
                    return
                if closed[0]:
                    late.append(done)

            with anyio.fail_after(BOUND):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(collector)
                    while rng.random() < 0.95 and not (s._buffer and s._waiting) and not s._ended:
                        await anyio.sleep(0)
                    await s.aclose()
                    closed[0] = True
            assert late == []


# ---- the shape of one step (issue 19) -------------------------------------------------

# A Lane's lifecycle: what the engine thread decides (prefill progress, generated
# ids, its sequence, how it ended, its pooled embedding). Only engine_thread.py
# writes these, from the results the step and the output processor return.
LANE_LIFECYCLE = {
    "prefilled",
    "generated",
    "seq",
    "final",
    "error",
    "first_token_at",
    "first_token_step",
    "admitted_at",
    "cached",
    "prefix_handle",
    "pending",
    "total",
    "finite",
    "admitted_step",
}


def test_only_the_engine_thread_writes_a_lanes_lifecycle() -> None:
    import ast

    package = Path(aiobasert.__file__).parent
    writes: list[str] = []
    # where lanes live: the SDK's top level and its engine machinery (not models/ or server/, whose
    # objects share attribute names such as a progress bar's `total`)
    for path in sorted([*package.glob("*.py"), *(package / "_core").glob("*.py")]):
        if path.name == "engine_thread.py":
            continue
        for node in ast.walk(parse_python(path.read_text(encoding="utf-8"), str(path))):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend")
                and isinstance(node.func.value, ast.Attribute)
            ):
                targets = [node.func.value]  # lane.generated.append(...)
            for t in targets:
                # a lane's own constructor and methods write `self.x`: that is the lane itself
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr in LANE_LIFECYCLE
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    writes.append(f"{path.name}:{t.lineno}: {ast.unparse(t)}")
    assert writes == []


def test_the_fused_call_is_chosen_in_one_place() -> None:
    from aiobasert._core.step import Batch

    assert Batch(fusable=True).path() == "sample"
    assert Batch(fusable=False).path() == "logits"  # no engine-side sampling: host rows
    assert Batch(fusable=True, host=True).path() == "logits"  # a lane needs its logits row
    assert Batch(fusable=True, host=True, tapped=3).path() == "taps"  # an embedding chunk rides along


async def test_thread_side_queries_are_typed_messages(tiny_model_path: Path) -> None:
    from aiobasert._core.protocol import Ask, EvictPrefixCache, Stats

    async with Engine.open(tiny_model_path) as engine:
        posted: list[Any] = []
        post = engine._thread.post  # private on purpose: the messages posted to the thread are what is tested

        def spy(msg: Any) -> None:
            posted.append(msg)
            post(msg)

        engine._thread.post = spy  # type: ignore[method-assign]
        with anyio.fail_after(BOUND):
            ids = [5, 6, 7]
            assert await engine.decode(ids) == await engine.decode(list(ids))
            assert (await engine.stats()).steps == 0  # queries are answered between steps, never as one
            assert await engine.evict_prefix_cache() == 0  # nothing was generated, so nothing is cached
        queries = [type(m.query) for m in posted if isinstance(m, Ask)]
        assert queries == [Stats, EvictPrefixCache]  # decode runs on a tokenizer worker (tests/_core/test_prepare.py)
        assert all(isinstance(m, Ask) for m in posted)  # no Call(lambda) on the SDK's paths
