"""Speculative decoding over HTTP (issue 36): a server opened with n-gram speculation answers with
the tokens of plain decoding, reports draft counts in `usage` and on /metrics (vLLM's spec-decode
counters), and honours the per-request `speculation: false` extension."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from loopback import API_KEY, MODEL_NAME

from aiobasert import Engine
from aiobasert.config import EngineConfig, SpeculationConfig

PROMPT = "the cat sat on the mat the cat sat on the mat the cat"


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    spec = SpeculationConfig(adaptive=False)
    return {"api_key": API_KEY, "model_name": MODEL_NAME, "config": EngineConfig(max_batch_size=4, speculation=spec)}


def _complete(base_url: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, **extra}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.anyio
async def test_served_speculation_is_plain_output_with_counts(base_url: str, tiny_model_path: Path) -> None:
    async with Engine.open(tiny_model_path) as plain:
        want = await plain.generate(PROMPT, max_tokens=40, special=False)
    got = _complete(base_url)
    assert got["choices"][0]["text"] == want.text
    usage = got["usage"]
    assert usage["completion_tokens"] == len(want.token_ids)
    assert usage["draft_tokens"] >= usage["accepted_draft_tokens"] > 0
    assert _metric(base_url, "aiobasert_spec_decode_num_accepted_tokens_total") >= usage["accepted_draft_tokens"]
    assert _metric(base_url, "aiobasert_spec_decode_num_draft_tokens_total") >= usage["draft_tokens"]
    off = _complete(base_url, speculation=False)
    assert off["choices"][0]["text"] == want.text
    assert off["usage"].get("draft_tokens") is None


def test_speculation_field_is_typed(base_url: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "speculation": "yes"}
    r = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 400 and "speculation" in r.text


def test_a_draft_model_is_served(asgi_server: Any, tiny_model_path: Path) -> None:
    """A server with a draft model (`--draft-model`: the target's own weights here, so its greedy
    drafts are accepted) answers with the plain tokens and counts the drafts in `usage`."""
    from aiobasert.server import create_app

    plain = _complete(asgi_server(create_app(tiny_model_path, api_key=API_KEY, model_name=MODEL_NAME)))
    spec = SpeculationConfig(method="draft", draft_model=str(tiny_model_path), adaptive=False)
    config = EngineConfig(max_batch_size=2, speculation=spec)
    url = asgi_server(create_app(tiny_model_path, api_key=API_KEY, model_name=MODEL_NAME, config=config))
    got = _complete(url)
    assert got["choices"][0]["text"] == plain["choices"][0]["text"]
    assert got["usage"]["accepted_draft_tokens"] >= 0.9 * got["usage"]["draft_tokens"] > 0
    # a long prompt served twice: the second's draft sequence starts from the draft's own prefix cache
    long = " ".join([PROMPT] * 6)
    assert _metric(url, "aiobasert_draft_prefix_cache_hits_total") == 0
    first, again = _complete(url, prompt=long), _complete(url, prompt=long)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert _metric(url, "aiobasert_draft_prefix_cache_hits_total") >= 32


def _stats(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/internal/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_draft_model_server_under_hostile_clients(asgi_server: Any, tiny_model_path: Path) -> None:
    """A server drafting with a draft model (the target's weights: long accepted runs), against the plain
    one: n > 1 seeded choices with logprobs and top_logprobs and a stop string, streamed and not, give the
    plain values; `speculation: false` too; streams cut off mid-generation by their clients (several at
    once, while they verify) leave no sequence, target's or draft's."""
    import time

    from openai import OpenAI

    from aiobasert.server import create_app

    spec = SpeculationConfig(method="draft", draft_model=str(tiny_model_path), adaptive=False)
    plain_url = asgi_server(create_app(tiny_model_path, api_key=API_KEY, model_name=MODEL_NAME, max_batch_size=4))
    config = EngineConfig(max_batch_size=4, speculation=spec)
    url = asgi_server(create_app(tiny_model_path, api_key=API_KEY, model_name=MODEL_NAME, config=config))
    ask: dict[str, Any] = dict(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=30, n=3, seed=5,
        temperature=0.8, logprobs=True, top_logprobs=2, stop=[" mat"],
    )  # fmt: skip

    def key(r: Any) -> list[Any]:
        return [(c.message.content, c.finish_reason, c.logprobs.model_dump()) for c in r.choices]

    with OpenAI(base_url=f"{plain_url}/v1", api_key=API_KEY, max_retries=0) as plain, \
            OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as c:  # fmt: skip
        want = plain.chat.completions.create(**ask)
        got = c.chat.completions.create(**ask)
        assert key(got) == key(want)
        assert got.usage is not None and (got.usage.model_extra or {}).get("draft_tokens", 0) > 0
        off = c.chat.completions.create(**ask, extra_body={"speculation": False})
        assert key(off) == key(want)
        texts = [""] * 3
        for chunk in c.chat.completions.create(**ask, stream=True):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        assert texts == [ch.message.content for ch in want.choices]
        # clients that leave mid-stream, four at once (every lane busy verifying)
        streams = [
            c.chat.completions.create(**{**ask, "n": 1, "stop": None, "max_tokens": 400, "seed": i}, stream=True)
            for i in range(4)
        ]
        for s in streams:
            for i, _ in enumerate(s):
                if i == 5:
                    break
        for s in streams:
            s.close()
    deadline = time.monotonic() + 30
    while True:
        stats = _stats(url)
        if stats["live_sequences"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["live_sequences"] == 0 and stats["draft_live_sequences"] == 0, stats


_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**_CHAT, "speculation": 1}, "speculation"),
        ("/v1/chat/completions", {**_CHAT, "speculation": "false"}, "speculation"),
        ("/v1/chat/completions", {**_CHAT, "speculation": [False]}, "speculation"),
        ("/v1/chat/completions", {**_CHAT, "reasoning_budget_tokens": "8"}, "reasoning_budget_tokens"),
        ("/v1/chat/completions", {**_CHAT, "reasoning_budget_tokens": 8.5}, "reasoning_budget_tokens"),
        ("/v1/chat/completions", {**_CHAT, "thinking_token_budget": -2}, "thinking_token_budget"),
        ("/v1/chat/completions", {**_CHAT, "thinking_token_budget": 2**31}, "thinking_token_budget"),
        ("/v1/chat/completions", {**_CHAT, "reasoning_budget_tokens": 8}, "reasoning_budget_tokens"),  # no thought
        ("/v1/chat/completions", {**_CHAT, "continue_final_message": 1, "add_generation_prompt": False},
         "continue_final_message"),
        ("/v1/chat/completions", {**_CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ("/v1/chat/completions", {**_CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "speculation": None, "max_tokens": -1},
         "max_tokens"),
    ],
)  # fmt: skip
def test_new_fields_of_the_wrong_type_or_range_are_400s_naming_them(
    base_url: str, path: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{base_url}{path}", json=body, headers=_HEADERS, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("max_tokens", [1, 2, 10**9])
def test_speculated_max_tokens_at_the_edges(base_url: str, tiny_model_path: Path, max_tokens: int) -> None:
    # one token (no room for a draft), two, and past the context (drafts capped by what may still come):
    # the plain tokens, or the plain refusal
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                   "max_tokens": max_tokens, "temperature": 0}, headers=_HEADERS, timeout=60)  # fmt: skip
    off = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "speculation": False,
                     "max_tokens": max_tokens, "temperature": 0}, headers=_HEADERS, timeout=60)  # fmt: skip
    assert r.status_code == off.status_code and r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"] == off.json()["error"]
        return
    assert r.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
    assert r.json()["choices"][0]["finish_reason"] == off.json()["choices"][0]["finish_reason"]
    assert r.json()["usage"]["completion_tokens"] == off.json()["usage"]["completion_tokens"]
