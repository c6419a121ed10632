"""Tools for testing code built on aiobasert (in the spirit of `trio.testing` and httpx's
`MockTransport`), and the ones this project's own tests use: nothing here fakes the engine, every
call goes through the real one.

- `snapshot(engine)`: what the engine is doing now (`EngineSnapshot`: its counters, each request's
  status), read on the engine thread between two steps;
- `wait_until(engine, predicate, steps=...)`: wait for a condition on the snapshot, bounded in
  engine steps (and a generous wall-clock guard), instead of sleeping and hoping;
- `hold_lane(engine)`: a request that holds a lane, feeding nothing, until released: the
  deterministic way to keep the engine full (a long stream races generation on a fast machine);
- `thread_state(engine)`: the engine thread as the loop sees it, without a round trip (also after
  the engine closed): did it end, and did it free its model exactly once;
- `build_tiny_model(path, ...)`: a random-weight model of a few hundred kilobytes, built in well
  under a second, that the reference engine loads like any other (docs/testing.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import anyio
import msgspec

from ._core import request as _request
from ._core.step import StepRunner, TapPooler
from .engine import Engine
from .models.tiny import build_tiny_model
from .streams import TokenStream
from .types import EngineStats

__all__ = [
    "ConditionNotMet",
    "EngineSnapshot",
    "HeldLane",
    "RequestSnapshot",
    "RequestStatus",
    "ThreadState",
    "build_tiny_model",
    "hold_lane",
    "snapshot",
    "thread_state",
    "wait_until",
]

RequestStatus = Literal["preparing", "waiting", "running", "paused"]
"""Where a live request is: handed to the intake workers (tokenized, its grammar compiled; a
request cancelled meanwhile stays "preparing" until its preparation returns, holding its place),
queued for a lane, in a lane (prefilling or generating), or taken out of its lane and waiting
to resume (docs/fairness.md). A request that ended is in no snapshot."""


class RequestSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One live request as the engine holds it."""

    request_id: str
    status: RequestStatus
    embedding: bool = False
    """An embedding (`Engine.embed`), not a generation."""
    prompt_tokens: int = 0
    """Its prompt's length in tokens (0 while it is being prepared)."""
    prefilled: int = 0
    """Prompt tokens in its KV now (prefilled or seeded from the prefix cache)."""
    generated: int = 0
    """Tokens it has sampled so far."""

    @property
    def prefilling(self) -> bool:
        """In a lane with part of its prompt still to prefill."""
        return self.status == "running" and self.prefilled < self.prompt_tokens


EmbeddingPath = Literal["undecided", "tapped", "whole"]
"""How the engine embeds: not decided yet (no embedding so far), through taps in chunks like any
other lane, or in one `baseRT_embed` call between steps (the fallback, docs/architecture.md)."""


class EngineSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine is doing, read on its thread between two steps (`snapshot`)."""

    stats: EngineStats
    """The counters `Engine.stats()` returns, read at the same moment."""
    requests: dict[str, RequestSnapshot]
    """Every live request by its id (`TokenStream.request_id`): preparing, waiting, running or paused."""
    grammar_backends: dict[str, int]
    """Structured-output grammars served by backend ("engine" / "llguidance"), cached ones included."""
    grammar_compiles: dict[str, int]
    """Of those, the ones compiled (not found in the grammar cache)."""
    host_grammar_built: bool
    """The host (llguidance) grammar backend has been built (it is built on first use, or at open)."""
    embedding_path: EmbeddingPath

    def status(self, request_id: str) -> RequestStatus | None:
        """`request_id`'s status, or None when the engine does not hold it (not submitted yet, or ended)."""
        req = self.requests.get(request_id)
        return None if req is None else req.status

    def count(self, status: RequestStatus) -> int:
        """How many requests are `status` now."""
        return sum(1 for r in self.requests.values() if r.status == status)


_STATUS: dict[_request.RequestStatus, RequestStatus] = {
    _request.RequestStatus.PREPARING: "preparing",
    _request.RequestStatus.WAITING: "waiting",
    _request.RequestStatus.RUNNING: "running",
    _request.RequestStatus.PAUSED: "paused",
}


def _take(engine: Engine) -> EngineSnapshot:
    """On the engine thread, between two steps: nothing here changes while it is read."""
    thread = engine._thread
    prep = thread.prep
    requests = {
        # the engine holds a finished request only while its preparation is still out (it was
        # answered meanwhile, and holds its queue place until that returns): still "preparing"
        req.rid: RequestSnapshot(
            request_id=req.rid,
            status=_STATUS.get(req.status, "preparing"),
            embedding=req.embed,
            prompt_tokens=req.prompt_len,
            prefilled=req.prefilled,
            generated=req.generated,
        )
        for req in thread.requests.records()
    }
    pooler = thread.embedder.pooler
    path: EmbeddingPath = "tapped" if isinstance(pooler, TapPooler) else "whole" if pooler is None else "undecided"
    return EngineSnapshot(
        stats=thread.stats(),
        requests=requests,
        grammar_backends=dict(prep.grammar_backends),
        grammar_compiles=dict(prep.grammar_compiles),
        host_grammar_built=prep.backend is not None,
        embedding_path=path,
    )


async def snapshot(engine: Engine) -> EngineSnapshot:
    """What `engine` is doing now, read on its thread between two steps (as `Engine.stats()`).
    Raises `EngineClosedError` once the engine is closed."""
    return await engine._call(lambda: _take(engine))


class ConditionNotMet(AssertionError):
    """`wait_until`'s condition did not hold within its bound; `snapshot` is the last one read."""

    def __init__(self, message: str, snapshot: EngineSnapshot | None) -> None:
        super().__init__(message)
        self.snapshot = snapshot


async def wait_until(
    engine: Engine,
    predicate: Callable[[EngineSnapshot], bool],
    *,
    steps: int | None = None,
    timeout: float = 60.0,
) -> EngineSnapshot:
    """Wait until `predicate(snapshot)` holds and return that snapshot.

    The predicate sees each snapshot in turn (and may read loop-side state too: a stream's
    `finish_reason`, a flag a task set). `steps` bounds the wait in engine steps: the engine
    taking more than `steps` steps without the condition holding raises `ConditionNotMet`,
    however fast or slow the machine; `timeout` (seconds) is the wall-clock guard for a
    condition that needs no steps (an idle engine, work on the intake workers) and raises
    `ConditionNotMet` too. Between two snapshots it waits for the engine's next step when the
    engine is stepping, and a millisecond when it is not."""
    last: EngineSnapshot | None = None
    bound = "" if steps is None else f" within {steps} engine steps"
    with anyio.move_on_after(timeout) as guard:
        first: int | None = None
        while True:
            snap = await snapshot(engine)
            if predicate(snap):
                return snap
            if first is None:
                first = snap.stats.steps
            elif steps is not None and snap.stats.steps - first > steps:
                raise ConditionNotMet(f"the condition did not hold{bound}; last: {snap}", snap)
            moved = last is not None and snap.stats.steps != last.stats.steps
            last = snap
            if not moved:  # idle, or waiting on the loop or the intake workers: do not spin
                await anyio.sleep(0.001)
    assert guard.cancel_called
    raise ConditionNotMet(f"the condition did not hold{bound} in {timeout:g} s; last: {last}", last)


class ThreadState(msgspec.Struct, frozen=True, kw_only=True):
    """The engine thread as the loop sees it (`thread_state`)."""

    alive: bool
    """The thread is running (it ends once a closed engine has drained, or aborted)."""
    models_freed: int
    """Times it freed its model handle: 1 once it ended (never 2), 0 before."""
    steps: int
    """Steps taken so far."""
    requests_finished: int
    requests_cancelled: int
    requests_failed: int
    """The counters of `EngineStats` of those names: after the engine closed, their final values."""


def thread_state(engine: Engine) -> ThreadState:
    """Read without a round trip to the engine thread, so also after the engine closed (each
    value is one int or flag the thread writes: each is current, though not all of one instant)."""
    thread = engine._thread
    return ThreadState(
        alive=thread.alive,
        models_freed=thread.models_freed,
        steps=thread.steps,
        requests_finished=thread.finished,
        requests_cancelled=thread.cancelled,
        requests_failed=thread.failed,
    )


class _Holds:
    """The held requests of one engine: their rows are left out of every step at the C boundary
    (`StepRunner.run`, patched on this engine's runner only while anything is held)."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.rids: dict[str, threading.Event] = {}  # held id -> set once its rows were first left out
        self.released = threading.Event()  # wakes a step that had nothing else to run
        self.real = runner.run

        def run(rows: Any) -> Any:
            held = self.rids
            kept = [(lane, row) for lane, row in rows if row.lane.rid not in held]
            if len(kept) < len(rows):
                for _, row in rows:
                    if (seen := held.get(row.lane.rid)) is not None:
                        seen.set()
                if not kept:  # nothing else to run: wait a little rather than spin the engine thread
                    self.released.wait(0.001)
                    return []
                rows = kept
            return self.real(rows)

        runner.run = run  # type: ignore[method-assign]

    def drop(self, rid: str) -> None:
        self.rids.pop(rid, None)
        self.released.set()
        if not self.rids and self.runner.run is not self.real:
            del self.runner.run  # the class's own method again
            _HOLDS.pop(id(self.runner), None)


_HOLDS: dict[int, _Holds] = {}  # by id(runner): one patch per engine, however many holds
_HOLDS_LOCK = threading.Lock()


class HeldLane:
    """A request that takes one of the engine's lanes and keeps it, feeding nothing, until
    `release()` (`hold_lane`).

    Its rows are left out of every step at the C boundary from its admission on: it stays
    admitted and prefilling, so it counts as a running lane (`EngineStats.active_lanes`) and the
    queue waits behind it, it never finishes, and fair admission never takes it back (only a lane
    that has sampled is). The engine serves every other lane and message as usual. Released, its
    rows run again: it prefills and generates its `max_tokens` like any request."""

    def __init__(self, engine: Engine, prompt: str = "held", max_tokens: int = 8) -> None:
        self.stream: TokenStream = engine.stream(prompt, max_tokens=max_tokens, ignore_eos=True)
        self._admitted = threading.Event()
        self._released = False
        runner = engine._thread.runner
        with _HOLDS_LOCK:
            holds = _HOLDS.get(id(runner))
            if holds is None:
                holds = _HOLDS[id(runner)] = _Holds(runner)
            holds.rids[self.stream.request_id] = self._admitted
        self._holds = holds

    async def wait_admitted(self, timeout: float = 30) -> None:
        """Submit the request and wait until the engine has given it a lane (it planned its first row)."""
        self.stream.submit()
        with anyio.fail_after(timeout):
            while not self._admitted.is_set():
                await anyio.sleep(0.001)

    def release(self) -> None:
        """Its rows run again: it prefills and generates its max_tokens."""
        if not self._released:
            self._released = True
            with _HOLDS_LOCK:
                self._holds.drop(self.stream.request_id)

    @property
    def released(self) -> bool:
        return self._released

    async def aclose(self) -> None:
        """Give the lane back: the request is cancelled (it never ran)."""
        await self.stream.aclose()
        self.release()


@contextlib.asynccontextmanager
async def hold_lane(engine: Engine, prompt: str = "held", max_tokens: int = 8) -> AsyncIterator[HeldLane]:
    """`async with hold_lane(engine) as held:` the block runs once a request holds one of the
    engine's lanes (`HeldLane`); leaving it releases the hold and cancels the request if it is
    still running, so a failing test never leaves a lane taken."""
    held = HeldLane(engine, prompt, max_tokens)
    try:
        await held.wait_admitted()
        yield held
    finally:
        held.release()
        with anyio.CancelScope(shield=True):
            await held.stream.aclose()
