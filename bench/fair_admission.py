"""Fair admission against FIFO (AIOBASERT_ADMISSION=fifo), side by side in one run, on the
traffic it was built for and on the traffic it could make worse (docs/fairness.md):

- holders: one client's streamed n=16 request and eight long generations hold every lane,
  then another client's 2-token request: its time to first token, and what fairness costs
  the long requests (their mean completion, the run's steps, the preemptions);
- sustained: a long stream, read from its 10th token on, on 2 lanes beside closed-loop
  clients sending short requests one after another (issue 37 item 1): how long the stream
  takes, its pauses and its longest one, the short requests served meanwhile;
- burst: distinct long prompts at once, more than the lanes (issue 37 item 2): the burst's
  total and mean completion;
- mix: the burst with a few short requests arriving in it: every request's mean completion.

Steps are the robust measure; seconds move with the machine's load.

    python bench/fair_admission.py                # SmolLM2-135M (default model)
    python bench/fair_admission.py --tiny         # a tiny random model
    python bench/fair_admission.py --only burst   # one scenario
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import Completion, Engine, client_scope
from bench.common import add_model_arguments, bench_model

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides through the storm."
Result = dict[str, float]


def _steps(c: Completion) -> int:
    return c.timing.finished_step - c.timing.submitted_step


async def holders(engine: Engine, args: argparse.Namespace) -> Result:
    longs: list[Completion] = []
    steps0 = (await engine.stats()).steps

    async def choice() -> None:  # one choice of a streamed n=16 request: one client
        with client_scope("n=16 client"):
            stream = engine.stream(PROMPT, max_tokens=args.long, ignore_eos=True, temperature=0.8, seed=1)
            async for _tok in stream:
                pass
            longs.append(await stream)

    async def generation() -> None:  # eight long generations, each its own client
        longs.append(await engine.generate(PROMPT, max_tokens=args.long, ignore_eos=True, temperature=0))

    async with anyio.create_task_group() as tg:
        for _ in range(16):
            tg.start_soon(choice)
        for _ in range(8):
            tg.start_soon(generation)
        while (s := await engine.stats()).active_lanes < args.lanes or s.steps < steps0 + 40:
            await anyio.sleep(0.01)
        short = await engine.generate("Hello", max_tokens=2, temperature=0)
    t = short.timing
    return {
        "short TTFT (steps)": t.first_token_step - t.submitted_step,
        "short TTFT (s)": t.time_to_first_token_s,
        "long requests, mean (steps)": statistics.mean(_steps(c) for c in longs),
        "long requests, mean (s)": statistics.mean(c.timing.total_s for c in longs),
    }


async def sustained(engine: Engine, args: argparse.Namespace) -> Result:
    served = 0
    async with anyio.create_task_group() as tg:
        stream = engine.stream(PROMPT, max_tokens=args.stream, ignore_eos=True, temperature=0)
        for _ in range(10):
            await stream.__anext__()

        async def client(i: int) -> None:
            nonlocal served
            while True:
                await engine.generate(f"{i} {served} hi", max_tokens=args.short, ignore_eos=True, temperature=0)
                served += 1

        for i in range(args.clients):
            tg.start_soon(client, i)
        async for _tok in stream:
            pass
        done = await stream
        tg.cancel_scope.cancel()
    t = done.timing
    return {
        "stream, first to last token (steps)": t.finished_step - t.first_token_step,
        "stream, total (s)": t.total_s,
        "stream pauses": t.pauses,
        "stream's longest pause (steps)": t.longest_pause_steps,
        "short requests served meanwhile": served,
    }


def _burst_prompts(args: argparse.Namespace) -> list[str]:
    # distinct from the first word: no prefix is shared (each prompt ~`burst_prompt` tokens)
    return [" ".join(f"w{(i * 7919 + j) % 10007}" for j in range(args.burst_prompt // 3)) for i in range(args.burst)]


async def _run_all(calls: list[Callable[[], Awaitable[Completion]]]) -> list[Completion]:
    got: list[Completion] = []

    async def one(call: Callable[[], Awaitable[Completion]]) -> None:
        got.append(await call())

    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(one, call)
    return got


async def burst(engine: Engine, args: argparse.Namespace) -> Result:
    def call(p: str) -> Callable[[], Awaitable[Completion]]:
        return lambda: engine.generate(p, max_tokens=args.burst_tokens, ignore_eos=True, temperature=0)

    got = await _run_all([call(p) for p in _burst_prompts(args)])
    return {
        "burst, all done (steps)": max(c.timing.finished_step for c in got) - min(c.timing.submitted_step for c in got),
        "burst, mean completion (steps)": statistics.mean(_steps(c) for c in got),
        "burst, mean completion (s)": statistics.mean(c.timing.total_s for c in got),
    }


async def mix(engine: Engine, args: argparse.Namespace) -> Result:
    def call(p: str, n: int) -> Callable[[], Awaitable[Completion]]:
        return lambda: engine.generate(p, max_tokens=n, ignore_eos=True, temperature=0)

    prompts = _burst_prompts(args)
    calls = [call(p, args.burst_tokens) for p in prompts]
    shorts = [call(f"short {i}", 2) for i in range(len(prompts) // 4)]
    got = await _run_all(calls + shorts)
    short = [c for c in got if len(c.token_ids) == 2]
    return {
        "mix, all done (steps)": max(c.timing.finished_step for c in got) - min(c.timing.submitted_step for c in got),
        "mix, mean completion (steps)": statistics.mean(_steps(c) for c in got),
        "mix, short requests' mean (steps)": statistics.mean(_steps(c) for c in short),
    }


SCENARIOS: dict[str, Callable[[Engine, argparse.Namespace], Awaitable[Result]]] = {
    "holders": holders, "sustained": sustained, "burst": burst, "mix": mix,
}  # fmt: skip


async def measure(model: str, policy: str, name: str, args: argparse.Namespace) -> Result:
    os.environ["AIOBASERT_ADMISSION"] = policy  # read when the engine opens
    lanes = 2 if name == "sustained" else args.lanes
    async with Engine.open(model, max_batch_size=lanes, max_context=args.context) as engine:
        await engine.generate("warm up", max_tokens=2)
        before, started = await engine.stats(), time.monotonic()
        result = await SCENARIOS[name](engine, args)
        stats = await engine.stats()
    result["all done (s)"] = time.monotonic() - started
    result["engine steps"] = stats.steps - before.steps
    result["preemptions"] = stats.requests_preempted - before.requests_preempted
    return result


async def main_async(model: str, args: argparse.Namespace) -> None:
    print(f"model {Path(model).name}, {args.lanes} lanes (sustained: 2), max_context {args.context}")
    for name in args.only or SCENARIOS:
        fifo = await measure(model, "fifo", name, args)
        fair = await measure(model, "fair", name, args)
        print(f"\n{name}")
        print(f"{'':38}{'FIFO':>12}{'fair':>12}{'fair/FIFO':>12}")
        for key in fifo:
            a, b = fifo[key], fair[key]
            ratio = f"{b / a:12.2f}" if a else f"{'-':>12}"
            print(f"{key:38}{a:12.3f}{b:12.3f}{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only this scenario (repeatable)")
    ap.add_argument("--lanes", type=int, default=8, help="max_batch_size (the sustained scenario runs on 2)")
    ap.add_argument("--context", type=int, default=2048, help="max_context")
    ap.add_argument("--long", type=int, default=400, help="holders: tokens of each long request")
    ap.add_argument("--stream", type=int, default=120, help="sustained: tokens of the long stream")
    ap.add_argument("--short", type=int, default=8, help="sustained: tokens of each short request")
    ap.add_argument("--clients", type=int, default=6, help="sustained: closed-loop short clients")
    ap.add_argument("--burst", type=int, default=48, help="burst, mix: distinct prompts")
    ap.add_argument("--burst-prompt", type=int, default=870, help="burst, mix: ~tokens of each prompt")
    ap.add_argument("--burst-tokens", type=int, default=32, help="burst, mix: tokens generated for each")
    args = ap.parse_args()
    anyio.run(main_async, bench_model(args.tiny), args)


if __name__ == "__main__":
    main()
