"""No silently ignored field: every request field in aiobasert.server.compat is
sent with its `ok` example (200) and its `bad` example (400 naming it), the
table lists exactly the request structs' fields, and docs/openai-compat.md carries the
table rendered from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from loopback import serving
from test_server import REPO

from aiobasert.server import create_app
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
def base_url(tiny_model_path: Path) -> Iterator[str]:
    with serving(create_app(tiny_model_path, model_name="tiny", max_batch_size=4)) as url:
        yield url


def test_the_table_lists_exactly_the_request_fields() -> None:
    for endpoint, struct in STRUCTS.items():
        declared = {f.name for f in msgspec.structs.fields(struct)}
        assert {f.name for f in FIELDS[endpoint]} == declared, endpoint


def test_readme_carries_the_table() -> None:
    assert render_table() in (REPO / "docs" / "openai-compat.md").read_text(), "run: python -m aiobasert.server.compat"


@pytest.mark.parametrize(("endpoint", "name", "ok", "bad"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_field_is_honoured_or_refused_by_name(
    base_url: str, endpoint: str, name: str, ok: Any, bad: Any
) -> None:
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


@pytest.mark.parametrize("endpoint", list(BASE))
def test_unknown_fields_are_refused(base_url: str, endpoint: str) -> None:
    r = httpx.post(f"{base_url}{endpoint}", json={**BASE[endpoint], "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
