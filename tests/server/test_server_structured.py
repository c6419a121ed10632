"""Structured output through the OpenAI-compatible server: `response_format`
json_schema and json_object on /v1/chat/completions, with the official client."""

from __future__ import annotations

import json
import re
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


# ---- constraints beyond JSON Schema: vLLM's structured_outputs, llama.cpp's grammar (issue 35 item 4) ----

PARENS_GBNF = 'root ::= group+\ngroup ::= "(" ( [a-z] | group )+ ")"'


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0 or (ch not in "()" and not ("a" <= ch <= "z" and depth > 0)):
            return False
    return depth == 0 and bool(text)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_structured_outputs_regex_and_choice(client: OpenAI, seed: int) -> None:
    pattern = r"[0-9]{3}-[a-c]+"
    bias = {str(EOS_ID): 4}
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=32, temperature=1.0, seed=seed, logit_bias=bias,
        extra_body={"structured_outputs": {"regex": pattern}},
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "stop" and re.fullmatch(pattern, chat.choices[0].message.content or "")
    choices = ["red", "green", "blue"]
    done = client.completions.create(
        model=MODEL_NAME, prompt="Color:", max_tokens=8, temperature=1.0, seed=seed,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert done.choices[0].text in choices
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=seed, stream=True,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in choices


@pytest.mark.parametrize("body", [{"grammar": PARENS_GBNF}, {"structured_outputs": {"grammar": PARENS_GBNF}}])
def test_a_gbnf_grammar_on_chat_and_completions(client: OpenAI, base_url: str, body: dict[str, Any]) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    close = httpx.post(f"{base_url}/tokenize", json={"prompt": ")"}, headers=auth).json()["tokens"][0]
    bias = {str(close): 3, str(EOS_ID): 3}  # a random model closes what it opens, sooner
    for seed in (1, 2, 3):
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=1.0, seed=seed, logit_bias=bias,
            extra_body=body,
        )  # fmt: skip
        assert chat.choices[0].finish_reason == "stop" and _balanced(chat.choices[0].message.content or ""), chat
    done = client.completions.create(
        model=MODEL_NAME, prompt="(", max_tokens=8, extra_body={"structured_outputs": {"json": '{"type": "integer"}'}}
    )
    assert int(done.choices[0].text) == json.loads(done.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "unknown name"),
        ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs", "Invalid type"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "is not JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
        ({"grammar": "root ::= ("}, "grammar", "cannot be converted to Lark"),
        ({"grammar": 'root ::= "a"', "structured_outputs": {"regex": "a"}}, "grammar", "cannot be combined"),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar", "response_format"),
        ({"grammar": 'root ::= "a"', "tools": [{"type": "function", "function": {"name": "f"}}]}, "grammar", "tools"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(
    base_url: str, body: dict[str, Any], param: str, message: str, stream: bool
) -> None:
    request = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "stream": stream, **body}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
