"""What a speculative verify step costs against a plain decode step, at one stream, in the engine.

One sequence holds a prompt; each repetition then times, in a rotating order, on that same sequence
(rolled back to the prompt after each, so every step sees the same KV length):

- decode:        `baseRT_batch_step_fused`, 1 row (the pending token): a plain greedy decode step;
- verify_argmax: `baseRT_batch_step_fused_rows_argmax`, k + 1 rows (the pending token and k drafts),
                 every row argmaxed in the engine (the SDK's greedy verify);
- verify_rows:   `baseRT_batch_step_fused_logits_rows`, k + 1 rows, then `baseRT_sample_logits_rows`
                 greedy over them (the SDK's verify where rows_argmax is absent or a lane samples).

It prints the median wall time and process CPU time of each, and verify / decode. A decode step that is
bandwidth-bound (every weight streamed once per step) should verify k + 1 rows for little more than one
row's cost when the engine reads each weight once for all rows of a step (native/src/forward.c: one
batched matmul per weight per slice of rows).

    python bench/verify_cost.py                            # Llama-3.2-1B shapes, Q4_K / Q6_K, k = 4
    python bench/verify_cost.py --model X.base --k 4 --reps 40 --prompt 128

Without --model a random-weight Llama-3.2-1B geometry is written (`bench/geometry_gguf.py`: Q4_K
matrices, a Q6_K embedding / tied head, the llama-bpe vocabulary) and converted once, kept quantized
(`aiobasert.models.convert --dtype auto`), under $TMPDIR/aiobasert-bench/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from ctypes import byref, c_int, c_uint32, c_void_p, sizeof
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import _ffi


def default_model(geometry: str, qtype: str) -> Path:
    """The cached random-weight bundle of `geometry` (a GGUF written, then converted kept quantized)."""
    root = Path(tempfile.gettempdir()) / "aiobasert-bench"
    root.mkdir(exist_ok=True)
    bundle = root / f"{geometry}-{qtype.lower()}-gguf.base"
    if bundle.exists():
        return bundle
    gguf = root / f"{geometry}-{qtype.lower()}.gguf"
    if not gguf.exists():
        here = Path(__file__).resolve().parent
        tmp = gguf.with_suffix(".tmp.gguf")
        subprocess.run(
            [sys.executable, str(here / "geometry_gguf.py"), geometry, str(tmp), "--qtype", qtype], check=True
        )
        tmp.rename(gguf)
    tmp = bundle.with_suffix(".tmp")
    cmd = [sys.executable, "-m", "aiobasert.models.convert", str(gguf), str(tmp), "--dtype", "auto", "--quiet"]
    subprocess.run(cmd, check=True)
    tmp.rename(bundle)
    return bundle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a bundle (default: the random-weight geometry below)")
    ap.add_argument("--geometry", default="1b", help="bench/geometry_gguf.py's geometry (default 1b)")
    ap.add_argument("--qtype", default="Q4_K", help="bench/geometry_gguf.py's --qtype (default Q4_K)")
    ap.add_argument("--k", type=int, default=4, help="drafts a verify step checks (k + 1 rows)")
    ap.add_argument("--reps", type=int, default=30, help="repetitions of each step, interleaved")
    ap.add_argument("--prompt", type=int, default=128, help="tokens the sequence holds")
    args = ap.parse_args()
    model = args.model or default_model(args.geometry, args.qtype)
    k1 = args.k + 1

    lib = _ffi.load_library()
    opts = _ffi.BaseRTLoadOptions(
        struct_size=sizeof(_ffi.BaseRTLoadOptions), paged_kv=1, max_batch_size=1, prefill_chunk=256
    )
    m = lib.baseRT_load_model_ex(os.fsencode(str(model)), None, max(1024, args.prompt + 64), byref(opts))
    if not m:
        raise lib.last_error("baseRT_load_model_ex")
    vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
    seq = lib.baseRT_sequence_create(m)
    seqs = (c_void_p * 1)(seq)
    prompt = [1000 + (7919 * i) % (vocab - 2000) for i in range(args.prompt)]
    feed = _ffi.u32_array([prompt[-1] + 1 + i for i in range(k1)])  # pending token + k drafts
    one, rows = (c_int * 1)(1), (c_int * 1)(k1)
    out = (c_uint32 * k1)()
    greedy = (_ffi.BaseRTRowSampling * k1)(*[_ffi.BaseRTRowSampling(temperature=0.0, top_p=1.0) for _ in range(k1)])
    lib.check(
        lib.baseRT_batch_step_fused(m, seqs, 1, _ffi.u32_array(prompt), (c_int * 1)(len(prompt)), out),
        "baseRT_batch_step_fused",
    )
    held = len(prompt)

    def decode() -> None:
        lib.check(lib.baseRT_batch_step_fused(m, seqs, 1, feed, one, out), "baseRT_batch_step_fused")

    def verify_argmax() -> None:
        rc = lib.baseRT_batch_step_fused_rows_argmax(m, seqs, 1, feed, rows, rows, None, 0, None, out)
        lib.check(rc, "baseRT_batch_step_fused_rows_argmax")

    def verify_rows() -> None:
        lib.check(lib.baseRT_batch_step_fused_logits_rows(m, seqs, 1, feed, rows, rows), "logits_rows")
        lib.check(lib.baseRT_sample_logits_rows(m, 0, k1, greedy, out), "baseRT_sample_logits_rows")

    cases: dict[str, Callable[[], None]] = {
        "decode": decode,
        "verify_argmax": verify_argmax,
        "verify_rows": verify_rows,
    }
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for rep in range(args.reps + 2):  # the first two rounds warm up (not counted)
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            cases[name]()
            t1, c1 = time.perf_counter(), time.process_time()
            lib.check(lib.baseRT_sequence_rollback(seq, held), "baseRT_sequence_rollback")
            if rep >= 2:
                wall[name].append(t1 - t0)
                cpu[name].append(c1 - c0)
    lib.baseRT_sequence_free(seq)
    lib.baseRT_free_model(m)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model {model}: vocab {vocab}, prompt {held} tokens, k = {args.k} ({k1} verify rows), {args.reps} reps")
    print(f"threads BASERT_REF_THREADS={os.environ.get('BASERT_REF_THREADS', 'default')}, load average {load:.2f}")
    print(f"{'step':<14} {'wall ms (median)':>17} {'wall ms (min)':>14} {'cpu ms (median)':>16}")
    for name in names:
        print(
            f"{name:<14} {1e3 * statistics.median(wall[name]):>17.2f} {1e3 * min(wall[name]):>14.2f}"
            f" {1e3 * statistics.median(cpu[name]):>16.2f}"
        )
    base_w, base_c, base_min = statistics.median(wall["decode"]), statistics.median(cpu["decode"]), min(wall["decode"])
    for name in ("verify_argmax", "verify_rows"):
        print(
            f"{name}(k={args.k}) / decode(1): wall {statistics.median(wall[name]) / base_w:.2f}"
            f" (min {min(wall[name]) / base_min:.2f}), cpu {statistics.median(cpu[name]) / base_c:.2f}"
        )


if __name__ == "__main__":
    main()
