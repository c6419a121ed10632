"""A chat turn rendered and constrained once (`prepare_chat_turn`).

No `from __future__ import annotations`: ChatTurn is re-exported as `aiobasert.tools.ChatTurn`
(see _types)."""

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .._core.protocol import ThoughtSpec
from ..chat import check_message_count, check_template_kwargs
from ..errors import InvalidRequestError
from ..reasoning import ReasoningFormat, Thinking
from ._format import ToolFormat
from ._input import check_tools, parse_tool_choice, parse_tools
from ._render import render_tool_chat
from ._types import Tool, ToolChoice


class ChatTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A chat turn rendered and constrained once (`Engine.prepare_chat`), to be streamed
    any number of times (`Engine.stream_turn`: one per choice of an n > 1 request).

    Preparing is the request-sized part (rendering every message and tool, the call
    grammar's text); it reads only the model's immutable template, tokens and call format,
    so a server runs it in a worker thread, where it delays only its own request."""

    pieces: list[tuple[str, bool]]
    """The rendered prompt: (text, is_content) pieces, as `baseRT_encode_pieces` takes them."""
    lark: str | None
    """The turn's Lark grammar (llguidance); None without tools."""
    structural_tag: str | None
    """The same contract as an xgrammar structural tag (JSON text), where one can say it."""
    parse_calls: bool
    """Whether the output may hold calls (tools, and `tool_choice` not "none")."""
    forced: bool
    """Only calls may be generated ("required" or a named function)."""
    tool_format: ToolFormat
    reasoning: ReasoningFormat | None = None
    """The model's reasoning format (None: it does not reason): the stream separates its thought."""
    open_at_start: bool = False
    """The prompt left the thought open: the output starts inside it."""
    thought: ThoughtSpec | None = None
    """The thought as the engine gates it (budget, a grammar after it, stop strings outside it), where
    the model may think in this turn (None: no reasoning format, or the prompt closed the thought)."""


def prepare_chat_turn(
    template: str,
    messages: Sequence[Any],
    *,
    tool_format: ToolFormat,
    tools: Sequence[Tool | Mapping[str, Any]] | None,
    tool_choice: ToolChoice | Mapping[str, Any] | None,
    parallel: bool,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    reasoning: ReasoningFormat | None = None,
    thinking: Thinking | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    special_tokens: Sequence[str] = (),
    continue_final_message: bool = False,
) -> ChatTurn:
    """Render and constrain one tool-aware chat turn with the model's chat `template`, in its
    tool-call format (`Engine.tool_format`); `bos_token` / `eos_token` are the model's
    (`ModelInfo`), as the template may print them. Bounded before it is paid: more than
    `MAX_CHAT_MESSAGES` messages or `MAX_TOOLS` tools are refused before anything is
    rendered. Safe to run in a worker thread (it touches no engine and no event loop).

    `reasoning`: the model's reasoning format (`Engine.reasoning_format`); `thinking`: what the turn
    asks of the thought (on / off through the template's knob, its budget); `template_kwargs`: more
    variables for the template (`chat_template_kwargs`, checked by `chat.check_template_kwargs`);
    `special_tokens`: the vocabulary's, which a template variable may not carry;
    `continue_final_message`: the last message is an assistant turn the model goes on writing (a
    prefill), rendered without a generation prompt and cut after its text."""
    check_message_count(messages)
    check_tools(tools)
    kwargs = check_template_kwargs(template, template_kwargs, special_tokens)
    _thinking_knob(template, reasoning, thinking, kwargs)
    fmt = tool_format
    parsed = parse_tools(tools)
    if parsed and reasoning is not None and not reasoning.tool_calls:
        raise InvalidRequestError(
            f"tools: this model's tool calls ({reasoning.name} framing) are not read; send the turn without tools"
        )
    choice = parse_tool_choice(tool_choice, parsed)
    forced = choice != "none" and choice != "auto"
    if forced and choice != "required":
        parallel = False  # a named function is called exactly once (as OpenAI and vLLM do)
    lark = fmt.grammar(parsed, choice, parallel=parallel)
    tag = fmt.structural_tag(parsed, choice, parallel=parallel)
    if continue_final_message and fmt.after_thought is not None and parsed:
        # a format whose calls are messages of their own (Harmony): its grammar opens a message
        # (`<|channel|>` ...), which cannot follow inside the continued final answer's body
        if forced:
            raise InvalidRequestError(
                f"tool_choice: {choice!r} cannot be met when the final answer is continued "
                f"(continue_final_message): this model's tool calls ({fmt.name}) are messages of their own"
            )
        lark, tag = None, None
    pieces = render_tool_chat(
        template,
        messages,
        parsed,  # listed under "none" too: the model knows them, the grammar forbids calls
        tool_format=fmt,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        template_kwargs=kwargs,
        continue_final_message=continue_final_message,
    )
    state = "closed"
    if reasoning is not None and continue_final_message:
        # the model goes on with the turn's text: in its thought if the template opened one just
        # before it, else in its answer (it does not open a thought mid-answer)
        last = max((i for i, (_, is_content) in enumerate(pieces) if is_content), default=len(pieces))
        framing = [text for text, is_content in pieces[:last] if not is_content]
        state = "open" if framing and reasoning.prompt_state(framing[-1]) == "open" else "closed"
    elif reasoning is not None:
        text, is_content = pieces[-1]
        state = reasoning.prompt_state("" if is_content else text)
    thought = None
    if reasoning is not None and state != "closed" and reasoning.tags_are_tokens:
        opts = thinking or Thinking()
        thought = ThoughtSpec(reasoning.open_tag, reasoning.close_tag, starts_open=state == "open",
                              budget=opts.budget, stop_in_thought=opts.stop_in_thought,
                              answer_tag=_answer_tag(reasoning, fmt, lark), reopens=reasoning.reopens)  # fmt: skip
    return ChatTurn(
        pieces=pieces,
        lark=lark,
        structural_tag=json.dumps(tag) if tag is not None else None,
        parse_calls=choice != "none" and bool(parsed),
        forced=forced,
        tool_format=fmt,
        reasoning=reasoning,
        open_at_start=state == "open",
        thought=thought,
    )


def _answer_tag(reasoning: ReasoningFormat, fmt: ToolFormat, lark: str | None) -> str:
    """What the engine writes after the thought's close tag: the tool format's own opening where its call
    grammar follows (Harmony's: the grammar names the channel, final or a call's), else the answer's header."""
    if lark is not None and fmt.after_thought is not None and reasoning.answer_tag:
        return fmt.after_thought
    return reasoning.answer_tag


def _thinking_knob(
    template: str, reasoning: ReasoningFormat | None, thinking: Thinking | None, kwargs: dict[str, Any]
) -> None:
    """`thinking` written into the template's variables (its `enable_thinking`), or
    `InvalidRequestError` naming `thinking` where the model cannot do what it asks."""
    template_kwargs_set = reasoning is not None and reasoning.thinking_knob in kwargs
    if reasoning is not None and reasoning.has_knob(template):
        # as llama.cpp: the knob is always given, on unless asked off (DeepSeek-R1's llama.cpp template
        # reads an absent `enable_thinking` as off, Qwen3's and SmolLM3's as on)
        kwargs.setdefault(reasoning.thinking_knob, True)
    if thinking is None:
        return
    if reasoning is None and (thinking.enabled or thinking.budget is not None):
        raise InvalidRequestError("thinking: this model does not reason (its chat template has no thought)")
    if reasoning is not None and not reasoning.tags_are_tokens and thinking.budget is not None:
        raise InvalidRequestError(
            f"thinking.budget: this model's thought ({reasoning.name} framing) cannot be bounded: its "
            "tags are not tokens of its vocabulary"
        )
    if thinking.enabled is None:
        return
    knob = reasoning.thinking_knob if reasoning is not None else "enable_thinking"
    if reasoning is None or not reasoning.has_knob(template):
        raise InvalidRequestError(f"thinking: this model's chat template cannot turn thinking on or off (no {knob})")
    if template_kwargs_set and kwargs.get(knob) != thinking.enabled:
        raise InvalidRequestError(f"thinking: chat_template_kwargs.{knob} says otherwise")
    kwargs[knob] = thinking.enabled
