"""Structured output through the OpenAI-compatible server: `response_format`
json_schema and json_object on /v1/chat/completions, with the official client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from loopback import API_KEY, MODEL_NAME
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from aiobasert.models.bundle import read_bundle
from aiobasert.models.tiny import EOS_ID

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe a pet as JSON."}]
PET: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "name": {"type": "string", "maxLength": 10},
        "legs": {"type": "integer", "minimum": 0, "maximum": 4},
    },
    "required": ["kind", "name", "legs"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served_model(untied_model_path: Path) -> Path:
    return untied_model_path


def schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_json_schema_response(client: OpenAI, seed: int | None) -> None:
    sampling: dict[str, Any] = {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=96, response_format=schema_format(PET), **sampling
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), PET)


def test_json_schema_response_streamed(client: OpenAI) -> None:
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=96, seed=7, response_format=schema_format(PET), stream=True
    )
    text, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PET)


def test_json_object_response(client: OpenAI, untied_model_path: Path) -> None:
    # A random model rarely closes what it opens; a mild bias toward the closing
    # tokens lets the output finish, while the grammar decides what is allowed.
    tokens = read_bundle(untied_model_path).tokenizer["tokenizer.ggml.tokens"]
    closers = {str(tokens.index(s)): 5 for s in ('"', "]", "}")} | {str(EOS_ID): 5}
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=96,
            seed=seed,
            logit_bias=closers,
            response_format={"type": "json_object"},
        )
        (choice,) = reply.choices
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        assert isinstance(json.loads(choice.message.content), dict)  # OpenAI's json_object: an object


def test_invalid_schema_is_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Invalid type"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, response_format=schema_format({"type": "foo"})
        )
    ok = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=96, response_format=schema_format(PET)
    )
    assert ok.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ({"type": "json_schema"}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "yaml"}, "unknown response_format"),
    ],
)
def test_bad_response_format_is_a_400(base_url: str, response_format: Any, message: str) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "response_format": response_format}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert message in error["message"]
