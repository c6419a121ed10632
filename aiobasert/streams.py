"""Async iterators over one request's tokens.

A `TokenStream` is the consumer end of one engine lane. The engine thread
pushes each step's tokens in one batched wake-up (`deliver`, on the loop);
`__anext__` hands them out. The stream reaches its engine only through the
narrow `StreamHost` interface (submit, cancel, loop check).

Leaving a stream early in any way frees its lane before the next step:
`break` out of `async for` (named stream or not: the loop's iterator is
dropped), an exception or a cancellation while reading, `anyio.fail_after`,
`aclose()` (from any task of the engine's loop), garbage collection. Nothing
decodes on for a client that is gone (sglang #36333), and no KV block leaks.

No backpressure onto the engine: a lane never waits for its reader. A slow
consumer's tokens accumulate in its stream's buffer (at most the request's
max_tokens, itself bounded by the context window), and its lane is freed as
soon as its generation ends, read or not (docs/fairness.md).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import anyio

from ._core.protocol import Final, RequestSpec, StreamHost, Submit, Ticket
from .errors import StreamBusyError, StreamClosedError, WrongEventLoopError
from .types import Completion, FinishReason, Token

_ids = itertools.count(1)
_prefix = os.urandom(3).hex()


def new_request_id() -> str:
    return f"req-{_prefix}-{next(_ids)}"


class _WeakSink:
    """What the engine thread holds of a stream: a weak reference.

    A strong one would keep an abandoned stream (`break` out of `async for`)
    alive until its lane finished, so its `__del__` could not cancel the lane.
    """

    __slots__ = ("_ref",)

    def __init__(self, stream: TokenStream) -> None:
        self._ref = weakref.ref(stream)

    def deliver(self, tokens: list[Token], final: Final | None, error: BaseException | None) -> None:
        stream = self._ref()
        if stream is not None:
            stream.deliver(tokens, final, error)

    def alive(self) -> bool:
        stream = self._ref()
        return stream is not None and not stream._closed


class _Iteration:
    """What `async for` iterates: ends the stream when the loop is left early.

    `async for tok in stream` holds this object, not the stream, so a `break`
    (or an exception out of the loop body) drops it at once even when the
    stream itself is still referenced by a name: its `__del__` then closes the
    stream and the lane is cancelled as promptly as for an unnamed stream.
    """

    __slots__ = ("__weakref__", "_done", "_stream")

    def __init__(self, stream: TokenStream) -> None:
        self._stream = stream
        self._done = False

    def __aiter__(self) -> _Iteration:
        return self

    async def __anext__(self) -> Token:
        try:
            return await self._stream._next()
        except BaseException as exc:
            # Over, or a misuse that must not end the stream for its rightful
            # reader (a second reader, a foreign loop): nothing to cancel.
            if isinstance(exc, (StopAsyncIteration, StreamBusyError, WrongEventLoopError)) or self._stream._ended:
                self._done = True
            raise

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # a finalizer must not raise
                self._stream._abandon()


class TokenStream:
    """`async for tok in stream` yields `Token`s; `await stream` gives the `Completion`.

    The request is submitted on first iteration (or await, or `submit()`), so a
    stream that is created and dropped unused costs nothing. After the stream
    ends, `finish_reason`, `usage` and `timing` describe how.

    One reader at a time: a second task reading while another waits gets
    `StreamBusyError`. The stream belongs to its engine's event loop
    (`WrongEventLoopError` elsewhere).
    """

    def __init__(self, host: StreamHost, spec: RequestSpec, owner: object = None) -> None:
        self._host = host
        self._owner = owner  # keeps the engine open while a stream of it is alive
        self._spec = spec
        self._ticket = Ticket()
        self._buffer: deque[Token] = deque()
        self._event: anyio.Event | None = None
        self._final: Final | None = None
        self._error: BaseException | None = None
        self._started = False
        self._closed = False  # consumer side finished (exhausted, cancelled or closed)
        self._ended = False  # engine side finished (final or error delivered)
        self._waiting = False
        self._left_early = False  # closed with output unread: there is no whole completion
        # Everything read so far, so `await stream` is whole after partial reads.
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._completion: Completion | None = None
        self._listener: Callable[[], None] | None = None  # a reader of several streams (`Choices`)

    @property
    def request_id(self) -> str:
        """A process-unique id of this request (also in its `Completion`)."""
        return self._spec.rid

    @property
    def finish_reason(self) -> FinishReason | None:
        """ "stop", "length" or "aborted" once the request has ended, else None."""
        return self._final.finish_reason if self._final else None

    @property
    def final(self) -> Final | None:
        """Usage and timing, once the request has ended."""
        return self._final

    @property
    def unread(self) -> int:
        """Tokens the engine has generated for this request that its reader has not taken
        yet (counted on the engine side, so those on their way to the loop count too)."""
        return max(0, self._ticket.delivered - self._ticket.consumed)

    @property
    def closed(self) -> bool:
        """True once reading is over: exhausted, failed, broken out of, cancelled or `aclose()`d."""
        return self._closed

    # ---- engine side (called on the loop by the engine thread's wake-up) ------------

    def deliver(self, tokens: list[Token], final: Final | None, error: BaseException | None) -> None:
        """Engine side (on the loop): one step's tokens, and how the request ended."""
        self._buffer.extend(tokens)
        if final is not None:
            self._final = final
            self._ended = True
        if error is not None:
            self._error = error
            self._ended = True
        if self._event is not None:
            self._event.set()
        if self._listener is not None:
            self._listener()

    # ---- consumer side ------------------------------------------------------------------

    def submit(self) -> None:
        """Queue the request now instead of on first iteration (idempotent).

        Requests are admitted in the order they are submitted.
        """
        if not self._started:
            self._host.submit(Submit(self._spec, _WeakSink(self), self._ticket))
            self._started = True

    def __aiter__(self) -> _Iteration:
        return _Iteration(self)

    async def __anext__(self) -> Token:
        return await self._next()

    async def _next(self) -> Token:
        if self._closed:
            raise StopAsyncIteration
        if not self._buffer:
            await self._wait()
            if self._closed:  # aclose() by another task while we waited: no token after it returned
                raise StopAsyncIteration
        return self._pop()

    def _pop(self) -> Token:
        tok = self._buffer.popleft()
        self._text.append(tok.text)
        self._ids.append(tok.id)
        if tok.logprob is not None:
            self._logprobs.append(tok.logprob)
        self._ticket.consumed += 1
        return tok

    def _listen(self, wake: Callable[[], None]) -> None:
        """Call `wake` (on the loop) whenever the engine delivers to this stream: a reader of several
        streams (`aiobasert.choices.Choices`) waits on one event for all of them, no task per stream."""
        self._listener = wake

    def _take(self) -> Token | None:
        """The next token without waiting, None when none is buffered yet; StopAsyncIteration once
        the stream is over, its error once it failed (after the tokens before the error)."""
        if self._closed:
            raise StopAsyncIteration
        if self._buffer:
            return self._pop()
        if self._error is not None:
            self._closed = True
            raise self._error
        if self._ended:
            self._closed = True
            raise StopAsyncIteration
        return None

    async def _wait(self) -> None:
        """Until a token is buffered; StopAsyncIteration / the error once the stream is over."""
        if self._waiting:
            raise StreamBusyError(f"stream {self._spec.rid} is already being read by another task")
        self._host.check_loop()
        self.submit()
        self._waiting = True
        try:
            while not self._buffer or self._closed:
                if self._closed:  # aclose() from another task while we waited (even if tokens came too)
                    raise StopAsyncIteration
                if self._error is not None:
                    self._closed = True
                    raise self._error
                if self._ended:
                    self._closed = True
                    raise StopAsyncIteration
                self._event = anyio.Event()
                await self._event.wait()
        except BaseException as exc:
            if not isinstance(exc, StopAsyncIteration) and not self._ended:
                self._abandon()  # cancelled or timed out while waiting: free the lane
            raise
        finally:
            self._event = None
            self._waiting = False

    def _abandon(self) -> None:
        """Stop reading: cancel the lane if it still runs, wake a waiting reader."""
        if self._closed:
            return
        self._closed = True
        self._left_early = not (self._ended and not self._buffer)
        if self._started and not self._ended:
            self._host.cancel(self._spec.rid)
        if self._event is not None:
            try:  # an Event may only be set in its own loop (a finalizer may run anywhere)
                self._host.check_loop()
            except WrongEventLoopError:
                return
            self._event.set()

    async def aclose(self) -> None:
        """Stop reading: the engine frees the lane before its next step.

        A task waiting in `async for` on this stream (another task of the same
        loop) wakes at once and its loop ends (StopAsyncIteration), with no
        token after this returned; `await stream` raises `StreamClosedError`
        unless every token had been read. Idempotent; never waits for the engine."""
        self._host.check_loop()
        self._abandon()

    async def __aenter__(self) -> TokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._abandon()

    def __del__(self) -> None:
        # The last reference is gone: cancel right here (no loop calls).
        try:
            if self._started and not self._ended and not self._closed:
                self._host.cancel(self._spec.rid)
        except Exception:
            pass

    async def collect(self) -> Completion:
        """The whole completion: tokens already read plus the rest of the stream.

        Awaiting again returns the same `Completion`; a failed stream raises its
        error again; a stream left early (break, `aclose()`, a cancellation)
        with output it had not read raises `StreamClosedError`, whether or not
        the request had finished: its text would not be whole."""
        if self._completion is not None:
            return self._completion
        if self._left_early or (self._closed and self._error is None and self._final is None):
            raise StreamClosedError(f"stream {self._spec.rid} was closed before all of its output was read")
        while True:
            try:
                await self._next()
            except StopAsyncIteration:
                break
        if self._error is not None:
            raise self._error
        final = self._final
        if final is None or self._left_early:  # aclose() by another task while we collected
            raise StreamClosedError(f"stream {self._spec.rid} was closed before the request finished")
        self._completion = Completion(
            request_id=self._spec.rid,
            text="".join(self._text),
            token_ids=list(self._ids),
            finish_reason=final.finish_reason,
            usage=final.usage,
            timing=final.timing,
            logprobs=list(self._logprobs) if self._spec.params.logprobs else None,
        )
        return self._completion

    def __await__(self) -> Generator[Any, None, Completion]:
        return self.collect().__await__()
