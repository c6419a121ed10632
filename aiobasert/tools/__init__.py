"""Tool calling: typed tools and calls, prompt rendering, the call grammar, and
an incremental parser that turns generated text into text and tool-call deltas.

```python
weather = Tool(name="get_weather", parameters={"type": "object",
               "properties": {"city": {"type": "string"}}, "required": ["city"]})
reply = await engine.chat(messages, tools=[weather], tool_choice="required")
for call in reply.tool_calls:            # ToolCall(id, name, arguments: JSON text)
    print(call.name, json.loads(call.arguments))
async for delta in engine.stream_chat(messages, tools=[weather]):
    ...                                   # TextDelta | ToolCallDelta
```

Each model calls tools in its family's format, chosen once from its chat template
(`tool_format_for`, `engine.tool_format`): Llama 3.x's templates ask for
bare JSON, ``{"name": "get_weather", "parameters": {"city":"Paris"}}`` as the
whole reply (`llama3_json`); gpt-oss's (Harmony) a commentary message
``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>``
(`harmony`); every other model uses the Hermes / Qwen format (`hermes`)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

(several calls are separated by one newline). Tools are rendered into the
prompt by the model's own chat template when it knows about tools (it mentions
`tools`), otherwise by the default below: a system-prompt tool list
(`DEFAULT_TOOL_PROMPT`), assistant calls in the model's format (Hermes, which
that prompt asks for), and tool results as user turns wrapped in
`<tool_response>` tags.

The output is constrained by a grammar, never filtered afterwards. For Hermes, the engine's
own grammar backend is tried first with an xgrammar STRUCTURAL TAG
(`tool_structural_tag`: free text, and after the trigger `<tool_call>` one of
the allowed calls, its arguments under the tool's schema); where the engine
cannot build it (no `baseRT_grammar_create_from_structural_tag`, or a schema it
cannot enforce) llguidance runs the Lark grammar of `tool_grammar` (`%json` for
each tool's arguments) on the host. Both enforce:

- `tool_choice="auto"`: text, and any call the model starts is well-formed
  (the structural tag lets text surround calls; the Lark grammar is stricter:
  either text without `<tool_call>`, or calls from the first character on);
- `"required"` / a named function: only well-formed calls (of that function),
  at least one;
- `"none"`: text without `<tool_call>`;
- `parallel_tool_calls=False`: at most one call (the structural tag's
  `stop_after_first`: only an end token may follow it).

Arguments always validate against the tool's JSON Schema, and hold only the properties
it declares (`closed_objects`: an absent `additionalProperties` is read as false). The grammar masks
the lane's logits row each step, so tool lanes keep batching with free lanes.

The package: one module per call format (`hermes`, `llama3_json`, `harmony`), each a `ToolFormat`
registered when the package imports it below, so a new family is one new module; and the
pieces every format shares, private: `_types` (tools, calls, deltas, the reply), `_input`
(tools and `tool_choice` normalised and bounded), `_format` (the `ToolFormat` interface and
the registry, `tool_format_for`), `_syntax` (what each format's grammar and structural tag
are built from, the JSON extent scanner, call ids), `_render` (the prompt), `_turn`
(`ChatTurn`: a turn rendered and constrained once) and `_stream` (`ChatStream`: the output
parsed into deltas while it streams). tests/sdk/test_tool_formats.py round-trips every
registered format.
"""

from __future__ import annotations

from ._format import (
    CallParser,
    ToolFormat,
    default_tool_format,
    register_tool_format,
    registered_tool_formats,
    template_supports_tools,
    tool_format_for,
)
from ._input import MAX_TOOLS, check_schema_and_tools, check_tools, parse_tool_choice, parse_tools
from ._render import DEFAULT_TOOL_PROMPT, render_tool_chat
from ._stream import ChatStream, finish_reason_with_tools
from ._turn import ChatTurn, prepare_chat_turn
from ._types import ChatDelta, ChatReply, TextDelta, Tool, ToolCall, ToolCallDelta, ToolChoice
from .harmony import HARMONY_TOOLS, HarmonyCallParser, HarmonyToolFormat

# the formats, one module each: importing one registers it (the order is the order `tool_format_for` asks them in)
from .hermes import CALL_CLOSE, CALL_OPEN, HERMES, HermesFormat, ToolCallParser, tool_grammar, tool_structural_tag
from .llama3_json import LLAMA3_JSON, Llama3JsonFormat, Llama3JsonParser

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "DEFAULT_TOOL_PROMPT",
    "HARMONY_TOOLS",
    "HERMES",
    "LLAMA3_JSON",
    "MAX_TOOLS",
    "CallParser",
    "ChatDelta",
    "ChatReply",
    "ChatStream",
    "ChatTurn",
    "HarmonyCallParser",
    "HarmonyToolFormat",
    "HermesFormat",
    "Llama3JsonFormat",
    "Llama3JsonParser",
    "TextDelta",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolChoice",
    "ToolFormat",
    "check_schema_and_tools",
    "check_tools",
    "default_tool_format",
    "finish_reason_with_tools",
    "parse_tool_choice",
    "parse_tools",
    "prepare_chat_turn",
    "register_tool_format",
    "registered_tool_formats",
    "render_tool_chat",
    "template_supports_tools",
    "tool_format_for",
    "tool_grammar",
    "tool_structural_tag",
]

# Public classes under the name users import them by (reprs, pickles, the API reference).
for _cls in (
    Tool,
    ToolCall,
    ToolCallDelta,
    TextDelta,
    ChatReply,
    CallParser,
    ToolFormat,
    ToolCallParser,
    ChatTurn,
    ChatStream,
):
    _cls.__module__ = __name__
del _cls
