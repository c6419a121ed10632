"""Prefix-cache affinity on Ray Serve: AffinityRouter vs Serve's default router.

Starts a local Ray cluster, deploys aiobasert with N engine replicas, and runs
multi-turn chat sessions whose turns share a system prompt and the conversation
so far, first with aiobasert's AffinityRouter, then with Serve's default
router (power of two choices). Prints, for each, the share of prompt tokens
served from a replica's prefix cache (`usage.prompt_tokens_details.cached_tokens`)
and the wall time, and the ratio between them.

    python bench/ray_affinity.py                      # tiny random model, 2 replicas
    python bench/ray_affinity.py --model m.base --replicas 4 --sessions 16 --turns 6
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray
from openai import OpenAI
from ray import serve

from aiobasert.models.tiny import build_tiny_model
from aiobasert.server.ray_serve import build_ray_app

SYSTEM = "You are the support assistant of a parcel delivery company. Be brief and polite."


def session(client: OpenAI, model: str, n: int, turns: int, user: bool) -> tuple[int, int]:
    # The run's mode opens the system prompt: each run starts with cold caches.
    messages: list[Any] = [{"role": "system", "content": f"[{'sessions' if user else 'prefix'}] {SYSTEM}"}]
    prompt = cached = 0
    for t in range(turns):
        question = f"Customer {n}, question {t}: where is parcel {n * 100 + t}? It was due on day {t}. " * 3
        messages.append({"role": "user", "content": question})
        extra: dict[str, Any] = {"user": f"session-{n}"} if user else {}
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0, **extra)
        usage = reply.usage
        assert usage is not None
        prompt += usage.prompt_tokens
        cached += (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return prompt, cached


def run(url: str, model: str, sessions: int, turns: int, user: bool) -> tuple[float, float]:
    with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(sessions, 8)) as pool:
            results = list(pool.map(lambda n: session(client, model, n, turns, user), range(sessions)))
        elapsed = time.perf_counter() - start
    prompt = sum(p for p, _ in results)
    cached = sum(c for _, c in results)
    return cached / prompt, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a .base bundle (default: a tiny random model)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    model = args.model or build_tiny_model(Path(tempfile.mkdtemp()) / "tiny.base")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results: dict[tuple[str, bool], tuple[float, float]] = {}
    try:
        for label, router in (("affinity", "aiobasert.server.ray_router.AffinityRouter"), ("serve-default", None)):
            app = build_ray_app([str(model)], replicas=args.replicas, engine_num_cpus=0, request_router=router)
            serve.run(app, name=f"aiobasert-{label}", route_prefix="/")
            for user in (True, False):
                hit, secs = results[label, user] = run(url, model.stem, args.sessions, args.turns, user)
                how = "sessions (user field)" if user else "prompt prefix only   "
                print(f"{label:14s} {how} prompt tokens from the prefix cache: {hit:6.1%}   wall {secs:6.2f} s")
            serve.delete(f"aiobasert-{label}")
    finally:
        serve.shutdown()
        ray.shutdown()
    for user in (True, False):
        (a_hit, a_secs), (d_hit, d_secs) = results["affinity", user], results["serve-default", user]
        mode = "sessions" if user else "prefix only"
        print(
            f"{mode}: cache-hit ratio affinity/default {a_hit / max(d_hit, 1e-9):.2f}x, "
            f"wall-time ratio default/affinity {d_secs / a_secs:.2f}x"
        )


if __name__ == "__main__":
    main()
