"""Non-blocking hand-off from the engine thread to the event loop.

anyio's `from_thread.run_sync` waits for the loop to run the callback; the
engine thread must never wait on a busy loop, so we use each backend's own
thread-safe, fire-and-forget scheduling: `loop.call_soon_threadsafe` on
asyncio, `TrioToken.run_sync_soon` on trio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sniffio


class LoopWaker:
    """Captured in the event loop that opens the engine; used from any thread."""

    def __init__(self) -> None:
        self.backend = sniffio.current_async_library()
        if self.backend == "asyncio":
            import asyncio

            self._schedule: Callable[..., Any] = asyncio.get_running_loop().call_soon_threadsafe
        elif self.backend == "trio":
            import trio

            self._schedule = trio.lowlevel.current_trio_token().run_sync_soon
        else:  # pragma: no cover - anyio supports only these two
            raise RuntimeError(f"unsupported async library {self.backend!r}")
        self.closed = False

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run fn(*args) on the loop soon. Never blocks; dropped once the loop is gone."""
        if self.closed:
            return
        try:
            self._schedule(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is left to tell
            self.closed = True
