"""No silently ignored field: every request field in aiobasert.server.compat is
sent with its `ok` example (200) and its `bad` example (400 naming it); a served
field's `ok` example changes what the engine is asked for or the reply (a 200
alone is not "honoured"); the table lists exactly the request structs' fields, and
docs/openai-compat.md carries the table rendered from it."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import msgspec
import openai
import pytest
from loopback import REPO
from openai import OpenAI

from aiobasert.server.compat import _UNSET, FIELDS, render_table
from aiobasert.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from aiobasert.server.responses import ResponsesRequest

BASE: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/embeddings": {"model": "tiny", "input": "Hi"},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 2},
}
# what a field needs besides itself
NEEDS: dict[str, dict[str, Any]] = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}}
STRUCTS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
}
CASES = [(e, f.name, f.ok, f.bad) for e, fields in FIELDS.items() for f in fields]


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"model_name": "tiny", "max_batch_size": 4}  # without an API key: the rows send none


def test_the_table_lists_exactly_the_request_fields() -> None:
    for endpoint, struct in STRUCTS.items():
        declared = {f.name for f in msgspec.structs.fields(struct)}
        assert {f.name for f in FIELDS[endpoint]} == declared, endpoint


def test_readme_carries_the_table() -> None:
    assert render_table() in (REPO / "docs" / "openai-compat.md").read_text(), "run: python -m aiobasert.server.compat"


@pytest.mark.parametrize(("endpoint", "name", "ok", "bad"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_field_is_honoured_or_refused_by_name(base_url: str, endpoint: str, name: str, ok: Any, bad: Any) -> None:
    assert ok is not _UNSET or bad is not _UNSET, f"{endpoint} {name}: no tested value"
    with httpx.Client(base_url=base_url, timeout=60) as http:
        if ok is not _UNSET and ok is not None:
            body = {**BASE[endpoint], **NEEDS.get(name, {}), name: ok}
            r = http.post(endpoint, json=body)
            assert r.status_code == 200, r.text
        if bad is not _UNSET:
            body = {**BASE[endpoint], **NEEDS.get(name, {}), name: bad}
            r = http.post(endpoint, json=body)
            assert r.status_code in (400, 404), r.text
            assert r.json()["error"]["param"] == name, r.text


# what a field needs, besides itself, to have an effect to observe (tool_choice and
# parallel_tool_calls act on tools)
_TOOLS: dict[str, Any] = {"tools": [{"type": "function", "function": {"name": "f"}}]}
_RESPONSES_TOOLS: dict[str, Any] = {"tools": [{"type": "function", "name": "f"}]}
EFFECT_NEEDS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/chat/completions", "tool_choice"): _TOOLS,
    ("/v1/chat/completions", "parallel_tool_calls"): _TOOLS,
    ("/v1/responses", "tool_choice"): _RESPONSES_TOOLS,
    ("/v1/responses", "parallel_tool_calls"): _RESPONSES_TOOLS,
}
# greedy, so two runs of the same request answer the same and a difference is the field's
GREEDY = {
    "/v1/completions": {"temperature": 0},
    "/v1/chat/completions": {"temperature": 0},
    "/v1/responses": {"temperature": 0},
    "/v1/embeddings": {},
}
SERVED = [
    (e, f.name, f.ok)
    for e, fields in FIELDS.items()
    for f in fields
    if f.status in ("honoured", "alias", "extension") and f.ok is not _UNSET and f.ok is not None
]
# ids, times, and the prefix cache's hits (the second of two requests finds the first's prompt)
_VOLATILE = re.compile(
    r'"(id|created|created_at|call_id|item_id|response_id|system_fingerprint|cached_tokens)":\s*("[^"]*"|[\d.]+)'
)


def _served(http: httpx.Client, endpoint: str, body: dict[str, Any], asked: list[Any]) -> tuple[Any, ...]:
    """What the engine was asked for and the reply (less its ids and times) to one request."""
    del asked[:]
    r = http.post(endpoint, json=body)
    assert r.status_code == 200, r.text
    return (list(asked), r.headers["content-type"], _VOLATILE.sub(r'"\1":"_"', r.text))


@pytest.mark.parametrize(("endpoint", "name", "ok"), SERVED, ids=[f"{c[0]}:{c[1]}" for c in SERVED])
def test_each_served_field_changes_what_is_served(
    base_url: str, endpoint: str, name: str, ok: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 200 is not enough: the same request without the field asks the engine for
    something else or is answered otherwise (`model` and a logged `user` show elsewhere)."""
    from aiobasert import Engine

    asked: list[Any] = []
    new_stream, embed = Engine._new_stream, Engine.embed

    def recorded(self: Engine, *args: Any, **kwargs: Any) -> Any:
        asked.append((args, kwargs))
        return new_stream(self, *args, **kwargs)

    async def recorded_embed(self: Engine, text: Any) -> Any:
        asked.append(text)
        return await embed(self, text)

    monkeypatch.setattr(Engine, "_new_stream", recorded)
    monkeypatch.setattr(Engine, "embed", recorded_embed)
    base = {**BASE[endpoint], **GREEDY[endpoint], **NEEDS.get(name, {}), **EFFECT_NEEDS.get((endpoint, name), {})}
    with httpx.Client(base_url=base_url, timeout=60) as http, caplog.at_level("INFO", "aiobasert.server"):
        without = _served(http, endpoint, base, asked)
        with_field = _served(http, endpoint, {**base, name: ok}, asked)
        if name == "model":  # the single-model server resolves any name to its model, named in the reply
            assert with_field == without and json.loads(with_field[2])["model"] == "tiny"
        elif name == "user" and endpoint != "/v1/responses":  # logged with the request id (Responses: echoed)
            assert with_field == without and repr(ok) in caplog.text, caplog.text
        else:
            assert with_field != without, f"{endpoint} {name}={ok!r} served the same as without it"


@pytest.mark.parametrize("endpoint", list(BASE))
def test_unknown_fields_are_refused(base_url: str, endpoint: str) -> None:
    r = httpx.post(f"{base_url}{endpoint}", json={**BASE[endpoint], "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"


# ---- what real clients send ----------------------------------------------------------------


def test_the_agents_sdk_default_responses_call(base_url: str) -> None:
    """openai-agents' OpenAIResponsesModel (the Agents SDK's default model) always sends
    `include` (a list built from its tools and settings: `[]` by default) and `tools`
    (`[]` without tools); `include` asking for something is refused by name."""
    with OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        # greedy: a sampled token of the tiny random model may be an end marker (a "completed" reply: CI
        # saw one in ~thousands), which says nothing about the fields this test is about
        r = client.responses.create(
            model="tiny",
            input=[{"content": "Hi", "role": "user"}],
            include=[],
            tools=[],
            max_output_tokens=2,
            temperature=0,
        )
        assert r.status == "incomplete" and r.usage is not None and r.usage.output_tokens == 2
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny", input="Hi", include=["reasoning.encrypted_content"])
        assert info.value.param == "include"


def test_autogen_participant_names(base_url: str) -> None:
    """autogen-ext's OpenAIChatCompletionClient names every user turn by its source
    (`user_message_to_oai`: `name=message.source`) and assistant turns likewise."""
    messages = [
        {"content": "You are a helpful AI assistant.", "role": "system"},
        {"content": "Hi", "role": "user", "name": "user"},
        {"content": "Hello!", "role": "assistant", "name": "assistant"},
        {"content": "Bye", "role": "user", "name": "user"},
    ]
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_message_from_the_stream_helper_replays(base_url: str) -> None:
    """The openai SDK's `chat.completions.stream()` helper builds its final message from
    the deltas: it keeps `refusal: null` and each call's `index`, and sending that
    message back (the usual tool loop) sends them too."""
    sent: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    tools: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"tz": {"enum": ["UTC", "CET"]}},
                    "required": ["tz"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": "Call f."}]
    http = httpx.Client(event_hooks={"request": [record]})
    with OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, http_client=http) as client:
        with client.chat.completions.stream(
            model="tiny",
            messages=messages,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=150,
            seed=4,
        ) as stream:
            final = stream.get_final_completion()
        message = final.choices[0].message
        (call,) = message.tool_calls or []
        messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "1"}]
        r = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "tool_calls", "stop")
    replayed = sent[-1]["messages"][1]
    # what the helper sends
    assert replayed["refusal"] is None and "annotations" in replayed and "parsed" in replayed
    assert replayed["tool_calls"][0]["index"] == 0 and "parsed_arguments" in replayed["tool_calls"][0]["function"]


def test_cache_control_parts(base_url: str) -> None:
    """Anthropic-style prompt caching marks on text parts, as gateways (LiteLLM,
    OpenRouter) pass them to OpenAI-compatible servers: a hint, the prefix cache is
    automatic here. Other part types are still refused by name."""
    part = {"type": "text", "text": "A long shared system prompt.", "cache_control": {"type": "ephemeral"}}
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": [part]}, {"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    }
    assert httpx.post(f"{base_url}/v1/chat/completions", json=body).status_code == 200
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    body["messages"] = [{"role": "user", "content": [image]}]
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
