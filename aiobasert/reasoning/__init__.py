"""Reasoning models: the thought kept apart from the answer.

```python
async for delta in engine.stream_chat(messages, thinking=Thinking(budget=256)):
    ...                                  # ReasoningDelta | TextDelta | ToolCallDelta
reply = await engine.stream_chat(messages, response_format_schema...)
reply.reasoning, reply.content, reply.usage.reasoning_tokens
```

A model's reasoning format is known from its chat template and its vocabulary's special
tokens (`reasoning_format_for`, `engine.reasoning_format`): `<think>` / `</think>` for Qwen3,
QwQ, DeepSeek-R1 and SmolLM3 (`think`), gpt-oss's Harmony channels (`harmony`: the analysis
channel is the thought, the final one the answer), none otherwise. One module per format
registers itself (`register_reasoning_format`).

What a turn asks of the thought is a `Thinking` (`thinking=` of `stream_chat`): on / off through
the template's `enable_thinking`, a token budget after which the engine writes the close tag
itself, whether stop strings may match inside it. docs/reasoning.md has the whole contract,
structured output and tool calls after the thought included.
"""

from __future__ import annotations

from ._format import (
    Part,
    ReasoningFormat,
    ReasoningSplitter,
    reasoning_format_for,
    register_reasoning_format,
    registered_reasoning_formats,
)
from ._options import MAX_REASONING_BUDGET, ReasoningDelta, Thinking
from .harmony import HARMONY, Harmony, HarmonySplitter
from .think import THINK, ThinkSplitter, ThinkTags

__all__ = [
    "HARMONY",
    "MAX_REASONING_BUDGET",
    "THINK",
    "Harmony",
    "HarmonySplitter",
    "Part",
    "ReasoningDelta",
    "ReasoningFormat",
    "ReasoningSplitter",
    "ThinkSplitter",
    "ThinkTags",
    "Thinking",
    "reasoning_format_for",
    "register_reasoning_format",
    "registered_reasoning_formats",
]

for _cls in (Thinking, ReasoningDelta, ReasoningFormat, ReasoningSplitter, ThinkTags, ThinkSplitter, Harmony,
             HarmonySplitter):  # fmt: skip
    _cls.__module__ = __name__
del _cls
