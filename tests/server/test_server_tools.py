"""Tool calling over HTTP: tools / tool_choice / parallel_tool_calls on
/v1/chat/completions with the official openai client (sync and async), stream
and non-stream, on the tiny model; SmolLM2 for a real tool loop (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loopback import API_KEY, MODEL_NAME, serving
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from aiobasert import Engine, InvalidRequestError
from aiobasert.server import create_app

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What's the weather in Paris?"}]
JSON_OBJECT = {"type": "json_object"}


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_call_stream_equals_non_stream(client: OpenAI, seed: int) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=150,
        seed=seed,
        temperature=1.0,
    )
    whole = client.chat.completions.create(**kw)
    (choice,) = whole.choices
    calls = choice.message.tool_calls
    assert calls
    assert choice.message.content is None
    if choice.finish_reason == "tool_calls":
        for c in calls:
            assert c.type == "function" and c.id.startswith("call_")
            valid(c.function.name, c.function.arguments)
    else:
        assert choice.finish_reason == "length"

    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.index not in names:  # id, type and name arrive first
                assert tc.id and tc.type == "function" and tc.function and tc.function.name
                names[tc.index] = tc.function.name
                args[tc.index] = []
            else:
                assert tc.id is None and tc.function is not None and tc.function.name is None
            if tc.function and tc.function.arguments:
                args[tc.index].append(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == choice.finish_reason
    assert [names[i] for i in sorted(names)] == [c.function.name for c in calls]
    assert ["".join(args[i]) for i in sorted(args)] == [c.function.arguments for c in calls]  # byte for byte


@pytest.mark.parametrize("seed", [4, 5])
def test_named_function_and_parallel_false(client: OpenAI, seed: int) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=150,
        seed=seed,
        temperature=1.0,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time"
    valid("get_time", call.function.arguments)


def test_none_and_auto(client: OpenAI) -> None:
    for seed in range(3):
        none = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=24,
            seed=seed,
            temperature=1.0,
        )
        assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
        auto = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=24, seed=seed, temperature=1.0
        )
        msg = auto.choices[0].message
        assert msg.tool_calls or "<tool_call>" not in (msg.content or "")


@pytest.mark.anyio
async def test_full_tool_loop_with_the_async_client(base_url: str) -> None:
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        first = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=150,
            seed=1,
        )
        msg = first.choices[0].message
        (call,) = msg.tool_calls or []
        history: list[ChatCompletionMessageParam] = [
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ]
        answer = await client.chat.completions.create(
            model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, seed=1
        )
        assert answer.choices[0].message.content is not None
        assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [{"type": "retrieval"}]}, "tools", ""),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "duplicate"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tools"),
        # a past call in the history is the messages' fault, not the tools'
        (
            {
                "tools": TOOLS,
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}
                        ],
                    },
                ],
            },
            "messages",
            "messages[1].tool_calls[0]",
        ),
        (
            {
                "tools": TOOLS,
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                            },
                            {"id": "d", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": '}},
                        ],
                    },
                ],
            },
            "messages",
            "messages[1].tool_calls[1]",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_param(
    base_url: str, body: dict[str, Any], param: str, message: str
) -> None:
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


@pytest.mark.parametrize("choice", ["auto", "none", "required", "get_time"])
@pytest.mark.anyio
async def test_a_schema_with_tools_is_refused_alike_by_the_sdk_chat_and_responses(
    base_url: str, tiny_model_path: Path, choice: str
) -> None:
    """One rule (aiobasert.tools.check_schema_and_tools) for every surface: a reply held to a JSON
    schema cannot also be held to the tool-call grammar, whatever tool_choice says ("none" still
    constrains the text), each refusal naming that surface's own schema field."""
    async with Engine.open(tiny_model_path, max_batch_size=1) as engine:
        for call in (engine.stream_chat, engine.chat):
            with pytest.raises(InvalidRequestError) as sdk:
                call(MESSAGES, tools=[TOOLS[1]], tool_choice=choice, json_schema={"type": "object"})
            assert str(sdk.value) == "json_schema cannot be combined with tools"
    named = {"type": "function", "function": {"name": choice}} if choice == "get_time" else choice
    flat_tool = {"type": "function", "name": "get_time", "parameters": TIME_PARAMS}
    surfaces = [
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "tools": [TOOLS[1]], "tool_choice": named, "response_format": JSON_OBJECT},
            "response_format",
            "response_format",
        ),
        (
            "/v1/responses",
            {
                "input": "Hi",
                "tools": [flat_tool],
                "tool_choice": {"type": "function", "name": choice} if choice == "get_time" else choice,
                "text": {"format": JSON_OBJECT},
            },
            "text",
            "text.format",
        ),
    ]
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for path, body, param, field in surfaces:
            r = await http.post(path, json={"model": MODEL_NAME, **body})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert (error["param"], error["message"]) == (param, f"{field} cannot be combined with tools"), path


def test_client_sees_bad_request(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.slow
def test_smollm2_tool_loop_stream_and_not(smollm2_path: Path) -> None:
    """The real model with the default (Hermes-style) tool rendering: a forced call
    streams the same arguments as the whole response, they validate, and the
    tool result leads to a text answer."""
    tools: list[ChatCompletionToolParam] = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather like in Paris?"}]
    with (
        serving(create_app(smollm2_path, model_name="smol", max_batch_size=2)) as url,
        OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        kw: dict[str, Any] = dict(
            model="smol",
            messages=messages,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=40,
            temperature=0,
        )
        whole = client.chat.completions.create(**kw)
        (call,) = whole.choices[0].message.tool_calls or []
        assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, tools[0]["function"]["parameters"])
        assert "paris" in args["city"].lower()  # the model understood the question
        fragments = [
            tc.function.arguments
            for chunk in client.chat.completions.create(**kw, stream=True)
            if chunk.choices
            for tc in chunk.choices[0].delta.tool_calls or []
            if tc.function and tc.function.arguments
        ]
        assert "".join(fragments) == call.function.arguments
        follow = [
            *messages,
            whole.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "sunny"}'},
        ]
        answer = client.chat.completions.create(
            model="smol", messages=follow, tools=tools, max_tokens=30, temperature=0
        )
        assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31),
    with_tools=st.booleans(),
    choice=st.sampled_from(["auto", "required", "none"]),
    logprobs=st.booleans(),
    max_tokens=st.integers(1, 60),
)
def test_stream_and_whole_bodies_agree(
    client: OpenAI, seed: int, with_tools: bool, choice: str, logprobs: bool, max_tokens: int
) -> None:
    """Same seed, same request: the streamed chunks add up to the whole body
    (text, tool calls, logprobs, usage, finish reason)."""
    kw: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=max_tokens,
        seed=seed,
        temperature=1.0,
        logprobs=logprobs,
        top_logprobs=2 if logprobs else None,
    )
    if with_tools:
        kw |= dict(tools=TOOLS, tool_choice=choice)
    whole = client.chat.completions.create(**kw)
    (wc,) = whole.choices
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    lps: list[tuple[str, float]] = []
    finish = None
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content.append(c.delta.content or "")
        for tc in c.delta.tool_calls or []:
            assert tc.function is not None
            if tc.id:
                names[tc.index] = tc.function.name or ""
            calls.setdefault(tc.index, []).append(tc.function.arguments or "")
        if c.logprobs and c.logprobs.content:
            lps += [(e.token, e.logprob) for e in c.logprobs.content]
        finish = c.finish_reason or finish
    assert finish == wc.finish_reason
    assert "".join(content) == (wc.message.content or "")
    whole_calls = wc.message.tool_calls or []
    assert [names[i] for i in sorted(names)] == [t.function.name for t in whole_calls]
    assert ["".join(calls[i]) for i in sorted(calls)] == [t.function.arguments for t in whole_calls]
    if logprobs:
        assert wc.logprobs is not None and wc.logprobs.content is not None
        assert lps == [(e.token, e.logprob) for e in wc.logprobs.content]
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_engine_structural_tag_over_http(untied_model_path: Path) -> None:
    """Tools whose schemas the reference grammar enforces run on the engine's structural
    tag (not llguidance) behind /v1/chat/completions: required calls stream the same
    arguments as the whole response and validate; a named call with
    parallel_tool_calls=false is the only one."""
    from aiobasert.models.bundle import read_bundle
    from aiobasert.models.tiny import EOS_ID
    from aiobasert.server.provider import SingleEngineProvider

    params = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "get_weather", "parameters": params}},
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
            },
        },
    ]
    vocab = list(read_bundle(untied_model_path).tokenizer["tokenizer.ggml.tokens"])
    bias = {str(vocab.index(s)): 4.0 for s in ('"', "}", ",")} | {str(EOS_ID): 4.0}
    provider = SingleEngineProvider.from_path(untied_model_path, model_name=MODEL_NAME, max_batch_size=4)
    with serving(create_app(provider)) as url, OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        for seed in (1, 2):
            kw: dict[str, Any] = dict(
                model=MODEL_NAME,
                messages=MESSAGES,
                tools=tools,
                tool_choice="required",
                max_tokens=150,
                temperature=1.0,
                seed=seed,
                logit_bias=bias,
            )
            whole = client.chat.completions.create(**kw)
            calls = whole.choices[0].message.tool_calls or []
            assert calls and not whole.choices[0].message.content
            if whole.choices[0].finish_reason == "tool_calls":
                for c in calls:
                    schema = params if c.function.name == "get_weather" else tools[1]["function"]["parameters"]
                    jsonschema.validate(json.loads(c.function.arguments), schema)
            fragments: dict[int, list[str]] = {}
            for chunk in client.chat.completions.create(**kw, stream=True):
                for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    fragments.setdefault(tc.index, []).append(tc.function.arguments or "" if tc.function else "")
            assert ["".join(f) for f in fragments.values()] == [c.function.arguments for c in calls]
            named = client.chat.completions.create(
                **kw
                | {"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": False}
            )
            (call,) = named.choices[0].message.tool_calls or []
            assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), tools[1]["function"]["parameters"])
        (served,) = provider.served()
        # private on purpose: the engine is closed and served on the server's loop (snapshot needs an open one)
        assert dict(served.engine._thread.prep.grammar_backends) == {"engine": 6}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_chunk_carries_one_delta_per_call(client: OpenAI, seed: int) -> None:
    """llama-index reads one `tool_calls` entry per chunk (the first): a call's head and
    its first argument fragment sent as two entries of one chunk lost that fragment
    (the `{`). Each chunk carries at most one entry per call index."""
    kw: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=150,
        seed=seed,
        temperature=1.0,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls or []
    args: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        entries = chunk.choices[0].delta.tool_calls if chunk.choices else None
        if not entries:
            continue
        assert len({e.index for e in entries}) == len(entries), entries
        first = entries[0]  # what llama-index keeps
        args[first.index] = args.get(first.index, "") + (first.function.arguments or "" if first.function else "")
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in whole]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_a_forced_call_cut_by_max_tokens_is_length_without_markup(client: OpenAI, max_tokens: int) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, seed=1
    )
    (choice,) = client.chat.completions.create(**kw).choices
    assert choice.finish_reason == "length"
    assert not choice.message.content, choice.message.content  # no raw `<tool_call>` text
    text, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and text == ""


def test_llama3_tool_calls_over_http(llama3_tools_model_path: Path) -> None:
    """A model with Llama 3.1's own template answers in its format, bare JSON `{"name": ...,
    "parameters": ...}`: the server reads it back as OpenAI tool_calls with schema-valid JSON
    arguments (stream and whole alike, finish_reason "tool_calls"); "auto" nudged to open with
    "{" calls too; a past turn with two calls and their results renders through the template;
    a bad tool_choice stays a 400 naming it."""
    from aiobasert.models.bundle import read_bundle

    brace = str(list(read_bundle(llama3_tools_model_path).tokenizer["tokenizer.ggml.tokens"]).index("{"))
    app = create_app(llama3_tools_model_path, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=4)
    with serving(app) as url, OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:
        for seed in (1, 2):
            kw: dict[str, Any] = dict(
                model=MODEL_NAME,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice="required",
                max_tokens=150,
                temperature=1.0,
                seed=seed,
            )
            whole = client.chat.completions.create(**kw)
            (choice,) = whole.choices
            calls = choice.message.tool_calls or []
            assert calls and choice.message.content is None
            complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
            assert choice.finish_reason in ("tool_calls", "length")
            for c in complete:
                assert c.type == "function" and c.id.startswith("call_")
                valid(c.function.name, c.function.arguments)
            fragments: dict[int, list[str]] = {}
            names: dict[int, str] = {}
            for chunk in client.chat.completions.create(**kw, stream=True):
                for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    assert tc.function is not None
                    if tc.function.name:
                        names[tc.index] = tc.function.name
                    fragments.setdefault(tc.index, []).append(tc.function.arguments or "")
            assert list(names.values()) == [c.function.name for c in calls]
            assert ["".join(f) for f in fragments.values()] == [c.function.arguments for c in calls]
        auto = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            max_tokens=150,
            temperature=1.0,
            seed=1,
            logit_bias={brace: 10},
        )
        (call, *_) = auto.choices[0].message.tool_calls or []
        if auto.choices[0].finish_reason == "tool_calls":
            valid(call.function.name, call.function.arguments)
        history: list[ChatCompletionMessageParam] = [
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": '{"tz":"UTC"}'},
                    }
                    for i in range(2)
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "noon"},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
        ]
        answer = client.chat.completions.create(
            model=MODEL_NAME,
            messages=history,
            tools=TOOLS,
            max_tokens=60,
            temperature=1.0,
            seed=3,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        (named,) = answer.choices[0].message.tool_calls or []
        assert named.function.name == "get_time"
        if answer.choices[0].finish_reason == "tool_calls":
            valid("get_time", named.function.arguments)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="sometimes")  # type: ignore[call-overload]
        assert bad.value.body["param"] == "tool_choice"  # type: ignore[index]


@pytest.mark.anyio
async def test_llama3_hostile_tool_traffic_leaves_a_neighbour_stream_alone(llama3_tools_model_path: Path) -> None:
    """On the Llama-3.1-templated model, a greedy forced-call stream runs beside hostile tool traffic: 200
    tools, a schema nested past the limit, names with quotes / unicode / marker text, tool_choice naming a
    missing tool, malformed history calls (each a 400 naming its field), n=2 with "required" and
    parallel_tool_calls false (one call per choice), and streaming clients that hang up mid-call. The
    neighbour's calls equal its solo run's, and the server serves a request afterwards."""
    import anyio

    app = create_app(llama3_tools_model_path, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=4)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    greedy: dict[str, Any] = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0.0
    )
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(80):
        deep = {"type": "object", "properties": {"a": deep}}
    bad_history = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{"}}],
        },
    ]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "function", "function": {"name": n}}]}, "tools")
        for n in ('a"b', "caf\u00e9", "<|eot_id|>", '{"name": "x"}', "")
    ] + [
        ({"tools": [{"type": "function", "function": {"name": "d", "parameters": deep}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": TOOLS, "messages": bad_history}, "messages"),
        (
            {
                "tools": TOOLS,
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_time", "arguments": '{"tz": "<|eot_id|>"}'},
                            }
                        ],
                    },
                ],
            },
            "messages",
        ),  # a forged turn
    ]
    many = [{"type": "function", "function": {"name": f"t{i}", "parameters": TIME_PARAMS}} for i in range(200)]

    async def calls(client: AsyncOpenAI) -> list[tuple[str, str]]:
        fragments: dict[int, list[str]] = {}
        names: dict[int, str] = {}
        async for chunk in await client.chat.completions.create(**greedy, stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                assert tc.function is not None
                if tc.function.name:
                    names[tc.index] = tc.function.name
                fragments.setdefault(tc.index, []).append(tc.function.arguments or "")
        return [(names[i], "".join(f)) for i, f in sorted(fragments.items())]

    with serving(app) as url:
        async with (
            AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client,
            httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as http,
        ):
            solo = await calls(client)
            assert solo
            got: list[list[tuple[str, str]]] = []

            async def neighbour() -> None:
                got.append(await calls(client))

            async def hang_up(i: int) -> None:
                body = {
                    "model": MODEL_NAME,
                    "messages": MESSAGES,
                    "tools": TOOLS,
                    "tool_choice": "required",
                    "max_tokens": 60,
                    "temperature": 1.0,
                    "seed": i,
                    "stream": True,
                }
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if '"tool_calls"' in line:
                            break  # mid-call: the client goes away

            async def hostile() -> None:
                for body, param in bad:
                    r = await http.post(
                        "/v1/chat/completions",
                        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, **body},
                    )
                    assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": MODEL_NAME, "messages": MESSAGES, "tools": many, "max_tokens": 8},
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text  # past MAX_TOOLS
                two = await client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=MESSAGES,
                    tools=TOOLS,
                    tool_choice="required",
                    n=2,
                    parallel_tool_calls=False,
                    max_tokens=60,
                    temperature=1.0,
                    seed=5,
                )
                assert len(two.choices) == 2
                for choice in two.choices:
                    assert len(choice.message.tool_calls or []) == 1 and choice.message.content is None

            async with anyio.create_task_group() as tg:
                tg.start_soon(neighbour)
                for i in range(3):
                    tg.start_soon(hang_up, i)
                tg.start_soon(hostile)
            assert got == [solo]
            assert await calls(client) == solo


def test_a_forced_call_of_a_pydantic_schema_ends_with_its_declared_properties(client: OpenAI, base_url: str) -> None:
    """LangChain's with_structured_output(method="function_calling") forces a call of the
    pydantic model's schema, which has no additionalProperties: biased towards "," (a model
    adding properties), the call kept going until max_tokens and LangChain got None. The call
    grammar now closes the object: the call ends holding only the declared properties."""
    import pydantic

    class Joke(pydantic.BaseModel):
        """A joke."""

        setup: str = pydantic.Field(max_length=8)
        rating: int | None = None

    schema = Joke.model_json_schema()
    assert "additionalProperties" not in schema
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": ',"'},
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]  # fmt: skip
    assert len(ids) == 2  # "," and "\""
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=1,
        tools=[{"type": "function", "function": {"name": "Joke", "description": "A joke.", "parameters": schema}}],
        tool_choice={"type": "function", "function": {"name": "Joke"}}, logit_bias={str(ids[0]): 8, str(ids[1]): 4},
    )  # fmt: skip
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    Joke.model_validate_json(call.function.arguments)
    assert set(json.loads(call.function.arguments)) <= {"setup", "rating"}
