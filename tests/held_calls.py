"""Holding one engine-side call until the test releases it: the stalls of issue 18 made
deterministic (a slow grammar compile or tokenization, without a slow input)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from aiobasert import Engine, TokenStream


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
