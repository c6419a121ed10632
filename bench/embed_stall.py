"""Embed stall: the longest gap between two tokens of a running stream while a
~1000-token input is embedded, before (one `baseRT_embed` forward between two
steps, forced with AIOBASERT_EMBED_TAPS=0) and after (the embed fed in chunks
within the per-step prefill budget, pooled from hidden-state taps), side by
side in one run; also how far the chunked result is from baseRT_embed's.

    python bench/embed_stall.py                  # SmolLM2-135M (default model)
    python bench/embed_stall.py --tiny           # a tiny random model
    python bench/embed_stall.py --chunks 256 64  # prefill_chunk values to try
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import Engine
from bench.common import add_model_arguments, bench_model

TEXT = "The quick brown fox jumps over the lazy dog while the model keeps talking. "


async def measure(model: str, chunk: int, taps: bool, n_tokens: int) -> tuple[float, float, float, np.ndarray]:
    """(longest gap during the embed, median gap before it, embed latency, vector), seconds."""
    os.environ["AIOBASERT_EMBED_TAPS"] = "1" if taps else "0"
    async with Engine.open(model, max_batch_size=2, prefill_chunk=chunk, max_context=2048) as engine:
        ids = (await engine.encode(TEXT * 200))[:n_tokens]
        await engine.embed(ids[:8])  # settle the embed path outside the measurement
        stamps: list[float] = []
        window: list[float] = []
        async with anyio.create_task_group() as tg:
            stream = engine.stream("Once upon a time", max_tokens=1500, ignore_eos=True)

            async def read() -> None:
                async for _ in stream:
                    stamps.append(time.perf_counter())

            tg.start_soon(read)
            while len(stamps) < 20:
                await anyio.sleep(0.001)
            window.append(time.perf_counter())
            vec = await engine.embed(ids)
            window.append(time.perf_counter())
            while len(stamps) < 2 or stamps[-1] <= window[1]:  # the first token after the embed
                await anyio.sleep(0.001)
            await stream.aclose()
    t = np.array(stamps)
    gaps = np.diff(t)
    ends = t[1:]
    during = gaps[(ends > window[0]) & (t[:-1] < window[1])]
    before = gaps[ends <= window[0]]
    return float(during.max()), float(np.median(before)), window[1] - window[0], vec


async def main_async(model: str, chunks: list[int], n_tokens: int) -> None:
    print(f"model {model}\nstream decoding (2 lanes) while a {n_tokens}-token embed runs\n")
    print(f"{'prefill_chunk':>13} {'mode':>22} {'longest gap':>12} {'median gap':>11} {'embed':>8} {'rel err':>9}")
    for chunk in chunks:
        before = await measure(model, chunk, False, n_tokens)
        after = await measure(model, chunk, True, n_tokens)
        err = float(np.linalg.norm(after[3].astype(np.float64) - before[3]) / np.linalg.norm(before[3]))
        for name, r, e in (("baseRT_embed (before)", before, ""), ("chunked taps (after)", after, f"{err:.2e}")):
            print(f"{chunk:>13} {name:>22} {r[0] * 1e3:>10.1f}ms {r[1] * 1e3:>9.1f}ms {r[2]:>7.2f}s {e:>9}")
        print(f"{'':>13} {'longest gap ratio':>22} {before[0] / after[0]:>11.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 64], help="prefill_chunk values")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens to embed")
    args = ap.parse_args()
    model = bench_model(args.tiny)
    anyio.run(main_async, model, args.chunks, args.tokens)


if __name__ == "__main__":
    main()
