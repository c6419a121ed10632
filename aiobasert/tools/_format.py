"""A tool-call format: what a turn is rendered, constrained and parsed through (`ToolFormat`,
its parser's `CallParser`), and the registry of formats, from which `tool_format_for` picks
the one a chat template teaches its model.

Each format is one module of this package (hermes.py, llama3_json.py) that subclasses
`ToolFormat` and registers one instance (`register_tool_format`) when the package imports it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Final, Protocol, TypeVar

from ._types import ChatDelta, Tool, ToolCall


class CallParser(Protocol):
    """What a ChatStream feeds its generated text through (ToolCallParser, Llama3JsonParser)."""

    calls: list[ToolCall]

    def feed(self, text: str) -> list[ChatDelta]: ...

    def close(self) -> list[ChatDelta]: ...

    @property
    def content(self) -> str: ...


class ToolFormat(ABC):
    """One family's tool-call format: how its model writes calls (`grammar`, `structural_tag`),
    how they are read back (`parser`), how past calls go back into the prompt (`call_text`,
    `shape_messages`), and which chat templates teach it (`detect`). The formats are the
    modules of aiobasert.tools (hermes, llama3_json), each registered once."""

    name: str
    """The registry's key (`registered_tool_formats`)."""
    trigger: str
    """What starts a call in the generated text."""
    reads_framing: bool = False
    """The parser reads the whole output, the reasoning format's framing included (Harmony's channels, where
    a call is a message of its own), not only the answer the reasoning splitter leaves (`turn_parser`)."""
    after_thought: str | None = None
    """Where a reasoning model's thought comes first: what the engine writes after the thought's close tag
    before this format's grammar starts (Harmony's `<|start|>assistant`: the grammar names the channel), in
    place of the reasoning format's `answer_tag`. None: the reasoning format's."""

    def detect(self, template: str) -> bool:
        """Whether a chat `template` teaches its model this format (`tool_format_for` asks each
        registered format; default: never, the format is only chosen by hand)."""
        return False

    @abstractmethod
    def grammar(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> str | None:
        """The Lark grammar (llguidance) of an assistant turn under `choice`; None without tools."""

    @abstractmethod
    def structural_tag(self, tools: Sequence[Tool], choice: str, *, parallel: bool = True) -> dict[str, Any] | None:
        """The same contract as an xgrammar structural tag for the engine's grammar backend,
        or None where a structural tag cannot say it (the Lark grammar then runs on the host)."""

    @abstractmethod
    def parser(self, *, forced: bool = False) -> CallParser:
        """A fresh incremental parser of one turn (`forced`: only calls were allowed)."""

    def turn_parser(self, *, forced: bool = False, open_at_start: bool = False) -> CallParser:
        """The parser of one turn as a chat stream builds it: `parser`, and where the format
        `reads_framing`, one told whether the prompt left the thought open (default: `parser`)."""
        return self.parser(forced=forced)

    @abstractmethod
    def call_text(self, calls: Sequence[ToolCall]) -> str:
        """A past assistant turn's calls as the model writes them, for a template that
        does not render `tool_calls` itself."""

    def shape_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tools (`Tool.as_openai` each) as the model's own template expects them, when it
        renders tools itself (default: unchanged)."""
        return tools

    def shape_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the model's own template expects it, when it renders tools
        itself (default: unchanged)."""
        return messages

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"


def template_supports_tools(template: str) -> bool:
    """True when a chat template renders a `tools` variable itself."""
    return bool(template) and re.search(r"\btools\b", template) is not None


# ---- the registry ---------------------------------------------------------------------------

DEFAULT_TOOL_FORMAT: Final = "hermes"
"""The format of a template no registered format detects (also what the default tool prompt
asks for, when a template renders no tools)."""

_FORMATS: dict[str, ToolFormat] = {}

F = TypeVar("F", bound=ToolFormat)


def register_tool_format(fmt: F) -> F:
    """Add `fmt` to the registry under its `name` (each format module registers its one
    instance when imported) and return it. A name already taken is refused."""
    if fmt.name in _FORMATS:
        raise ValueError(f"a tool format named {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt
    tool_format_for.cache_clear()  # a template seen before may be this format's
    return fmt


def registered_tool_formats() -> dict[str, ToolFormat]:
    """The registered formats by name, in the order they were registered."""
    return dict(_FORMATS)


def default_tool_format() -> ToolFormat:
    """The format of a template no registered format detects (`DEFAULT_TOOL_FORMAT`)."""
    return _FORMATS[DEFAULT_TOOL_FORMAT]


@lru_cache(maxsize=16)
def tool_format_for(template: str) -> ToolFormat:
    """The tool-call format a chat template teaches its model: the first registered format
    whose `detect` says so, else the default (Hermes)."""
    for fmt in _FORMATS.values():
        if fmt.detect(template):
            return fmt
    return default_tool_format()
