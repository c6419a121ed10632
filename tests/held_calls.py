"""Holding engine-side work until the test releases it: one call (the stalls of issue 18 made
deterministic: a slow grammar compile or tokenization, without a slow input). A lane that stays
taken, whatever the machine's speed, is `aiobasert.testing.hold_lane` (the `hold_lane` fixture)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest

from aiobasert import Engine, TokenStream
from aiobasert.testing import HeldLane, snapshot, wait_until


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

        def held(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if when is None or when(args):
                self.entered.set()
                self.gate.wait(120)  # bounded, in case the hold is on the engine thread itself
            return real(obj, *args, **kwargs)

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
    rid = running.request_id
    before = await snapshot(engine)
    after = await wait_until(engine, lambda s: s.stats.steps >= before.stats.steps + steps)
    assert after.requests[rid].generated >= before.requests[rid].generated + steps and not held.released


HoldLane = Callable[..., Awaitable[HeldLane]]
"""The `hold_lane` fixture's type: `held = await hold_lane(engine, prompt="held", max_tokens=8)`
(an `aiobasert.testing.HeldLane`, released at the test's end)."""
