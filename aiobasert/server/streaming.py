"""Server-sent events and client disconnects.

A client that goes away cancels its work: `unless_disconnected` for a whole
(non-streamed) response, `EventStream` for a streamed one. Cancelling the work
closes its `TokenStream`, which frees the engine lane before the next step.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import ClientGone, api_error

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse(body: msgspec.Struct) -> bytes:
    """One `data:` event."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def error_event(exc: BaseException) -> bytes:
    """The in-band error event of a stream that has already started."""
    return sse(api_error(exc).body)


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel `scope` when the client goes away (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work`, cancelling it (and so its engine request) if the client disconnects."""
    results: list[T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
        try:
            results.append(await work())
        except Exception as exc:  # re-raised below, outside the task group (no ExceptionGroup)
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    if not results:
        raise ClientGone
    return results[0]


async def gather(calls: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Run `calls` concurrently; re-raise the first failure as itself (not in an ExceptionGroup)."""
    errors: list[Exception] = []

    async def guarded(call: Callable[[], Awaitable[None]]) -> None:
        try:
            await call()
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(guarded, call)
    if errors:
        raise errors[0]


class EventStream(Response):
    """A server-sent-event response that commits to 200 only once its first event is ready.

    The events generator raises before its first yield when the request fails
    (a too-long prompt, a full queue): that becomes an ordinary JSON error
    response. The client's disconnect is watched from the start, also while the
    request waits for a lane, and cancels the generator, which closes its
    `TokenStream` and so frees the lane.

    Several generators (one per choice, n > 1) are merged: all their first
    events are awaited before the response starts, then events go out as each
    choice produces them, and `tail()` (usage, `[DONE]`) ends the stream.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None] | Sequence[AsyncGenerator[bytes, None]],
        tail: Callable[[], bytes] | None = None,
    ) -> None:
        self._all = [events] if isinstance(events, AsyncGenerator) else list(events)
        self._tail = tail
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
            try:
                await self._send_events(scope, receive, send)
            finally:
                with anyio.CancelScope(shield=True):
                    for events in self._all:
                        await events.aclose()
                tg.cancel_scope.cancel()

    async def _send_events(self, scope: Scope, receive: Receive, send: Send) -> None:
        firsts: list[bytes] = []
        for events in self._all:
            try:
                firsts.append(await events.__anext__())
            except StopAsyncIteration:
                pass
            except Exception as exc:
                await api_error(exc).response()(scope, receive, send)
                return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": b"".join(firsts), "more_body": True})
        if len(self._all) == 1:
            async for event in self._all[0]:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        else:
            await self._merge(send)
        if self._tail is not None:
            await send({"type": "http.response.body", "body": self._tail(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _merge(self, send: Send) -> None:
        # One task per choice feeds a channel; only this task sends, so events never interleave.
        tx, rx = anyio.create_memory_object_stream[bytes](16)

        async def pump(events: AsyncGenerator[bytes, None], out: MemoryObjectSendStream[bytes]) -> None:
            async with out:
                async for event in events:
                    if event:
                        await out.send(event)

        async with anyio.create_task_group() as tg, rx:
            async with tx:
                for events in self._all:
                    tg.start_soon(pump, events, tx.clone())
            async for event in rx:
                await send({"type": "http.response.body", "body": event, "more_body": True})
