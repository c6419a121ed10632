"""AffinityRouter's policy without a cluster: session and prefix affinity, the prefix table,
load-aware fallback and dead replicas. Replicas are stand-ins carrying what the policy
reads (`replica_id`, `max_ongoing_requests`); the end-to-end behaviour on a real cluster
is in test_server_ray_serve.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve extra is not installed (pip install 'aiobasert[ray]')")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from aiobasert.server.ray_router import AffinityRouter, replica_tag
from aiobasert.server.ray_serve import ForwardedRequest, affinity_of, continued_on

# Serve's routers live on asyncio event loops.
on_asyncio = pytest.mark.parametrize("anyio_backend", ["asyncio"])
pytestmark = pytest.mark.anyio

DEPLOYMENT = DeploymentID(name="aiobasert-engine", app_name="aiobasert")
SYSTEM = "You are a terse assistant for a shipping company. Answer with one short sentence. " * 2


@dataclass
class Replica:
    replica_id: ReplicaID
    max_ongoing_requests: int = 8


REPLICAS: list[Any] = [Replica(ReplicaID(unique_id=u, deployment_id=DEPLOYMENT)) for u in ("r1", "r2", "r3")]


def router(**options: Any) -> AffinityRouter:
    r = AffinityRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
    )
    r.initialize_state(**options)
    return r


def request(session: str | None = None, prompt: str | None = None) -> PendingRequest:
    fwd = ForwardedRequest(
        method="POST",
        path="/v1/chat/completions",
        query_string=b"",
        headers=[],
        body=b"",
        session=session,
        prompt=prompt,
    )
    return PendingRequest(args=[fwd], kwargs={}, metadata=RequestMetadata(request_id="x", internal_request_id="x"))


async def preferred(r: AffinityRouter, pending: PendingRequest, replicas: list[Any] = REPLICAS) -> str | None:
    """The replica ranked first on its own (None: no preference, two random candidates)."""
    ranks = await r.choose_replicas(replicas, pending)
    assert ranks and all(ranks)
    return ranks[0][0].replica_id.unique_id if len(ranks) == 2 and len(ranks[0]) == 1 else None


@on_asyncio
async def test_a_session_always_prefers_one_replica_and_sessions_spread() -> None:
    r = router()
    chosen = {s: await preferred(r, request(session=s)) for s in (f"user-{i}" for i in range(32))}
    for s, replica in chosen.items():
        assert replica is not None and await preferred(r, request(session=s)) == replica
    assert set(chosen.values()) == {"r1", "r2", "r3"}
    # Only the dead replica's sessions move when a replica goes (rendezvous hashing).
    survivors = [rep for rep in REPLICAS if rep.replica_id.unique_id != "r2"]
    for s, replica in chosen.items():
        after = await preferred(r, request(session=s), survivors)
        assert after == replica if replica != "r2" else after in ("r1", "r3")


@on_asyncio
async def test_prompts_sharing_a_prefix_prefer_one_replica() -> None:
    r = router()
    first = await preferred(r, request(prompt=SYSTEM + "Where is my parcel?"))
    assert first is not None
    for question in ("Refund?", "Can I change the address?", "x" * 500):
        assert await preferred(r, request(prompt=SYSTEM + question)) == first
    assert await preferred(r, request()) is None  # nothing to be affine to: load balancing only


@on_asyncio
async def test_the_prefix_table_follows_where_a_conversation_was_served() -> None:
    r = router(block_chars=16)
    turn1 = SYSTEM + "user: hi\nassistant: hello\n"
    hashed = await preferred(r, request(prompt=turn1))
    elsewhere = next(rep for rep in REPLICAS if rep.replica_id.unique_id != hashed)
    # Load sent turn 1 elsewhere: its KV lives there now, and turn 2 follows it.
    r.on_request_routed(request(prompt=turn1), elsewhere.replica_id, None)
    turn2 = turn1 + "user: and the weather?\n"
    assert await preferred(r, request(prompt=turn2)) == elsewhere.replica_id.unique_id
    r.on_replica_actor_died(elsewhere.replica_id)  # its cache died with it: back to hashing
    survivors = [rep for rep in REPLICAS if rep is not elsewhere]
    assert await preferred(r, request(prompt=turn2), survivors) == hashed


@on_asyncio
async def test_an_overloaded_preferred_replica_is_passed_over() -> None:
    r = router(imbalance=2)
    pending = request(session="alice")
    favourite = await preferred(r, pending)
    assert favourite is not None
    for rep in REPLICAS:
        r.on_new_queue_len_info(rep.replica_id, 0)
    fav_id = next(rep.replica_id for rep in REPLICAS if rep.replica_id.unique_id == favourite)
    r.on_new_queue_len_info(fav_id, 2)  # within the imbalance allowed: affinity wins
    assert await preferred(r, pending) == favourite
    r.on_new_queue_len_info(fav_id, 3)  # beyond it: two random replicas, the less loaded wins
    ranks = await r.choose_replicas(REPLICAS, pending)
    assert len(ranks) == 1 and len(ranks[0]) == 2


def test_affinity_keys_from_requests() -> None:
    chat = b'{"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}'
    session, prompt = affinity_of({}, chat)
    assert session is None and prompt is not None and "S" in prompt and prompt.index("S") < prompt.index("Q")
    assert affinity_of({"x-session-id": "h"}, b'{"user": "u", "prompt": "P"}') == ("h", "P")
    assert affinity_of({}, b'{"user": "u", "prompt": [1, 2]}') == ("u", "1,2,")
    assert affinity_of({}, b"not json") == (None, None)


@on_asyncio
async def test_a_previous_response_id_goes_to_the_replica_storing_it() -> None:
    r = router()
    owner = REPLICAS[1]
    response_id = f"resp_{replica_tag(owner.replica_id.to_full_id_str())}_{'0' * 24}"
    body = json.dumps({"previous_response_id": response_id, "input": "more"}).encode()
    tag = continued_on(body)
    assert tag is not None and continued_on(b'{"previous_response_id": "resp_0123"}') is None
    fwd = ForwardedRequest(
        method="POST",
        path="/v1/responses",
        query_string=b"",
        headers=[],
        body=body,
        session="someone-else",
        prompt="more",
        replica=tag,
    )
    pending = PendingRequest(args=[fwd], kwargs={}, metadata=RequestMetadata(request_id="x", internal_request_id="x"))
    # Only that replica can answer, so it is the only candidate (also when it is the busiest).
    r._replica_queue_len_cache.update(owner.replica_id, 100)
    assert await r.choose_replicas(REPLICAS, pending) == [[owner]]
    # Gone: routed as usual (the replica that gets it answers 404 naming previous_response_id).
    others = [rep for rep in REPLICAS if rep is not owner]
    ranks = await r.choose_replicas(others, pending)
    assert ranks and all(rep in others for rank in ranks for rep in rank)
