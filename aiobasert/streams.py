"""Async iterators over one request's tokens.

A `TokenStream` is the consumer end of one engine lane. The engine thread
pushes each step's tokens in one batched wake-up (`deliver`, on the loop);
`__anext__` hands them out. Leaving the stream early in any way (`break`,
task cancellation, `anyio.fail_after`, `aclose()`, garbage collection) sends a
cancel to the engine thread, which rolls the lane's sequence back and frees it
before the next step: nothing decodes on for a client that is gone
(sglang #36333), and no KV block leaks.

Backpressure: a consumer that lags `max_buffered_tokens` tokens behind pauses
its own lane (it keeps its KV and resumes as soon as the consumer reads); the
engine and the other lanes never wait for it. So a stream buffers at most
`max_buffered_tokens` tokens plus one step's worth.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections import deque
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import anyio

from .engine_thread import Cancel, Final, RequestSpec, Resume, Submit, Ticket
from .errors import EngineClosedError
from .types import Completion, FinishReason, Token

if TYPE_CHECKING:
    from .engine import Engine

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


class TokenStream:
    """`async for tok in stream` yields `Token`s; `await stream` gives the `Completion`.

    The request is submitted on first iteration (or await), so a stream that is
    created and dropped unused costs nothing. After the stream ends,
    `finish_reason`, `usage` and `timing` describe how.
    """

    def __init__(self, engine: Engine, spec: RequestSpec) -> None:
        self._engine = engine
        self._spec = spec
        self._ticket = Ticket()
        self._buffer: deque[Token] = deque()
        self._event: anyio.Event | None = None
        self._final: Final | None = None
        self._error: BaseException | None = None
        self._started = False
        self._closed = False  # consumer side finished (exhausted, cancelled or closed)
        self._ended = False  # engine side finished (final or error delivered)

    @property
    def request_id(self) -> str:
        """A process-unique id of this request (also in its `Completion`)."""
        return self._spec.rid

    @property
    def finish_reason(self) -> FinishReason | None:
        """"stop", "length" or "aborted" once the request has ended, else None."""
        return self._final.finish_reason if self._final else None

    @property
    def final(self) -> Final | None:
        """Usage and timing, once the request has ended."""
        return self._final

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

    # ---- consumer side ------------------------------------------------------------------

    def submit(self) -> None:
        """Queue the request now instead of on first iteration (idempotent).

        Requests are admitted in the order they are submitted.
        """
        if not self._started:
            self._started = True
            self._engine._submit(Submit(self._spec, _WeakSink(self), self._ticket))

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> Token:
        if self._closed:
            raise StopAsyncIteration
        self.submit()
        try:
            while not self._buffer:
                if self._error is not None:
                    self._closed = True
                    raise self._error
                if self._ended:
                    self._closed = True
                    raise StopAsyncIteration
                self._event = anyio.Event()
                await self._event.wait()
                self._event = None
        except BaseException as exc:
            if not isinstance(exc, StopAsyncIteration):
                self._abandon()  # cancelled or timed out while waiting: free the lane
            raise
        tok = self._buffer.popleft()
        t = self._ticket
        t.consumed += 1
        if t.paused:  # our lane waits for us to catch up
            t.paused = False
            self._engine._post(Resume())
        return tok

    def _abandon(self) -> None:
        if self._started and not self._ended and not self._closed:
            self._engine._post(Cancel(self._spec.rid))
        self._closed = True

    async def aclose(self) -> None:
        """Stop consuming: the engine frees the lane before its next step."""
        self._abandon()

    async def __aenter__(self) -> TokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._abandon()

    def __del__(self) -> None:
        # `break` out of `async for` drops the last reference: cancel right here.
        try:
            if self._started and not self._ended and not self._closed:
                self._engine._post(Cancel(self._spec.rid))
        except Exception:
            pass

    async def collect(self) -> Completion:
        """Consume the whole stream into a `Completion`."""
        if self._closed and not self._ended:
            raise EngineClosedError("this stream was closed before it finished")
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[float] = []
        async for tok in self:
            text.append(tok.text)
            ids.append(tok.id)
            if tok.logprob is not None:
                logprobs.append(tok.logprob)
        final = self._final
        assert final is not None  # the stream ended without error, so a final arrived
        return Completion(
            request_id=self._spec.rid,
            text="".join(text),
            token_ids=ids,
            finish_reason=final.finish_reason,
            usage=final.usage,
            timing=final.timing,
            logprobs=logprobs if self._spec.params.logprobs else None,
        )

    def __await__(self) -> Generator[Any, None, Completion]:
        return self.collect().__await__()
