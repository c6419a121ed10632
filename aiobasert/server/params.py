"""Request -> engine: OpenAI's request fields as `SamplingParams` and chat
messages, and the engine's finish reasons as OpenAI's."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..chat import MAX_CHAT_MESSAGES
from ..errors import InvalidRequestError
from ..reasoning import MAX_REASONING_BUDGET, Thinking
from ..streams import TokenStream
from ..tools import MAX_TOOLS, ToolCall, ToolChoice, check_schema_and_tools
from ..types import FinishReason, SamplingParams, Token
from .errors import APIError, aborted, api_error, constraint_from
from .protocol import RequestMessage, ResponseFormat, SamplingRequest

if TYPE_CHECKING:
    from ..engine import Engine


def sampling_params(
    req: SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    json_schema: dict[str, Any] | bool | None = None,
    constraint: dict[str, Any] | None = None,
) -> SamplingParams:
    """SamplingParams from the OpenAI fields (OpenAI's defaults: temperature 1, top_p 1);
    `constraint`: `output_constraint`'s."""
    bias = logit_bias(req.logit_bias)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or None)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        stop=stop,
        seed=req.seed,
        logit_bias=bias,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        **{"json_schema": json_schema, **(constraint or {})},  # at most one of them is set (the endpoint checks)
        speculation=req.speculation is not False,
    )


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON keys) as SamplingParams takes it."""
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
    return bias


def output_constraint(req: SamplingRequest) -> tuple[dict[str, Any], str | None]:
    """The SamplingParams constraint of vLLM's `structured_outputs` or llama.cpp's `grammar` (one
    of them), and the field it came from (None: neither): errors about it name that field from
    now on (`errors.constraint_from`)."""
    so, gbnf = req.structured_outputs, req.grammar
    if gbnf is not None:
        if so is not None:
            raise APIError(400, "grammar cannot be combined with structured_outputs", param="grammar")
        constraint_from("grammar")
        return {"grammar": gbnf}, "grammar"
    if so is None:
        return {}, None
    given: dict[str, Any] = {k: v for k in ("regex", "choice", "grammar") if (v := getattr(so, k)) is not None}
    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise APIError(400, f"structured_outputs.json is not JSON: {exc}", param="structured_outputs") from None
        given["json_schema"] = schema
    if so.json_object:
        given["json_schema"] = {"type": "object"} if "json_schema" not in given else None
    if len(given) != 1 or None in given.values():
        raise APIError(
            400,
            "structured_outputs takes exactly one of json, regex, choice, grammar and json_object",
            param="structured_outputs",
        )
    constraint_from("structured_outputs")
    return given, "structured_outputs"


def json_schema_of(fmt: ResponseFormat | None) -> dict[str, Any] | bool | None:
    """`SamplingParams.json_schema` for a `response_format` (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}  # OpenAI's json_object is an object, never a bare value
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        return fmt.json_schema.schema
    raise APIError(400, f"unknown response_format type {fmt.type!r}", param="response_format")


def refuse_schema_with_tools(has_tools: bool, json_schema: object, *, field: str, param: str) -> None:
    """`aiobasert.tools.check_schema_and_tools`, the SDK's own rule, as a 400 naming `param`."""
    try:
        check_schema_and_tools(has_tools, json_schema, field=field)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=param) from None


def request_tools(
    tools: Sequence[msgspec.Struct] | None, tool_choice: str | msgspec.Struct | None
) -> tuple[list[dict[str, Any]] | None, ToolChoice | dict[str, Any] | None]:
    """A request's `tools` and `tool_choice` (chat's nested or Responses' flat shapes) as the
    OpenAI dicts the SDK reads: their rules live in `aiobasert.tools` (`parse_tools`,
    `parse_tool_choice`). Request-sized (it copies every schema): run it in a worker."""
    choice: ToolChoice | dict[str, Any] | None = msgspec.to_builtins(tool_choice)
    return (msgspec.to_builtins(tools) or None), choice


def check_chat_size(messages: int, tools: int, messages_param: str) -> None:
    """400 naming the field for a chat with more messages or tools than any request may have:
    a count, checked before any message is read, rendered or tokenized."""
    if messages > MAX_CHAT_MESSAGES:
        raise APIError(
            400, f"{messages_param}: {messages} messages; at most {MAX_CHAT_MESSAGES} per request", param=messages_param
        )
    if tools > MAX_TOOLS:
        raise APIError(400, f"tools: {tools} tools; at most {MAX_TOOLS} per request", param="tools")


class _ChatCounts(msgspec.Struct):
    """The lists of a chat request, undecoded: only their lengths are read."""

    messages: list[msgspec.Raw] = []
    tools: list[msgspec.Raw] | None = None


class _ResponsesCounts(msgspec.Struct):
    input: str | list[msgspec.Raw] = ""
    tools: list[msgspec.Raw] | None = None


def precount_chat(data: bytes | bytearray) -> None:
    """`read_json`'s precount of a chat body: `check_chat_size` before its messages are decoded."""
    try:
        counts = msgspec.json.decode(data, type=_ChatCounts)
    except (msgspec.DecodeError, RecursionError):  # the full decode reports it, naming the field
        return
    check_chat_size(len(counts.messages), len(counts.tools or ()), "messages")


def precount_responses(data: bytes | bytearray) -> None:
    """`read_json`'s precount of a Responses body: `check_chat_size` before its items are decoded."""
    try:
        counts = msgspec.json.decode(data, type=_ResponsesCounts)
    except (msgspec.DecodeError, RecursionError):
        return
    items = 0 if isinstance(counts.input, str) else len(counts.input)
    check_chat_size(items, len(counts.tools or ()), "input")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(messages: Sequence[RequestMessage]) -> list[dict[str, Any]]:
    """The SDK's message mappings (`Engine.stream_chat`): role, content, `name`, and
    the tool fields (assistant `tool_calls`, tool `tool_call_id`). The SDK renders
    names and ids as client text (never parsed for turn markers), as it does content."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages[{i}]: role {m.role!r} is not supported", param="messages")
        if m.tool_calls and role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant turns carry tool_calls", param="messages")
        if m.audio is not None:
            raise APIError(400, f"messages[{i}]: audio is not supported", param="messages")
        if m.function_call is not None:
            raise APIError(400, f"messages[{i}]: function_call is deprecated: send tool_calls", param="messages")
        if m.refusal is not None and role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant turns carry a refusal", param="messages")
        if role == "tool" and not m.tool_call_id:
            raise APIError(400, f"messages[{i}]: a tool turn needs tool_call_id", param="messages")
        if m.content is None:
            if role != "assistant":
                raise APIError(400, f"messages[{i}] has no content", param="messages")
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            texts: list[str] = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400, f"messages[{i}]: content parts of type {part.type!r} are not supported", param="messages"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        if not content and m.refusal:  # a refused turn's text is its refusal
            content = m.refusal
        entry: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            for j, c in enumerate(m.tool_calls):
                # a past call's arguments the model could never have written: the messages' fault,
                # on every model (a template that renders them raw would otherwise take them)
                try:
                    json.loads(c.function.arguments)
                except ValueError:
                    raise APIError(
                        400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", param="messages"
                    ) from None
            entry["tool_calls"] = [
                ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thought is not None:
            if role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant turns carry reasoning", param="messages")
            entry["reasoning_content"] = thought
        out.append(entry)
    return out


def finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's finish_reason for a generation that ended normally; an aborted one raises."""
    if reason == "aborted":
        raise aborted()
    if reason is None:  # the stream was read to its end, so it always has a reason
        raise APIError(500, "the generation ended without a finish reason", type="server_error")
    return reason


async def first_token(stream: TokenStream) -> Token | None:
    """The stream's first token; request errors (context length, overload) surface here."""
    tok = await anext(stream, None)
    if tok is None:
        finish_reason(stream.finish_reason)  # an empty stream ends only by abort
    return tok


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def reasoning_effort(effort: object, param: str = "reasoning_effort") -> Thinking | None:
    """OpenAI's `reasoning_effort` as the SDK's `thinking`: "none" turns thinking off, any other
    effort on (the chat template's `enable_thinking`; a model without the knob refuses either)."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"{param} must be one of {', '.join(REASONING_EFFORTS)}", param=param)
    return Thinking(enabled=effort != "none")


TEMPLATE_EFFORTS = ("low", "medium", "high")


def effort_for(
    effort: object, engine: Engine, template_kwargs: Mapping[str, Any] | None, param: str = "reasoning_effort"
) -> tuple[Thinking | None, Mapping[str, Any] | None]:
    """A request's effort as the SDK's `thinking` and the template's variables: on a reasoning model
    whose template reads `reasoning_effort` itself (gpt-oss's: `Reasoning: low`), the effort goes to
    the template, as vLLM and llama-server give it (low / medium / high; any other is a 400 naming
    `param`, and so is a `chat_template_kwargs.reasoning_effort` that says otherwise); elsewhere it
    turns thinking on or off (`reasoning_effort`)."""
    fmt = engine.reasoning_format
    if effort is None or fmt is None or re.search(r"\breasoning_effort\b", engine.chat_template) is None:
        return reasoning_effort(effort, param), template_kwargs
    if effort not in TEMPLATE_EFFORTS:
        raise APIError(400, f"{param}: this model's chat template takes {', '.join(TEMPLATE_EFFORTS)}", param=param)
    given = (template_kwargs or {}).get("reasoning_effort", effort)
    if given != effort:
        raise APIError(400, f"{param}: chat_template_kwargs.reasoning_effort says otherwise", param=param)
    return None, {**(template_kwargs or {}), "reasoning_effort": effort}


REASONING_BUDGET_FIELDS = ("reasoning_budget_tokens", "thinking_token_budget")
"""A request's reasoning budget, by its peers' names: llama-server's and vLLM's (the same number)."""


def reasoning_budget(fields: Mapping[str, object]) -> tuple[str, int | None] | None:
    """The reasoning budget a request gives (`fields`: its `REASONING_BUDGET_FIELDS` by name), as
    (the field that gave it, its tokens): None where it gives none. -1 is "the server's default"
    (llama-server's meaning: its `--reasoning-budget`), so its tokens are None. Wrong types,
    numbers below -1 or above 2**30, and both fields with different numbers are 400s naming the field."""
    given: tuple[str, int | None] | None = None
    for name in REASONING_BUDGET_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= MAX_REASONING_BUDGET:
            raise APIError(
                400, f"{name} must be an integer from -1 (the server's default) to 2**30, got {value!r}", param=name
            )
        tokens = None if value == -1 else value
        if given is not None and given[1] != tokens:
            raise APIError(400, f"{name} says otherwise than {given[0]}", param=name)
        given = given or (name, tokens)
    return given


def request_thinking(
    thinking: Thinking | None,
    budget: tuple[str, int | None] | None,
    default_budget: int,
    engine: Engine,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Thinking | None:
    """The SDK's `thinking` for one request: what it asks (`thinking`: from its effort, or Anthropic's
    `thinking`; `budget`: `reasoning_budget`'s) over the server's `--reasoning-budget` (`default_budget`:
    -1 unbounded, 0 thinking off, N tokens), which fills in only what the request leaves unsaid: a
    request that turns thinking on (an effort, the template's knob in `chat_template_kwargs`) is not
    turned off by a default of 0, and one that turns it off gets no budget. A model that does not
    reason ignores the default (there is nothing to bound) and refuses a request's budget (the SDK,
    naming `thinking`: the caller names the field); so does a model whose thought the engine cannot
    gate (`ReasoningFormat.tags_are_tokens` False). On Harmony (gpt-oss) a default of 0 closes the thought
    at once (its template has no knob): the engine writes the final channel's header after it."""
    if budget is not None and budget[1] is not None:
        name, tokens = budget
        try:
            return Thinking(enabled=thinking.enabled if thinking is not None else None, budget=tokens)
        except InvalidRequestError:  # only a budget with thinking turned off
            raise APIError(400, f"{name}: a reasoning budget needs thinking on", param=name) from None
    fmt = engine.reasoning_format
    if fmt is None or default_budget < 0 or (thinking is not None and thinking.budget is not None):
        return thinking
    if not fmt.tags_are_tokens:  # a thought the engine cannot gate: the default cannot bound it
        return thinking
    enabled = thinking.enabled if thinking is not None else None
    knob = (template_kwargs or {}).get(fmt.thinking_knob)
    if enabled is False or knob is False:
        return thinking
    if default_budget > 0:
        return Thinking(enabled=enabled, budget=default_budget)
    if enabled or knob is not None:  # the request turned thinking on: a default of 0 does not turn it off
        return thinking
    # 0: thinking off (llama-server's `--reasoning-budget 0`): through the template's knob where it has
    # one, else a thought closed at once (a template that always opens one, without a knob)
    return Thinking(enabled=False) if fmt.has_knob(engine.chat_template) else Thinking(budget=0)


def chat_refusal(exc: InvalidRequestError, conversation: str, *, thinking: str | None = None) -> APIError:
    """The 400 of a chat the SDK refused (chat completions, Responses), naming the field it is about
    where the error names none: `tool_choice`, `tools`, or the conversation's field (`conversation`:
    "messages", "input"), which a past tool call in it (aiobasert.tools' render: "tool call ...") is too."""
    err = api_error(exc)
    if err.body.error.param is not None:
        return err
    message = str(exc)
    if message.startswith("thinking") and thinking is not None:  # the SDK's `thinking`: the request's field for it
        return APIError(400, message, param=thinking)
    for field in ("chat_template_kwargs", "continue_final_message"):
        if message.startswith(field):
            return APIError(400, message, param=field)
    if "tool_choice" in message:
        param: str | None = "tool_choice"
    elif message.startswith("tool call"):
        param = conversation
    elif "tool" in message:
        param = "tools"
    else:
        param = conversation if "message" in message or conversation == "input" else None
    return APIError(400, message, param=param)
