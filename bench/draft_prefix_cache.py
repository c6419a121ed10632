"""What the draft model's own prefix cache saves: a long system prompt served again, drafts from a draft model.

Each round opens one engine (the target's prefix cache on) drafting with `--draft`, with the draft's prefix
cache on or off (off: `DraftModel.prefix` cleared after open, so only the draft's cache differs), and sends
`--requests` greedy chats one after the other: the same system prompt (about `--rules` x 20 tokens), a user
turn that differs. It prints each request's wall time, the tokens fed to the draft model for it (its catch-up
and its drafts) and the prompt tokens the target took from its cache; then the repeated requests' median
times, on over off. Every round's replies must be the same tokens (drafts change speed only).

    python bench/draft_prefix_cache.py --target SmolLM2-f16.base --draft SmolLM2-q4.base
    python bench/draft_prefix_cache.py --target T.base --draft D.base --rounds 2 --requests 4 --max-tokens 32

Measured (docs/speculative.md): SmolLM2-135M f16 drafted by its q4 bundle, an 844-token prompt, 32 tokens
out, 2 cores shared with other work: repeated requests 441 ms with the draft's cache, 2293 ms without
(medians of 6; 37 draft tokens fed instead of 851).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import Engine
from aiobasert._core.draft_model import DraftModelDrafter
from aiobasert.config import SpeculationConfig


async def round_(args: argparse.Namespace, draft_cache: bool, replies: dict[int, list[int]]) -> list[float]:
    system = " ".join(
        f"Rule {i}: answer politely, cite the manual section {i}, and never invent facts." for i in range(args.rules)
    )
    spec = SpeculationConfig(method="draft", draft_model=args.draft, adaptive=False)
    times: list[float] = []
    async with Engine.open(args.target, max_batch_size=2, speculation=spec) as engine:
        drafter = engine._thread.drafter
        assert isinstance(drafter, DraftModelDrafter)
        drafter.model.prefix = drafter.model.prefix and draft_cache
        for i in range(args.requests):
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: why is the sky blue?"},
            ]
            before = await engine._call(lambda: drafter.fed)
            began = time.perf_counter()
            out = await engine.chat(msgs, max_tokens=args.max_tokens, temperature=0)
            took = time.perf_counter() - began
            fed = await engine._call(lambda: drafter.fed) - before
            times.append(took)
            assert replies.setdefault(i, out.token_ids) == out.token_ids, "drafts changed the output"
            print(
                f"draft cache {'on ' if draft_cache else 'off'} request {i}: {took * 1000:7.0f} ms, "
                f"prompt {out.usage.prompt_tokens}, target cached {out.usage.cached_prompt_tokens}, "
                f"draft fed {fed}, drafts accepted {out.usage.accepted_draft_tokens}/{out.usage.draft_tokens}"
            )
    return times


async def main(args: argparse.Namespace) -> None:
    on: list[float] = []
    off: list[float] = []
    replies: dict[int, list[int]] = {}  # every round's replies: the same tokens, cache on or off
    for _ in range(args.rounds):
        on += (await round_(args, True, replies))[1:]  # the first request fills the caches: not a repeat
        off += (await round_(args, False, replies))[1:]
    if on and off:
        a, b = statistics.median(on), statistics.median(off)
        print(f"repeated requests, median: draft cache on {a * 1000:.0f} ms, off {b * 1000:.0f} ms, on/off {a / b:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rules", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    anyio.run(main, ap.parse_args())
