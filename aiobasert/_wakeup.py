"""Non-blocking hand-off from the engine thread to the event loop, and loop affinity.

anyio's `from_thread.run_sync` waits for the loop to run the callback; the
engine thread must never wait on a busy loop, so we use each backend's own
thread-safe, fire-and-forget scheduling: `loop.call_soon_threadsafe` on
asyncio, `TrioToken.run_sync_soon` on trio.

Every wake-up goes to the loop that opened the engine, so the engine can only
be used from that loop: `check()` raises `WrongEventLoopError` anywhere else
(another loop, another thread, no loop) instead of letting the caller wait
for a wake-up that will never come to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sniffio

from .errors import WrongEventLoopError


class LoopWaker:
    """Captured in the event loop that opens the engine; used from any thread."""

    def __init__(self) -> None:
        self.backend = sniffio.current_async_library()
        self._owner: object
        if self.backend == "asyncio":
            import asyncio

            loop = asyncio.get_running_loop()
            self._owner = loop
            self._schedule: Callable[..., Any] = loop.call_soon_threadsafe
            self._current: Callable[[], object] = asyncio._get_running_loop
        elif self.backend == "trio":
            import trio

            token = trio.lowlevel.current_trio_token()
            self._owner = token
            self._schedule = token.run_sync_soon
            self._current = _current_trio_token
        else:  # pragma: no cover - anyio supports only these two
            raise RuntimeError(f"unsupported async library {self.backend!r}")
        self.closed = False

    def in_owner(self) -> bool:
        """True when called inside the event loop that opened the engine."""
        return self._current() is self._owner

    def check(self, what: str = "this engine") -> None:
        """Raise WrongEventLoopError unless called in the owning event loop."""
        if self._current() is not self._owner:
            raise WrongEventLoopError(
                f"{what} belongs to the {self.backend} event loop that opened it and cannot be used from "
                "another event loop or thread; open an engine in each event loop that needs one"
            )

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run fn(*args) on the loop soon. Never blocks; dropped once the loop is gone."""
        if self.closed:
            return
        try:
            self._schedule(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is left to tell
            self.closed = True


def _current_trio_token() -> object:
    import trio

    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:  # not inside trio.run
        return None
