"""The chat stream: a turn's tokens parsed into text and tool-call deltas as they come."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import InvalidRequestError, StreamBusyError, WrongEventLoopError
from ..reasoning import ReasoningDelta, ReasoningFormat, ReasoningSplitter
from ..types import FinishReason, Token
from ._format import CallParser, ToolFormat, default_tool_format
from ._types import ChatDelta, ChatReply, TextDelta, ToolCall

if TYPE_CHECKING:
    from ..streams import TokenStream


def finish_reason_with_tools(reason: FinishReason | None, calls: Sequence[ToolCall]) -> Any:
    """OpenAI's rule: a turn that ended normally after calls finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


class _ChatIteration:
    """What `async for delta in chat` iterates (as `streams._Iteration` for tokens):
    a `break` or an exception out of the loop drops it at once, and its `__del__`
    frees the lane then, not when an async generator would finally be closed."""

    __slots__ = ("__weakref__", "_chat", "_done", "_pending")

    def __init__(self, chat: ChatStream) -> None:
        self._chat = chat
        self._pending: deque[ChatDelta] = deque()
        self._done = False

    def __aiter__(self) -> _ChatIteration:
        return self

    async def __anext__(self) -> ChatDelta:
        chat = self._chat
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                tok = await chat.tokens._next()
            except StopAsyncIteration:
                self._done = True
                self._pending.extend(chat.close_parser())
                continue
            except BaseException as exc:
                # as streams._Iteration: a misuse (a second reader, a foreign loop) must not
                # end the stream for its rightful reader; a cancellation already freed the lane
                if isinstance(exc, (StreamBusyError, WrongEventLoopError)) or chat.tokens._ended:
                    self._done = True
                raise
            self._pending.extend(chat.feed(tok))
        return self._pending.popleft()

    def __del__(self) -> None:
        if not self._done:
            with contextlib.suppress(Exception):  # a finalizer must not raise
                self._chat.tokens._abandon()


class ChatStream:
    """`async for delta in stream` yields `TextDelta` / `ToolCallDelta` / `ReasoningDelta`;
    `await stream` gives the `ChatReply`. Wraps the turn's `TokenStream`
    (`stream.tokens`); closing one closes the other. Leaving the loop early
    (`break`, an exception) frees the lane at once, as for a `TokenStream`.
    `tool_format`: the model's call format the text is parsed in (default Hermes;
    `engine.stream_chat` passes `engine.tool_format`). `reasoning`: the model's reasoning format
    (`engine.reasoning_format`): its thought comes as `ReasoningDelta`s, never as text, and only the
    answer is parsed for calls (`open_at_start`: the prompt left the thought open)."""

    def __init__(
        self,
        tokens: TokenStream,
        *,
        parse_calls: bool,
        forced: bool = False,
        tool_format: ToolFormat | None = None,
        reasoning: ReasoningFormat | None = None,
        open_at_start: bool = False,
    ) -> None:
        self.tokens = tokens
        self._splitter: ReasoningSplitter | None = None
        if reasoning is not None:
            self._splitter = reasoning.splitter(open_at_start=open_at_start)
        self._thought: list[str] = []
        self._thought_tokens = 0
        self._parser: CallParser | None = None
        self._framed = False
        """The parser reads the whole output (framing included), the splitter gives only the thought."""
        if parse_calls:  # in the model's call format (default Hermes)
            fmt = tool_format or default_tool_format()
            self._parser = fmt.turn_parser(forced=forced, open_at_start=open_at_start)
            self._framed = fmt.reads_framing and self._splitter is not None
        self._text: list[str] = []
        self._reply: ChatReply | None = None

    def __aiter__(self) -> _ChatIteration:
        return _ChatIteration(self)

    def feed(self, tok: Token) -> list[ChatDelta]:
        """The deltas one token completes (for callers that walk the tokens themselves)."""
        splitter = self._splitter
        if splitter is None:
            return self._answer(tok.text)
        was_in = splitter.in_thought
        parts = splitter.feed(tok.text)
        if was_in or splitter.in_thought:  # its tags count as the thought's
            self._thought_tokens += 1
        out = self._parts(parts)
        if self._framed and self._parser is not None:
            out += self._parser.feed(tok.text)
        return out

    def _parts(self, parts: Sequence[tuple[str, str]]) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        for kind, text in parts:
            if kind == "reasoning":
                self._thought.append(text)
                out.append(ReasoningDelta(text))
            elif not self._framed:  # else the parser reads the answer itself, from the framed text
                out.extend(self._answer(text))
        return out

    def _answer(self, text: str) -> list[ChatDelta]:
        if self._parser is None:
            self._text.append(text)
            return [TextDelta(text)] if text else []
        return self._parser.feed(text)

    def close_parser(self) -> list[ChatDelta]:
        """The deltas held back until the end (call after the last `feed`; idempotent)."""
        out = self._parts(self._splitter.close()) if self._splitter is not None else []
        return out + (self._parser.close() if self._parser is not None else [])

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the thought so far, its tags included (`Usage.reasoning_tokens` of the reply)."""
        return self._thought_tokens

    @property
    def reasoning(self) -> str | None:
        """The thought so far; None when there was none."""
        if self._splitter is None or not self._splitter.thought_seen:
            return None
        return "".join(self._thought)

    @property
    def content(self) -> str:
        """The assistant text so far (without tool calls)."""
        return self._parser.content if self._parser is not None else "".join(self._text)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return list(self._parser.calls) if self._parser is not None else []

    async def aclose(self) -> None:
        """Stop the turn (its lane is freed before the engine's next step)."""
        await self.tokens.aclose()

    def reply(self) -> ChatReply:
        """The turn so far as a `ChatReply` (call once the stream has ended)."""
        final = self.tokens.final
        if final is None:
            raise InvalidRequestError("the chat stream has not finished")
        return ChatReply(
            request_id=self.tokens.request_id,
            content=self.content,
            tool_calls=self.tool_calls,
            finish_reason=finish_reason_with_tools(final.finish_reason, self.tool_calls),
            usage=msgspec.structs.replace(final.usage, reasoning_tokens=self.reasoning_tokens),
            timing=final.timing,
            reasoning=self.reasoning,
        )

    async def collect(self) -> ChatReply:
        """Run the turn to its end: the `ChatReply` (`await stream` does the same).
        Awaiting again returns the same reply; a stream closed before its request
        finished raises `StreamClosedError`, a failed one its error (as `TokenStream`)."""
        if self._reply is not None:
            return self._reply
        async for _ in self:
            pass
        await self.tokens.collect()  # raises the stream's error, or StreamClosedError
        self._reply = self.reply()
        return self._reply

    def __await__(self) -> Generator[Any, None, ChatReply]:
        return self.collect().__await__()
