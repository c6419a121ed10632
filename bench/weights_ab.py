"""Decode speed and memory per weight storage on SmolLM2-135M, measured side by side.

Variants: the f16 bundle with f16 kept in memory (widened in registers), the same
bundle widened to f32 at load (BASERT_REF_WIDEN_F16=1, the engine before issue 10),
and the q8 / q4 bundles (base_q8 / base_q4, integer dot products). Each variant runs
bench/engine.py --json in its own process (so its peak RSS is its own); the variants
are alternated for --rounds rounds so a shared machine's load hits all alike, and the
best round of each is printed with its ratio to the widened-f32 baseline. The f16
variants' logits are bit-identical (tests/test_native_weights.py); q8 / q4 meet the
perplexity bar (tests/test_native_quant.py).

    python bench/weights_ab.py --f16 X.f16.base [--q8 X.q8.base] [--q4 X.q4.base] [--rounds 2]
    (python -m aiobasert.convert SRC.gguf X.q4.base --dtype q4 makes the quantized bundles)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ENGINE = Path(__file__).resolve().parent / "engine.py"


def run(model: str, widen: bool, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, BASERT_REF_WIDEN_F16="1" if widen else "0")
    cmd = [sys.executable, str(ENGINE), "--json", "--model", model, "--tokens", str(args.tokens),
           "--lanes", args.lanes, "--prefill", str(args.prefill)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1800).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--f16", required=True, help="the f16 bundle")
    ap.add_argument("--q8")
    ap.add_argument("--q4")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--lanes", default="1,4,16")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    variants: dict[str, tuple[str, bool]] = {"f32 widened": (args.f16, True), "f16 kept": (args.f16, False)}
    if args.q8:
        variants["q8"] = (args.q8, False)
    if args.q4:
        variants["q4"] = (args.q4, False)
    best: dict[str, dict[str, Any]] = {}
    names = list(variants)
    for r in range(args.rounds):
        for v in names if r % 2 == 0 else names[::-1]:
            res = run(*variants[v], args)
            b = best.setdefault(v, res)
            for lanes, rate in res["decode_tok_s"].items():
                b["decode_tok_s"][lanes] = max(b["decode_tok_s"][lanes], rate)
            b["prefill_tok_s"] = max(b["prefill_tok_s"], res["prefill_tok_s"])
            b["peak_rss_mb"] = min(b["peak_rss_mb"], res["peak_rss_mb"])
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; "
          f"best of {args.rounds} alternated rounds; ratio = variant / f32 widened")
    base = best["f32 widened"]
    print(f"{'':>24}" + "".join(f"{v:>20}" for v in names))

    def row(label: str, get: Any, fmt: str) -> None:
        cells = [f"{get(best[v]):{fmt}} ({get(best[v]) / get(base):.2f}x)" for v in names]
        print(f"{label:>24}" + "".join(f"{c:>20}" for c in cells))

    for lanes in base["decode_tok_s"]:
        row(f"decode tok/s, {lanes} lane(s)", lambda b, n=lanes: b["decode_tok_s"][n], ".1f")
    row("prefill tok/s", lambda b: b["prefill_tok_s"], ".1f")
    row("weights+scratch MB", lambda b: b["weights_mb"], ".0f")
    row("peak RSS MB", lambda b: b["peak_rss_mb"], ".0f")


if __name__ == "__main__":
    main()
