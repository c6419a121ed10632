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

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import sniffio

from ..errors import WrongEventLoopError


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

    def check(self, what: str = "this engine") -> None:
        """Raise WrongEventLoopError unless called in the owning event loop."""
        if self._current() is not self._owner:
            raise WrongEventLoopError(
                f"{what} belongs to the {self.backend} event loop that opened it and cannot be used from "
                "another event loop or thread; open an engine in each event loop that needs one"
            )

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run fn(*args) on the loop soon. Never blocks; dropped once the loop is gone.

        The wake-up itself (a write to the loop's self-pipe) is made by the relay
        thread, not the caller: the write releases the GIL, the woken loop takes it
        and the engine thread would then wait, GIL-less, until the loop has handled
        the step's tokens (up to the 5 ms switch interval) before it can start its
        next step. Handed to the relay, the engine thread goes straight on into that
        step (C code, GIL released) and the loop does its work meanwhile."""
        if not self.closed:
            _relay().put((self, fn, args))

    def _deliver(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        if self.closed:
            return
        try:
            self._schedule(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is left to tell
            self.closed = True


_Item = tuple[LoopWaker, Callable[..., object], tuple[Any, ...]]
_relay_queue: queue.SimpleQueue[_Item] | None = None
_relay_lock = threading.Lock()


def _relay() -> queue.SimpleQueue[_Item]:
    """The process's one relay thread (started on first use), in FIFO order, so
    every loop sees its callbacks in the order they were scheduled."""
    global _relay_queue
    if _relay_queue is None:
        with _relay_lock:
            if _relay_queue is None:
                q: queue.SimpleQueue[_Item] = queue.SimpleQueue()
                threading.Thread(target=_run_relay, args=(q,), name="aiobasert-loop-waker", daemon=True).start()
                _relay_queue = q
    return _relay_queue


def _forget_relay() -> None:
    global _relay_queue
    _relay_queue = None  # a forked child has no relay thread: it starts its own on first use


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_relay)


def _run_relay(q: queue.SimpleQueue[_Item]) -> None:
    while True:
        waker, fn, args = q.get()
        try:
            waker._deliver(fn, args)
        except BaseException:  # a loop's scheduling failure must not stop the relay of the others
            waker.closed = True


def _current_trio_token() -> object:
    import trio

    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:  # not inside trio.run
        return None
