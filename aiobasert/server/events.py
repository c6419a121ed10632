"""The one event driver behind every streamed endpoint, and its non-streamed twin.

`drive` walks a `TokenStream` and turns it into server-sent events; what the
events look like is the endpoint's `ChunkFormat` (a text-completion chunk, a
chat-completion chunk, a Responses-API event). The driver owns what is the
same for all of them: request errors before the first token become an ordinary
HTTP error response, errors after it an in-band error event, the stream always
ends with the format's `done()` and its lane is always released; the metrics
observer sees every token, the end, and a client's abort. `collect` does the
same for a whole (non-streamed) response.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Protocol

import anyio

from ..streams import TokenStream
from ..types import Timing, Token, Usage
from .metrics import RequestObserver
from .params import finish_reason, first_token
from .streaming import SSE_DONE, error_event


class ChunkFormat(Protocol):
    """How one endpoint spells the events of one streamed response."""

    def opening(self, request_id: str) -> bytes | None:
        """Called once the first token exists (the request is admitted): the
        opening event, if the format has one (chat: the role delta)."""

    async def token(self, tok: Token) -> bytes | None:
        """The event of one token (None: nothing to send for it)."""

    def closing(self, finish: str, usage: Usage | None) -> bytes | None:
        """The events after the last token, given OpenAI's finish reason."""

    def usage(self, usage: Usage, timing: Timing | None = None) -> bytes:
        """The trailing usage event (`stream_options.include_usage`); `timing`: the stream's."""

    def error(self, exc: BaseException) -> bytes:
        """The in-band error event once the response has started."""

    def done(self) -> bytes:
        """The stream's last bytes."""


class OpenAIChunks:
    """The parts completions and chat spell alike: error events and `[DONE]`
    (left to the merged stream's tail when this is one of several choices)."""

    last = True

    def error(self, exc: BaseException) -> bytes:
        return error_event(exc)

    def done(self) -> bytes:
        return SSE_DONE if self.last else b""


async def drive(
    stream: TokenStream, fmt: ChunkFormat, *, include_usage: bool, observer: RequestObserver | None = None
) -> AsyncGenerator[bytes, None]:
    """The SSE events of `stream` in `fmt`, then `fmt.done()`; closes the stream."""
    try:
        tok = await first_token(stream)  # raising here becomes an HTTP error response
        opening = fmt.opening(stream.request_id)
        if opening is not None:
            yield opening
        try:
            while tok is not None:
                if observer is not None:
                    observer.token()
                event = await fmt.token(tok)
                if event is not None:
                    yield event
                tok = await anext(stream, None)
            finish = finish_reason(stream.finish_reason)  # raises if the lane was aborted
            usage = stream.final.usage if stream.final is not None else None
            closing = fmt.closing(finish, usage)
            if closing is not None:
                yield closing
            if include_usage and usage is not None:
                yield fmt.usage(usage, stream.final.timing if stream.final is not None else None)
        except Exception as exc:  # the response has started: report in-band
            yield fmt.error(exc)
        if observer is not None:
            observer.finished(stream.final)
        yield fmt.done()
    except (GeneratorExit, anyio.get_cancelled_exc_class()):  # the client went away
        since = time.perf_counter()
        with anyio.CancelScope(shield=True):
            await stream.aclose()
            if observer is not None:
                await observer.aborted(since)
        raise
    finally:
        await stream.aclose()


async def collect(stream: TokenStream, observer: RequestObserver) -> list[Token]:
    """Every token of a non-streamed request (the metrics see them arrive)."""
    tokens: list[Token] = []
    try:
        async for tok in stream:
            observer.token()
            tokens.append(tok)
    except anyio.get_cancelled_exc_class():  # the client went away
        since = time.perf_counter()
        with anyio.CancelScope(shield=True):
            await stream.aclose()
            await observer.aborted(since)
        raise
    finally:
        await stream.aclose()
    observer.finished(stream.final)
    return tokens
