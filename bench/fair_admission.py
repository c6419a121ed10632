"""Fair admission: how long a 2-token request of another client waits for its first
token while one client's streamed n=16 request and eight long generations hold every
lane, under plain FIFO admission (AIOBASERT_ADMISSION=fifo) and under fair admission
(the default, docs/fairness.md), side by side in one run; also what fairness costs the
long requests (their mean completion, the run's steps, the preemptions). Steps are
the robust measure; seconds move with the machine's load.

    python bench/fair_admission.py                # SmolLM2-135M (default model)
    python bench/fair_admission.py --tiny         # a tiny random model
    python bench/fair_admission.py --long 200     # tokens of each long request
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import Completion, Engine, client_scope
from bench.common import add_model_arguments, bench_model

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides through the storm."


async def measure(model: str, policy: str, long: int, lanes: int) -> dict[str, float]:
    os.environ["AIOBASERT_ADMISSION"] = policy  # read when the engine opens
    async with Engine.open(model, max_batch_size=lanes) as engine:
        await engine.generate("warm up", max_tokens=2)
        longs: list[Completion] = []
        started = time.monotonic()
        steps0 = (await engine.stats()).steps

        async def choice() -> None:  # one choice of a streamed n=16 request: one client
            with client_scope("n=16 client"):
                stream = engine.stream(PROMPT, max_tokens=long, ignore_eos=True, temperature=0.8, seed=1)
                async for _tok in stream:
                    pass
                longs.append(await stream)

        async def generation() -> None:  # eight long generations, each its own client
            longs.append(await engine.generate(PROMPT, max_tokens=long, ignore_eos=True, temperature=0))

        async with anyio.create_task_group() as tg:
            for _ in range(16):
                tg.start_soon(choice)
            for _ in range(8):
                tg.start_soon(generation)
            while (s := await engine.stats()).active_lanes < lanes or s.steps < steps0 + 40:
                await anyio.sleep(0.01)
            short = await engine.generate("Hello", max_tokens=2, temperature=0)
        stats = await engine.stats()
        t = short.timing
        return {
            "ttft_s": t.time_to_first_token_s,
            "ttft_steps": t.first_token_step - t.submitted_step,
            "long_mean_steps": statistics.mean(c.timing.finished_step - c.timing.submitted_step for c in longs),
            "long_mean_s": statistics.mean(c.timing.total_s for c in longs),
            "all_s": time.monotonic() - started,
            "steps": stats.steps - steps0,
            "preempted": stats.requests_preempted,
        }


async def main_async(model: str, long: int, lanes: int) -> None:
    fifo = await measure(model, "fifo", long, lanes)
    fair = await measure(model, "fair", long, lanes)
    print(f"model {Path(model).name}, {lanes} lanes, 16 + 8 requests of {long} tokens, then a 2-token request")
    print(f"{'':28}{'FIFO':>12}{'fair':>12}{'FIFO/fair':>12}")
    for key, label in [("ttft_steps", "short TTFT (steps)"), ("ttft_s", "short TTFT (s)"),
                       ("long_mean_steps", "long requests, mean (steps)"), ("long_mean_s", "long requests, mean (s)"),
                       ("all_s", "all done (s)"),
                       ("steps", "engine steps"), ("preempted", "preemptions")]:  # fmt: skip
        a, b = fifo[key], fair[key]
        ratio = f"{a / b:12.1f}" if b else f"{'-':>12}"
        print(f"{label:28}{a:12.3f}{b:12.3f}{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--long", type=int, default=400, help="tokens of each long request")
    ap.add_argument("--lanes", type=int, default=8, help="max_batch_size")
    args = ap.parse_args()
    model = bench_model(args.tiny)
    anyio.run(main_async, model, args.long, args.lanes)


if __name__ == "__main__":
    main()
