"""Reasoning models over HTTP: `reasoning_content` (whole and streamed), the thought sent back, `reasoning_effort`
and `chat_template_kwargs` honoured or refused by name, `usage.completion_tokens_details.reasoning_tokens`, the
reasoning budget (a request's `reasoning_budget_tokens` / `thinking_token_budget`, the server's `reasoning_budget`).

The server serves a tiny model with DeepSeek-R1-Distill's template (its prompt opens the thought) and the
tags as tokens; a small `logit_bias` on `</think>` makes the random model close its thought after a few
tokens (at temperature 0: the same every time). The SDK's reply on the same model is the oracle."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from loopback import API_KEY, MODEL_NAME
from openai import OpenAI

from aiobasert import Engine, Thinking
from aiobasert.errors import InvalidConfigError
from aiobasert.server import create_app
from aiobasert.server.responses import ResponseStore
from aiobasert.tools import ChatReply

USER = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def served_model(r1_think_model_path: Path) -> Path:
    return r1_think_model_path


@pytest.fixture(scope="module")
def close_bias(served_model: Path) -> dict[str, int]:
    async def close_id() -> int:
        async with Engine.open(served_model, max_batch_size=1) as engine:
            return (await engine.encode("</think>", special=True))[0]

    return {str(anyio.run(close_id)): 3}


@pytest.fixture(scope="module")
def sdk_reply(served_model: Path, close_bias: dict[str, int]) -> ChatReply:
    """The SDK's reply to the request the tests send (the oracle of what the server returns)."""

    async def reply() -> ChatReply:
        async with Engine.open(served_model, max_batch_size=1) as engine:
            bias = {int(k): v for k, v in close_bias.items()}
            return await engine.stream_chat(USER, max_tokens=16, temperature=0, logit_bias=bias)

    got = anyio.run(reply)
    assert got.reasoning and got.content  # the bias lets the thought close mid-reply: both sides are there
    return got


def _ask(client: OpenAI, close_bias: dict[str, int], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        logit_bias=close_bias,
        **extra,
    )


def test_the_thought_is_reasoning_content_and_counted(
    client: OpenAI, close_bias: dict[str, int], sdk_reply: ChatReply
) -> None:
    out = _ask(client, close_bias)
    message = out.choices[0].message
    assert message.reasoning_content == sdk_reply.reasoning  # type: ignore[attr-defined]
    assert message.content == sdk_reply.content
    assert out.usage is not None and out.usage.completion_tokens_details is not None
    assert out.usage.completion_tokens_details.reasoning_tokens == sdk_reply.usage.reasoning_tokens > 0


def test_streamed_deltas_carry_the_thought_apart(
    client: OpenAI, close_bias: dict[str, int], sdk_reply: ChatReply
) -> None:
    thought, text, usage = [], [], None
    for chunk in _ask(client, close_bias, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            thought.append(getattr(choice.delta, "reasoning_content", None) or "")
            text.append(choice.delta.content or "")
    assert ("".join(thought), "".join(text)) == (sdk_reply.reasoning, sdk_reply.content)
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == sdk_reply.usage.reasoning_tokens


def test_reasoning_effort_and_template_kwargs_turn_thinking_off(client: OpenAI, close_bias: dict[str, int]) -> None:
    off = _ask(client, close_bias, reasoning_effort="none")
    via_kwargs = _ask(client, close_bias, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None  # the prompt closed the thought
    assert off.choices[0].message.content == via_kwargs.choices[0].message.content
    on = _ask(client, close_bias, reasoning_effort="high")
    assert on.choices[0].message.reasoning_content  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"extra_body": {"chat_template_kwargs": {"no_such_knob": 1}}}, "chat_template_kwargs"),
        ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),
        (
            {"reasoning_effort": "low", "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
            "reasoning_effort",
        ),
    ],
)
def test_bad_knobs_are_refused_by_name(
    client: OpenAI, close_bias: dict[str, int], extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _ask(client, close_bias, **extra)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_a_thought_sent_back_is_accepted_and_only_on_assistant_turns(client: OpenAI) -> None:
    for key in ("reasoning_content", "reasoning"):
        turns = [*USER, {"role": "assistant", "content": "4", key: "two and two"}, {"role": "user", "content": "ok"}]
        out = client.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=2)  # type: ignore[arg-type]
        assert out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "x", "reasoning_content": "y"}],
            max_tokens=2,  # type: ignore[list-item]
        )
    assert err.value.body["param"] == "messages"  # type: ignore[index]


@pytest.fixture(scope="module")
def plain_client(asgi_server: Callable[[Any], str], tiny_model_path: Path) -> Iterator[OpenAI]:
    """A server on the tiny ChatML model, which does not reason."""
    url = asgi_server(create_app(tiny_model_path, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1))
    with OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"reasoning_effort": "none"}, "reasoning_effort"),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, "chat_template_kwargs"),
        ({"extra_body": {"reasoning_budget_tokens": 4}}, "reasoning_budget_tokens"),
        ({"extra_body": {"thinking_token_budget": 0}}, "thinking_token_budget"),
    ],
)
def test_a_model_that_does_not_reason_refuses_the_knobs_by_name(
    plain_client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        plain_client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, **extra)  # type: ignore[arg-type]
    assert err.value.body["param"] == param  # type: ignore[index]


# ---- the reasoning budget: per request (llama-server's and vLLM's field) and the server's default ----

BUDGET = 5


def _sdk_budget_reply(model: Path, budget: int) -> ChatReply:
    async def reply() -> ChatReply:
        async with Engine.open(model, max_batch_size=1) as engine:
            return await engine.stream_chat(USER, max_tokens=24, temperature=0, thinking=Thinking(budget=budget))

    return anyio.run(reply)


@pytest.fixture(scope="module")
def sdk_budget_reply(served_model: Path) -> ChatReply:
    """The SDK's reply under `Thinking(budget=BUDGET)`: without a bias the random model thinks on, so the
    engine closes the thought at the budget (its tokens and the close tag it wrote) and the answer follows."""
    got = _sdk_budget_reply(served_model, BUDGET)
    assert got.usage.reasoning_tokens == BUDGET + 1 and got.reasoning and got.content
    return got


@pytest.mark.parametrize("field", ["reasoning_budget_tokens", "thinking_token_budget"])
def test_a_request_budget_closes_the_thought_and_the_answer_follows(
    client: OpenAI, sdk_budget_reply: ChatReply, field: str
) -> None:
    ask: Any = {"model": MODEL_NAME, "messages": USER, "max_tokens": 24, "temperature": 0}
    out = client.chat.completions.create(**ask, extra_body={field: BUDGET})
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == (sdk_budget_reply.reasoning, sdk_budget_reply.content)  # type: ignore[attr-defined]
    assert out.usage is not None and out.usage.completion_tokens_details is not None
    assert out.usage.completion_tokens_details.reasoning_tokens == BUDGET + 1
    thought, text, usage = [], [], None
    chunks = client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}, extra_body={field: BUDGET}
    )
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thought.append(getattr(choice.delta, "reasoning_content", None) or "")
            text.append(choice.delta.content or "")
    assert ("".join(thought), "".join(text)) == (sdk_budget_reply.reasoning, sdk_budget_reply.content)
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == BUDGET + 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
        ({"reasoning_budget_tokens": "5"}, "reasoning_budget_tokens"),
        ({"reasoning_budget_tokens": True}, "reasoning_budget_tokens"),
        ({"reasoning_budget_tokens": 2.5}, "reasoning_budget_tokens"),
        ({"thinking_token_budget": 2**31}, "thinking_token_budget"),
        ({"reasoning_budget_tokens": 4, "thinking_token_budget": 5}, "thinking_token_budget"),
        ({"reasoning_budget_tokens": 4, "reasoning_effort": "none"}, "reasoning_budget_tokens"),
    ],
)
def test_bad_reasoning_budgets_are_refused_by_name(client: OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, extra_body=body)  # type: ignore[arg-type]
    assert err.value.body["param"] == param  # type: ignore[index]


@pytest.fixture(scope="module")
def budget_client(asgi_server: Callable[[Any], str], served_model: Path) -> Iterator[OpenAI]:
    """A server whose `--reasoning-budget` is BUDGET."""
    app = create_app(served_model, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1, reasoning_budget=BUDGET)
    with OpenAI(base_url=f"{asgi_server(app)}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def _reasoning_tokens(out: Any) -> int:
    return out.usage.completion_tokens_details.reasoning_tokens if out.usage.completion_tokens_details else 0


def test_the_server_budget_is_the_default_and_a_request_overrides_it(
    budget_client: OpenAI, served_model: Path, sdk_budget_reply: ChatReply
) -> None:
    ask: Any = {"model": MODEL_NAME, "messages": USER, "max_tokens": 24, "temperature": 0}
    default = budget_client.chat.completions.create(**ask)
    assert default.choices[0].message.reasoning_content == sdk_budget_reply.reasoning  # type: ignore[attr-defined]
    assert _reasoning_tokens(default) == BUDGET + 1
    assert default.choices[0].message.content == sdk_budget_reply.content
    same = budget_client.chat.completions.create(**ask, extra_body={"reasoning_budget_tokens": -1})  # the default
    assert _reasoning_tokens(same) == BUDGET + 1
    assert _reasoning_tokens(budget_client.chat.completions.create(**ask, extra_body={"thinking_token_budget": 2})) == 3
    off = budget_client.chat.completions.create(**ask, reasoning_effort="none")
    assert getattr(off.choices[0].message, "reasoning_content", None) is None and _reasoning_tokens(off) == 0
    on = budget_client.chat.completions.create(**ask, reasoning_effort="high")  # on, still bounded by the default
    assert _reasoning_tokens(on) == BUDGET + 1
    response = budget_client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == BUDGET + 1
    assert response.output_text == sdk_budget_reply.content


def test_a_server_budget_of_zero_turns_thinking_off_unless_a_request_turns_it_on(
    asgi_server: Callable[[Any], str], served_model: Path
) -> None:
    app = create_app(served_model, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1, reasoning_budget=0)
    ask: Any = {"model": MODEL_NAME, "messages": USER, "max_tokens": 8, "temperature": 0}
    with OpenAI(base_url=f"{asgi_server(app)}/v1", api_key=API_KEY, max_retries=0) as c:
        off = c.chat.completions.create(**ask)
        assert getattr(off.choices[0].message, "reasoning_content", None) is None and _reasoning_tokens(off) == 0
        explicit_off = c.chat.completions.create(**ask, reasoning_effort="none")
        assert off.choices[0].message.content == explicit_off.choices[0].message.content  # as llama-server's 0
        assert _reasoning_tokens(c.chat.completions.create(**ask, reasoning_effort="high")) == 8  # unbounded
        kwargs_on = {"chat_template_kwargs": {"enable_thinking": True}}
        assert _reasoning_tokens(c.chat.completions.create(**ask, extra_body=kwargs_on)) == 8
        assert _reasoning_tokens(c.chat.completions.create(**ask, extra_body={"reasoning_budget_tokens": 2})) == 3


def test_a_plain_model_ignores_the_server_budget(asgi_server: Callable[[Any], str], tiny_model_path: Path) -> None:
    app = create_app(tiny_model_path, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1, reasoning_budget=3)
    with OpenAI(base_url=f"{asgi_server(app)}/v1", api_key=API_KEY, max_retries=0) as c:
        out = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        assert out.usage is not None and out.usage.completion_tokens == 4 and _reasoning_tokens(out) == 0


@pytest.mark.parametrize("budget", [-2, 2**31, True, 1.5])
def test_create_app_refuses_a_bad_reasoning_budget(tiny_model_path: Path, budget: Any) -> None:
    with pytest.raises(InvalidConfigError, match="reasoning_budget"):
        create_app(tiny_model_path, reasoning_budget=budget)


# ---- the Responses API (`POST /v1/responses`): reasoning items and the `reasoning` option ----


def _respond(client: OpenAI, close_bias: dict[str, int], **extra: Any) -> Any:
    # `logit_bias` is this server's extension to the Responses API (its chat completions field)
    body = {"logit_bias": close_bias, **extra.pop("extra_body", {})}
    return client.responses.create(
        model=MODEL_NAME, input=USER, max_output_tokens=16, temperature=0, extra_body=body, **extra
    )


def test_responses_reasoning_item_comes_before_the_message(
    client: OpenAI, close_bias: dict[str, int], sdk_reply: ChatReply
) -> None:
    out = _respond(client, close_bias)
    thought, message = out.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_")
    assert thought.summary == []  # no summary is generated: `content` is the whole thought
    assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", sdk_reply.reasoning)]
    assert message.type == "message" and out.output_text == sdk_reply.content
    assert out.usage.output_tokens_details.reasoning_tokens == sdk_reply.usage.reasoning_tokens > 0


def test_responses_stream_carries_the_thought_as_reasoning_text_events(
    client: OpenAI, close_bias: dict[str, int], sdk_reply: ChatReply
) -> None:
    kinds: list[tuple[str, int | None]] = []
    deltas: list[str] = []
    done = final = None
    with client.responses.stream(
        model=MODEL_NAME,
        input=USER,  # type: ignore[arg-type]
        max_output_tokens=16,
        temperature=0,
        extra_body={"logit_bias": close_bias},
    ) as stream:
        for event in stream:
            kinds.append((event.type, getattr(event, "output_index", None)))
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.reasoning_text.done":
                done = event.text
            elif event.type in ("response.completed", "response.incomplete"):  # 16 tokens may cut the answer
                final = event.response
    assert final is not None
    assert "".join(deltas) == done == sdk_reply.reasoning
    first_text = kinds.index(("response.output_text.delta", 1))
    thought_events = [k for k, index in kinds[:first_text] if index == 0 and k != "response.reasoning_text.delta"]
    assert thought_events == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == sdk_reply.reasoning  # type: ignore[union-attr,index]
    assert final.output_text == sdk_reply.content
    assert final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens == sdk_reply.usage.reasoning_tokens


def test_responses_thought_cut_by_max_output_tokens_is_the_only_item(client: OpenAI) -> None:
    out = client.responses.create(model=MODEL_NAME, input=USER, max_output_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert out.status == "incomplete"
    assert [(item.type, item.status) for item in out.output] == [("reasoning", "incomplete")]
    assert out.usage is not None and out.usage.output_tokens_details.reasoning_tokens == 4


def test_responses_reasoning_effort_turns_thinking_on_and_off(client: OpenAI, close_bias: dict[str, int]) -> None:
    off = _respond(client, close_bias, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]  # the prompt closed the thought
    assert off.output_text == _ask(client, close_bias, reasoning_effort="none").choices[0].message.content
    assert off.reasoning is not None and off.reasoning.effort == "none"  # echoed
    on = _respond(client, close_bias, reasoning={"effort": "high", "summary": "auto"})
    assert [item.type for item in on.output] == ["reasoning", "message"]
    assert on.output[0].summary == []  # type: ignore[union-attr]  # accepted, none generated


@pytest.mark.parametrize(
    ("reasoning", "param"),
    [({"effort": "extreme"}, "reasoning.effort"), ({"summary": "verbose"}, "reasoning"), ({"mode": "x"}, "reasoning")],
)
def test_responses_bad_reasoning_is_refused_by_name(
    client: OpenAI, close_bias: dict[str, int], reasoning: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _respond(client, close_bias, extra_body={"reasoning": reasoning})
    assert err.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize(
    ("reasoning", "param"),
    [
        ({"effort": "low"}, "reasoning.effort"),
        ({"effort": "none"}, "reasoning.effort"),
        ({"summary": "auto"}, "reasoning"),
    ],
)
def test_responses_reasoning_on_a_model_that_does_not_reason_is_refused_by_name(
    plain_client: OpenAI, reasoning: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        plain_client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, reasoning=reasoning)  # type: ignore[arg-type]
    assert err.value.body["param"] == param  # type: ignore[index]
    plain_client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, reasoning={})  # asks nothing


THOUGHT = "two and two make four"
REPLAYED: list[Any] = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
]
AS_CHAT = [*USER, {"role": "assistant", "content": "4", "reasoning_content": THOUGHT}]


@pytest.fixture(scope="module")
def qwen3_client(asgi_server: Callable[[Any], str], qwen3_think_model_path: Path) -> Iterator[OpenAI]:
    """A server on the tiny model with Qwen3's template, which renders a thought sent back after the last
    user message (R1's drops every one)."""
    url = asgi_server(create_app(qwen3_think_model_path, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1))
    with OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def _prompt_tokens(model: Path, messages: list[Any]) -> int:
    async def count() -> int:
        async with Engine.open(model, max_batch_size=1) as engine:
            return (await engine.stream_chat(messages, max_tokens=1)).usage.prompt_tokens

    return anyio.run(count)


def test_responses_reasoning_item_sent_back_is_rendered_as_the_template_does(
    client: OpenAI, qwen3_client: OpenAI, served_model: Path, qwen3_think_model_path: Path
) -> None:
    for api, model in ((qwen3_client, qwen3_think_model_path), (client, served_model)):
        with_thought = api.responses.create(model=MODEL_NAME, input=REPLAYED, max_output_tokens=1)
        without = api.responses.create(model=MODEL_NAME, input=[REPLAYED[0], REPLAYED[2]], max_output_tokens=1)
        assert with_thought.usage is not None and without.usage is not None
        # the SDK's chat with the thought as the assistant turn's `reasoning_content` is the oracle
        assert with_thought.usage.input_tokens == _prompt_tokens(model, AS_CHAT)
        rendered = with_thought.usage.input_tokens > without.usage.input_tokens
        assert rendered == (model == qwen3_think_model_path)  # Qwen3 renders it, R1 drops it


def test_responses_previous_response_id_replays_the_thought(
    client: OpenAI, qwen3_client: OpenAI, close_bias: dict[str, int]
) -> None:
    first = _respond(client, close_bias)
    (thought, message) = first.output
    replayed = [*USER, thought.model_dump(exclude_none=True), message.model_dump(exclude_none=True)]
    follow = {"role": "user", "content": "and 3 + 3?"}
    chained = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, input=[follow], max_output_tokens=1
    )
    by_hand = client.responses.create(model=MODEL_NAME, input=[*replayed, follow], max_output_tokens=1)
    assert chained.usage is not None and by_hand.usage is not None
    assert chained.usage.input_tokens == by_hand.usage.input_tokens


def test_the_responses_store_keeps_the_thought_for_the_template() -> None:
    # R1's template drops a thought, so the chained turn above cannot show it kept: the store itself does
    store = ResponseStore()
    store.put("resp_1", [*USER, {"role": "assistant", "content": "4", "reasoning_content": THOUGHT}], MODEL_NAME)
    found = store.get("resp_1")
    assert found is not None and found[0][-1] == {"role": "assistant", "content": "4", "reasoning_content": THOUGHT}


def _harmony_replies(model: Path) -> dict[str, str]:
    """The SDK's answers with gpt-oss's template given each effort (`Reasoning: low` in its system message)."""

    async def replies() -> dict[str, str]:
        async with Engine.open(model, max_batch_size=1) as engine:
            out = {}
            for effort in ("low", "medium", "high"):
                kwargs = {"reasoning_effort": effort}
                out[effort] = (
                    await engine.stream_chat(USER, max_tokens=6, temperature=0, chat_template_kwargs=kwargs)
                ).content
            return out

    return anyio.run(replies)


def test_a_harmony_model_over_http(asgi_server: Callable[[Any], str], harmony_model_path: Path) -> None:
    """gpt-oss's Harmony framing: `reasoning_effort` (and Responses' `reasoning.effort`) goes to its template,
    which reads it (as vLLM and llama-server give it); a budget (the server's, a request's) bounds only a thought
    the model opens (the random model names no channel: its replies are unchanged); a tool call comes after the
    thought (aiobasert/tools/harmony.py)."""
    expected = _harmony_replies(harmony_model_path)
    assert len(set(expected.values())) == 3  # the effort changes the prompt, so the random model's answer
    app = create_app(harmony_model_path, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1, reasoning_budget=3)
    ask: Any = {"model": MODEL_NAME, "messages": USER, "max_tokens": 6, "temperature": 0}
    with OpenAI(base_url=f"{asgi_server(app)}/v1", api_key=API_KEY, max_retries=0) as c:
        assert c.chat.completions.create(**ask).choices[0].message.content == expected["medium"]  # the default
        for effort, content in expected.items():
            assert c.chat.completions.create(**ask, reasoning_effort=effort).choices[0].message.content == content
            response = c.responses.create(
                model=MODEL_NAME,
                input=USER,
                max_output_tokens=6,
                temperature=0,
                reasoning={"effort": effort},  # type: ignore[arg-type]
            )
            assert response.output_text == content
        for bad in ("none", "minimal"):
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(**ask, reasoning_effort=bad)
            assert err.value.body["param"] == "reasoning_effort"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(
                **ask, reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}
            )
        assert err.value.body["param"] == "reasoning_effort"  # type: ignore[index]
        for field in ("reasoning_budget_tokens", "thinking_token_budget"):
            bounded = c.chat.completions.create(**ask, extra_body={field: 4}).choices[0].message.content
            assert bounded == expected["medium"]
        schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        called = c.chat.completions.create(**{**ask, "max_tokens": 60}, tools=[tool], tool_choice="required",
                                           extra_body={"reasoning_budget_tokens": 2})  # fmt: skip
        message = called.choices[0].message
        assert called.choices[0].finish_reason == "tool_calls" and message.tool_calls is not None
        (call,) = message.tool_calls
        assert call.function.name == "f" and json.loads(call.function.arguments)["n"] in (1, 2, 3)  # type: ignore[union-attr]
        assert message.reasoning_content is not None  # type: ignore[attr-defined]
        # streamed: the thought as reasoning_content deltas, the call's id and name, then its arguments
        chunks = list(
            c.chat.completions.create(
                **{**ask, "max_tokens": 60},
                tools=[tool],
                tool_choice="required",
                stream=True,
                extra_body={"reasoning_budget_tokens": 2},
            )
        )
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        parts = [t for d in deltas for t in d.tool_calls or ()]
        assert thought == message.reasoning_content  # type: ignore[attr-defined]
        assert parts[0].function is not None and parts[0].function.name == "f" and parts[0].id
        assert "".join(p.function.arguments or "" for p in parts if p.function) == call.function.arguments  # type: ignore[union-attr]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
            "tool_calls"
        ]


def test_a_harmony_thought_is_bounded_over_http(
    asgi_server: Callable[[Any], str], llama_cpp_templates_dir: Path, tmp_path: Path
) -> None:
    """gpt-oss's template with its generation prompt opening the analysis channel (a bias makes every token `a`):
    the server's `--reasoning-budget` and a request's `reasoning_budget_tokens` close the thought after that many
    tokens, and the final channel's answer follows (the engine writes `<|end|>` and its header); a budget of 0
    closes it at once."""
    from aiobasert.models.tiny import build_tiny_model

    template = (llama_cpp_templates_dir / "openai-gpt-oss-120b.jinja").read_text()
    opening = "<|start|>assistant\n{%- endif -%}"
    assert opening in template
    template = template.replace(opening, "<|start|>assistant<|channel|>analysis<|message|>\n{%- endif -%}")
    markers = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
    model = build_tiny_model(tmp_path / "tiny.base", tied=False, extra_tokens=tuple((m, 3) for m in markers),
                             chat_template=template)  # fmt: skip

    async def ids() -> tuple[int, int]:
        async with Engine.open(model, max_batch_size=1) as engine:
            (a,) = await engine.encode("a")
            return a, len(await engine.encode("<|end|><|start|>assistant<|channel|>final<|message|>", special=True))

    a, header = anyio.run(ids)
    app = create_app(model, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1, reasoning_budget=3)
    ask: Any = {"model": MODEL_NAME, "messages": USER, "max_tokens": 16, "temperature": 0, "logit_bias": {a: 100}}
    with OpenAI(base_url=f"{asgi_server(app)}/v1", api_key=API_KEY, max_retries=0) as c:
        for extra, budget in (({}, 3), ({"reasoning_budget_tokens": 1}, 1), ({"thinking_token_budget": 0}, 0)):
            r = c.chat.completions.create(**ask, extra_body=extra)
            message: Any = r.choices[0].message
            assert (message.reasoning_content, message.content) == ("a" * budget, "a" * (16 - budget - header))
            assert r.usage is not None and r.usage.completion_tokens_details is not None
            assert r.usage.completion_tokens_details.reasoning_tokens == budget + 1


def test_a_final_assistant_message_is_continued_as_the_answer(client: OpenAI, base_url: str) -> None:
    # vLLM's continue_final_message (with add_generation_prompt false): the reply goes on from the
    # assistant's text; on this reasoning model that text is the answer, so no thought is reopened
    turns = [*USER, {"role": "assistant", "content": "The answer is"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=6, temperature=0,  # type: ignore[arg-type]
                                       extra_body=cont)  # fmt: skip
    assert r.usage is not None and r.usage.completion_tokens > 0
    assert not getattr(r.choices[0].message, "reasoning_content", None)
    closed = client.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=1)  # type: ignore[arg-type]
    assert closed.usage is not None and r.usage.prompt_tokens < closed.usage.prompt_tokens  # cut, no new turn
    for extra, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # as vLLM: add_generation_prompt false too
        ({"continue_final_message": "yes", "add_generation_prompt": False}, "continue_final_message"),
        ({"add_generation_prompt": 0}, "add_generation_prompt"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=1, extra_body=extra)  # type: ignore[arg-type]
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:  # nothing to continue
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1, extra_body=cont)  # type: ignore[arg-type]
    assert caught.value.body["param"] == "continue_final_message"  # type: ignore[index]
    # Anthropic's prefill refuses thinking with it, as Anthropic does
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": turns,
            "thinking": {"type": "enabled", "budget_tokens": 16}}  # fmt: skip
    refused = httpx.post(f"{base_url}/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert refused.status_code == 400 and "prefill" in refused.text, refused.text


def test_an_empty_final_assistant_turn_is_no_prefill_over_messages(base_url: str) -> None:
    # Anthropic takes an empty final assistant turn (its content may be empty, the others' not): nothing is
    # continued, so on this model the prompt still opens the thought and the reply is the plain one (the
    # turn was continued, which dropped the thought the generation prompt opens; with thinking enabled,
    # it was refused as a prefill)
    headers = {"x-api-key": API_KEY}
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "messages": USER}
    empty = {**body, "messages": [*USER, {"role": "assistant", "content": ""}]}

    def prompt(r: httpx.Response) -> tuple[Any, int]:
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return r.json()["content"], usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)

    want = prompt(httpx.post(f"{base_url}/v1/messages", json=body, headers=headers, timeout=60))
    assert want[0][0]["type"] == "thinking"
    assert prompt(httpx.post(f"{base_url}/v1/messages", json=empty, headers=headers, timeout=60)) == want
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 4}, "max_tokens": 16}
    r = httpx.post(f"{base_url}/v1/messages", json={**empty, **thinking}, headers=headers, timeout=60)
    want_thinking = httpx.post(f"{base_url}/v1/messages", json={**body, **thinking}, headers=headers, timeout=60)
    assert r.status_code == want_thinking.status_code, (r.text, want_thinking.text)


def test_anthropic_thinking_bounds_a_harmony_thought(
    asgi_server: Callable[[Any], str], llama_cpp_templates_dir: Path, tmp_path: Path
) -> None:
    """/v1/messages on gpt-oss (no `enable_thinking`: it thinks anyway): `thinking: enabled` with `budget_tokens`
    bounds the analysis channel (it was refused: "cannot turn thinking on or off") and `disabled` closes the thought
    at once, as the server's `--reasoning-budget 0` does on this model. The SDK's replies are the oracle."""
    from aiobasert.models.tiny import build_tiny_model

    template = (llama_cpp_templates_dir / "openai-gpt-oss-120b.jinja").read_text()
    opening = "<|start|>assistant\n{%- endif -%}"
    template = template.replace(opening, "<|start|>assistant<|channel|>analysis<|message|>\n{%- endif -%}")
    markers = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
    model = build_tiny_model(tmp_path / "tiny.base", tied=False, extra_tokens=tuple((m, 3) for m in markers),
                             chat_template=template)  # fmt: skip

    async def oracle() -> list[ChatReply]:
        async with Engine.open(model, max_batch_size=1) as engine:
            return [await engine.stream_chat(USER, max_tokens=16, temperature=0, thinking=Thinking(budget=b))
                    for b in (3, 0)]  # fmt: skip

    bounded, closed = anyio.run(oracle)
    assert bounded.reasoning and bounded.usage.reasoning_tokens == 3 + 1 and not closed.reasoning
    url = asgi_server(create_app(model, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=1))
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 16, "temperature": 0, "messages": USER}
    for thinking, want in (({"type": "enabled", "budget_tokens": 3}, bounded), ({"type": "disabled"}, closed)):
        r = httpx.post(f"{url}/v1/messages", json={**body, "thinking": thinking}, headers={"x-api-key": API_KEY})
        assert r.status_code == 200, r.text
        blocks = {b["type"]: b for b in r.json()["content"]}
        assert blocks.get("thinking", {}).get("thinking", "") == (want.reasoning or "")
        assert blocks["text"]["text"] == want.content
        count = {k: body[k] for k in ("model", "messages")} | {"thinking": thinking}
        r = httpx.post(f"{url}/v1/messages/count_tokens", json=count, headers={"x-api-key": API_KEY})
        assert r.status_code == 200, r.text
