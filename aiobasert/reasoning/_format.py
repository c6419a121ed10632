"""A reasoning format: how a model marks its thought in its output (`ReasoningFormat`), the
incremental splitter that separates the thought from the answer while it streams, and the
registry from which `reasoning_format_for` picks the format a chat template and vocabulary teach.

Each format is one module of this package (think.py: `<think>` ... `</think>`) that subclasses
`ReasoningFormat` and registers one instance (`register_reasoning_format`) when the package imports
it; a model with channels (gpt-oss Harmony) is one more module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from functools import lru_cache
from typing import Literal, TypeVar

Part = tuple[Literal["reasoning", "content"], str]
"""A piece of generated text: which side of the thought it is on, and its text."""


class ReasoningSplitter(ABC):
    """Feeds generated text, gives back the pieces it settles, in order: ("reasoning", text) for
    the thought, ("content", text) for the answer. Text that may still turn out to be a tag is held
    back until it is settled (or `close`)."""

    @property
    @abstractmethod
    def in_thought(self) -> bool:
        """The text fed so far ends inside an open thought."""

    @property
    @abstractmethod
    def thought_seen(self) -> bool:
        """A thought was opened (by the model, or left open by the prompt)."""

    @abstractmethod
    def feed(self, text: str) -> list[Part]: ...

    @abstractmethod
    def close(self) -> list[Part]:
        """The end of the output: what was held back, settled (idempotent)."""


class ReasoningFormat(ABC):
    """One family's way of marking a thought. Where `tags_are_tokens`, `open_tag` / `close_tag` are
    written in the model's special tokens (one each, or Harmony's headers of several): the engine
    forces the close tag (a reasoning budget) and switches a constraint on after it (structured
    output after thought) by those tokens' ids."""

    name: str
    """The registry's key (`registered_reasoning_formats`)."""
    open_tag: str
    close_tag: str
    thinking_knob: str = "enable_thinking"
    """The chat-template variable that turns thinking on and off (HF and llama.cpp name it so)."""
    tags_are_tokens: bool = True
    """`open_tag` and `close_tag` (with `answer_tag`) are tokens of the vocabulary, so the engine's thought
    gate can take the thought (a budget, a grammar after it, stop strings outside it). False: the thought
    runs ungated, a budget is refused by name."""
    answer_tag: str = ""
    """What follows the close tag when the engine closes the thought (a budget) or a grammar follows it:
    the answer's header where the answer has one (Harmony's final channel); empty for `<think>`."""
    reopens: bool = False
    """The thought is one channel among a turn's messages (Harmony): the model may open it again after
    closing it, and the engine forces neither its open tag nor what follows a close the model wrote."""
    tool_calls: bool = True
    """The model's tool calls are read by its tool format. False: a turn with tools is refused by name."""

    @abstractmethod
    def detect(self, template: str, special_tokens: frozenset[str]) -> bool:
        """Whether a model with this chat `template` and these special tokens reasons in this format."""

    @abstractmethod
    def splitter(self, *, open_at_start: bool) -> ReasoningSplitter:
        """A fresh splitter of one turn's output (`open_at_start`: the prompt left the thought open)."""

    def has_knob(self, template: str) -> bool:
        """The template reads `thinking_knob` (it can turn thinking on and off)."""
        return self.thinking_knob in template

    def prompt_state(self, prompt_tail: str) -> Literal["open", "closed", "free"]:
        """How a rendered prompt ending in `prompt_tail` leaves the thought: "open" (the template
        opened it: DeepSeek-R1, QwQ), "closed" (it wrote an empty thought: thinking off), or "free"
        (the model may open one itself: Qwen3)."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.open_tag):
            return "open"
        if tail.endswith(self.close_tag):
            return "closed"
        return "free"

    def __repr__(self) -> str:
        return f"<ReasoningFormat {self.name}>"


_FORMATS: dict[str, ReasoningFormat] = {}

F = TypeVar("F", bound=ReasoningFormat)


def register_reasoning_format(fmt: F) -> F:
    """Add `fmt` to the registry under its `name` and return it (a name already taken is refused)."""
    if fmt.name in _FORMATS:
        raise ValueError(f"a reasoning format named {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt
    _detect.cache_clear()
    return fmt


def registered_reasoning_formats() -> dict[str, ReasoningFormat]:
    """The registered formats by name, in the order they were registered."""
    return dict(_FORMATS)


def reasoning_format_for(template: str, special_tokens: Iterable[str]) -> ReasoningFormat | None:
    """The reasoning format of a model with this chat `template` and these special tokens (the
    text of each control / user-defined token): the first registered format that detects it, or
    None for a model that does not reason."""
    return _detect(template, frozenset(special_tokens))


@lru_cache(maxsize=16)
def _detect(template: str, special_tokens: frozenset[str]) -> ReasoningFormat | None:
    return next((fmt for fmt in _FORMATS.values() if fmt.detect(template, special_tokens)), None)
