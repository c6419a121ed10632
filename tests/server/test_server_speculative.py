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
