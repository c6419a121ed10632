"""aiobasert on Ray Serve: a local 2-CPU cluster started by the module's fixture, 2 engine
replicas (each serving two tiny models) behind Serve's HTTP proxy. Streaming with the openai client,
session and prefix affinity observed in per-replica engine stats, a client disconnect
freeing the lane on its replica, and a replica killed mid-stream failing only its own
stream while Serve replaces it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

pytest.importorskip("ray.serve", reason="the Ray Serve extra is not installed (pip install 'aiobasert[ray]')")

from aiobasert import EngineConfig
from aiobasert.server import SingleEngineProvider
from aiobasert.server.ray_serve import REPLICA_HEADER, SESSION_HEADER, _provider

pytestmark = pytest.mark.ray

SYSTEM = "You are a terse assistant for a shipping company. Answer with one short sentence. " * 3


@pytest.mark.anyio
async def test_a_replica_opens_its_one_model_with_every_engine_option(tiny_model_path: Path) -> None:
    # `aiobasert serve --ray MODEL` passes kv_cache_dtype with the limits: a single model's
    # provider took only the limits (TypeError in the replica); the options are one EngineConfig now
    options = {"max_batch_size": 2, "max_context": 64, "kv_cache_dtype": "f32"}
    provider = _provider([tiny_model_path], None, options)
    assert isinstance(provider, SingleEngineProvider)
    async with provider.lifespan():
        (served,) = provider.served()
        assert served.engine.config == EngineConfig(**options) and served.engine.info.kv_cache_dtype == "f32"


@pytest.fixture(scope="module")
def client(ray_serve_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{ray_serve_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(ray_serve_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ray_serve_url, timeout=60) as c:
        yield c


def replica_of(http: httpx.Client, session: str) -> str:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={SESSION_HEADER: session})
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER]


def engine_stats(http: httpx.Client, session: str) -> tuple[str, dict[str, Any]]:
    """The engine stats of the replica `session` is routed to, and that replica's id."""
    r = http.get("/v1/internal/stats", headers={SESSION_HEADER: session})
    assert r.status_code == 200, r.text
    stats: dict[str, Any] = r.json()
    return r.headers[REPLICA_HEADER], stats


def sessions_per_replica(http: httpx.Client, count: int = 16) -> dict[str, list[str]]:
    by_replica: dict[str, list[str]] = {}
    for i in range(count):
        by_replica.setdefault(replica_of(http, f"user-{i}"), []).append(f"user-{i}")
    return by_replica


def wait_until(what: str, check: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_openai_client_streams_through_the_proxy(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny", "other"]
    messages: Any = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 3  # token by token, not one buffered body
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_models_are_routed_by_name_on_every_replica(client: OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hello"}]
    texts = {}
    for model in ("tiny", "other"):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert reply.model == model
        texts[model] = reply.choices[0].message.content
    assert texts["tiny"] != texts["other"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4, stream=True)
    assert info.value.code == "model_not_found"


def test_session_affinity_observed_in_per_replica_stats(http: httpx.Client) -> None:
    by_replica = sessions_per_replica(http)
    assert len(by_replica) == 2, "16 sessions all hashed to one of two replicas"
    probe = {replica: sessions[0] for replica, sessions in by_replica.items()}
    before = {replica: engine_stats(http, s) for replica, s in probe.items()}
    for replica, (seen, _) in before.items():
        assert seen == replica  # a session's stats request lands on its replica too
    sent = {replica: 0 for replica in by_replica}
    for _ in range(3):
        for replica, sessions in by_replica.items():
            for session in sessions:
                r = http.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "user": session},
                )
                assert r.status_code == 200 and r.headers[REPLICA_HEADER] == replica  # `user` is the session
                sent[replica] += 1
    for replica, session in probe.items():
        seen, after = engine_stats(http, session)
        assert seen == replica
        assert after["requests_finished"] - before[replica][1]["requests_finished"] == sent[replica]


def test_shared_prefix_goes_to_one_replica_and_hits_its_prefix_cache(client: OpenAI) -> None:
    replicas, cached = set(), []
    for question in ("Where is my parcel?", "Can I change the address?", "How much is express?", "Refund?"):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=2,
        )
        replicas.add(raw.headers[REPLICA_HEADER])
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens or 0)
    assert len(replicas) == 1
    assert all(c > 0 for c in cached[1:])  # the shared system prompt's KV was reused on that replica


def test_disconnect_through_the_proxy_frees_the_lane(http: httpx.Client) -> None:
    session = "disconnecting"
    _, before = engine_stats(http, session)
    body = {"prompt": "Once", "max_tokens": 1500, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers={SESSION_HEADER: session}) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")

    def freed() -> bool:
        stats = engine_stats(http, session)[1]
        cancelled = stats["requests_cancelled"] == before["requests_cancelled"] + 1
        return cancelled and stats["active_lanes"] == 0 and stats["live_sequences"] == 0

    wait_until("the lane to be freed on its replica", freed, timeout=60)
    assert engine_stats(http, session)[1]["requests_finished"] == before["requests_finished"]


def test_a_killed_replica_fails_only_its_own_stream_and_is_replaced(http: httpx.Client) -> None:
    import ray
    from ray import serve

    by_replica: dict[str, list[str]] = {}

    def both_replicas_route() -> bool:  # the router's view of its replicas may lag on a loaded machine
        by_replica.clear()
        by_replica.update(sessions_per_replica(http))  # 16 sessions: all on one replica by hash is 2**-15
        return len(by_replica) == 2

    wait_until("the router to route sessions to both replicas", both_replicas_route, timeout=60)
    (victim, victim_sessions), (survivor, survivor_sessions) = sorted(by_replica.items())
    body = {"prompt": "Once", "max_tokens": 400, "temperature": 0, "stream": True}
    long = {**body, "max_tokens": 1800}  # still generating when its replica is killed
    with (
        http.stream("POST", "/v1/completions", json=long, headers={SESSION_HEADER: victim_sessions[0]}) as doomed,
        http.stream("POST", "/v1/completions", json=body, headers={SESSION_HEADER: survivor_sessions[0]}) as alive,
    ):
        assert doomed.headers[REPLICA_HEADER] == victim and alive.headers[REPLICA_HEADER] == survivor
        doomed_lines, alive_lines = doomed.iter_lines(), alive.iter_lines()
        assert next(doomed_lines).startswith("data: ") and next(alive_lines).startswith("data: ")
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        doomed_rest = [line for line in doomed_lines if line]
        alive_rest = [line for line in alive_lines if line]
    # The killed replica's stream ends with an error event (not a hang, not a fake finish).
    assert doomed_rest[-1] == "data: [DONE]" and '"code":"replica_failed"' in doomed_rest[-2], doomed_rest[-3:]
    assert not any('"finish_reason":"length"' in line for line in doomed_rest)
    assert alive_rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in alive_rest[-2]
    assert not any('"error"' in line for line in alive_rest)

    def replaced() -> bool:
        app = serve.status().applications["aiobasert"]
        engines = app.deployments["aiobasert-engine"]
        return app.status == "RUNNING" and engines.replica_states.get("RUNNING", 0) == 2

    wait_until("Serve to replace the killed replica", replaced)
    seen: set[str] = set()

    def routed_to_two() -> bool:  # once the ingress's router has heard of the new replica
        seen.clear()
        seen.update(sessions_per_replica(http))
        return len(seen) == 2

    wait_until("the new replica to take requests", routed_to_two)
    assert survivor in seen and victim not in seen


def test_previous_response_id_follow_ups_reach_the_replica_storing_it(http: httpx.Client) -> None:
    # Responses are stored on the replica that made them: follow-ups (other inputs, no
    # session) must be routed there, not by their prompt (which would spread them).
    first = http.post("/v1/responses", json={"model": "tiny", "input": "Hello there", "max_output_tokens": 2})
    assert first.status_code == 200, first.text
    owner = first.headers[REPLICA_HEADER]
    for i in range(8):
        body = {
            "model": "tiny",
            "previous_response_id": first.json()["id"],
            "input": f"question {i} " * (i + 1),
            "max_output_tokens": 2,
        }
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] == owner
