"""Anthropic's Messages API (issue 35 item 6): `/v1/messages` and `/v1/messages/count_tokens` with the
official `anthropic` SDK (sync, async, `messages.stream`, a tool-use round trip, stop sequences,
errors in Anthropic's shape) and LangChain's ChatAnthropic on it; every field of the table in
aiobasert.server.compat honoured or refused by name, and docs/anthropic-compat.md carrying it."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema  # type: ignore[import-untyped]
import msgspec
import pytest
from loopback import API_KEY, MODEL_NAME, REPO, serving

from aiobasert import Engine, Thinking
from aiobasert.server import create_app
from aiobasert.server.anthropic import CountTokensRequest, MessagesRequest
from aiobasert.server.compat import _UNSET, ANTHROPIC_FIELDS, render_table

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}}},
]
# anthropic 2.x sends no sampling fields of its own (newer Claude models take none): sent as extra fields,
# as older SDKs and Claude Code send them
GREEDY = {"temperature": 0}
ASK: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(base_url: str) -> Any:
    """The official anthropic client on `base_url` (its key sent as `x-api-key`; no retries)."""
    with anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ---- the SDK ---------------------------------------------------------------------------------


def test_a_message_sync(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL_NAME, max_tokens=12, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL_NAME
    assert message.id.startswith("msg_") and message.stop_reason in ("end_turn", "max_tokens")
    assert message.content and message.content[0].type == "text"
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    count = claude.messages.count_tokens(
        model=MODEL_NAME, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert count.input_tokens == prompt > 0
    assert 0 < message.usage.output_tokens <= 12


def test_a_message_async(base_url: str) -> None:
    async def main() -> list[str]:
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key=API_KEY, max_retries=0) as c:
            replies = await asyncio.gather(
                *(c.messages.create(model=MODEL_NAME, max_tokens=10, messages=ASK, extra_body=GREEDY) for _ in range(3))
            )
            return [_text(r) for r in replies]

    texts = asyncio.run(main())
    assert len(set(texts)) == 1 and texts[0]  # greedy: the same answer, batched together


def test_messages_stream_equals_the_whole_message(claude: anthropic.Anthropic, base_url: str) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=16, extra_body=GREEDY, messages=ASK)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    )
    # the event sequence, as Anthropic sends it
    with httpx.stream(
        "POST",
        f"{base_url}/v1/messages",
        json={**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True},
        headers={"x-api-key": API_KEY},
    ) as r:
        kinds = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[2] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[3:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip(claude: anthropic.Anthropic, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=120, extra_body=GREEDY, tools=TOOLS)
    forced = {"type": "tool", "name": "get_weather"}
    if stream:
        with claude.messages.stream(messages=ASK, tool_choice=forced, **kw) as s:
            deltas = [e for e in s if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
            first = s.get_final_message()
        assert deltas  # the arguments streamed as input_json_delta
    else:
        first = claude.messages.create(messages=ASK, tool_choice=forced, **kw)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    turns: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]},
    ]
    answer = claude.messages.create(messages=turns, tool_choice={"type": "none"}, **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens") and _text(answer)
    assert not [b for b in answer.content if b.type == "tool_use"]
    before = claude.messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=TOOLS).input_tokens
    after = claude.messages.count_tokens(model=MODEL_NAME, messages=turns, tools=TOOLS).input_tokens
    assert after > before  # the call and its result are in the prompt
    # `any` requires a call (one of them), disable_parallel_tool_use: one at most
    required = claude.messages.create(
        messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw
    )
    assert required.stop_reason == "tool_use" and len([b for b in required.content if b.type == "tool_use"]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(claude: anthropic.Anthropic, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=24, extra_body=GREEDY, messages=ASK)
    text = _text(claude.messages.create(**kw))
    assert len(text) >= 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stream:
        with claude.messages.stream(stop_sequences=["\x00never", stop], **kw) as s:
            streamed = "".join(s.text_stream)
            message = s.get_final_message()
        assert streamed == _text(message)
    else:
        message = claude.messages.create(stop_sequences=["\x00never", stop], **kw)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == text[: text.index(stop)]
    unmatched = claude.messages.create(stop_sequences=["\x00never"], **kw)
    assert unmatched.stop_reason in ("end_turn", "max_tokens") and unmatched.stop_sequence is None


# ---- errors ----------------------------------------------------------------------------------


def test_a_final_assistant_turn_is_continued(claude: anthropic.Anthropic) -> None:
    # Anthropic's prefill: the reply goes on from the assistant's text (the prompt cut right after it)
    turns: list[Any] = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "In Paris it is"}]}]
    message = claude.messages.create(model=MODEL_NAME, max_tokens=6, messages=turns, extra_body=GREEDY)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    count = claude.messages.count_tokens(model=MODEL_NAME, messages=turns)
    assert count.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    later = claude.messages.count_tokens(model=MODEL_NAME, messages=[*turns, {"role": "user", "content": "ok"}])
    assert count.input_tokens < later.input_tokens
    # refused as Anthropic refuses them, naming the turn
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        claude.messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[*ASK, {"role": "assistant", "content": "It is "}]
        )
    calls = [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "C"}}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]: a final assistant turn with a tool_use"):
        claude.messages.create(model=MODEL_NAME, max_tokens=4, tools=TOOLS,  # type: ignore[arg-type]
                               messages=[*ASK, {"role": "assistant", "content": calls}])  # fmt: skip


@pytest.mark.parametrize("final", ["", [], [{"type": "text", "text": ""}]])
def test_an_empty_final_assistant_turn_is_no_prefill(claude: anthropic.Anthropic, final: Any) -> None:
    # Anthropic takes an empty final assistant turn ("all messages must have non-empty content except
    # for the optional final assistant message"): nothing to continue, the reply is the plain one (it
    # was a 400 naming continue_final_message, a field Anthropic's API does not have)
    kw: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=6, extra_body=GREEDY)
    want = claude.messages.create(messages=ASK, **kw)
    got = claude.messages.create(messages=[*ASK, {"role": "assistant", "content": final}], **kw)

    def prompt(m: Any) -> int:  # prefilled or read from the prefix cache
        return int(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0))

    assert (_text(got), got.stop_reason, prompt(got)) == (_text(want), want.stop_reason, prompt(want))
    count = claude.messages.count_tokens(model=MODEL_NAME, messages=[*ASK, {"role": "assistant", "content": final}])
    assert count.input_tokens == claude.messages.count_tokens(model=MODEL_NAME, messages=ASK).input_tokens


def test_errors_have_anthropics_shape_and_name_the_field(claude: anthropic.Anthropic, base_url: str) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model=MODEL_NAME, messages=ASK, max_tokens=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]: image blocks"):
        claude.messages.create(
            model=MODEL_NAME,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image]}],
        )
    with pytest.raises(anthropic.BadRequestError, match="thinking") as caught:
        claude.messages.create(
            model=MODEL_NAME, max_tokens=2048, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    body: Any = caught.value.body
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and set(body["error"]) == {"type", "message"}
    assert claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK, thinking={"type": "disabled"})
    r = httpx.post(
        f"{base_url}/v1/messages", json={"model": MODEL_NAME, "messages": ASK}, headers={"x-api-key": API_KEY}
    )
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(
        f"{base_url}/v1/messages", json={"model": MODEL_NAME, "max_tokens": 2, "messages": ASK, "frobnicate": 1},
        headers={"Authorization": f"Bearer {API_KEY}", "anthropic-version": "2023-06-01"},
    )  # fmt: skip
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]["message"]


def test_a_bad_key_is_a_401_in_anthropics_shape(base_url: str) -> None:
    with anthropic.Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK)
        assert caught.value.status_code == 401
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.count_tokens(model=MODEL_NAME, messages=ASK)
    # the OpenAI routes take x-api-key too, and answer in their own shape
    r = httpx.post(
        f"{base_url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, headers={"x-api-key": API_KEY}
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{base_url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, headers={"x-api-key": "no"}
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---- a framework on it -----------------------------------------------------------------------


def test_langchain_chat_anthropic(base_url: str) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(  # type: ignore[call-arg]
        model=MODEL_NAME, base_url=base_url, api_key=API_KEY, max_tokens=150, temperature=0, max_retries=0
    )
    whole = llm.invoke("Hello")
    assert isinstance(whole.content, str) and whole.content
    assert "".join(str(c.content) for c in llm.stream("Hello")) == whole.content
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    called = bound.invoke("What's the weather in Paris?")
    (call,) = called.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)


# ---- the field table -------------------------------------------------------------------------

BASE: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]},
}
STRUCTS = {"/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest}
CASES = [(e, f.name, f.ok, f.bad) for e, fields in ANTHROPIC_FIELDS.items() for f in fields]


def test_the_table_lists_exactly_the_request_fields() -> None:
    for endpoint, struct in STRUCTS.items():
        declared = {f.name for f in msgspec.structs.fields(struct)}
        assert {f.name for f in ANTHROPIC_FIELDS[endpoint]} == declared, endpoint


def test_the_docs_carry_the_table() -> None:
    doc = (REPO / "docs" / "anthropic-compat.md").read_text()
    assert render_table(ANTHROPIC_FIELDS) in doc, "run: python -m aiobasert.server.compat"


@pytest.mark.parametrize(("endpoint", "name", "ok", "bad"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_field_is_honoured_or_refused_by_name(base_url: str, endpoint: str, name: str, ok: Any, bad: Any) -> None:
    assert ok is not _UNSET or bad is not _UNSET, f"{endpoint} {name}: no tested value"
    with httpx.Client(base_url=base_url, timeout=60, headers={"x-api-key": API_KEY}) as http:
        if ok is not _UNSET and ok is not None:
            r = http.post(endpoint, json={**BASE[endpoint], name: ok})
            assert r.status_code == 200, r.text
        if bad is not _UNSET:
            r = http.post(endpoint, json={**BASE[endpoint], name: bad})
            assert r.status_code == 400, r.text
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert name in body["error"]["message"], body


def test_the_stream_reports_usage_and_stop_in_message_delta(base_url: str) -> None:
    body = {**BASE["/v1/messages"], "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, headers={"x-api-key": API_KEY}) as r:
        data = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: ")]
    delta = next(d for d in data if d["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] >= 1
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] > 0


# ---- thinking (issue 35 items 1 and 6) -------------------------------------------------------------


def test_thinking_blocks_from_a_reasoning_model(r1_think_model_path: Path) -> None:
    # DeepSeek-R1's template opens the thought in the prompt; `budget_tokens` closes it after that many
    # tokens (the engine writes `</think>`): a `thinking` block, then the text, whole and streamed alike
    # (thinking_delta events, a signature_delta last); `disabled` writes an empty thought into the prompt.
    app = create_app(functools.partial(Engine.open, r1_think_model_path, max_batch_size=2), api_key=API_KEY)
    with serving(app) as url, anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0) as c:
        kw: Any = {"model": "tiny", "max_tokens": 12, "messages": ASK, "extra_body": GREEDY}
        whole = c.messages.create(thinking={"type": "enabled", "budget_tokens": 4}, **kw)
        kinds = [b.type for b in whole.content]
        assert kinds[0] == "thinking" and "text" in kinds, kinds
        thought = whole.content[0]
        assert thought.thinking and "</think>" not in thought.thinking and thought.signature == ""
        with c.messages.stream(thinking={"type": "enabled", "budget_tokens": 4}, **kw) as s:
            events = [e.type for e in s]
            streamed = s.get_final_message()
        assert streamed.content[0].model_dump() == thought.model_dump()
        assert _text(streamed) == _text(whole) and "content_block_delta" in events
        off = c.messages.create(thinking={"type": "disabled"}, **kw)
        assert [b.type for b in off.content] == ["text"]
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            c.messages.create(thinking={"type": "enabled"}, **kw)


def test_the_server_reasoning_budget_bounds_a_request_without_thinking(r1_think_model_path: Path) -> None:
    # `serve --reasoning-budget 3`: a request without `thinking` gets the SDK's Thinking(budget=3) thought;
    # `thinking.budget_tokens` overrides it, `disabled` turns it off
    async def sdk(budget: int) -> str | None:
        async with Engine.open(r1_think_model_path, max_batch_size=1) as engine:
            reply = await engine.stream_chat(ASK, max_tokens=12, temperature=0, thinking=Thinking(budget=budget))
            return reply.reasoning

    bounded, longer = asyncio.run(sdk(3)), asyncio.run(sdk(6))
    assert bounded and longer and bounded != longer
    factory = functools.partial(Engine.open, r1_think_model_path, max_batch_size=1)
    app = create_app(factory, api_key=API_KEY, reasoning_budget=3)
    with serving(app) as url, anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0) as c:
        kw: Any = {"model": "tiny", "max_tokens": 12, "messages": ASK, "extra_body": GREEDY}
        assert c.messages.create(**kw).content[0].thinking == bounded  # type: ignore[union-attr]
        asked = c.messages.create(thinking={"type": "enabled", "budget_tokens": 6}, **kw)
        assert asked.content[0].thinking == longer  # type: ignore[union-attr]
        assert [b.type for b in c.messages.create(thinking={"type": "disabled"}, **kw).content] == ["text"]
