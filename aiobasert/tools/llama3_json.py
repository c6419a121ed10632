"""Llama 3.x's tool-call format (`LLAMA3_JSON`, "llama3_json"): Llama 3.1 / 3.2 / 3.3, whose
templates render tools and ask for `{"name": function name, "parameters": ...}`. The whole reply
is the call, bare JSON ``{"name": "f", "parameters": {...}}`` (several separated by ``; ``, as
vLLM's llama3_json parser reads them), optionally after `<|python_tag|>`. Its template renders
the tools and past calls itself, one call per assistant turn (`shape_messages`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Final

from ._format import CallParser, ToolFormat, register_tool_format, template_supports_tools
from ._syntax import JsonExtent, new_call_id, turn_grammar, turn_structural_tag
from ._types import ChatDelta, TextDelta, Tool, ToolCall, ToolCallDelta

__all__ = ["LLAMA3_JSON", "Llama3JsonFormat", "Llama3JsonParser"]


# ---- Llama 3.x: bare JSON -------------------------------------------------------------------

PYTHON_TAG: Final = "<|python_tag|>"
# JSON's blanks, the only ones the "auto" grammar lets lead to a call: after str.isspace's others (\v, NBSP,
# ...) a reply is TEXT, never held to a schema, so the parser must not read a call there either
_BLANK: Final = " \t\r\n"
_LLAMA_SEP = "; "
_LLAMA_ARGS_KEY = "parameters"
# Llama 3.1 / 3.2 / 3.3's tool instruction: 'Respond in the format {"name": function name, "parameters": ...'
_LLAMA3_INSTRUCTION = re.compile(r'\{"name": [^{}]{0,40}"parameters"')


def _llama_head(name: str) -> str:
    return '{"name": "' + name + '", "' + _LLAMA_ARGS_KEY + '": '


class Llama3JsonFormat(ToolFormat):
    """Llama 3.x's JSON calls: `{"name": "f", "parameters": {...}}` is the whole reply.

    "auto": text that does not start with `{` (after whitespace), or calls from the
    first character; "required" / a named function: calls only, each
    `{"name": <one of the tools>, "parameters": <its schema>}`, separated by `; `
    (`parallel=False`: exactly one); "none": text that does not start with `{`.
    Only "required" / named run on the engine's structural tag (calls with a
    separator); "auto" and "none" say "at the start" and run on llguidance."""

    name = "llama3_json"
    trigger = "{"

    def detect(self, template: str) -> bool:
        # a template that renders tools and asks for {"name": ..., "parameters": ...}, without
        # Hermes' <tool_call> (Hermes 3's template is on Llama 3.1 weights, with Hermes calls)
        return (
            template_supports_tools(template)
            and "<tool_call>" not in template
            and _LLAMA3_INSTRUCTION.search(template) is not None
        )

    def grammar(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> str | None:
        # whitespace then "{" opens a call (as the parser reads it), also after "<|python_tag|>" (which
        # ordinary tokens can spell): text never does
        text = r"TEXT: /(?s:.+)/ & ~/(?s:[ \t\r\n]*(<\|python_tag\|>[ \t\r\n]*)?\{.*)/"
        return turn_grammar(
            tools, choice, parallel=parallel, text=text, head=_llama_head, tail="}", separator=_LLAMA_SEP
        )

    def structural_tag(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> dict[str, Any] | None:
        if not tools or choice in ("auto", "none"):
            return None  # "a call only at the start" is no structural tag: the Lark grammar runs
        return turn_structural_tag(
            tools, choice, parallel=parallel, head=_llama_head, tail="}", separator=_LLAMA_SEP, trigger=self.trigger
        )

    def parser(self, *, forced: bool = False) -> CallParser:
        return Llama3JsonParser(forced=forced)

    def call_text(self, calls: Sequence[ToolCall]) -> str:
        return _LLAMA_SEP.join(_llama_head(c.name) + c.arguments + "}" for c in calls)

    def shape_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Llama 3.1's template refuses an assistant turn with several calls ("This model
        # only supports single tool-calls at once!"): one turn per call, in order
        out: list[dict[str, Any]] = []
        for m in messages:
            calls = m.get("tool_calls") or []
            if len(calls) <= 1:
                out.append(m)
                continue
            for j, call in enumerate(calls):
                out.append({**m, "content": m["content"] if j == 0 else "", "tool_calls": [call]})
        return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


# A cut-off call's head: `{"name": "f", "parameters": ` (what follows is its partial arguments).
_HEAD_RE = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def _as_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as compact JSON) when `text` (one whole JSON object) is a Llama call:
    `{"name": str, "parameters" | "arguments": object}`, optionally with `"type": "function"`."""
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = set(obj) - {"name"}
    if obj.pop("type", "function") != "function":
        return None
    keys.discard("type")
    if len(keys) != 1 or not keys <= {"parameters", "arguments"}:
        return None
    args = obj[keys.pop()]
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


class Llama3JsonParser:
    """Incremental parser of Llama 3.x replies (same interface as ToolCallParser).

    A reply whose first non-blank text is `{` or `<|python_tag|>` may be calls: it is
    held back until each JSON object closes, then a call (`_as_call`) is reported as
    two deltas (its id and name, then its arguments, re-serialised compactly from
    "parameters"); whatever turns out not to be a call is released as text unchanged,
    and so is every reply that starts otherwise (at once). After a call, `;` or
    whitespace may lead to the next one; anything else is text.

    At `close()` (the turn ended, e.g. cut by max_tokens): an unfinished call whose
    head (`{"name": "f", "parameters": `) is complete is a call with the arguments
    generated so far (finish_reason "length" says it was cut); framing cut off after a
    call is dropped, as is an unfinished first call when `forced` (only calls were
    allowed); otherwise the held text is released."""

    def __init__(self, *, forced: bool = False) -> None:
        self._forced = forced
        self._closed = False
        self._buf = ""  # text held back: maybe (part of) a call
        self._mode: str = "start"  # start | text | call | after
        self._obj = 0  # where the held call's `{` is in _buf
        self._json = JsonExtent()
        self._scanned = 0  # chars of _buf after _obj the scanner has read
        self._keyed = False  # the held object's first key has begun
        self.calls: list[ToolCall] = []
        self.text: list[str] = []

    @property
    def content(self) -> str:
        """The text parsed so far (outside calls)."""
        return "".join(self.text)

    def feed(self, text: str) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        if self._closed:
            return out
        if self._mode == "text":
            self._emit_text(text, out)
            return out
        self._buf += text
        while self._buf and self._mode != "text":
            before = (self._mode, len(self._buf))
            self._step(out)
            if (self._mode, len(self._buf)) == before:
                break  # needs more text
        if self._mode == "text" and self._buf:
            self._emit_text(self._buf, out)
            self._buf = ""
        return out

    def close(self) -> list[ChatDelta]:
        """The end of the output (idempotent: a second close reports nothing)."""
        out: list[ChatDelta] = []
        if self._closed:
            return out
        self._closed = True
        buf, self._buf = self._buf, ""
        if self._mode == "call":
            head = _HEAD_RE.match(buf, self._obj)
            name = _json_string(head.group(1)) if head is not None else None
            if head is not None and name is not None:  # a call cut off in its arguments
                self._report(name, buf[head.end() :], out)
            elif not self.calls and not self._forced:
                self._emit_text(buf, out)
        elif self._mode == "start" and not self._forced:
            self._emit_text(buf, out)
        # "after": a separator / blank after a call, cut off: nothing to report
        return out

    def _emit_text(self, text: str, out: list[ChatDelta]) -> None:
        if text:
            self.text.append(text)
            out.append(TextDelta(text))

    def _report(self, name: str, arguments: str, out: list[ChatDelta]) -> None:
        call = ToolCall(id=new_call_id(), name=name, arguments=arguments)
        out.append(ToolCallDelta(index=len(self.calls), id=call.id, name=name, arguments=""))
        out.append(ToolCallDelta(index=len(self.calls), arguments=arguments))
        self.calls.append(call)

    def _step(self, out: list[ChatDelta]) -> None:
        buf = self._buf
        if self._mode in ("start", "after"):
            # leading blanks, then (at the start) <|python_tag|>, (after a call) one `;`
            i = len(buf) - len(buf.lstrip(_BLANK))
            rest = buf[i:]
            if self._mode == "start" and rest.startswith(PYTHON_TAG):
                i += len(PYTHON_TAG)
                i += len(buf[i:]) - len(buf[i:].lstrip(_BLANK))
                rest = buf[i:]
            elif self._mode == "start" and rest and PYTHON_TAG.startswith(rest):
                return  # may still become <|python_tag|>
            if self._mode == "after" and rest.startswith(";"):
                i += 1
                i += len(buf[i:]) - len(buf[i:].lstrip(_BLANK))
                rest = buf[i:]
            if not rest:
                return  # blanks so far
            if rest.startswith("{"):
                self._mode, self._obj, self._scanned, self._keyed = "call", i, 0, False
                self._json = JsonExtent()
            else:
                self._to_text()
        elif self._mode == "call":
            end = self._scan()
            if end is None:
                if self._hopeless():
                    self._to_text()
                return
            call = _as_call(buf[self._obj : end])
            if call is None:
                self._to_text()
                return
            self._report(*call, out)
            self._buf = buf[end:]
            self._mode = "after"

    def _to_text(self) -> None:
        """The held text is no call: it (and all that follows) is text. A separator
        after a call stays with the text after it (that is where the calls ended)."""
        self._mode = "text"

    def _hopeless(self) -> bool:
        """The held object cannot be a call: its first key does not start at once
        (looked at until that key's quote is seen: a long call is not rescanned)."""
        if self._keyed:
            return False
        body = self._buf[self._obj + 1 :].lstrip(_BLANK)
        self._keyed = body.startswith('"')
        return bool(body) and not self._keyed

    def _scan(self) -> int | None:
        """Where the held JSON object ends in _buf (just past its `}`), or None if it is still open."""
        buf = self._buf
        end = self._json.end(buf, self._obj + self._scanned)
        if end is None:
            self._scanned = len(buf) - self._obj
        return end


LLAMA3_JSON: Final = register_tool_format(Llama3JsonFormat())
