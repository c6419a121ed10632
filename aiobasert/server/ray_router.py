"""`AffinityRouter`: the Serve request router of aiobasert's engine replicas.

Requests of one session, or sharing a prompt prefix, go to the same replica,
where that prefix's KV is in the prefix cache; an overloaded replica is passed
over for the less loaded of two random ones. It reads the `session` and
`prompt` attributes of the request's first argument (`ray_serve.ForwardedRequest`).

Serve pickles a request router's module *by value* into each process that
routes (`RequestRouterConfig`), so this module holds the router alone and
duck-types its input instead of importing the request class.
"""

from __future__ import annotations

import collections
import hashlib
import random
from collections.abc import Sequence
from typing import Any, Protocol, cast

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

__all__ = ["AffinityRouter", "replica_tag"]

_FIRST_BLOCK_CHARS = 64


class _Affinity(Protocol):
    session: str | None
    prompt: str | None


def replica_tag(full_id: str) -> str:
    """A replica's short tag (from its full id): its Responses ids carry it, so a
    `previous_response_id` follow-up is routed back to the replica that stores it."""
    return hashlib.blake2b(full_id.encode(), digest_size=6).hexdigest()


def _score(key: str, replica: RunningReplica) -> bytes:
    return hashlib.blake2b(f"{key}\x00{replica.replica_id.unique_id}".encode(), digest_size=8).digest()


def _rendezvous(key: str, replicas: Sequence[RunningReplica]) -> RunningReplica:
    """Highest-random-weight hashing: stable across processes; when a replica goes,
    only its keys move."""
    return max(replicas, key=lambda r: _score(key, r))


class AffinityRouter(RequestRouter):
    """Serve request router: session / prompt-prefix affinity with load-aware fallback.

    A request continuing a stored response (`replica`: the tag its
    `previous_response_id` carries) goes to the replica that stores it, however
    loaded (nowhere else can answer it); if that replica is gone, routing goes on
    as usual and the replica that gets it answers 404 naming `previous_response_id`.
    A session key picks its replica by rendezvous hashing. A prompt first looks
    for the replica that last served its longest known prefix (a bounded table
    of prefix-block hashes, filled as requests are routed: where that prefix's
    KV actually is); without one, rendezvous hashing on its first block, so
    prompts sharing a system prompt meet even on a cold start. The preferred
    replica ranks first; if its queue is longer than the shortest by more than
    `imbalance` it is skipped, and if it is full Serve takes the next rank:
    two random replicas, the less loaded wins.
    """

    def initialize_state(
        self, block_chars: int = 64, imbalance: int = 4, table_size: int = 100_000, **kwargs: Any
    ) -> None:
        self._block_chars = block_chars
        self._imbalance = imbalance
        self._table_size = table_size
        # prefix-block hash -> full id of the replica that last served a prompt with that prefix
        self._owner: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.preferred_hits = 0
        self.fallbacks = 0

    @staticmethod
    def _forwarded(pending: PendingRequest | None) -> _Affinity | None:
        # Duck-typed: Serve pickles this module by value into the ingress process, so a
        # class imported here would not be the class the ingress instantiates.
        if pending is None:
            return None
        for arg in pending.args:
            if hasattr(arg, "session") and hasattr(arg, "prompt"):
                return cast(_Affinity, arg)
        return None

    def _blocks(self, prompt: str) -> list[bytes]:
        """Chained hashes of the prompt's whole blocks (the first always, even if short)."""
        out: list[bytes] = []
        h = hashlib.blake2b(digest_size=16)
        n = max(1, len(prompt) // self._block_chars)
        for i in range(n):
            h.update(prompt[i * self._block_chars : (i + 1) * self._block_chars].encode())
            out.append(h.copy().digest())
        return out

    def _preferred(self, fwd: _Affinity, candidates: list[RunningReplica]) -> RunningReplica | None:
        if fwd.session:
            return _rendezvous("s:" + fwd.session, candidates)
        if not fwd.prompt:
            return None
        by_id = {r.replica_id.to_full_id_str(): r for r in candidates}
        for block in reversed(self._blocks(fwd.prompt)):
            owner = self._owner.get(block)
            if owner is not None and owner in by_id:
                return by_id[owner]
        return _rendezvous("p:" + fwd.prompt[:_FIRST_BLOCK_CHARS], candidates)

    def _overloaded(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self._replica_queue_len_cache
        mine = cache.get(replica.replica_id)
        known = [q for q in (cache.get(r.replica_id) for r in candidates) if q is not None]
        return mine is not None and bool(known) and mine - min(known) > self._imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ranks: list[list[RunningReplica]] = []
        fwd = self._forwarded(pending_request)
        tag = getattr(fwd, "replica", None)
        if tag:
            owner = [r for r in candidate_replicas if replica_tag(r.replica_id.to_full_id_str()) == tag]
            if owner:
                return [owner]
        preferred = self._preferred(fwd, candidate_replicas) if fwd is not None else None
        if preferred is not None and not self._overloaded(preferred, candidate_replicas):
            ranks.append([preferred])
        others = [r for r in candidate_replicas if not ranks or r is not ranks[0][0]] or candidate_replicas
        ranks.append(random.sample(others, min(2, len(others))))
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        fwd = self._forwarded(pending_request)
        if fwd is None or not fwd.prompt:
            return
        owner = replica_id.to_full_id_str()
        for block in self._blocks(fwd.prompt):
            self._owner[block] = owner
            self._owner.move_to_end(block)
        while len(self._owner) > self._table_size:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        dead = replica_id.to_full_id_str()
        for block in [b for b, owner in self._owner.items() if owner == dead]:
            del self._owner[block]
