"""Several models behind one server (GroupProvider + ModelRouter), over real HTTP with the
openai client: routing by `model`, /v1/models, 404 model_not_found, per-model stats,
keep-alive unload and reload, and disconnects still freeing the lane."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from loopback import sigterm_and_wait
from openai import OpenAI

from aiobasert.server import GroupProvider, create_app

API_KEY = "sk-router"


@pytest.fixture(scope="module")
def two_models(asgi_server: Callable[[Any], str], tiny_model_path: Path, second_tiny_model_path: Path) -> str:
    provider = GroupProvider([tiny_model_path, f"other={second_tiny_model_path}"], max_batch_size=2)
    return asgi_server(create_app(provider, api_key=API_KEY))


@pytest.fixture(scope="module")
def idle_unloading(asgi_server: Callable[[Any], str], tiny_model_path: Path, second_tiny_model_path: Path) -> str:
    provider = GroupProvider([tiny_model_path, second_tiny_model_path], keep_alive=0, max_batch_size=2)
    return asgi_server(create_app(provider))


@pytest.fixture(scope="module")
def idle_unloading_slow(asgi_server: Callable[[Any], str], smollm2_path: Path) -> str:
    """keep_alive 0 with SmolLM2 (~250 tok/s here: 8 s for 2,000 tokens): such a stream is surely
    still running while the test looks for 0.1 s (a tiny model's would be done, and sent, in a blink)."""
    return asgi_server(create_app(GroupProvider([f"second={smollm2_path}"], keep_alive=0, max_batch_size=2)))


@pytest.fixture(scope="module")
def client(two_models: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{two_models}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def model_stats(base_url: str, api_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{base_url}/v1/internal/models", headers=headers, timeout=30)
    assert r.status_code == 200
    stats: dict[str, Any] = r.json()
    return stats


def wait_until(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def chat(client: OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert reply.model == model
    return reply.choices[0].message.content or ""


def test_models_lists_every_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny", "other"]
    assert client.models.retrieve("other").id == "other"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_requests_are_routed_by_model(client: OpenAI, two_models: str) -> None:
    before = model_stats(two_models, API_KEY)
    text_tiny, text_other = chat(client, "tiny"), chat(client, "other")
    assert text_tiny != text_other  # different weights answered
    assert chat(client, "other") == text_other  # and the same one again
    completion = client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0)
    assert completion.model == "tiny"
    after = model_stats(two_models, API_KEY)
    assert after["tiny"]["requests"] - before["tiny"]["requests"] == 2
    assert after["other"]["requests"] - before["other"]["requests"] == 2
    # The per-model stats carry each engine's own counters, labelled by model name.
    assert after["other"]["engine"]["requests_finished"] - before["other"]["engine"]["requests_finished"] == 2


def test_streaming_through_the_router(client: OpenAI) -> None:
    whole = chat(client, "other")
    stream = client.chat.completions.create(
        model="other", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"other"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_unknown_model_is_openai_404(client: OpenAI, two_models: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=stream
            )
        assert info.value.code == "model_not_found"
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "model" and "gpt-4o" in body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    # Authentication comes first: without the key an unknown model is a 401, not a 404.
    r = httpx.post(f"{two_models}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 401


def test_a_request_without_model_uses_the_first(two_models: str) -> None:
    r = httpx.post(
        f"{two_models}/v1/completions",
        json={"prompt": "Once", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_idle_model_unloads_and_the_next_request_reloads_it(idle_unloading: str) -> None:
    with OpenAI(base_url=f"{idle_unloading}/v1", api_key="x", max_retries=0) as client:
        first = chat(client, "tiny")
        wait_until("tiny to unload", lambda: not model_stats(idle_unloading)["tiny"]["loaded"])
        loads = model_stats(idle_unloading)["tiny"]["loads"]
        assert chat(client, "tiny") == first  # reloaded, same weights, same greedy answer
        after = model_stats(idle_unloading)["tiny"]
        assert after["loads"] == loads + 1 and after["unloads"] >= 1
        assert [m.id for m in client.models.list()] == ["tiny", "second"]  # unloaded models are listed too


@pytest.mark.slow
def test_a_model_streaming_is_not_unloaded(idle_unloading_slow: str) -> None:
    idle_unloading = idle_unloading_slow
    prompt = "Count from 1 to 1000: 1, 2, 3, 4, 5,"  # greedy SmolLM2 keeps counting: no early end of text
    body = {"model": "second", "prompt": prompt, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{idle_unloading}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        # keep_alive is 0, yet the model with a stream in flight stays loaded and leased.
        for _ in range(5):
            stats = model_stats(idle_unloading)["second"]
            assert stats["loaded"] and stats["leases"] == 1
            time.sleep(0.02)
    # The client went away mid-stream: the lease ends and the idle model unloads.
    wait_until("second to unload", lambda: not model_stats(idle_unloading)["second"]["loaded"])


def test_disconnect_through_the_router_frees_the_lane(two_models: str) -> None:
    before = model_stats(two_models, API_KEY)["other"]["engine"]["requests_cancelled"]
    body = {"model": "other", "prompt": "Once", "max_tokens": 2000, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(timeout=30, headers=headers) as http,
        http.stream("POST", f"{two_models}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")

    def freed() -> bool:
        s = model_stats(two_models, API_KEY)["other"]
        e = s["engine"]
        return s["leases"] == 0 and e["requests_cancelled"] == before + 1 and e["active_lanes"] == 0

    wait_until("the lane to be freed", freed)


def test_serve_command_serves_several_models(tiny_model_path: Path, second_tiny_model_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "aiobasert", "serve", str(tiny_model_path), f"--model=other={second_tiny_model_path}"]
    cmd += ["--port", str(port), "--keep-alive", "60", "--max-batch-size", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                return httpx.get(f"{base}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until("the server to start", healthy, timeout=60)
        with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["tiny", "other"]
            assert chat(client, "other")
            with pytest.raises(openai.NotFoundError):
                chat(client, "tiny2")
    finally:
        sigterm_and_wait(proc, 30)
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful exit


def test_metrics_are_labelled_per_model(client: OpenAI, two_models: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def e2e_counts() -> dict[str, float]:
        text = httpx.get(f"{two_models}/metrics", timeout=30).text
        return {
            s.labels["model_name"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "aiobasert_e2e_request_latency_seconds_count"
        }

    before = e2e_counts()
    chat(client, "other")
    chat(client, "other")
    chat(client, "tiny")
    after = e2e_counts()
    assert after["other"] - before.get("other", 0.0) == 2
    assert after["tiny"] - before.get("tiny", 0.0) == 1
    gauges = httpx.get(f"{two_models}/metrics", timeout=30).text
    assert 'aiobasert_kv_blocks_capacity{model_name="other"}' in gauges
    assert 'aiobasert_kv_blocks_capacity{model_name="tiny"}' in gauges


def test_a_body_not_declared_json_loads_no_model(idle_unloading: str) -> None:
    """A `text/plain` POST (a web page's preflight-free "simple request") is refused
    before the router leases, so it cannot make the server load a model either."""
    wait_until("tiny to unload", lambda: not model_stats(idle_unloading)["tiny"]["loaded"])
    loads = model_stats(idle_unloading)["tiny"]["loads"]
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1})
    r = httpx.post(f"{idle_unloading}/v1/completions", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    after = model_stats(idle_unloading)["tiny"]
    assert after["loads"] == loads and not after["loaded"]
