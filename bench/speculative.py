"""Speculative decoding on vs off, side by side in one run (issue 36, docs/speculative.md).

For each prompt set (input-grounded: rewrite a passage with one change, quote it; and free text)
and each number of concurrent streams (1 / 4 / 16), the same greedy requests run on an engine
without speculation and on one with n-gram speculation (the default adaptive policy), each run
on an engine of its own, taking turns (the order reversed every repetition): tok/s, engine steps,
drafted / accepted tokens, and whether the outputs are identical (they must be). The ratio is
the median over repetitions of on / off tok/s of back-to-back runs, with its quartiles: on a
shared machine a single run's tok/s moves by more than speculation's cost where it does not pay.
llama-server side by side: bench/spec_vs_llama_server.py.

    python bench/speculative.py            # SmolLM2-135M (the demo model)
    python bench/speculative.py --tiny     # a tiny random model (steps and acceptance, not speed)
    python bench/speculative.py --repeat 3 --prompts free   # the median of 3 off/on pairs
    python bench/speculative.py --pair f16   # SmolLM2 f16 target: off, ngram and the demo q4 as its draft model
    python bench/speculative.py --draft-model d.base --sources draft   # any draft model for --model

With a draft model (`--pair` or `--draft-model`) each row is one source (ngram, draft) beside the
same off run: the draft model's own steps are part of the on run's time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from common import add_model_arguments, bench_model

from aiobasert import Engine, SpeculationConfig

PASSAGE = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night the keeper climbed "
    "the spiral stairs, trimmed the wick and polished the great lens, so that ships passing the rocks "
    "could find their way into the harbour. When the storm of 1893 broke the windows, the keeper kept "
    "the light burning with his own coat held against the wind."
)
GROUNDED = [
    f"Rewrite the following passage, changing only 'northern' to 'southern'. Passage: {PASSAGE}\nRewritten passage:",
    f"Quote the passage below exactly, then say in one sentence what it is about.\n\n{PASSAGE}\n\nQuote:",
    f"Copy this text word for word:\n{PASSAGE}\nCopy:",
    f"{PASSAGE}\nRepeat the second sentence of the passage above verbatim:",
]
FREE = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten year old.",
    "List five ideas for a weekend trip and say why each is fun.",
    "What are the benefits of learning a second language?",
]


async def run(model: str, spec: SpeculationConfig | None, prompts: list[str], streams: int, max_tokens: int) -> dict:
    """One engine, opened for this run alone, `streams` greedy requests at once: tok/s, steps, drafts,
    the outputs. Each run has the process to itself: of two identical engines open side by side,
    one ran 0-40% faster than the other in some runs on this loaded machine (not in others; the
    cause is not known), which would be read as speculation's gain or loss."""
    async with Engine.open(model, max_batch_size=streams, max_context=1024, speculation=spec) as engine:
        # a warm-up round of the same width on other prompts: first-step costs out of the timing, and
        # the policy's first measurements made (a draft step's time, the step fit), as a server's are
        # after its first requests: a run of a second or so would otherwise weigh them as its own
        await asyncio.gather(*(engine.generate(f"Warm up {i}:", max_tokens=16) for i in range(streams)))
        return await measure(engine, prompts, streams, max_tokens)


async def measure(engine: Engine, prompts: list[str], streams: int, max_tokens: int) -> dict:
    before = await engine.stats()
    jobs = [prompts[i % len(prompts)] for i in range(streams)]
    began, cpu = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(*(engine.generate(p, max_tokens=max_tokens, ignore_eos=True) for p in jobs))
    wall = time.perf_counter() - began
    cpu = time.process_time() - cpu
    after = await engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {
        "tok_s": tokens / wall,
        "tok_cpu_s": tokens / cpu,  # per CPU second of this process: less at the mercy of other load
        "steps": after.steps - before.steps,
        "drafted": drafted,
        "accepted": accepted,
        "ids": [o.token_ids for o in outs],
    }


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s (its own steps and draft counts with it)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--model", default=None, help="a bundle or GGUF (default: the demo SmolLM2-135M)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--draft", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeat", type=int, default=1, help="off/on pairs per row, interleaved; medians reported")
    ap.add_argument("--prompts", nargs="*", choices=["grounded", "free"], default=["grounded", "free"])
    ap.add_argument("--pair", choices=["f16", "q8"], default=None,
                    help="SmolLM2 in this dtype as the target, the demo q4 as its draft model")  # fmt: skip
    ap.add_argument("--draft-model", default=None, help="a draft model for --model (method='draft')")
    ap.add_argument("--sources", nargs="*", choices=["ngram", "draft"], default=None,
                    help="sources run beside off (default: ngram, and draft given a draft model)")  # fmt: skip
    args = ap.parse_args()
    draft_model = args.draft_model
    if args.pair:
        from aiobasert.models.cache import default_model_path, gguf_bundle_path, smollm2_gguf_path

        model = str(gguf_bundle_path(smollm2_gguf_path(), dtype=args.pair))
        draft_model = draft_model or str(default_model_path())
    else:
        model = bench_model(args.tiny, args.model)
    sources = args.sources or (["ngram", "draft"] if draft_model else ["ngram"])
    specs = {
        "ngram": SpeculationConfig(num_speculative_tokens=args.draft),
        "draft": SpeculationConfig(method="draft", draft_model=draft_model, num_speculative_tokens=args.draft)
        if draft_model
        else None,
    }
    print(f"model {model}, max_tokens {args.max_tokens}, k<={args.draft} (adaptive), draft model {draft_model}")
    print(f"{'prompts':9} {'source':6} {'streams':>7} {'off tok/s':>10} {'on tok/s':>9} {'ratio':>6} "
          f"{'quartiles':>11} {'steps off/on':>13} {'drafted':>8} {'accept':>7} {'cpu ratio':>9} same")  # fmt: skip
    for name, prompts in (("grounded", GROUNDED), ("free", FREE)):
        if name not in args.prompts:
            continue
        for streams in args.streams:
            # off and each source take turns, the order reversed every repetition (ABBA), so load from
            # elsewhere on a shared machine hits all alike; each repetition gives one on / off ratio of
            # back-to-back runs, and the median of those is quoted
            configs: dict[str, SpeculationConfig | None] = {"off": None, **{src: specs[src] for src in sources}}
            runs: dict[str, list[dict[str, Any]]] = {key: [] for key in configs}
            for i in range(args.repeat):
                for key in list(configs)[:: 1 if i % 2 == 0 else -1]:
                    runs[key].append(await run(model, configs[key], prompts, streams, args.max_tokens))
            off: dict[str, Any] = median_run(runs["off"])
            for src in sources:
                on: dict[str, Any] = median_run(runs[src])
                pairs = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["off"], runs[src], strict=True)]
                cpu = [b["tok_cpu_s"] / a["tok_cpu_s"] for a, b in zip(runs["off"], runs[src], strict=True)]
                lo, med, hi = quartiles(pairs)
                rate = on["accepted"] / on["drafted"] if on["drafted"] else 0.0
                same = all(r["ids"] == runs["off"][0]["ids"] for r in runs["off"] + runs[src])
                print(
                    f"{name:9} {src:6} {streams:>7} {off['tok_s']:>10.1f} {on['tok_s']:>9.1f} "
                    f"{med:>6.2f} {lo:>5.2f}-{hi:<5.2f} {off['steps']:>6}/{on['steps']:<6} {on['drafted']:>8} "
                    f"{rate:>7.2f} {statistics.median(cpu):>9.2f} {same}",
                    flush=True,
                )


if __name__ == "__main__":
    asyncio.run(main())
