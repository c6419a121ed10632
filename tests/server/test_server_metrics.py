"""`GET /metrics`, scraped and parsed with prometheus_client's own parser before
and after traffic (the official openai client), on the tiny model."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from loopback import MODEL_NAME
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from aiobasert.models.tiny import SPECIAL_TOKENS


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    return {"model_name": MODEL_NAME, "max_batch_size": 4}  # without an API key


def scrape(base_url: str) -> dict[str, float]:
    r = httpx.get(f"{base_url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_metrics_count_traffic(base_url: str) -> None:
    before = scrape(base_url)
    assert before["aiobasert:kv_blocks_total"] > 0
    assert before["aiobasert:num_requests_running"] == 0 and before["aiobasert:num_requests_waiting"] == 0
    with OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        long_prompt = " ".join(["the quick brown fox"] * 30)
        for _ in range(2):  # the second one hits the prefix cache
            client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=5, temperature=0)
        list(client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, temperature=0
        ))
    after = scrape(base_url)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"aiobasert:{h}_count") == 3, h
        assert grew(f"aiobasert:{h}_sum") > 0, h
    assert grew("aiobasert:inter_token_latency_seconds_count") >= 3 * 4  # >= n-1 intervals per request
    assert grew("aiobasert:prefix_cache_hits_total") > 0
    assert grew("aiobasert:prefix_cache_queries_total") >= grew("aiobasert:prefix_cache_hits_total")
    assert grew("aiobasert:request_success_total{finished_reason=length}") == 3
    # Idle again: live requests hold no KV; the long prompt's blocks stay in the prefix cache,
    # reported apart (the engine's own count includes them: ~100% "used" on an idle server).
    assert after["aiobasert:kv_blocks_used"] == 0 and after["aiobasert:num_requests_running"] == 0
    assert after["aiobasert:kv_blocks_cached"] > 0
    # The probe runs every 0.1 s: the traffic above can finish before its first sample, so wait for one.
    deadline = time.monotonic() + 10
    while scrape(base_url).get("aiobasert:event_loop_lag_seconds_count", 0.0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(base_url)["aiobasert:event_loop_lag_seconds_count"] > 0


def test_abort_latency_is_recorded_on_disconnect(base_url: str) -> None:
    before = scrape(base_url).get("aiobasert:abort_latency_seconds_count", 0.0)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2000, "stream": True,
            "logit_bias": {str(t): -100 for t in range(len(SPECIAL_TOKENS))}}  # it cannot end by itself
    with httpx.Client(base_url=base_url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the stream is running; leaving the block drops the connection
    deadline = time.monotonic() + 10
    while scrape(base_url).get("aiobasert:abort_latency_seconds_count", 0.0) == before:
        assert time.monotonic() < deadline, "no abort latency was recorded"
        time.sleep(0.05)
    after = scrape(base_url)
    assert after["aiobasert:abort_latency_seconds_count"] == before + 1
    assert after["aiobasert:num_requests_running"] == 0
