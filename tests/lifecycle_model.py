"""A model-based random walk over the engine and stream lifecycle (asyncio or trio).

Each step picks one action at random (seeded): open an engine with random
limits, submit streams with random parameters, read some tokens, break out
of named and unnamed streams, cancel readers from their own and from other
tasks, time out, `aclose()` streams (with a reader waiting or not), drop
references, await whole completions, embed inputs in the background (chunked
lanes next to the streams) and cancel some, go idle, close the engine (drain,
drain timed out then abort, abort) and reopen. After every step the invariants:

* no task is blocked past a bound (every wait runs under `anyio.fail_after`);
* every stream ends with tokens or a typed error (AioBaseRTError), or was
  closed by the walk itself; a reader never sees anything else; every embed
  ends with a finite vector of the model's dim, a typed error, or our cancel;
* once idle: zero live sequences, decode streams and grammars, and no KV
  block in use outside the prefix cache;
* after close: the engine's thread is gone and its model freed, every reader
  has ended.

The suite runs it short (tests/sdk/test_lifecycle_model.py); bench/lifecycle_soak.py
runs it long.
"""

from __future__ import annotations

import gc
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from aiobasert import (
    AioBaseRTError,
    Completion,
    Engine,
    EngineClosedError,
    StreamClosedError,
    TokenStream,
)
from aiobasert.testing import thread_state

BOUND = 30.0

WORDS = ["the", "a", "of", "time", "once", "upon", "model", "😀", "日本", "\n", "token", "lane"]


async def assert_idle_and_whole(engine: Engine) -> None:
    """Nothing running, and nothing held: sequences, grammars, KV outside the prefix cache."""
    with anyio.fail_after(BOUND):
        while True:
            s = await engine.stats()
            if s.active_lanes == 0 and s.waiting_requests == 0:
                break
            await anyio.sleep(0.005)
    assert s.live_sequences == 0 and s.live_grammars == 0, s
    assert s.kv_blocks_used == s.prefix_blocks_cached, s


def engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "aiobasert-engine" and t.is_alive()}


@dataclass
class Tracked:
    stream: TokenStream
    max_tokens: int
    tokens: int = 0
    outcome: str | None = None  # "done", "closed", "error:<type>", "cancelled"
    reader: anyio.CancelScope | None = None
    reader_done: anyio.Event = field(default_factory=anyio.Event)
    has_reader: bool = False


@dataclass
class TrackedEmbed:
    source: str | list[int]
    outcome: str | None = None  # "done", "error:<type>", "cancelled"
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class WalkStats:
    steps: int = 0
    opens: int = 0
    closes: int = 0
    streams: int = 0
    done: int = 0
    closed: int = 0
    errors: int = 0
    cancelled: int = 0
    idle_checks: int = 0
    embeds: int = 0
    embeds_done: int = 0
    actions: dict[str, int] = field(default_factory=dict)


class LifecycleWalk:
    def __init__(self, model: Path, seed: int, *, structured: bool = True) -> None:
        self.model = model
        self.rng = random.Random(seed)
        self.seed = seed
        self.structured = structured
        self.engine: Engine | None = None
        self.tracked: list[Tracked] = []
        self.embeds: list[TrackedEmbed] = []
        self.stats = WalkStats()
        self.baseline = engine_threads()
        self.tg: Any = None
        self.history: list[str] = []

    # ---- invariants ---------------------------------------------------------------

    def check_outcome(self, t: Tracked, exc: BaseException | None) -> None:
        if exc is None:
            return
        assert isinstance(exc, AioBaseRTError), f"seed {self.seed}: a stream ended with {exc!r}"

    async def check_idle(self) -> None:
        """Close every stream, wait for every reader, then nothing may be held."""
        engine = self.engine
        assert engine is not None
        for t in self.tracked:
            await t.stream.aclose()
        for t in self.tracked:
            if t.has_reader:
                await t.reader_done.wait()
        self.tracked.clear()
        await self.settle_embeds()  # with no stream left, a queued embed gets a lane
        gc.collect()
        while True:
            s = await engine.stats()
            if s.active_lanes == 0 and s.waiting_requests == 0:
                break
            await anyio.sleep(0.002)
        assert s.live_sequences == 0 and s.live_grammars == 0, (self.seed, s)
        assert s.kv_blocks_used == s.prefix_blocks_cached, (self.seed, s)
        self.stats.idle_checks += 1

    async def settle_embeds(self) -> None:
        for e in self.embeds:
            await e.done.wait()
        self.embeds.clear()

    # ---- actions ------------------------------------------------------------------

    def start_embed(self) -> None:
        assert self.engine is not None
        rng = self.rng
        if rng.random() < 0.5:
            source: str | list[int] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 120)))
        else:  # ids; past the 256-token context now and then (refused in the caller)
            source = [rng.randrange(3, self.engine.info.vocab_size) for _ in range(rng.choice([1, 40, 250, 300]))]
        e = TrackedEmbed(source)
        self.embeds.append(e)
        self.stats.embeds += 1
        self.tg.start_soon(self.embedder, self.engine, e)

    async def embedder(self, engine: Engine, e: TrackedEmbed) -> None:
        with e.scope:
            try:
                vec = await engine.embed(e.source)
                assert isinstance(vec, np.ndarray) and vec.dtype == np.float32, (self.seed, vec)
                assert vec.shape == (engine.info.dim,) and np.isfinite(vec).all(), (self.seed, vec)
                e.outcome = "done"
                self.stats.embeds_done += 1
            except AioBaseRTError as exc:
                e.outcome = f"error:{type(exc).__name__}"
            except BaseException as exc:  # only our own cancellation may end an embed otherwise
                if not isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise AssertionError(f"seed {self.seed}: an embed ended with {exc!r}") from exc
                raise
        if e.scope.cancel_called and e.outcome is None:
            e.outcome = "cancelled"
        e.done.set()

    def params(self) -> dict[str, Any]:
        rng = self.rng
        p: dict[str, Any] = {"max_tokens": rng.randint(1, 40), "ignore_eos": rng.random() < 0.7}
        if rng.random() < 0.5:
            p.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(2**32))
        if rng.random() < 0.2:
            p["stop"] = rng.choice(WORDS)
        if rng.random() < 0.15:
            p["logprobs"] = True
            p["top_logprobs"] = rng.randint(0, 3)
        if self.structured and rng.random() < 0.1:
            p["json_schema"] = True
        if rng.random() < 0.05:
            p["max_tokens"] = 10**6  # refused in the caller's coroutine (context)
        return p

    async def open(self) -> None:
        rng = self.rng
        self.engine = await Engine.open(
            self.model,
            max_batch_size=rng.choice([1, 2, 4, 8]),
            max_queue=rng.choice([1, 2, 16]),
            prefill_chunk=rng.choice([4, 16, 256]),
            max_context=256,
            kv_cache_dtype=rng.choice(["auto", "f16", "q8"]),
        )
        self.stats.opens += 1

    def new_stream(self) -> Tracked | None:
        assert self.engine is not None
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 30)))
        p = self.params()
        stream = self.engine.stream(prompt, **p)
        self.stats.streams += 1
        t = Tracked(stream, p["max_tokens"])
        self.tracked.append(t)
        return t

    async def read_some(self, t: Tracked, n: int) -> None:
        if t.has_reader:
            return
        try:
            for _ in range(n):
                await t.stream.__anext__()
                t.tokens += 1
        except StopAsyncIteration:
            t.outcome = t.outcome or "done"
        except AioBaseRTError as exc:
            t.outcome = f"error:{type(exc).__name__}"
            self.stats.errors += 1

    async def reader(self, t: Tracked, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                async for _ in t.stream:
                    t.tokens += 1
                    if self.rng.random() < 0.05:
                        await anyio.sleep(0)
                t.outcome = t.outcome or "done"
            except AioBaseRTError as exc:
                self.check_outcome(t, exc)
                t.outcome = f"error:{type(exc).__name__}"
            except BaseException as exc:  # only our own cancellation may end a reader otherwise
                if not isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise AssertionError(f"seed {self.seed}: a reader ended with {exc!r}") from exc
                raise
        if scope.cancel_called:
            t.outcome = "cancelled"
        t.reader_done.set()

    def unblock(self, keep: Tracked) -> None:
        """Before a blocking read of `keep`: every other submitted stream gets a
        reader (lanes never wait for readers, so this only keeps the run's
        readers busy, as a real client's would be)."""
        for t in self.tracked:
            if t is not keep and t.outcome is None and not t.has_reader and t.stream._started:
                self.start_reader(t)

    def start_reader(self, t: Tracked) -> None:
        t.has_reader = True
        t.reader = anyio.CancelScope()
        self.tg.start_soon(self.reader, t, t.reader)

    async def step(self) -> None:
        rng = self.rng
        if self.engine is None:
            if rng.random() < 0.2:
                self.note("idle-without-engine")
                return
            self.note("open")
            await self.open()
            return
        engine = self.engine
        live = [t for t in self.tracked if t.outcome is None]
        action = rng.choices(
            [
                "submit",
                "read",
                "break_named",
                "break_unnamed",
                "background",
                "cancel_reader",
                "timeout",
                "aclose",
                "aclose_waited",
                "drop",
                "await",
                "idle",
                "close",
                "embed",
                "cancel_embed",
            ],
            weights=[14, 10, 5, 4, 7, 4, 4, 4, 3, 4, 5, 2, 2, 4, 2],
        )[0]
        if (
            action
            in (
                "read",
                "break_named",
                "background",
                "timeout",
                "aclose",
                "aclose_waited",
                "drop",
                "await",
                "cancel_reader",
            )
            and not live
        ):
            action = "submit"
        self.note(action)
        if action == "submit":
            t = self.new_stream()
            if t is not None and rng.random() < 0.5:
                try:
                    t.stream.submit()
                except AioBaseRTError:
                    t.outcome = "error"
        elif action == "read":
            t = rng.choice(live)
            self.unblock(t)
            await self.read_some(t, rng.randint(1, 5))
        elif action == "break_named":
            t = rng.choice(live)
            self.unblock(t)
            if not t.has_reader:
                try:
                    async for _ in t.stream:
                        t.tokens += 1
                        break
                except AioBaseRTError as exc:
                    self.check_outcome(t, exc)
                t.outcome = t.outcome or "closed"
        elif action == "break_unnamed":
            for t in live:
                if not t.has_reader and t.stream._started:
                    self.start_reader(t)
            try:
                async for _ in engine.stream("unnamed " + rng.choice(WORDS), **self.params()):
                    break
            except AioBaseRTError:
                self.stats.errors += 1
        elif action == "background":
            t = rng.choice(live)
            if not t.has_reader:
                self.start_reader(t)
        elif action == "cancel_reader":
            readers = [t for t in live if t.has_reader and t.reader is not None]
            if readers:
                t = rng.choice(readers)
                assert t.reader is not None
                t.reader.cancel()  # from this task: another task's reader
                await t.reader_done.wait()
                self.stats.cancelled += 1
        elif action == "timeout":
            t = rng.choice(live)
            if not t.has_reader:
                with anyio.move_on_after(rng.choice([0, 0.001, 0.01])):
                    try:
                        await t.stream
                        t.outcome = "done"
                    except AioBaseRTError as exc:
                        self.check_outcome(t, exc)
                        t.outcome = "error"
        elif action in ("aclose", "aclose_waited"):
            t = rng.choice(live)
            if action == "aclose_waited" and not t.has_reader:
                self.start_reader(t)
                await anyio.sleep(0)
            await t.stream.aclose()
            if t.has_reader:
                await t.reader_done.wait()  # a waiting reader wakes at once
            t.outcome = t.outcome or "closed"
            self.stats.closed += 1
        elif action == "drop":
            t = rng.choice(live)
            if not t.has_reader:
                self.tracked.remove(t)
                del t
                gc.collect()
        elif action == "await":
            t = rng.choice(live)
            self.unblock(t)
            if not t.has_reader:
                try:
                    done = await t.stream
                    assert isinstance(done, Completion)
                    assert done is await t.stream  # awaiting twice: the same result
                    t.outcome = "done"
                    self.stats.done += 1
                except StreamClosedError:
                    t.outcome = "closed"
                except AioBaseRTError as exc:
                    self.check_outcome(t, exc)
                    t.outcome = "error"
                    self.stats.errors += 1
        elif action == "embed":
            self.start_embed()
        elif action == "cancel_embed":
            running = [e for e in self.embeds if not e.done.is_set()]
            if running:
                e = rng.choice(running)
                e.scope.cancel()  # from this task, mid-queue or mid-chunks
                await e.done.wait()
        elif action == "idle":
            await self.check_idle()
        elif action == "close":
            await self.close(rng.choice(["drain", "drain_timeout", "abort"]))

    async def close(self, how: str) -> None:
        engine = self.engine
        assert engine is not None
        if how == "drain_timeout":
            with anyio.move_on_after(self.rng.choice([0, 0.001, 0.01])):
                await engine.aclose()
            await engine.aclose(abort=True)
        else:
            await engine.aclose(abort=how == "abort")
        closed = thread_state(engine)
        assert engine.closed and not closed.alive and closed.models_freed == 1
        for t in self.tracked:  # every reader has ended, with tokens or a typed error
            if t.has_reader:
                await t.reader_done.wait()
        await self.settle_embeds()  # a drain finished them, an abort ended them with EngineClosedError
        try:
            engine.stream("after close")
            raise AssertionError("a closed engine took a request")
        except EngineClosedError:
            pass
        self.tracked.clear()
        self.engine = None
        self.stats.closes += 1
        gc.collect()
        extra = engine_threads() - self.baseline
        assert not extra, f"seed {self.seed}: threads left after close: {extra}"

    def note(self, action: str) -> None:
        self.stats.actions[action] = self.stats.actions.get(action, 0) + 1
        self.history.append(action)

    async def run(self, steps: int) -> WalkStats:
        async with anyio.create_task_group() as tg:
            self.tg = tg
            for _ in range(steps):
                try:
                    with anyio.fail_after(BOUND):
                        await self.step()
                except TimeoutError:
                    last = self.history[-12:]
                    raise AssertionError(f"seed {self.seed}: blocked past {BOUND} s after {last}") from None
                self.stats.steps += 1
            with anyio.fail_after(BOUND):
                if self.engine is not None:
                    await self.check_idle()
                    await self.close(self.rng.choice(["drain", "abort"]))
        return self.stats
