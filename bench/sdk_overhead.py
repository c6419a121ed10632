"""SDK overhead: N concurrent `engine.stream` consumers vs a bare ctypes loop.

Both sides drive the same library, model, lanes, prompts and token counts:
the bare loop calls baseRT_batch_step_fused (greedy) directly, one prefill
step and then one decode step per token; the SDK runs N streams through the
engine thread, batcher and per-lane decode streams. Printed side by side in
one run, with the ratio (goal: >= 0.95 at N = 32) and the event-loop lag p99
measured by a 5 ms ticker while the SDK streams (goal: < 5 ms).

    python bench/sdk_overhead.py                 # SmolLM2-135M (default model)
    python bench/sdk_overhead.py --tiny          # a tiny random model
    python bench/sdk_overhead.py --repeat 5      # best of 5 alternating runs per side
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from ctypes import byref, c_int, c_uint32, c_void_p, sizeof
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import Engine, _ffi
from bench.common import add_model_arguments, bench_model

PROMPT = "Once upon a time, in a land far away, there lived"
TICK = 0.005  # the lag probe's period: how late each 5 ms sleep wakes is the loop's lag


def bare_loop(model_path: str, n: int, tokens: int, context: int) -> float:
    """Aggregate tokens/s of a plain Python loop over the fused step."""
    lib = _ffi.load_library()
    opts = _ffi.BaseRTLoadOptions(
        struct_size=sizeof(_ffi.BaseRTLoadOptions), paged_kv=1, max_batch_size=n, prefill_chunk=256
    )
    model = lib.baseRT_load_model_ex(os.fsencode(model_path), None, context, byref(opts))
    if not model:
        raise lib.last_error("baseRT_load_model_ex")
    try:
        data = PROMPT.encode()
        buf = (c_uint32 * (len(data) + 8))()
        plen = lib.baseRT_encode(model, data, buf, len(buf))
        prompt = list(buf[:plen])
        seqs = (c_void_p * n)(*(lib.baseRT_sequence_create(model) for _ in range(n)))
        out = (c_uint32 * n)()
        t0 = time.perf_counter()
        feed = _ffi.u32_array(prompt * n)
        counts = (c_int * n)(*([plen] * n))
        lib.check(lib.baseRT_batch_step_fused(model, seqs, n, feed, counts, out), "prefill")
        ones = (c_int * n)(*([1] * n))
        for _ in range(tokens - 1):
            feed = (c_uint32 * n)(*out)
            lib.check(lib.baseRT_batch_step_fused(model, seqs, n, feed, ones, out), "decode")
        elapsed = time.perf_counter() - t0
        for i in range(n):
            lib.baseRT_sequence_free(seqs[i])
        return n * tokens / elapsed
    finally:
        lib.baseRT_free_model(model)


async def sdk(model_path: str, n: int, tokens: int, context: int) -> tuple[float, float]:
    """Aggregate tokens/s of N concurrent streams, and the loop-lag p99 in ms."""
    lags: list[float] = []
    async with Engine.open(model_path, max_batch_size=n, max_context=context, prefix_cache=False) as engine:
        await engine.generate(PROMPT, max_tokens=2)  # warm up the thread and caches
        done = False

        async def ticker() -> None:
            while not done:
                t = time.perf_counter()
                await anyio.sleep(TICK)
                lags.append((time.perf_counter() - t - TICK) * 1000)

        counted = 0

        async def consume() -> None:
            nonlocal counted
            async for _ in engine.stream(PROMPT, max_tokens=tokens, ignore_eos=True):
                counted += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            t0 = time.perf_counter()
            async with anyio.create_task_group() as streams:
                for _ in range(n):
                    streams.start_soon(consume)
            elapsed = time.perf_counter() - t0
            done = True
    assert counted == n * tokens
    lags.sort()
    p99 = lags[int(len(lags) * 0.99)] if lags else 0.0
    return counted / elapsed, p99


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .base bundle (default: SmolLM2-135M-Instruct)")
    add_model_arguments(ap)
    ap.add_argument("--lanes", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="bare and SDK runs alternate this many times; the best of each is printed, so a burst "
        "of load from other processes on a shared machine does not land on one side only",
    )
    args = ap.parse_args()
    model = bench_model(args.tiny, args.model, ffn_dim=768, tied=True)
    print(f"model: {model}\ntokens per stream: {args.tokens}")
    print(f"{'N':>4} {'bare tok/s':>12} {'SDK tok/s':>12} {'SDK/bare':>9} {'loop lag p99 ms':>16}")
    for n in (int(x) for x in args.lanes.split(",")):
        bare = rate = 0.0
        p99 = float("inf")
        for _ in range(max(1, args.repeat)):
            bare = max(bare, bare_loop(model, n, args.tokens, args.context))
            r, lag = anyio.run(sdk, model, n, args.tokens, args.context)
            if r > rate:
                rate, p99 = r, lag
        print(f"{n:>4} {bare:>12.1f} {rate:>12.1f} {rate / bare:>9.3f} {p99:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
