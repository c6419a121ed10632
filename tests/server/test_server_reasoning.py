"""Reasoning models over HTTP: `reasoning_content` (whole and streamed), the thought sent back, `reasoning_effort`
and `chat_template_kwargs` honoured or refused by name, `usage.completion_tokens_details.reasoning_tokens`.

The server serves a tiny model with DeepSeek-R1-Distill's template (its prompt opens the thought) and the
tags as tokens; a small `logit_bias` on `</think>` makes the random model close its thought after a few
tokens (at temperature 0: the same every time). The SDK's reply on the same model is the oracle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from loopback import API_KEY, MODEL_NAME
from openai import OpenAI

from aiobasert import Engine
from aiobasert.server import create_app
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
    ],
)
def test_a_model_that_does_not_reason_refuses_the_knobs_by_name(
    plain_client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        plain_client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, **extra)  # type: ignore[arg-type]
    assert err.value.body["param"] == param  # type: ignore[index]
