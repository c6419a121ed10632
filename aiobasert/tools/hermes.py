"""The Hermes / Qwen tool-call format (`HERMES`, "hermes"), the default: Qwen 2.5 / 3, SmolLM2,
Hermes, and every template that renders no tools (the default tool prompt asks for it).
``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``, several separated by a newline,
calls anywhere after the trigger `<tool_call>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

from ._format import CallParser, ToolFormat, register_tool_format, template_supports_tools
from ._syntax import JsonExtent, new_call_id, turn_grammar, turn_structural_tag
from ._types import ChatDelta, TextDelta, Tool, ToolCall, ToolCallDelta

# Hermes' call: <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, several separated by CALL_SEP
CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
NAME_OPEN = '{"name": "'
ARGS_OPEN = '", "arguments": '
CALL_END = "}" + CALL_CLOSE
CALL_SEP = "\n"


def hermes_call(name: str, arguments: str) -> str:
    """One call as Hermes writes it (`arguments`: the JSON text)."""
    return CALL_OPEN + NAME_OPEN + name + ARGS_OPEN + arguments + CALL_END


# ---- the grammar ---------------------------------------------------------------------------


def tool_grammar(tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> str | None:
    """The Lark grammar (llguidance dialect) of an assistant turn under `choice`;
    None when nothing needs constraining (no tools)."""
    return turn_grammar(
        tools,
        choice,
        parallel=parallel,
        text=r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/",
        head=lambda name: CALL_OPEN + NAME_OPEN + name + ARGS_OPEN,
        tail=CALL_END,
        separator=CALL_SEP,
    )


def tool_structural_tag(tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> dict[str, Any] | None:
    """The xgrammar structural tag of an assistant turn under `choice`, for the
    engine's own grammar backend; None without tools (see `_syntax.turn_structural_tag`:
    calls after the trigger `<tool_call>`, separated by a newline)."""
    return turn_structural_tag(
        tools,
        choice,
        parallel=parallel,
        head=lambda name: CALL_OPEN + NAME_OPEN + name + ARGS_OPEN,
        tail=CALL_END,
        separator=CALL_SEP,
        trigger=CALL_OPEN.rstrip("\n"),
    )


# ---- output parsing -------------------------------------------------------------------------


class ToolCallParser:
    """Incremental: `feed(text)` returns the deltas the new text completes, `close()`
    the rest. Text that may still become `<tool_call>` is held back until it
    cannot. Argument fragments are released as soon as they are generated; a
    small JSON scanner finds where the arguments end. Assumes the grammar's exact
    call format; anything else is passed through as text.

    forced: the grammar admits only calls (`tool_choice` "required" or a named
    function), so text held back as a possible call opener is a call's framing cut
    off by `max_tokens`: it is dropped at `close()`, never reported as text."""

    def __init__(self, *, forced: bool = False) -> None:
        self._forced = forced
        self._closed = False
        self._buf = ""
        self._mode: Literal["start", "text", "head", "args", "tail", "between"] = "start"
        self._index = -1
        self._json = JsonExtent()
        self.calls: list[ToolCall] = []
        self._name = ""
        self._id = ""
        self._args: list[str] = []
        self.text: list[str] = []

    def feed(self, text: str) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        self._buf += text
        while self._buf:
            before = (self._mode, len(self._buf))
            self._step(out)
            if (self._mode, len(self._buf)) == before:
                break  # needs more text
        return out

    def close(self) -> list[ChatDelta]:
        """The end of the output: flush held text (an unfinished call keeps its fragments).
        Idempotent: a second close reports nothing (and adds no call)."""
        out: list[ChatDelta] = []
        if self._closed:
            return out
        self._closed = True
        if self._mode == "args":
            self._finish_call()
        elif self._buf and self._mode in ("start", "text") and not self._forced:
            self._emit_text(self._buf, out)
        # "head" / "between" / "tail": a call's framing cut off (max_tokens): nothing to report
        self._buf = ""
        return out

    @property
    def content(self) -> str:
        """The text parsed so far (outside calls)."""
        return "".join(self.text)

    def _emit_text(self, text: str, out: list[ChatDelta]) -> None:
        if text:
            self.text.append(text)
            out.append(TextDelta(text))

    def _step(self, out: list[ChatDelta]) -> None:
        buf, opener = self._buf, CALL_OPEN + NAME_OPEN
        if self._mode in ("start", "between"):
            if self._mode == "between" and buf.startswith(CALL_SEP + opener[:1]):
                buf = self._buf = buf[len(CALL_SEP) :]
            if buf.startswith(opener):
                self._buf = buf[len(opener) :]
                self._mode = "head"
            elif opener.startswith(buf) or (self._mode == "between" and (CALL_SEP + opener).startswith(buf)):
                return  # may still become a call
            else:
                self._mode = "text"
        elif self._mode == "text":
            # a call may follow text (the structural tag allows it): text up to an
            # opener is released, a tail that may still become one is held back
            at = buf.find(opener)
            if at >= 0:
                self._emit_text(buf[:at], out)
                self._buf = buf[at + len(opener) :]
                self._mode = "head"
                return
            keep = next((k for k in range(min(len(buf), len(opener) - 1), 0, -1) if buf.endswith(opener[:k])), 0)
            self._emit_text(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep :]
        elif self._mode == "head":
            end = buf.find(ARGS_OPEN)
            if end < 0:
                return
            self._name, self._buf = buf[:end], buf[end + len(ARGS_OPEN) :]
            self._index += 1
            self._id = new_call_id()
            self._args = []
            self._json = JsonExtent()
            out.append(ToolCallDelta(index=self._index, id=self._id, name=self._name, arguments=""))
            self._mode = "args"
        elif self._mode == "args":
            n = self._scan(buf)
            if n:
                self._args.append(buf[:n])
                out.append(ToolCallDelta(index=self._index, arguments=buf[:n]))
                self._buf = buf[n:]
            if self._json.depth == 0 and self._args:
                self._finish_call()
                self._mode = "tail"
        elif self._mode == "tail":
            if buf.startswith(CALL_END):
                self._buf = buf[len(CALL_END) :]
                self._mode = "between"
            elif not CALL_END.startswith(buf):
                self._mode = "text"  # not the grammar's format: keep it as text

    def _scan(self, buf: str) -> int:
        """How many chars of `buf` belong to the arguments (stops after the closing bracket)."""
        end = self._json.end(buf)
        return len(buf) if end is None else end

    def _finish_call(self) -> None:
        self.calls.append(ToolCall(id=self._id, name=self._name, arguments="".join(self._args)))
        self._args = []


class HermesFormat(ToolFormat):
    """`<tool_call>` JSON `</tool_call>`: `tool_grammar`, `tool_structural_tag`, `ToolCallParser`."""

    name = "hermes"
    trigger = "<tool_call>"

    def detect(self, template: str) -> bool:
        # a template that renders tools and frames calls in <tool_call> (Qwen 2.5 / 3, Hermes, SmolLM3);
        # Hermes is also the default, for every template no format detects
        return template_supports_tools(template) and self.trigger in template

    def grammar(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> str | None:
        return tool_grammar(tools, choice, parallel=parallel)

    def structural_tag(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> dict[str, Any] | None:
        return tool_structural_tag(tools, choice, parallel=parallel)

    def parser(self, *, forced: bool = False) -> CallParser:
        return ToolCallParser(forced=forced)

    def call_text(self, calls: Sequence[ToolCall]) -> str:
        return CALL_SEP.join(hermes_call(c.name, c.arguments) for c in calls)


HERMES: Final = register_tool_format(HermesFormat())
