"""Every request field the server knows, what it does with it, and the docs
table built from that (no silently ignored field).

The policy. A field is honoured exactly, or refused with a 400 whose `param`
names it; a 200 never means a request was silently served less than it asked:

- an OpenAI field this server does not implement is accepted when its value
  asks for nothing (null, `[]`, false, its default: e.g. `include: []`, which
  the Agents SDK always sends, or `store: false`) and refused otherwise;
- a field that is only a hint about how to serve (`cache_control` on a content
  part, a replayed `tool_calls[].index`) is accepted and ignored, and the
  table says so;
- a field nobody defined is refused by name (`forbid_unknown_fields`). vLLM
  accepts and ignores such fields with a logged warning; here an unknown
  field may be another server's instruction (`guided_json`, `chat_template`),
  and ignoring it would answer 200 to a request not served as asked.
tests/server/test_server_compat.py sends every `ok` example (expecting 200, and for
a served field a different engine request or reply than without it) and every
`bad` example (expecting 400 naming the field), checks the table lists exactly
the request structs' fields, and that docs/openai-compat.md carries `render_table()`:

    python -m aiobasert.server.compat      # rewrite the tables in docs/openai-compat.md, docs/anthropic-compat.md

Anthropic's Messages API has its table too (`ANTHROPIC_FIELDS`): the same policy, its 400s in
Anthropic's error shape with the field named in the message.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import APIError

_UNSET: Any = object()


@dataclass(frozen=True)
class Field:
    name: str
    status: str
    """"honoured", "alias", "extension", "partial" or "refused"."""
    note: str
    ok: Any = _UNSET
    """A value that is served (200)."""
    bad: Any = _UNSET
    """A value that is refused (400 naming the field)."""
    allowed: tuple[Any, ...] = field(default=(None,))
    """Values of a refused field that ask for nothing and are accepted."""


_COMMON = [
    Field("model", "honoured", "resolved by the server's engine provider; the reply names the served model", ok="x"),
    Field("max_tokens", "honoured", "", ok=3, bad=0),
    Field("temperature", "honoured", "default 1", ok=0.5, bad=-1),
    Field("top_p", "honoured", "", ok=0.9, bad=0),
    Field("top_k", "extension", "keep the k most likely tokens", ok=5, bad=-1),
    Field("min_p", "extension", "drop tokens below min_p × p(top)", ok=0.1, bad=2),
    Field(
        "speculation",
        "extension",
        "false opts this request out of speculative decoding where the server runs it (docs/speculative.md); "
        "the tokens are the same either way",
        ok=False,
        bad="x",
    ),
    Field("stop", "honoured", "string or up to 16 strings", ok=["\n\n"], bad=[""]),
    Field("seed", "honoured", "same seed, same tokens, whatever else is batched", ok=7, bad=-1),
    Field("logit_bias", "honoured", "token id → bias in [-100, 100]", ok={"5": 1.0}, bad={"x": 1}),
    Field("presence_penalty", "honoured", "", ok=0.5, bad=5),
    Field("frequency_penalty", "honoured", "", ok=0.5, bad=5),
    Field(
        "n",
        "honoured",
        "1..16 choices, the prompt prefilled once (prefix cache), each its own seed stream",
        ok=2,
        bad=0,
    ),
    Field("stream", "honoured", "server-sent events", ok=True),
    Field("stream_options", "honoured", "include_usage", ok={"include_usage": True}),
    Field("user", "honoured", "logged with the request id", ok="u1"),
    Field(
        "structured_outputs",
        "extension",
        "vLLM's: exactly one of `json` (a schema, or its JSON text), `regex`, `choice`, `grammar` (Lark or GBNF), "
        "`json_object`; grammar-enforced, errors name this field",
        ok={"choice": ["yes", "no"]},
        bad={"regex": "(unclosed"},
    ),
    Field(
        "grammar",
        "extension",
        "llama.cpp's GBNF (converted to Lark; Lark is read too); a GBNF that cannot be converted is refused",
        ok='root ::= "yes" | "no"',
        bad="root ::= (",
    ),
]

FIELDS: dict[str, list[Field]] = {
    "/v1/completions": [
        Field("prompt", "honoured", "text, token ids, or a batch of either (one choice each)", ok=["a", "b"], bad=5),
        *_COMMON,
        Field("logprobs", "honoured", "0..20 alternatives", ok=2, bad=21),
        Field("echo", "refused", "", bad=True, allowed=(None, False)),
        Field("suffix", "refused", "", bad="x"),
        Field("best_of", "refused", "only 1", bad=2, allowed=(None, 1)),
    ],
    "/v1/chat/completions": [
        Field(
            "messages",
            "honoured",
            "system/developer/user/assistant(+tool_calls)/tool; text parts. `name`: "
            "given to the chat template (rendered only where it mentions it); `refusal`: an assistant turn's "
            "text; ignored (replayed or hints): `cache_control` on parts, `annotations`, `parsed`, "
            "`tool_calls[].index`, `function.parsed_arguments`; `audio`/`function_call`: null only",
            ok=None,
        ),
        *_COMMON,
        Field("max_completion_tokens", "alias", "of max_tokens (wins when both are given)", ok=3, bad=0),
        Field("logprobs", "honoured", "", ok=True),
        Field("top_logprobs", "honoured", "0..20, needs logprobs", ok=2, bad=21),
        Field(
            "response_format",
            "honoured",
            "text, json_object (an object), json_schema (grammar-enforced)",
            ok={"type": "json_object"},
            bad={"type": "xml"},
        ),
        Field(
            "tools",
            "honoured",
            "function tools, arguments grammar-enforced against their schema",
            ok=[{"type": "function", "function": {"name": "f"}}],
            bad=[{"type": "retrieval"}],
        ),
        Field(
            "tool_choice",
            "honoured",
            "auto, none, required, or a named function (called exactly once)",
            ok="none",
            bad="sometimes",
        ),
        Field("parallel_tool_calls", "honoured", "false: at most one call", ok=False),
        Field("audio", "refused", "", bad={"voice": "x"}),
        Field("function_call", "refused", "deprecated: use tool_choice", bad="auto"),
        Field("functions", "refused", "deprecated: use tools", bad=[{"name": "f"}]),
        Field("modalities", "refused", 'only ["text"]', bad=["audio"], allowed=(None, ["text"])),
        Field("prediction", "refused", "", bad={"type": "content", "content": "x"}),
        Field(
            "reasoning_effort",
            "honoured",
            "reasoning models (docs/reasoning.md): none = the template's `enable_thinking` off, any other on; "
            "400 where the template has no such knob; a template that reads `reasoning_effort` (gpt-oss) gets "
            "low / medium / high",
            bad="extreme",
        ),
        Field(
            "reasoning_budget_tokens",
            "extension",
            "llama-server's: the most tokens the thought may take, then the engine closes it and the answer "
            "follows (docs/reasoning.md); -1 = the server's `--reasoning-budget`; 400 on a model that does not reason",
            bad=-2,
        ),
        Field("thinking_token_budget", "alias", "vLLM's name of `reasoning_budget_tokens`", bad="many"),
        Field(
            "add_generation_prompt",
            "extension",
            "vLLM's: false renders the conversation without opening the assistant's turn",
            ok=False,
            bad="no",
        ),
        Field(
            "continue_final_message",
            "extension",
            "vLLM's: the final assistant message is continued (a prefill; with add_generation_prompt false), "
            "the reply holds what follows it",
            bad="yes",
        ),
        Field(
            "chat_template_kwargs",
            "extension",
            "variables for the chat template (`enable_thinking`, ...); one the template does not read is a 400",
            bad={"no_such_knob": True},
        ),
        Field(
            "service_tier", "refused", "one tier: auto/default accepted", bad="flex", allowed=(None, "auto", "default")
        ),
        Field("store", "refused", "nothing is stored: false accepted", bad=True, allowed=(None, False)),
        Field("metadata", "refused", "only with store", bad={"k": "v"}),
        Field("web_search_options", "refused", "", bad={}),
        Field("prompt_cache_key", "refused", "the prefix cache is automatic", bad="k"),
        Field("safety_identifier", "refused", "", bad="s"),
        Field("verbosity", "refused", "", bad="low"),
    ],
    "/v1/embeddings": [
        Field("input", "honoured", "text, texts, token ids, or lists of token ids", ok=[[5, 6, 7]], bad=[]),
        Field("model", "honoured", "resolved by the server's engine provider", ok="x"),
        Field("encoding_format", "honoured", "float or base64", ok="base64", bad="int8"),
        Field("dimensions", "partial", "only the model's own width", bad=3),
        Field("user", "honoured", "logged with the request id", ok="u1"),
    ],
    "/v1/responses": [
        Field("model", "honoured", "resolved by the server's engine provider", ok="x"),
        Field(
            "input",
            "honoured",
            "text, or message / function_call / function_call_output items; a call's "
            "`output` is text or a list of `input_text` parts (joined with newlines; image and file parts are "
            "refused naming the part)",
            ok="hi",
            bad=[{"type": "image"}],
        ),
        Field("instructions", "honoured", "a system turn; not carried to the next turn (as OpenAI)", ok="Be brief."),
        Field(
            "previous_response_id",
            "honoured",
            "bounded TTL store; the previous turn's KV is reused",
            bad="resp_unknown",
        ),
        Field(
            "tools",
            "honoured",
            "function tools only",
            ok=[{"type": "function", "name": "f"}],
            bad=[{"type": "web_search"}],
        ),
        Field(
            "tool_choice",
            "honoured",
            "auto, none, required, or a named function (called exactly once)",
            ok="none",
            bad="required",
        ),
        Field("parallel_tool_calls", "honoured", "false: at most one call", ok=False),
        Field("max_output_tokens", "honoured", "", ok=3, bad=0),
        Field("temperature", "honoured", "default 1", ok=0.5, bad=-1),
        Field("top_p", "honoured", "", ok=0.9, bad=0),
        Field(
            "logit_bias",
            "extension",
            "token id → bias in [-100, 100], as chat completions'",
            ok={"5": 1.0},
            bad={"x": 1},
        ),
        Field("stream", "honoured", "the Responses event stream", ok=True),
        Field("store", "honoured", "false: not continuable", ok=False),
        Field("metadata", "honoured", "echoed on the response", ok={"k": "v"}),
        Field("user", "honoured", "echoed on the response", ok="u1"),
        Field(
            "text",
            "honoured",
            "format text / json_object / json_schema",
            ok={"format": {"type": "text"}},
            bad={"format": {"type": "xml"}},
        ),
        Field("truncation", "partial", "only disabled", ok="disabled", bad="auto"),
        Field(
            "include",
            "refused",
            "nothing extra to include: [] accepted",
            bad=["reasoning.encrypted_content"],
            allowed=(None, []),
        ),
        Field(
            "reasoning",
            "partial",
            "reasoning models (docs/reasoning.md): `effort` none = the template's `enable_thinking` off, any other "
            "on (400 where the template has no such knob); `summary` accepted, none generated; a model that "
            "does not reason refuses it",
            bad={"summary": "verbose"},
        ),
        Field("background", "refused", "false accepted", bad=True, allowed=(None, False)),
        Field("conversation", "refused", "use previous_response_id", bad="conv_1"),
        Field("prompt", "refused", "no stored prompts", bad={"id": "pmpt_1"}),
        Field("max_tool_calls", "refused", "", bad=2),
        Field(
            "service_tier", "refused", "one tier: auto/default accepted", bad="flex", allowed=(None, "auto", "default")
        ),
        Field("prompt_cache_key", "refused", "the prefix cache is automatic", bad="k"),
        Field("safety_identifier", "refused", "", bad="s"),
    ],
}


_TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
_CONVERSATION = [
    Field(
        "model",
        "honoured",
        "required; resolved by the server's engine provider, the reply names the served model",
        ok="x",
    ),
    Field(
        "messages",
        "honoured",
        "user/assistant turns of text, `tool_use` (assistant), `tool_result` (user: text or text blocks; "
        '`is_error` renders as "Error: ...") and `thinking` / `redacted_thinking` blocks (dropped from the '
        "prompt); `image` (and any other block) refused naming the block; a final assistant turn of text is "
        "continued (a prefill: the reply is what follows it; trailing whitespace, a `tool_use` in it or "
        "thinking enabled refused, as Anthropic); `cache_control` and `citations` accepted and ignored (hints)",
        ok=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        bad=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
    ),
    Field(
        "system",
        "honoured",
        "a string or text blocks: a system turn",
        ok="Be brief.",
        bad=[{"type": "image", "source": {}}],
    ),
    Field(
        "tools",
        "honoured",
        "client tools (`input_schema` grammar-enforced); server tools (`bash_...`, `web_search_...`) refused",
        ok=[_TOOL],
        bad=[{"type": "web_search_20250305", "name": "web_search"}],
    ),
    Field(
        "tool_choice",
        "honoured",
        "auto, any (a call is required), tool (that one, exactly once), none; `disable_parallel_tool_use`",
        ok={"type": "none"},
        bad={"type": "sometimes"},
    ),
    Field(
        "thinking",
        "honoured",
        "`enabled` with `budget_tokens` (the engine closes the thought after that many tokens) on a reasoning "
        "model, a `thinking` block before the text (`thinking_delta` streamed; `signature` empty); "
        "`disabled` writes an empty thought into the prompt (on a model without `enable_thinking`, gpt-oss's or "
        "DeepSeek-R1's, `enabled` is the budget alone and `disabled` closes the thought at once); `enabled` on a "
        "model that does not reason refused",
        ok={"type": "disabled"},
        bad={"type": "enabled", "budget_tokens": 1024},
    ),
    Field(
        "mcp_servers",
        "refused",
        "[] accepted",
        bad=[{"type": "url", "url": "http://x", "name": "x"}],
        allowed=(None, []),
    ),
    Field("context_management", "refused", "", bad={"edits": []}),
    Field("container", "refused", "", bad="c1"),
]

ANTHROPIC_FIELDS: dict[str, list[Field]] = {
    "/v1/messages": [
        *_CONVERSATION,
        Field("max_tokens", "honoured", "required, as Anthropic's", ok=3, bad=0),
        Field(
            "stop_sequences",
            "honoured",
            "up to 16; `stop_reason: stop_sequence` and `stop_sequence` name the one that matched",
            ok=["\n\n"],
            bad=[""],
        ),
        Field(
            "stream",
            "honoured",
            "Anthropic's events: message_start, ping, content_block_*, message_delta, "
            "message_stop; `error` events in-band",
            ok=True,
        ),
        Field("temperature", "honoured", "default 1", ok=0.5, bad=-1),
        Field("top_p", "honoured", "", ok=0.9, bad=0),
        Field("top_k", "honoured", "", ok=5, bad=-1),
        Field("metadata", "honoured", "`user_id` logged with the request id", ok={"user_id": "u1"}),
        Field(
            "output_config",
            "partial",
            "`format` (json_schema: grammar-enforced, not with tools); `effort` refused (no reasoning models yet)",
            ok={"format": {"type": "json_schema", "schema": {"type": "integer"}}},
            bad={"effort": "high"},
        ),
        Field(
            "cache_control",
            "partial",
            "accepted: the engine's prefix cache is automatic (`cache_read_input_tokens` reports its hits)",
            ok={"type": "ephemeral"},
        ),
        Field(
            "service_tier",
            "refused",
            "one tier: auto/standard_only accepted",
            bad="priority",
            allowed=(None, "auto", "standard_only"),
        ),
    ],
    "/v1/messages/count_tokens": _CONVERSATION,
}
"""The Messages API's fields (docs/anthropic-compat.md; tests/server/test_server_anthropic.py)."""


def check_refused(endpoint: str, request: Any) -> None:
    """Raise a 400 naming the first refused field `request` sets to something it asks for."""
    for f in FIELDS[endpoint] if endpoint in FIELDS else ANTHROPIC_FIELDS[endpoint]:
        if f.status != "refused":
            continue
        value = getattr(request, f.name, None)
        if value not in f.allowed:
            why = f": {f.note}" if f.note else ""
            raise APIError(400, f"{f.name} is not supported by this server{why}", param=f.name)


_STATUS = {"honoured": "✓", "alias": "✓ alias", "extension": "✓ extension", "partial": "partial", "refused": "400"}
BEGIN = "<!-- compat-table:begin (generated by aiobasert/server/compat.py; checked by tests) -->"
END = "<!-- compat-table:end -->"


def render_table(table: dict[str, list[Field]] = FIELDS) -> str:
    """`table`'s rows as the docs' markdown table (FIELDS: docs/openai-compat.md; ANTHROPIC_FIELDS:
    docs/anthropic-compat.md)."""
    lines = [BEGIN, "", "| endpoint | field | | notes |", "|---|---|---|---|"]
    for endpoint, fields in table.items():
        for f in fields:
            lines.append(f"| `{endpoint}` | `{f.name}` | {_STATUS[f.status]} | {f.note} |")
    lines += ["| any | any other field | 400 | the error's `param` names it |", "", END]
    return "\n".join(lines)


def update_readme(path: Path, table: dict[str, list[Field]] = FIELDS) -> bool:
    """Rewrite the table section of `path`; True if it changed."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render_table(table) + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    docs = Path(__file__).resolve().parents[2] / "docs"
    for readme, table in ((docs / "openai-compat.md", FIELDS), (docs / "anthropic-compat.md", ANTHROPIC_FIELDS)):
        changed = update_readme(readme, table)
        sys.stdout.write(f"{readme}: {'updated' if changed else 'up to date'}\n")
