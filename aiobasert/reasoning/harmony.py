"""OpenAI's Harmony framing (gpt-oss): the thought is the `analysis` channel, the answer the `final` one.

A turn is one or more messages, each `<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`
ended by `<|end|>` (more follows), `<|return|>` (the turn's end) or `<|call|>` (a tool call's end);
a message after the first starts with `<|start|>assistant`. The generation prompt ends in
`<|start|>assistant`, so the model names the channel itself:

    <|channel|>analysis<|message|>THOUGHT<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

`analysis` bodies are reasoning; `final` bodies, and `commentary` ones (a preamble to the user),
are the answer; a message addressed to a recipient (` to=functions.NAME`, ` to=python`: a call) is
neither, nor are headers and markers (as llama.cpp's gpt-oss parser: tests/test-chat.cpp's cases
are this splitter's oracle). Text outside any framing (a model that ignores it) is the answer, so
nothing generated is lost. Bodies are kept as written: Harmony pads nothing.

The thought is not one tag but a header of several tokens; the engine's thought gate (budget,
grammar after the thought, stop strings outside it) takes it all the same (`_core/thought.py`):
past a budget it writes `<|end|>` and the final channel's header (`answer_tag`) itself, so the
answer follows. Without a grammar it forces nothing else (`reopens`): `<|channel|>` may start
any channel, and after an analysis message the model writes what it likes (another one counts
against the same budget). Tool calls (the `commentary` channel addressed `to=functions.NAME`)
are read by the Harmony tool format (aiobasert/tools/harmony.py), which reads the framed text
itself; this splitter leaves them out of the thought and the answer.

The seed header's decode streams (`baseRT_decode_stream_*`) turn Harmony framing into reasoning
spans on the real engine, but they report text, not span kinds, and the SDK decodes its output
itself (token bytes), so this parser is what separates the thought on every engine.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

from ._format import Part, ReasoningFormat, ReasoningSplitter, register_reasoning_format

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL, CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
_ENDS = (END, RETURN, CALL)
_OPENERS = (START, CHANNEL, "to=")

# states: before the first header, in a header, in a body, between messages, unframed text
_OPENING, _HEADER, _BODY, _BETWEEN, _RAW = range(5)


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return k
    return 0


def _kind(header: str) -> Literal["reasoning", "content", "call"]:
    """What a message's body is, by its header (`assistant to=functions.f<|channel|>commentary <|constrain|>json`):
    a call where it names a recipient other than the assistant, else the thought for the last channel
    named `analysis` (a header may name two: llama.cpp's edge cases), else the answer."""
    words = header.replace(CHANNEL, " " + CHANNEL + " ").replace(CONSTRAIN, " ").split()
    if any(w.startswith("to=") and w != "to=assistant" for w in words):
        return "call"
    channels = [b for a, b in itertools.pairwise(words) if a == CHANNEL]
    return "reasoning" if channels and channels[-1] == "analysis" else "content"


class HarmonySplitter(ReasoningSplitter):
    """The incremental splitter of Harmony's channels (`Harmony.splitter`)."""

    __slots__ = ("_header", "_held", "_kind", "_seen", "_state")

    def __init__(self, *, open_at_start: bool) -> None:
        self._state = _BODY if open_at_start else _OPENING
        self._kind: Literal["reasoning", "content", "call"] = "reasoning"
        self._seen = open_at_start
        self._header = ""
        self._held = ""

    @property
    def in_thought(self) -> bool:
        return self._state == _BODY and self._kind == "reasoning"

    @property
    def thought_seen(self) -> bool:
        return self._seen

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._state in (_OPENING, _BETWEEN):
                # a header starts here (`<|start|>`, or after the prompt's `<|start|>assistant` straight
                # `<|channel|>` or ` to=`), or text outside any framing
                stripped = buf.lstrip()
                opener = next((m for m in _OPENERS if stripped.startswith(m)), None)
                if opener is not None:
                    self._state, self._header = _HEADER, ""
                    buf = stripped[len(opener) :] if opener == START else stripped
                    continue
                if any(m.startswith(stripped) for m in _OPENERS):  # whitespace, or an opener's start
                    self._held = buf
                    return out
                self._state, self._kind = _RAW, "content"
                continue
            if self._state == _HEADER:
                at = buf.find(MESSAGE)
                if at < 0:
                    keep = _held_prefix(buf, (MESSAGE,))
                    self._header += buf[: len(buf) - keep]
                    self._held = buf[len(buf) - keep :]
                    return out
                self._header += buf[:at]
                buf = buf[at + len(MESSAGE) :]
                self._kind = _kind(self._header)
                self._seen = self._seen or self._kind == "reasoning"
                self._state = _BODY
                self._opened(out)
                continue
            if self._state == _BODY:
                hits = [(i, m) for m in _ENDS if (i := buf.find(m)) >= 0]
                if hits:
                    at, marker = min(hits)
                    self._emit(out, buf[:at])
                    self._state = _BETWEEN
                    self._ended(out)
                    buf = buf[at + len(marker) :]
                    continue
                keep = _held_prefix(buf, _ENDS)
                self._emit(out, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                return out
            # _RAW: unframed text is the answer, markers and all
            self._emit(out, buf)
            return out
        return out

    def _emit(self, out: list[Any], text: str) -> None:
        if text and self._kind != "call":  # a call's body (its arguments) is neither thought nor answer
            out.append((self._kind, text))

    def _opened(self, out: list[Any]) -> None:
        """A message's header is complete (`_header`, `_kind`): a hook for a reader of calls (tools/harmony.py)."""

    def _ended(self, out: list[Any]) -> None:
        """The message's body ended (its end marker, or the output's end): a hook as `_opened`."""

    @property
    def header(self) -> str:
        """The header of the message being read (or last read)."""
        return self._header

    def close(self) -> list[Part]:
        held, self._held = self._held, ""
        out: list[Part] = []
        if self._state in (_BODY, _RAW):
            self._emit(out, held)  # a marker's start the turn ended on is text after all
            if self._state == _BODY:
                self._state = _BETWEEN
                self._ended(out)  # cut off (max_tokens) inside a body
        elif self._state == _OPENING and held.strip():
            self._kind = "content"
            self._emit(out, held)
        return out  # an unfinished header (or what follows a message's end) is framing, not text


class Harmony(ReasoningFormat):
    """gpt-oss's channels: `open_tag` / `close_tag` are the analysis header and its end, the open tag
    several tokens; a thought the engine closes is followed by the final channel's header (`answer_tag`)."""

    name = "harmony"
    open_tag = CHANNEL + "analysis" + MESSAGE
    close_tag = END
    answer_tag = START + "assistant" + CHANNEL + "final" + MESSAGE
    """What follows a closed thought when the answer comes (the gate's closing sequence, with `close_tag`)."""
    reopens = True

    def detect(self, template: str, special_tokens: frozenset[str]) -> bool:
        # the template writes channels, and the framing markers are tokens
        return CHANNEL + "analysis" in template and {START, CHANNEL, MESSAGE, END} <= special_tokens

    def splitter(self, *, open_at_start: bool) -> HarmonySplitter:
        return HarmonySplitter(open_at_start=open_at_start)

    def prompt_state(self, prompt_tail: str) -> Literal["open", "closed", "free"]:
        tail = prompt_tail.rstrip()
        if tail.endswith(self.open_tag):
            return "open"
        if tail.endswith(CHANNEL + "final" + MESSAGE):
            return "closed"
        return "free"


HARMONY = register_reasoning_format(Harmony())
"""The registered Harmony format."""
