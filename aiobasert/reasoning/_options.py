"""What a chat turn asks of the model's thought (`Thinking`) and a streamed piece of it (`ReasoningDelta`).

No `from __future__ import annotations`: these Structs are re-exported as names of
`aiobasert.reasoning` (see aiobasert.tools._types for why)."""

from typing import Any

import msgspec

from ..errors import InvalidRequestError

MAX_REASONING_BUDGET = 1 << 30


class Thinking(msgspec.Struct, frozen=True, kw_only=True):
    """How a reasoning model thinks in one chat turn (`engine.stream_chat(..., thinking=...)`;
    `thinking=True` / `False` are `Thinking(enabled=True / False)`).

    enabled: the chat template's `enable_thinking` (Qwen3, QwQ, DeepSeek-R1's llama.cpp template,
        SmolLM3); None leaves the template's default (they think). A template without the knob
        refuses True / False (`InvalidRequestError` naming `thinking`).
    budget: the most tokens the thought may take; past it the engine writes the close tag itself
        (as llama-server's `--reasoning-budget`) and the answer follows. None: unbounded (up to
        `max_tokens`). 0: the thought closes at once.
    stop_in_thought: stop strings may match inside the thought too (by default they only match
        in the answer: a thought that quotes one does not end the turn).

    Anthropic's `thinking: {"type": "enabled", "budget_tokens": N}` is `Thinking(enabled=True,
    budget=N)`; `{"type": "disabled"}` is `Thinking(enabled=False)`. OpenAI's `reasoning_effort`
    "none" is `enabled=False`, any other effort `enabled=True`.
    """

    enabled: bool | None = None
    budget: int | None = None
    stop_in_thought: bool = False

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise InvalidRequestError(f"thinking.enabled must be a bool or None, got {self.enabled!r}")
        b = self.budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_REASONING_BUDGET):
            raise InvalidRequestError(f"thinking.budget must be None or an integer in [0, 2**30], got {b!r}")
        if not isinstance(self.stop_in_thought, bool):
            raise InvalidRequestError(f"thinking.stop_in_thought must be a bool, got {self.stop_in_thought!r}")
        if self.enabled is False and b is not None:
            raise InvalidRequestError("thinking.budget: a budget needs thinking on")

    @classmethod
    def of(cls, value: Any) -> "Thinking | None":
        """`value` as a `Thinking`: None, a bool, or a `Thinking` (anything else: `InvalidRequestError`)."""
        if value is None or isinstance(value, Thinking):
            return value
        if isinstance(value, bool):
            return cls(enabled=value)
        raise InvalidRequestError(f"thinking must be a bool, a Thinking or None, not {type(value).__name__}")


class ReasoningDelta(msgspec.Struct, frozen=True):
    """A piece of the model's thought (`stream_chat` yields these apart from `TextDelta`s)."""

    text: str
