"""Holding engine-side work until the test releases it: one call (the stalls of issue 18 made
deterministic: a slow grammar compile or tokenization, without a slow input), or one lane
(`HeldLane`: a lane that stays taken, whatever the machine's speed)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest

from aiobasert import Engine, TokenStream
from aiobasert._core.step import StepRunner


class HeldCall:
    """Patches `cls.name` so that a call (on whatever thread makes it, when `when(args)`)
    sets `entered` and waits for `release()` before running the real method."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        cls: type,
        name: str,
        when: Callable[[tuple[Any, ...]], bool] | None = None,
    ) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        real = getattr(cls, name)

        def held(obj: Any, *args: Any) -> Any:
            if when is None or when(args):
                self.entered.set()
                self.gate.wait(120)  # bounded, in case the hold is on the engine thread itself
            return real(obj, *args)

        monkeypatch.setattr(cls, name, held)

    async def wait_entered(self) -> None:
        while not self.entered.is_set():
            await anyio.sleep(0.001)

    def release(self) -> None:
        self.gate.set()

    @contextlib.asynccontextmanager
    async def holding(self, bound: float = 30) -> AsyncIterator[None]:
        """The block runs once the call is held and while it is (both within `bound` s); leaving it,
        however, releases the call."""
        try:
            with anyio.fail_after(bound):
                await self.wait_entered()
                yield
        finally:
            self.release()

    @property
    def released(self) -> bool:
        return self.gate.is_set()


async def assert_engine_steps_on(engine: Engine, running: TokenStream, held: HeldCall, steps: int = 32) -> None:
    """While `held` is held, the engine takes `steps` more steps and `running` gets a token in each."""
    before, delivered = engine._thread.steps, running._ticket.delivered
    while engine._thread.steps < before + steps:
        await anyio.sleep(0.001)
    assert running._ticket.delivered >= delivered + steps and not held.released


class HeldLane:
    """A request that takes a lane and keeps it until `release()` (or `aclose()`), feeding nothing.

    Its rows are left out of every step (`StepRunner.run`, the C boundary), from its admission
    on: it stays admitted and prefilling, so it counts as a running lane and the queue waits
    behind it, it never finishes, and fair admission never takes it back (only a lane that has
    sampled is taken back). The engine serves every other lane and message as usual. This holds
    however fast or slow the machine is, unlike a long stream, which ends when its tokens run out.
    Get one with the `hold_lane` fixture; a hold left over is released at the test's end."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: Engine, prompt: str, max_tokens: int) -> None:
        self.stream = engine.stream(prompt, max_tokens=max_tokens, ignore_eos=True)
        self.admitted, self._released = threading.Event(), threading.Event()
        rid, real = self.stream.request_id, StepRunner.run

        def run(runner: StepRunner, rows: Any) -> Any:
            if not self._released.is_set():
                kept = [(lane, row) for lane, row in rows if row.lane.rid != rid]
                if len(kept) < len(rows):
                    self.admitted.set()
                    if not kept:  # nothing else to run: wait a little rather than spin the engine thread
                        self._released.wait(0.001)
                        return []
                    rows = kept
            return real(runner, rows)

        monkeypatch.setattr(StepRunner, "run", run)

    async def wait_admitted(self, bound: float = 30) -> None:
        """Until the engine has given it a lane (it planned its first row)."""
        self.stream.submit()
        with anyio.fail_after(bound):
            while not self.admitted.is_set():
                await anyio.sleep(0.001)

    def release(self) -> None:
        """Its rows run again: it prefills and generates its max_tokens."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    async def aclose(self) -> None:
        """Give the lane back: the request is cancelled (it never ran)."""
        await self.stream.aclose()
        self.release()


HoldLane = Callable[..., Awaitable[HeldLane]]
"""The `hold_lane` fixture's type: `held = await hold_lane(engine, prompt="held", max_tokens=8)`."""
