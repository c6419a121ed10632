"""A tool-call format: what a turn is rendered, constrained and parsed through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

from ._types import ChatDelta, Tool, ToolCall


class CallParser(Protocol):
    """What a ChatStream feeds its generated text through (ToolCallParser, Llama3JsonParser)."""

    calls: list[ToolCall]

    def feed(self, text: str) -> list[ChatDelta]: ...

    def close(self) -> list[ChatDelta]: ...

    @property
    def content(self) -> str: ...


class ToolFormat(ABC):
    """One family's tool-call format. Declared here, where turns are rendered and parsed
    through it; the formats themselves (Hermes, Llama 3's bare JSON) and the choice of one
    per chat template live in aiobasert.tool_formats."""

    name: str
    trigger: str
    """What starts a call in the generated text."""

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

    @abstractmethod
    def call_text(self, calls: Sequence[ToolCall]) -> str:
        """A past assistant turn's calls as the model writes them, for a template that
        does not render `tool_calls` itself."""

    def shape_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the model's own template expects it, when it renders tools
        itself (default: unchanged)."""
        return messages

    def __repr__(self) -> str:
        return f"<ToolFormat {self.name}>"
