"""Soak: many requests with random cancellation at 32 lanes on a tiny model.

Prints requests done / cancelled / failed, KV blocks in use at the end (must
be 0 once the prefix cache is evicted), live sequences (must be 0) and RSS
growth between the first and the last tenth of the run (must stay within 5%).

    python bench/soak.py                    # 10,000 requests
    python bench/soak.py --requests 2000
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import AioBaseRTError, Engine
from aiobasert.models.tiny import build_tiny_model


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


async def soak(model: Path, requests: int, lanes: int, concurrency: int, seed: int) -> int:
    rng = random.Random(seed)
    done = cancelled = failed = 0
    rss: list[float] = []
    words = [
        "the",
        "a",
        "of",
        "time",
        "once",
        "upon",
        "model",
        "token",
        "stream",
        "lane",
        "batch",
        "engine",
        "😀",
        "日本",
    ]
    async with Engine.open(model, max_batch_size=lanes, max_context=512, max_queue=4 * concurrency) as engine:
        limiter = anyio.Semaphore(concurrency)

        async def one(i: int) -> None:
            nonlocal done, cancelled, failed
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
            params = dict(
                max_tokens=rng.randint(1, 48),
                temperature=rng.choice([0.0, 0.8]),
                seed=i,
                stop=[rng.choice(words)] if rng.random() < 0.2 else None,
            )
            cancel_after = rng.randint(0, 20) if rng.random() < 0.4 else None
            try:
                n = 0
                async for _ in engine.stream(prompt, **params):
                    n += 1
                    if cancel_after is not None and n > cancel_after:
                        cancelled += 1
                        return  # leaving the loop drops the stream: the lane is cancelled
                done += 1
            except AioBaseRTError:
                failed += 1
            finally:
                limiter.release()

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(requests):
                await limiter.acquire()
                tg.start_soon(one, i)
                if i % max(1, requests // 10) == 0:
                    rss.append(rss_mb())
        elapsed = time.perf_counter() - t0
        rss.append(rss_mb())
        await anyio.sleep(0.1)
        stats = await engine.stats()
        await engine.evict_prefix_cache()
        after = await engine.stats()
    growth = (rss[-1] - rss[1]) / rss[1] * 100 if len(rss) > 2 else 0.0
    print(f"requests: {requests} in {elapsed:.1f} s ({requests / elapsed:.0f} req/s) at {lanes} lanes")
    print(f"done: {done}  cancelled: {cancelled}  failed: {failed}")
    print(f"live sequences at end: {stats.live_sequences}")
    print(f"KV blocks in use at end: {after.kv_blocks_used} (prefix cache held {stats.prefix_blocks_cached})")
    print(f"RSS: {rss[1]:.1f} MB after 10% -> {rss[-1]:.1f} MB at end ({growth:+.1f}%)")
    ok = (
        done + cancelled + failed == requests
        and failed == 0
        and after.kv_blocks_used == 0
        and stats.live_sequences == 0
        and abs(growth) <= 5.0
    )
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--lanes", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny.base", tied=False)
    sys.exit(anyio.run(soak, model, args.requests, args.lanes, args.concurrency, args.seed))


if __name__ == "__main__":
    main()
