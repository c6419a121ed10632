"""Weight storage A/B on SmolLM2-135M: f16 kept in memory (widened in registers) against
f16 widened to f32 at load (BASERT_REF_WIDEN_F16=1, the engine's behaviour before issue 10).

Each variant runs bench/engine.py --json in its own process (so peak RSS is its own), the
variants alternated for --rounds rounds so a shared machine's load hits both alike; the
best round of each is reported with the kept/widened ratios. Logits are bit-identical
between the two (tests/test_native_weights.py), so this measures speed and memory only.

    python bench/weights_ab.py [--model X.base] [--tokens 16] [--lanes 1,4,16] [--rounds 2]
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
VARIANTS = {"f16 kept": "0", "f32 widened": "1"}


def run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, BASERT_REF_WIDEN_F16=VARIANTS[variant])
    cmd = [sys.executable, str(ENGINE), "--json", "--tokens", str(args.tokens), "--lanes", args.lanes,
           "--prefill", str(args.prefill)]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1800).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--lanes", default="1,4,16")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    best: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for v in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            res = run(v, args)
            b = best.setdefault(v, res)
            for lanes, rate in res["decode_tok_s"].items():
                b["decode_tok_s"][lanes] = max(b["decode_tok_s"][lanes], rate)
            b["prefill_tok_s"] = max(b["prefill_tok_s"], res["prefill_tok_s"])
            b["peak_rss_mb"] = min(b["peak_rss_mb"], res["peak_rss_mb"])
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    kept, wide = best["f16 kept"], best["f32 widened"]
    print(f"{'':>22} {'f16 kept':>10} {'f32 widened':>12} {'ratio':>7}")
    for lanes in kept["decode_tok_s"]:
        a, b = kept["decode_tok_s"][lanes], wide["decode_tok_s"][lanes]
        print(f"{'decode tok/s, ' + lanes + ' lane(s)':>22} {a:>10.1f} {b:>12.1f} {a / b:>6.2f}x")
    a, b = kept["prefill_tok_s"], wide["prefill_tok_s"]
    print(f"{'prefill tok/s':>22} {a:>10.1f} {b:>12.1f} {a / b:>6.2f}x")
    a, b = kept["weights_mb"], wide["weights_mb"]
    print(f"{'weights+scratch MB':>22} {a:>10.0f} {b:>12.0f} {a / b:>6.2f}x")
    a, b = kept["peak_rss_mb"], wide["peak_rss_mb"]
    print(f"{'peak RSS MB':>22} {a:>10.0f} {b:>12.0f} {a / b:>6.2f}x")


if __name__ == "__main__":
    main()
