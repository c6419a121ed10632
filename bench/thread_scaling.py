"""Decode tok/s of the reference engine against its thread count: more threads must never be slower.

Each thread count (BASERT_REF_THREADS) runs in its own process (the shared pool is sized once per
process) on one random-weight bundle of a named geometry, measuring aggregate decode tok/s at each lane
count after a prompt and a warm-up step, and the CPU time the process burnt per generated token (user +
system, all its threads): a pool whose idle threads spin shows up there, and, once the threads outnumber
the cores, as a collapse of tok/s -- so an oversubscribed sweep on a small machine (threads 1..16 on 2
cores) exposes barrier costs that a 16-core machine shows as poor scaling. Thread counts alternate
direction round by round, and --variant runs other libraries (or environments) side by side, alternating
with this one; the best round of each cell is shown, with its CPU time.

    python bench/thread_scaling.py                         # 135M shape, q4, threads 1,2,4,8,16, 1 and 16 lanes
    python bench/thread_scaling.py --geometry 1b --layers 4 --dtype base_q8
    python bench/thread_scaling.py --model X.base --threads 1,2,3,4
    python bench/thread_scaling.py --variant before=/tmp/old.so --variant after=aiobasert/_native/libbaseRT.so
    python bench/thread_scaling.py --geometry 1b --bandwidth 1024   # weights GB/s against a read loop

With --bandwidth, a read loop (bench/read_bandwidth.c: threads reading slices of a large buffer with
software prefetch, as the kernels stream weights) measures the machine's read bandwidth at each thread
count, and one-lane decode's weight bytes per token x tok/s is printed against it: a decode that reads
every weight once per token cannot beat that loop (unless part of the weights stays in the last-level
cache: use a model several times larger than it).

The geometries are the real models' layer shapes with the tiny test vocabulary (so the head is small and
the layers dominate); --layers cuts the depth to keep a sweep short. Bundles are cached under
$TMPDIR/aiobasert-bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from ctypes import byref, c_int, c_uint32, c_void_p, sizeof
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import _ffi
from aiobasert.models.tiny import build_tiny_model


@dataclass(frozen=True)
class Geometry:
    """A model's layer shapes (llama layout)."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int


GEOMETRIES = {
    "135m": Geometry(30, 576, 9, 3, 1536),  # SmolLM2-135M
    "1b": Geometry(16, 2048, 32, 8, 8192),  # Llama-3.2-1B
    "3b": Geometry(28, 3072, 24, 8, 8192),  # Llama-3.2-3B
    "8b": Geometry(32, 4096, 32, 8, 14336),  # Llama-3.1-8B
}


def bundle_for(name: str, layers: int | None, dtype: str) -> Path:
    """The cached random-weight bundle of a geometry (f32 built, then quantized when dtype says so)."""
    g = GEOMETRIES[name]
    n_layers = layers or g.n_layers
    root = Path(tempfile.gettempdir()) / "aiobasert-bench"
    root.mkdir(exist_ok=True)
    f32 = root / f"{name}-{n_layers}l-f32.base"
    if not f32.exists():
        tmp = f32.with_suffix(".tmp")
        build_tiny_model(
            tmp,
            n_layers=n_layers,
            dim=g.dim,
            n_heads=g.n_heads,
            n_kv_heads=g.n_kv_heads,
            ffn_dim=g.ffn_dim,
            tied=False,
            seed=3,
            max_position_embeddings=1024,
        )
        tmp.rename(f32)
    if dtype == "f32":
        return f32
    out = root / f"{name}-{n_layers}l-{dtype}.base"
    if not out.exists():
        from tests.quantized import quantize_bundle

        tmp = out.with_suffix(".tmp")
        quantize_bundle(f32, tmp, dtype)
        tmp.rename(out)
    return out


PREFILL = 256  # prompt tokens of the prefill measured after the decode runs (one fused step, one chunk)


def child(model: str, lanes: list[int], tokens: int) -> None:
    """In this process (its pool sized by BASERT_REF_THREADS): per lane count, tok/s and CPU ms per token."""
    lib = _ffi.load_library()
    opts = _ffi.BaseRTLoadOptions(
        struct_size=sizeof(_ffi.BaseRTLoadOptions), paged_kv=1, max_batch_size=max(lanes), prefill_chunk=256
    )
    m = lib.baseRT_load_model_ex(os.fsencode(model), None, 512, byref(opts))
    if not m:
        raise lib.last_error("baseRT_load_model_ex")
    prompt = [3 + (7 * i) % 200 for i in range(24)]
    out: dict[str, dict[str, float]] = {}

    def step(seqs: list[int], feed: list[int], counts: list[int]) -> list[int]:
        n = len(seqs)
        nxt = (c_uint32 * n)()
        rc = lib.baseRT_batch_step_fused(m, (c_void_p * n)(*seqs), n, _ffi.u32_array(feed), (c_int * n)(*counts), nxt)
        lib.check(rc, "baseRT_batch_step_fused")
        return list(nxt)

    st = _ffi.BaseRTMemoryStats()
    weights = float("nan")
    if lib.baseRT_model_memory_stats(m, byref(st)):
        weights = float(int(lib.baseRT_model_memory(m)) - st.kv_cache_capacity_bytes)
    for n in lanes:
        seqs = [lib.baseRT_sequence_create(m) for _ in range(n)]
        nxt = step(seqs, prompt * n, [len(prompt)] * n)
        nxt = step(seqs, nxt, [1] * n)  # warm-up
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(tokens):
            nxt = step(seqs, nxt, [1] * n)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        out[str(n)] = {"tok_s": n * tokens / wall, "cpu_ms_per_tok": 1e3 * cpu / (n * tokens), "weight_bytes": weights}
        for s in seqs:
            lib.baseRT_sequence_free(s)
    seq = lib.baseRT_sequence_create(m)
    feed = [3 + (7 * i) % 200 for i in range(PREFILL)]
    t0 = time.perf_counter()
    step([seq], feed, [PREFILL])
    out["prefill"] = {"tok_s": PREFILL / (time.perf_counter() - t0)}
    lib.baseRT_sequence_free(seq)
    lib.baseRT_free_model(m)
    print(json.dumps(out))


def read_bandwidth(threads: int, mib: int) -> tuple[float, float]:
    """Bytes/s of bench/read_bandwidth.c (compiled here once): `threads` threads each reading its slice of a
    `mib` MiB buffer with 32-byte loads and software prefetch, as the kernels stream weights; best of 5. Then
    bytes per CPU-second of each thread times the threads: what it reads while its threads run."""
    exe = Path(tempfile.gettempdir()) / "aiobasert-bench" / "read_bandwidth"
    src = Path(__file__).with_name("read_bandwidth.c")
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        cc = shutil.which("cc") or shutil.which("gcc")
        if not cc:
            raise SystemExit("--bandwidth needs a C compiler (cc) for bench/read_bandwidth.c")
        exe.parent.mkdir(exist_ok=True)
        subprocess.run([cc, "-O2", "-mavx2", "-pthread", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), str(mib), str(threads)], capture_output=True, text=True, check=True).stdout
    wall, _, cpu = out.split()
    return float(wall), float(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="135m")
    ap.add_argument("--layers", type=int, help="layers to build (default: the geometry's own)")
    ap.add_argument("--dtype", default="base_q4", choices=("f32", "base_q8", "base_q4"))
    ap.add_argument("--model", help="a bundle to run instead of a built geometry")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--lanes", default="1,16")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps measured per lane count")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=LIB[,VAR=VALUE...]",
        help="a library (and environment) to measure, side by side with the others, e.g. "
        "before=/tmp/old.so or 'over=aiobasert/_native/libbaseRT.so,BASERT_REF_POOL_OVERSUBSCRIBE=1'"
        " (default: the installed library)",
    )
    ap.add_argument(
        "--bandwidth",
        type=int,
        default=0,
        metavar="MIB",
        help="also measure the read bandwidth per thread count with a buffer of MIB MiB (several "
        "times the last-level cache) and print 1-lane weight bytes per token x tok/s against it",
    )
    ap.add_argument("--json", action="store_true", help="print the table's cells as one JSON object too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lanes = [int(x) for x in args.lanes.split(",")]
    if args.child:
        child(args.model, lanes, args.tokens)
        return
    model = args.model or str(bundle_for(args.geometry, args.layers, args.dtype))
    threads = [int(x) for x in args.threads.split(",")]
    variants: dict[str, dict[str, str]] = {}
    for v in args.variant or ["engine=" + str(_ffi.load_library().path)]:
        label, _, spec = v.partition("=")
        lib, *pairs = spec.split(",")
        variants[label] = {_ffi.LIB_ENV: lib, **dict(p.split("=", 1) for p in pairs)}
    best: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for r in range(args.rounds):
        for n in threads if r % 2 == 0 else threads[::-1]:
            for label, extra in variants.items() if r % 2 == 0 else list(variants.items())[::-1]:
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    "--model",
                    model,
                    "--lanes",
                    args.lanes,
                    "--tokens",
                    str(args.tokens),
                ]
                env = dict(os.environ, BASERT_REF_THREADS=str(n), **extra)
                res = json.loads(
                    subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=1800)
                    .stdout.strip()
                    .splitlines()[-1]
                )
                cell = best.setdefault((label, n), res)
                for lane, v in res.items():  # each lane count's and the prefill's best round
                    if v["tok_s"] > cell[lane]["tok_s"]:
                        cell[lane] = v
    cpus = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    print(f"model: {model}; {cpus} usable CPUs; best of {args.rounds} round(s); load average {load:.2f} at the end")
    for label, extra in variants.items():
        print(f"  {label}: {' '.join(f'{k}={v}' for k, v in extra.items())}")
    head = " | ".join(f"{label} {k} lane{'s' if k > 1 else ''}" for label in variants for k in lanes)
    print(f"| threads | {head} | {' | '.join(f'{label} prefill' for label in variants)} |")
    print("|---:|" + "---:|" * ((len(lanes) + 1) * len(variants)))
    for n in threads:
        cells = " | ".join(
            f"{best[(label, n)][str(k)]['tok_s']:.1f} ({best[(label, n)][str(k)]['cpu_ms_per_tok']:.1f})"
            for label in variants
            for k in lanes
        )
        prefill = " | ".join(f"{best[(label, n)]['prefill']['tok_s']:.0f}" for label in variants)
        print(f"| {n} | {cells} | {prefill} |")
    print(f"cells: aggregate decode tok/s (CPU ms burnt per token, all threads); prefill: tok/s of {PREFILL} tokens")
    if args.bandwidth and 1 in lanes:
        # On a shared machine a descheduled thread lowers wall-clock rates, not per-CPU-second ones: both
        # are shown (the engine's CPU time counts every thread of its process, spinning included).
        print("\n1 lane: the weights are read once per token; bytes per token x tok/s against a read loop")
        print("(per CPU-s: bytes per CPU-second of the process x threads; the loop's likewise)")
        print(
            f"| threads | {' | '.join(f'{label} GB/s (per CPU-s)' for label in variants)} | read loop GB/s "
            "(per CPU-s) | % of the loop (per CPU-s) |"
        )
        print("|---:|" + "---:|" * (len(variants) + 2))
        for n in threads:
            bw, bw_cpu = (x / 1e9 for x in read_bandwidth(n, args.bandwidth))
            solo = [best[(label, n)]["1"] for label in variants]
            rates = [c["tok_s"] * c["weight_bytes"] / 1e9 for c in solo]
            cpu_rates = [n * c["weight_bytes"] / (c["cpu_ms_per_tok"] / 1e3) / 1e9 for c in solo]
            pairs = list(zip(rates, cpu_rates, strict=True))
            print(
                f"| {n} | {' | '.join(f'{r:.1f} ({c:.1f})' for r, c in pairs)} | {bw:.1f} ({bw_cpu:.1f}) | "
                f"{' / '.join(f'{100 * r / bw:.0f}% ({100 * c / bw_cpu:.0f}%)' for r, c in pairs)} |"
            )
    if args.json:
        print(json.dumps({f"{label}/{n}": cell for (label, n), cell in best.items()}))


if __name__ == "__main__":
    main()
