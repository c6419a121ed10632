"""Lifecycle soak: the suite's model-based random walk (tests/lifecycle_model.py), long.

Runs seeded walks on asyncio and trio over an untied tiny model: random opens,
streams, reads, breaks, cancellations from other tasks, timeouts, aclose,
dropped references, idle checks and closes (drain, drain timed out then abort,
abort). Every invariant is checked after every step (no task blocked past a
bound, typed endings only, nothing held once idle, no thread left after close).
Prints per-backend totals and PASS/FAIL.

    python bench/lifecycle_soak.py                     # 20 seeds x 400 steps per backend
    python bench/lifecycle_soak.py --seeds 100 --steps 1000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert.models.tiny import build_tiny_model
from tests.lifecycle_model import LifecycleWalk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--backend", choices=["asyncio", "trio", "both"], default="both")
    args = ap.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny.base", tied=False)
    backends = ["asyncio", "trio"] if args.backend == "both" else [args.backend]
    failures = 0
    for backend in backends:
        totals: dict[str, int] = {}
        t0 = time.perf_counter()
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            walk = LifecycleWalk(model, seed)
            try:
                anyio.run(walk.run, args.steps, backend=backend)
            except BaseException:
                failures += 1
                print(f"{backend} seed {seed}: FAIL after {walk.history[-12:]}")
                traceback.print_exc()
                continue
            s = walk.stats
            for key in ("steps", "opens", "closes", "streams", "done", "closed", "errors", "cancelled", "idle_checks"):
                totals[key] = totals.get(key, 0) + getattr(s, key)
        elapsed = time.perf_counter() - t0
        print(f"{backend}: {args.seeds} walks in {elapsed:.1f} s: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    print("lifecycle soak:", "PASS" if failures == 0 else f"FAIL ({failures} walks)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
