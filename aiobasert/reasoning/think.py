"""`<think>` ... `</think>`: the thought of Qwen3, QwQ, DeepSeek-R1 (and its distills) and SmolLM3.

The thought is the text between the tags; whitespace at its edges and at the answer's start is
dropped (as llama.cpp's `reasoning_format: deepseek` does). A thought the prompt opened
(DeepSeek-R1's and QwQ's generation prompts end in `<think>`) starts at the first token; otherwise
only a `<think>` before any other text opens one (Qwen3 writes it itself). A thought never closed
is all reasoning (the turn ran out inside it).
"""

from __future__ import annotations

from ._format import Part, ReasoningFormat, ReasoningSplitter, register_reasoning_format

_START, _THOUGHT, _ANSWER = 0, 1, 2


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter(ReasoningSplitter):
    """The incremental splitter of `<think>` tags (`ThinkTags.splitter`)."""

    __slots__ = ("_close", "_held", "_open", "_seen", "_started", "_state")

    def __init__(self, open_tag: str, close_tag: str, *, open_at_start: bool) -> None:
        self._open, self._close = open_tag, close_tag
        self._state = _THOUGHT if open_at_start else _START
        self._seen = open_at_start
        self._started = False  # the current side has emitted non-whitespace text
        self._held = ""

    @property
    def in_thought(self) -> bool:
        return self._state == _THOUGHT

    @property
    def thought_seen(self) -> bool:
        return self._seen

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._state == _START:
                stripped = buf.lstrip()
                if stripped.startswith(self._open):
                    self._state, self._seen, self._started = _THOUGHT, True, False
                    buf = stripped[len(self._open) :]
                    continue
                if self._open.startswith(stripped):  # whitespace, or the tag's start: not settled yet
                    self._held = buf
                    return out
                self._state = _ANSWER
                continue
            if self._state == _THOUGHT:
                at = buf.find(self._close)
                if at >= 0:
                    self._emit(out, "reasoning", buf[:at].rstrip())
                    self._state, self._started = _ANSWER, False
                    buf = buf[at + len(self._close) :]
                    continue
                keep = _partial_suffix(buf, self._close)
                body = buf[: len(buf) - keep]
                core = body.rstrip()  # trailing whitespace waits: it is dropped if the tag follows
                self._held = body[len(core) :] + buf[len(buf) - keep :]
                self._emit(out, "reasoning", core)
                return out
            self._emit(out, "content", buf)
            return out
        return out

    def _emit(self, out: list[Part], kind: str, text: str) -> None:
        if not self._started:
            text = text.lstrip()
        if text:
            self._started = True
            out.append((kind, text))  # type: ignore[arg-type]  # kind is "reasoning" or "content"

    def close(self) -> list[Part]:
        held, self._held = self._held, ""
        if not held:
            return []
        if self._state == _THOUGHT:
            held = held.rstrip()  # the partial tag's text stays (it never closed)
            out: list[Part] = []
            self._emit(out, "reasoning", held)
            return out
        out = []
        self._emit(out, "content", held)
        return out


class ThinkTags(ReasoningFormat):
    """`<think>` / `</think>`, each one token of the vocabulary."""

    name = "think"
    open_tag = "<think>"
    close_tag = "</think>"

    def detect(self, template: str, special_tokens: frozenset[str]) -> bool:
        # the template speaks of the thought (writes or strips a tag), and both tags are tokens
        spoken = self.open_tag in template or self.close_tag in template
        return spoken and {self.open_tag, self.close_tag} <= special_tokens

    def splitter(self, *, open_at_start: bool) -> ThinkSplitter:
        return ThinkSplitter(self.open_tag, self.close_tag, open_at_start=open_at_start)


THINK = register_reasoning_format(ThinkTags())
"""The registered `<think>` format."""
