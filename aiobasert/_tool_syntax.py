"""The call text both tool-call modules write and scan (aiobasert.tools: Hermes' grammar and
parser; aiobasert.tool_formats: every format's): Hermes' call framing, a Lark string literal, the
incremental JSON extent scanner, and call ids.

Private, and below both: it imports neither, so each imports it without a circle.
"""

from __future__ import annotations

import itertools
import json
import os

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


def lark_str(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


_call_ids = itertools.count(1)
_call_prefix = os.urandom(4).hex()


def new_call_id() -> str:
    """A fresh `ToolCall.id`: unique in this process, and unlikely to repeat across processes."""
    return f"call_{_call_prefix}{next(_call_ids):06d}"


class JsonExtent:
    """Incremental: where a JSON object or array fed in pieces ends (its closing bracket), aware of
    strings and escapes; `depth` is the nesting still open."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_str = False
        self._escape = False

    def end(self, text: str, start: int = 0) -> int | None:
        """Scan text[start:] (the part not scanned before): just past the bracket that closes the
        value, or None if it is still open."""
        for j in range(start, len(text)):
            ch = text[j]
            if self._in_str:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return j + 1
        return None
