"""`Engine.embed` shares the engine (issue 8 item 14): an embedding is a lane fed
in chunks within the per-step prefill budget, so running streams keep getting a
token every step while a long input is embedded, and its result is what
`baseRT_embed` computes (up to the f16 rounding of the hidden-state taps).

Everything here is structural (engine steps, tokens per step), never timed;
every wait is bounded.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from held_calls import HoldLane
from lifecycle_model import assert_idle_and_whole

from aiobasert import (
    AioBaseRTError,
    Engine,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    TokenStream,
)
from aiobasert._ffi import Library
from aiobasert.testing import EngineSnapshot, RequestStatus, snapshot, thread_state, wait_until

pytestmark = pytest.mark.anyio

BOUND = 60.0
CHUNK = 16
N_LONG = 1000
TAPS_OFF = "AIOBASERT_EMBED_TAPS"


def long_ids(vocab: int, n: int = N_LONG, seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=n)]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


async def reference(path: Path, inputs: list[Any], monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray]:
    """baseRT_embed's results: an engine forced onto the single-call path."""
    with monkeypatch.context() as mp:
        mp.setenv(TAPS_OFF, "0")
        async with Engine.open(path, max_context=2048) as engine:
            out = [await engine.embed(x) for x in inputs]
            assert (await snapshot(engine)).embedding_path == "whole"  # the fallback really ran
            return out


def _embeddings(snap: EngineSnapshot, status: RequestStatus) -> int:
    return sum(1 for r in snap.requests.values() if r.embedding and r.status == status)


async def read_all(stream: TokenStream, got: list[int]) -> None:
    async for tok in stream:
        got.append(tok.id)


@pytest.mark.parametrize("taps", [True, False], ids=["chunked", "single-call"])
async def test_a_stream_gets_a_token_in_every_step_a_long_embed_runs(
    untied_model_path: Path, monkeypatch: pytest.MonkeyPatch, taps: bool
) -> None:
    """While a 1000-token embed runs (63 chunks of 16), a running stream decodes on:
    the embed holds a lane next to the stream's for >= 63 engine steps, and the
    stream got a token in every step from its admission to its end. Forced onto
    the single call, the embed never holds a lane: its forward runs between two
    steps, every lane waiting for it."""
    if not taps:
        monkeypatch.setenv(TAPS_OFF, "0")
    async with Engine.open(untied_model_path, max_batch_size=2, prefill_chunk=CHUNK, max_context=2048) as engine:
        ids = long_ids(engine.info.vocab_size)
        want = math.ceil(N_LONG / CHUNK)
        shared_steps: set[int] = set()  # steps seen with the embed's lane next to the stream's
        with anyio.fail_after(BOUND):
            stream = engine.stream("running", max_tokens=1000, ignore_eos=True)
            await stream.__anext__()
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_all, stream, [])
                before = (await engine.stats()).steps
                embedded = anyio.Event()

                async def watch() -> None:
                    while not embedded.is_set():
                        st = await engine.stats()
                        if st.active_lanes == 2:
                            shared_steps.add(st.steps)

                tg.start_soon(watch)
                vec = await engine.embed(ids)
                embedded.set()
                after = (await engine.stats()).steps
            done = await stream
        assert vec.shape == (engine.info.dim,) and np.isfinite(vec).all()
        t = done.timing
        # The stream ran through the whole embed and produced exactly one token per
        # step from admission to finish: it decoded in every step the embed ran in.
        assert t.admitted_step <= before and t.finished_step > after, (t, before, after)
        assert t.finished_step - t.admitted_step + 1 == len(done.token_ids) == 1000
        if taps:
            assert after - before >= want, (before, after)  # at most one 16-token chunk a step
            assert shared_steps, "the embed never held a lane next to the stream"
            assert all(before <= s_ <= after for s_ in shared_steps)
        else:
            assert not shared_steps
        await assert_idle_and_whole(engine)


async def test_embed_equals_baseRT_embed(untied_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short, chunk-straddling and long inputs, text and ids, alone and sharing steps with
    streams and other embeds: each within f16-tap tolerance of baseRT_embed."""
    async with Engine.open(untied_model_path, max_context=2048) as probe:
        vocab = probe.info.vocab_size
    inputs: list[Any] = [[5], long_ids(vocab, 33, 1), long_ids(vocab, N_LONG, 2), "embed this text " * 30]
    want = await reference(untied_model_path, inputs, monkeypatch)
    async with Engine.open(untied_model_path, max_batch_size=4, prefill_chunk=CHUNK, max_context=2048) as engine:
        with anyio.fail_after(BOUND):
            alone = [await engine.embed(x) for x in inputs]
            assert (await snapshot(engine)).embedding_path == "tapped"  # the chunked path ran
            together: list[np.ndarray | None] = [None] * len(inputs)

            async def one(i: int) -> None:
                together[i] = await engine.embed(inputs[i])

            async with anyio.create_task_group() as tg:
                streams = [engine.stream("neighbour", max_tokens=60, ignore_eos=True) for _ in range(2)]
                for s in streams:
                    tg.start_soon(read_all, s, [])
                for i in range(len(inputs)):
                    tg.start_soon(one, i)
        for a, b, w in zip(alone, together, want, strict=True):
            assert b is not None and a.dtype == np.float32 and a.shape == w.shape
            assert rel_err(a, w) < 1e-3, rel_err(a, w)
            # chunk boundaries move the float64 sums' order only
            assert rel_err(b, a) < 1e-9
        await assert_idle_and_whole(engine)


async def test_cancel_mid_embed_frees_its_lane(untied_model_path: Path) -> None:
    async with Engine.open(untied_model_path, max_batch_size=2, prefill_chunk=16, max_context=2048) as engine:
        ids = long_ids(engine.info.vocab_size, 2000)
        with anyio.fail_after(BOUND):
            await engine.embed([1, 2, 3])  # decide the path first
            result: list[np.ndarray] = []
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    result.append(await engine.embed(ids))

                tg.start_soon(run)
                start = None
                while True:  # until the embed holds a lane and has run a few chunks
                    s = await engine.stats()
                    if s.active_lanes == 1:
                        start = s.steps if start is None else start
                        if s.steps >= start + 3:
                            break
                    await anyio.sleep(0.001)
                assert s.live_sequences == 1 and s.kv_blocks_used > 0
                tg.cancel_scope.cancel()
            assert result == []  # 2000 tokens in chunks of 16 = 125 steps: it was cut mid-way
            await assert_idle_and_whole(engine)
            # the engine serves on, the same input gives the same vector
            a, b = await engine.embed(ids[:100]), await engine.embed(ids[:100])
            assert np.array_equal(a, b)
        await assert_idle_and_whole(engine)


async def test_timeout_mid_embed_frees_its_lane(untied_model_path: Path) -> None:
    async with Engine.open(untied_model_path, max_batch_size=1, prefill_chunk=16, max_context=2048) as engine:
        ids = long_ids(engine.info.vocab_size, 2000)
        blocker = engine.stream("hold the only lane", max_tokens=1000, ignore_eos=True)
        with anyio.fail_after(BOUND):
            await blocker.__anext__()
            with anyio.move_on_after(0.05):  # waits for the lane (queued) or runs: freed either way
                await engine.embed(ids)
            await blocker.aclose()
        await assert_idle_and_whole(engine)


@pytest.mark.parametrize("abort", [True, False], ids=["abort", "drain"])
async def test_close_mid_embed(untied_model_path: Path, abort: bool) -> None:
    """Abort ends a running and a queued embed with EngineClosedError; a drain lets them finish."""
    engine = await Engine.open(untied_model_path, max_batch_size=1, prefill_chunk=16, max_context=2048)
    ids = long_ids(engine.info.vocab_size, 1500)
    outcomes: list[Any] = [None, None]
    with anyio.fail_after(BOUND):
        await engine.embed([1, 2, 3])

        async def run(i: int) -> None:
            try:
                outcomes[i] = await engine.embed(ids)
            except EngineClosedError as exc:
                outcomes[i] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
            await wait_until(engine, lambda s: s.stats.active_lanes > 0 and s.stats.waiting_requests > 0)
            await engine.aclose(abort=abort)
    closed = thread_state(engine)
    assert closed.models_freed == 1 and not closed.alive
    if abort:
        assert all(isinstance(o, EngineClosedError) for o in outcomes), outcomes
    else:
        assert all(isinstance(o, np.ndarray) for o in outcomes), outcomes
        assert np.array_equal(outcomes[0], outcomes[1])
    with pytest.raises(EngineClosedError):
        await engine.embed([1, 2])


async def test_embed_errors_cost_only_their_caller(untied_model_path: Path, hold_lane: HoldLane) -> None:
    """Refused embeds (too long, empty, past max_queue) raise in their caller only;
    an embed waits for a lane like any request."""
    async with Engine.open(untied_model_path, max_batch_size=1, max_queue=1, max_context=2048) as engine:
        with anyio.fail_after(BOUND):
            held = await hold_lane(engine)  # the only lane, until released
            with pytest.raises(InvalidRequestError, match="context window"):
                await engine.embed([5] * 3000)
            with pytest.raises(InvalidRequestError, match="empty"):
                await engine.embed("")
            async with anyio.create_task_group() as tg:
                waiting: list[np.ndarray] = []

                async def wait_one() -> None:
                    waiting.append(await engine.embed([7, 8, 9]))

                tg.start_soon(wait_one)
                await wait_until(
                    engine, lambda s: [r.embedding for r in s.requests.values() if r.status == "waiting"] == [True]
                )
                with pytest.raises(EngineOverloadedError):
                    await engine.embed([7, 8, 9])
                assert waiting == []
                held.release()
                await held.stream  # its end frees the lane
            assert len(waiting) == 1 and np.array_equal(waiting[0], await engine.embed([7, 8, 9]))
        await assert_idle_and_whole(engine)


async def test_a_failed_step_mid_embed_is_a_typed_error_and_frees_everything(
    untied_model_path: Path, lib: Library
) -> None:
    """The engine fails a step the embed is in (injected): the embed raises a typed
    error, its lane is freed, and the engine serves on."""
    async with Engine.open(untied_model_path, max_batch_size=2, prefill_chunk=16, max_context=2048) as engine:
        ids = long_ids(engine.info.vocab_size, 1500)
        with anyio.fail_after(BOUND):
            want = await engine.embed(ids[:50])
            outcome: list[BaseException] = []

            async def run() -> None:
                try:
                    await engine.embed(ids)
                except AioBaseRTError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await wait_until(
                    engine, lambda s: any(r.embedding and r.status == "running" for r in s.requests.values())
                )
                assert lib.baseRT_ref_inject_fault(1, 2) == 0  # the second step from now fails
            assert len(outcome) == 1 and "injected fault" in str(outcome[0])
            await assert_idle_and_whole(engine)
            assert np.array_equal(await engine.embed(ids[:50]), want)
        await assert_idle_and_whole(engine)


@pytest.mark.slow
async def test_smollm2_embed_equals_baseRT_embed(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 100  # ~1000 tokens
    (want,) = await reference(smollm2_path, [text], monkeypatch)
    async with Engine.open(smollm2_path, max_batch_size=2, prefill_chunk=128, max_context=2048) as engine:
        with anyio.fail_after(300):
            assert len(await engine.encode(text)) > 900
            s = engine.stream("Once upon a time", max_tokens=20, ignore_eos=True)
            await s.__anext__()
            got = await engine.embed(text)
            await s.aclose()
        assert (await snapshot(engine)).embedding_path == "tapped"
        assert rel_err(got, want) < 1e-3, rel_err(got, want)
        await assert_idle_and_whole(engine)


# ---- the policy alone (batcher.py: no engine) ------------------------------------------


def test_batcher_feeds_an_embedding_from_the_prefill_budget_and_the_tap_budget() -> None:
    from aiobasert._core.request import Request
    from aiobasert.batcher import Batcher

    b = Batcher(max_batch_size=4, max_context=4096, prefill_budget=64, tap_budget=40, prefix_cache=True)
    decode = Request(rid="d", prompt_len=1, max_new_tokens=100, prefilled=1)
    embed = Request(rid="e", prompt_len=100, max_new_tokens=0, embed=True)
    prompt = Request(rid="p", prompt_len=100, max_new_tokens=10)
    for st in (decode, embed, prompt):
        b.enqueue(st)
    b.admit()
    assert not b.should_match_prefix(embed) and b.should_match_prefix(prompt)
    assert not b.should_publish_prefix(embed, 100)
    # the decode lane: 1; the embed (admitted before the prompt: less work, so more urgent):
    # min(100, budget 64, taps 40) = 40; the prompt: the budget left, 24
    assert {st.rid: k for st, k in b.schedule()} == {"d": 1, "e": 40, "p": 24}
    embed.prefilled, prompt.prefilled = 80, 24
    assert {st.rid: k for st, k in b.schedule()} == {"d": 1, "e": 20, "p": 44}


_FIRST_NUMPY_IMPORT = """
import sys, threading, anyio, aiobasert
class Watch:  # records the thread that first asks for numpy, then steps aside
    seen = None
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and Watch.seen is None:
            Watch.seen = threading.current_thread().name
        return None
sys.meta_path.insert(0, Watch())
async def main():
    # without the grammar backend, which imports numpy at open (on a worker too)
    async with aiobasert.Engine.open(sys.argv[1], max_batch_size=2, grammar_backend_at_open=False) as engine:
        stream = engine.stream("running", max_tokens=64, ignore_eos=True)
        await stream.__anext__()
        assert "numpy" not in sys.modules
        vector = await engine.embed("a cat")
        print(Watch.seen, len(vector), len([t async for t in stream]), sep="|")
anyio.run(main)
"""


def test_the_first_embedding_imports_numpy_off_the_engine_thread(tiny_model_path: Path) -> None:
    """numpy is imported on first use (a text-only engine, `grammar_backend_at_open=False`, never pays
    for it), but not on the engine thread, where its import (~0.1 s) would stall every running stream's next token."""
    proc = subprocess.run([sys.executable, "-c", _FIRST_NUMPY_IMPORT, str(tiny_model_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    importer, dim, rest = proc.stdout.strip().split("|")
    assert importer not in ("None", "aiobasert-engine"), proc.stdout
    assert int(dim) > 0 and int(rest) == 63
