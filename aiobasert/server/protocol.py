"""The wire protocol: OpenAI's request and response bodies as msgspec structs.

No Starlette here: these are plain data. Nullable request fields accept an
explicit `null`, as some clients send for "default".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import msgspec

from ..types import Timing, Usage

MAX_EMBEDDING_INPUTS = 2048

# ---- request bodies ---------------------------------------------------------------------


class SchemaFields(NamedTuple):
    """Where a request body carries JSON Schemas, to name them in errors: the
    output schema's field, and a tool's `parameters` (a format of the tool's index);
    and its conversation's field (a context overflow names it); the field an output
    constraint came from (`structured_outputs`, `grammar`), once the endpoint knows it."""

    output: str
    tool: str
    conversation: str = "messages"
    constraint: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`stream_options`: `include_usage` adds a last chunk with the usage."""

    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`response_format.json_schema`: the output always conforms to `schema`, so
    `strict` changes nothing; `name` and `description` are not used."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`response_format`: `text`, `json_object` (any JSON value) or `json_schema`
    (JSON matching `json_schema.schema`), enforced by constrained decoding."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one of `json` (a JSON Schema, as an object or its JSON
    text), `regex`, `choice`, `grammar` (Lark, or llama.cpp's GBNF) or `json_object: true`,
    enforced by constrained decoding (`SamplingParams.json_schema` / `regex` / `choice` / `grammar`)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """Extension: keep the k most likely tokens (0 = off)."""
    min_p: float | None = None
    """Extension: drop tokens below min_p * p(most likely)."""
    speculation: bool | None = None
    """Extension: false opts this request out of speculative decoding (docs/speculative.md)."""
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    structured_outputs: StructuredOutputs | None = None
    """Extension (vLLM's): the output follows a JSON Schema, regex, choice or grammar."""
    grammar: str | None = None
    """Extension (llama.cpp's): the output follows this GBNF grammar (Lark is read too)."""


class CompletionRequest(SamplingRequest, kw_only=True):
    """`POST /v1/completions` (the legacy text completion API)."""

    prompt: str | list[int | str | list[int]]
    """One prompt (text or token ids) or a batch of them (one choice each, times n)."""
    logprobs: int | None = None
    """Report each token's log-probability and this many most likely alternatives."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served.
    `cache_control` (Anthropic-style, sent through OpenAI-compatible gateways) is a
    caching hint: the prefix cache here is automatic, so it asks for nothing."""

    type: str
    text: str | None = None
    cache_control: dict[str, Any] | None = None


class FunctionCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A called function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tool call in a response message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class RequestFunctionCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A called function in a request's assistant turn. `parsed_arguments` is the openai
    SDK's parsed copy of `arguments` (its `.stream()` / `.parse()` helpers replay it)."""

    name: str
    arguments: str
    parsed_arguments: Any = None


class RequestToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tool call in a request's assistant turn. `index` is the streamed delta's
    position, which the openai SDKs' `.stream()` helpers keep in the final message
    and so replay; it carries nothing the list order does not."""

    id: str
    type: Literal["function"] = "function"
    function: RequestFunctionCall
    index: int | None = None


class RequestMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One chat turn as a client sends it (tool turns and assistant turns with calls included).

    `name` (a participant's name, as AutoGen sends) goes to the chat template, which
    renders it only if it mentions it. An assistant turn replayed from a response
    (the openai SDK's `.stream()` helper sends every field of its final message)
    may carry `refusal` (that turn's text when it has no content), `annotations`
    (citations of that text: nothing to render) and `parsed` (the SDK's parsed copy
    of the content); `audio` and `function_call` must be null (params.py)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[RequestToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    parsed: Any = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None
    """A reasoning model's thought in an assistant turn sent back (vLLM's and DeepSeek's name; `reasoning`
    is the same): given to the chat template, which renders it (Qwen3, for the turns after the last user
    query) or drops it."""
    reasoning: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A function tool: `parameters` is the JSON Schema its arguments obey (always:
    the output grammar enforces it, so `strict` changes nothing)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`tools[i]`: only `{"type": "function", ...}` tools exist."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call exactly this one."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """`POST /v1/chat/completions`."""

    schema_fields: ClassVar[SchemaFields] = SchemaFields(
        "response_format.json_schema.schema", "tools[{}].function.parameters"
    )

    messages: list[RequestMessage]
    max_completion_tokens: int | None = None
    """The newer name of max_tokens; wins when both are given."""
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Known OpenAI fields this server does not serve: any non-default value is a 400 naming it.
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    """"none": thinking off; "minimal" / "low" / "medium" / "high": on (the template's `enable_thinking`)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (vLLM's, llama-server's field): each must be one it reads."""
    reasoning_budget_tokens: Any = None
    """The most tokens the thought may take (llama-server's field; -1: the server's `--reasoning-budget`):
    past it the engine closes the thought and the answer follows (params.reasoning_budget checks it)."""
    thinking_token_budget: Any = None
    """vLLM's name of `reasoning_budget_tokens`."""
    add_generation_prompt: Any = None
    """vLLM's: false renders the conversation without opening the assistant's turn (default true)."""
    continue_final_message: Any = None
    """vLLM's: the final assistant message is continued (a prefill), with add_generation_prompt false."""
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    web_search_options: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    verbosity: Any = None


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/embeddings`: mean-pooled final hidden states, one per input."""

    input: str | list[int | str | list[int]]
    """Text, texts, token ids, or lists of token ids (OpenAIEmbeddings' default)."""
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


# ---- response bodies --------------------------------------------------------------------


class ErrorDetail(msgspec.Struct, kw_only=True):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """The body of every error response, and of a mid-stream error event."""

    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    """Prompt tokens served from the engine's prefix cache."""


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int
    """Completion tokens of a reasoning model's thought, its tags included."""


class UsageInfo(msgspec.Struct, kw_only=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    draft_tokens: int | None = None
    """Extension (speculative decoding, docs/speculative.md): draft tokens verified; absent when none."""
    accepted_draft_tokens: int | None = None
    """Extension: of those, the ones accepted."""
    first_token_steps: int | None = None
    """Extension: engine steps from the request's arrival at the engine to its first token
    (`Timing.first_token_step - Timing.submitted_step`; of several choices or prompts, the latest), the time to
    first token that fair admission bounds, whatever the machine's speed (docs/fairness.md)."""

    @classmethod
    def of(cls, usage: Usage, timings: Sequence[Timing] = ()) -> UsageInfo:
        """`timings`: those of the request's choices (`Completion.timing`), for `first_token_steps`."""
        steps = [t.first_token_step - t.submitted_step for t in timings if t.first_token_step >= 0]
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens),
            first_token_steps=max(steps) if steps else None,
            draft_tokens=usage.draft_tokens or None,
            accepted_draft_tokens=usage.accepted_draft_tokens if usage.draft_tokens else None,
        )


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A text completion, or one chunk of a streamed one (then `usage` is absent)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprobEntry(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprobEntry]


class AssistantMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None
    """A reasoning model's thought (vLLM's, DeepSeek's and llama-server's field); absent without one."""


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A whole chat completion."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of a call: id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(msgspec.Struct, kw_only=True):
    """`GET /v1/models`: the one model this server serves."""

    object: str
    data: list[ModelCard]


class Embedding(msgspec.Struct, kw_only=True):
    object: str
    index: int
    embedding: list[float] | str
    """Floats, or with encoding_format "base64" the little-endian float32 bytes in base64."""


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class HealthStatus(msgspec.Struct, kw_only=True):
    status: str


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /tokenize`: the token ids of `prompt` (marker strings stay text)."""

    prompt: str
    model: str | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /detokenize`: the text of token ids."""

    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionInfo(msgspec.Struct, kw_only=True):
    version: str
