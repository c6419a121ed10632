"""Request-sized work off the event loop.

Rendering a chat (every message and tool through the template, the call grammar's
text) costs what the request decides. On the event loop it would pause every other
client's stream for as long as it takes; here it runs in a worker thread, where it
delays only its own request. Two small pools: a small job (few messages, few tools)
never waits behind a large one, and at most `LARGE_WORKERS` large jobs contend with
the loop for the GIL at once, so the loop keeps its share of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

SMALL_WORKERS = 4
LARGE_WORKERS = 2
SMALL_MESSAGES = 64
"""A chat of at most this many messages and `SMALL_TOOLS` tools is a small job."""
SMALL_TOOLS = 8


def is_large(messages: int, tools: int) -> bool:
    """Whether a chat of `messages` messages and `tools` tools is a large job."""
    return messages > SMALL_MESSAGES or tools > SMALL_TOOLS


class Workers:
    """The worker pools of one app (made on first use, in the app's own event loop)."""

    def __init__(self) -> None:
        self._limiters: dict[bool, anyio.CapacityLimiter] = {}

    async def run(self, job: Callable[[], T], *, large: bool) -> T:
        """Run `job` in a worker thread of its size class and return its result (or raise
        its error). A cancelled caller still waits for the job (bounded by its request's caps)."""
        limiter = self._limiters.get(large)
        if limiter is None:
            limiter = self._limiters[large] = anyio.CapacityLimiter(LARGE_WORKERS if large else SMALL_WORKERS)
        return await anyio.to_thread.run_sync(job, limiter=limiter)
