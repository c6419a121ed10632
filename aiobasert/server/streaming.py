"""Server-sent events and client disconnects.

A client that goes away cancels its work: `unless_disconnected` for a whole
(non-streamed) response, `EventStream` for a streamed one. Cancelling the work
closes its `TokenStream`, which frees the engine lane before the next step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from ..streams import TokenStream
from .errors import ClientGone, api_error, in_band_error

T = TypeVar("T")

logger = logging.getLogger("aiobasert.server")

SSE_DONE = b"data: [DONE]\n\n"

SSE_KEEPALIVE = b": keep-alive\n\n"
"""An SSE comment: clients skip it; a proxy sees bytes, so its idle timeout does not cut the stream."""

DEFAULT_SSE_KEEPALIVE_S = 15.0
"""A streamed response that has sent nothing for this long (queued for a lane, preempted) sends
`SSE_KEEPALIVE` (nginx's proxy_read_timeout and most load balancers' idle timeouts are 60 s)."""


def sse(body: msgspec.Struct) -> bytes:
    """One `data:` event."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def error_event(exc: BaseException) -> bytes:
    """The in-band error event of a stream that has already started."""
    return sse(in_band_error(exc).body)


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


async def gather(calls: Iterable[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run `calls` concurrently, results in order. The first failure cancels the
    others (their requests are closed, so their lanes and queue places are freed
    at once) and is re-raised as itself (not in an ExceptionGroup)."""
    todo = list(calls)
    results: list[T | None] = [None] * len(todo)
    errors: list[Exception] = []

    async def guarded(i: int, scope: anyio.CancelScope) -> None:
        try:
            results[i] = await todo[i]()
        except Exception as exc:
            errors.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        for i in range(len(todo)):
            tg.start_soon(guarded, i, tg.cancel_scope)
    if errors:
        raise errors[0]
    return cast("list[T]", results)  # no failure and not cancelled: every call returned


DEFAULT_WRITE_TIMEOUT_S = 30.0
"""How long a streamed response may wait for its client to take bytes before it is dropped."""

DEFAULT_MAX_UNSENT_BYTES = 1024 * 1024
"""How much of a streamed response may wait for a slow client (its backlog) before the
client must make progress on it within the write timeout or be dropped."""


@dataclass
class BacklogLimit:
    """The bound on a streamed response's backlog (docs/fairness.md, trickle readers): over
    `max_unsent_bytes` and not shrinking for `timeout_s` seconds (None: the write timeout),
    the client is dropped. `max_unsent_bytes=None`: unbounded."""

    max_unsent_bytes: int | None = DEFAULT_MAX_UNSENT_BYTES
    timeout_s: float | None = None


class ClientTooSlow(Exception):
    """The client took no bytes of its streamed response for `write_timeout` seconds."""


class EventStream(Response):
    """A server-sent-event response that commits to 200 only once its first event is ready.

    The events generator raises before its first yield when the request fails
    (a too-long prompt, a full queue): that becomes an ordinary JSON error
    response. The client's disconnect is watched from the start, also while the
    request waits for a lane, and cancels the generator, which closes its
    `TokenStream` and so frees the lane.

    Several generators (one per choice, n > 1) are merged: each choice's events
    go out as that choice produces them, the first of any choice starts the
    response (a choice still waiting for a lane never holds back the others,
    whose lanes would otherwise fill their buffers and wait on this writer), a
    choice that fails after the start reports in-band, and `tail()` (usage,
    `[DONE]`) ends the stream.

    `keepalive`: while no event has been sent for that many seconds (the request
    waits for a lane, or was preempted and waits to resume), an SSE comment is sent
    (`SSE_KEEPALIVE`), starting the response if it has not started (a request that
    fails after that reports in-band); None or 0: never.

    `write_timeout`: a client that takes no bytes for that many seconds is
    dropped: its generators are closed (their lanes freed) and the connection
    is closed without ending the response, so the client sees a cut stream.

    `streams`, `backlog`: a client that takes bytes, but slower than its
    generations produce them (a trickle reader), leaves their tokens waiting
    here, a backlog that grows at the engine's rate. Once the backlog (the
    streams' unread tokens, at this response's bytes per event) is over
    `backlog.max_unsent_bytes` and has not shrunk for `backlog.timeout_s`
    (default: `write_timeout`) seconds, the client is dropped the same way.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None] | Sequence[AsyncGenerator[bytes, None]],
        tail: Callable[[], bytes] | None = None,
        *,
        write_timeout: float | None = DEFAULT_WRITE_TIMEOUT_S,
        streams: Sequence[TokenStream] = (),
        backlog: BacklogLimit | None = None,
        keepalive: float | None = DEFAULT_SSE_KEEPALIVE_S,
    ) -> None:
        self._all = [events] if isinstance(events, AsyncGenerator) else list(events)
        self._tail = tail
        self._write_timeout = write_timeout
        self._keepalive = keepalive or None
        self._streams = list(streams)
        self._backlog = backlog if backlog is not None else BacklogLimit()
        self._sent_bytes = 0
        self._sent_events = 0
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
            window = self._backlog.timeout_s if self._backlog.timeout_s is not None else self._write_timeout
            bound = self._backlog.max_unsent_bytes
            if window is not None and window > 0 and bound is not None and self._streams:
                tg.start_soon(self._watch_backlog, window, bound, tg.cancel_scope)
            try:
                await self._send_events(scope, receive, self._bounded(send))
            except ClientTooSlow:
                # The generators are closed below (lanes freed); returning without ending
                # the response makes the ASGI server close the connection.
                logger.warning("dropped a client that took no bytes for %s s", self._write_timeout)
            finally:
                with anyio.CancelScope(shield=True):
                    for events in self._all:
                        await events.aclose()
                tg.cancel_scope.cancel()

    def unsent_bytes(self) -> int:
        """The backlog: bytes of events its streams' unread tokens will make, at this
        response's mean bytes per event so far."""
        unread = sum(st.unread for st in self._streams)
        return unread * max(1, self._sent_bytes // max(1, self._sent_events))

    async def _watch_backlog(self, timeout: float, bound: int, scope: anyio.CancelScope) -> None:
        """Drop the client (cancel `scope`) once the backlog has been over `bound`
        without shrinking for `timeout` seconds."""
        over_since: float | None = None
        low = 0
        while True:
            await anyio.sleep(min(1.0, timeout / 4))
            unsent = self.unsent_bytes()
            now = anyio.current_time()
            if unsent <= bound:
                over_since = None
            elif over_since is None or unsent < low:  # over the bound, or progress on it: the clock restarts
                over_since, low = now, unsent
            elif now - over_since >= timeout:
                logger.warning(
                    "dropped a client whose unsent backlog (%d bytes) did not shrink for %s s", unsent, timeout
                )
                scope.cancel()
                return

    def _bounded(self, send: Send) -> Send:
        timeout = self._write_timeout

        async def counted(message: Message) -> None:
            body = message.get("body")
            if body and body is not SSE_KEEPALIVE:  # comments would skew the bytes per event
                self._sent_bytes += len(body)
                self._sent_events += 1
            await send(message)

        if timeout is None:
            return counted

        async def bounded(message: Message) -> None:
            # The server's send waits while the socket's write buffer is full: a
            # client that stops reading would hold this response, and its lanes, forever.
            with anyio.move_on_after(timeout) as scope:
                await counted(message)
            if scope.cancelled_caught:
                raise ClientTooSlow

        return bounded

    async def _send_events(self, scope: Scope, receive: Receive, send: Send) -> None:
        if len(self._all) == 1 and self._keepalive is None:
            events = self._all[0]
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = b""
            except Exception as exc:
                await api_error(exc).response(scope["path"])(scope, receive, send)
                return
            await self._start(send, first)
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        elif not await self._merge(scope, receive, send):  # keep-alives need the merged loop's timer
            return
        if self._tail is not None:
            await send({"type": "http.response.body", "body": self._tail(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _start(self, send: Send, first: bytes) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})

    async def _merge(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Forward every choice's events as they come; False if the request failed
        before the response started (the error response is sent)."""
        # One task per choice feeds a channel; only this task sends, so events never interleave.
        tx, rx = anyio.create_memory_object_stream[bytes | Exception](len(self._all))
        started = slow = False
        failed: Exception | None = None

        async def pump(events: AsyncGenerator[bytes, None], out: MemoryObjectSendStream[bytes | Exception]) -> None:
            async with out:
                try:
                    async for event in events:
                        if event:
                            await out.send(event)
                except Exception as exc:  # before this choice's first event: a request error
                    await out.send(exc)

        async with anyio.create_task_group() as tg:
            async with tx:
                for events in self._all:
                    tg.start_soon(pump, events, tx.clone())
            async with rx:
                try:
                    while True:
                        item: bytes | Exception | None = None
                        with anyio.move_on_after(self._keepalive or math.inf):
                            try:
                                item = await rx.receive()
                            except anyio.EndOfStream:
                                break
                        if item is None:  # nothing to send for `keepalive` s: a comment, to keep proxies on
                            if not started:
                                started = True
                                await self._start(send, SSE_KEEPALIVE)
                            else:
                                await send({"type": "http.response.body", "body": SSE_KEEPALIVE, "more_body": True})
                            continue
                        if isinstance(item, Exception):
                            if not started:
                                failed = item
                                break
                            item = error_event(item)  # this choice failed; the others go on
                        if not started:
                            started = True
                            await self._start(send, item)
                        else:
                            await send({"type": "http.response.body", "body": item, "more_body": True})
                except ClientTooSlow:
                    slow = True  # re-raised below, outside the task group (no ExceptionGroup)
                tg.cancel_scope.cancel()  # before the channel closes: a pump then sees only the cancel
        if slow:
            raise ClientTooSlow
        if failed is not None:
            await api_error(failed).response(scope["path"])(scope, receive, send)
            return False
        if not started:
            await self._start(send, b"")
        return True
