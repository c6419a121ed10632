"""aiobasert against llama.cpp on one GGUF: tokens, greedy ids, perplexity, peak RSS.

llama.cpp is the project's oracle for any GGUF. One run puts both engines side by side:

(a) tokenization of TEXTS: llama-server /tokenize (add_special and parse_special off) against
    `engine.encode(text)`, id for id; and of the chat prompts below, rendered by llama.cpp with
    the model's own template and tokenized as llama-server's chat path does (BOS when the vocab
    adds it, markers parsed), against our `encode(rendered, special=True)` (+ BOS likewise);
(b) greedy continuation of the CHATS (5 chat prompts): llama-server /completion on the
    rendered prompt's token ids (temperature 0, n_predict 32, prompt cache off) against ours with
    temperature 0 and max_tokens 32 on the same ids (both stop at an end-of-generation token,
    which both count). The first diverging position per prompt is printed with both engines'
    top-2 log-probabilities there (the logit gap: a near-tie or a real difference). Ours through
    `engine.chat(messages)` (our own template rendering) is shown too;
(c) perplexity of bench/data/held_out.txt: `llama-perplexity -f FILE -c N -b N` (default N=128)
    against ours from the engine's logits with the same chunking: the whole text tokenized once
    (BOS first when the vocab adds one), cut into len // N chunks of N tokens, each chunk's first
    token replaced by BOS (when the vocab adds one) and evaluated from an empty cache, the last
    N/2 - 1 predictions of each chunk scored (positions N/2 .. N-2 predicting the next token);
    ppl = exp(mean NLL). Ours reads f16 logit rows through the C ABI
    (baseRT_batch_step_fused_logits_rows), from the same bundle Engine.open loads;
(d) peak RSS of each side: llama-server (which served (a) and (b)) against our Engine process
    (which did (a) and (b)), and llama-perplexity against our perplexity process, each a child
    process's VmHWM (not wait4's ru_maxrss, which starts at the parent's RSS). Both use --threads
    (default 2) threads.

    python bench/llama_oracle.py --model GGUF --llama-bin-dir DIR        # DIR: llama-server, llama-perplexity
    python bench/llama_oracle.py --model GGUF --record tests/data/llama_cpp/NAME.json
    python bench/llama_oracle.py --model GGUF --recorded FILE           # no llama.cpp: against a recording

Without --llama-bin-dir the llama.cpp tools are built once from the llama-cpp-python sdist
(vs_llama_server.build_llama_server, with the llama-perplexity target too). --record writes
llama.cpp's side (the texts and their ids, the chat prompts, rendered text, prompt ids, greedy ids
with top-2 log-probabilities, the perplexity with its chunking, llama.cpp's version and commit)
as JSON: tests/models/test_llama_cpp_parity.py holds the engine to it without building llama.cpp.
A model the engine refuses (conversion error) still gets llama.cpp's side printed and recorded;
ours is reported as refused, exit 3.

Our bundle: --dtype auto (default) is `Engine.open(gguf, dtype="auto")` where the engine has
that, else the GGUF's own block format where a bundle dtype carries it exactly (Q4_1 -> q4, Q8_0
-> q8) and f16 otherwise; --dtype f16|q8|q4 forces one (see aiobasert.models.convert).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import hashlib
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_llama_server as vls  # noqa: E402  (the llama.cpp builder and process helpers)

HELD_OUT = ROOT / "bench" / "data" / "held_out.txt"
N_PREDICT = 32
FORMAT = 1

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space, trailing space ",
    "Multiple   spaces\tand\ttabs\n\nand blank lines\n",
    "It's, we're, they'll, I'd, you've, she's, DON'T, We'Re",
    "Numbers: 0 7 42 123 2024 1234567 3.14159 -17 1e-9 0x1F",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12))",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "Ünïcödé: café, naïve, façade, Straße, Ελληνικά, русский",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "Emoji 🙂👍🏽 and symbols ∑∫√π ≠ ≤ → ©®™",
    "<|im_start|> is text here, as is <start_of_turn> and <|endoftext|>",
    "   \n\n\t  ",
    "URL https://example.com/path?q=1&x=y#frag and e-mail a.b@c.org",
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
    [{"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "How many legs does a spider have? Answer briefly."}],
]

# GGUFs without tokenizer.chat_template (the Gemma 3 270M one): llama.cpp's built-in template
# for the architecture, named here and recorded.
BUILTIN_TEMPLATE = {"gemma3": "gemma", "gemma2": "gemma", "gemma": "gemma"}


class OracleError(Exception):
    """A failure reported in one line (exit 2)."""


# ---- the model ------------------------------------------------------------------------------------


def gguf_facts(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(path)

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return {
        "file": path.name,
        "size": path.stat().st_size,
        "sha256": digest.hexdigest(),
        "architecture": field("general.architecture"),
        "tokenizer_model": field("tokenizer.ggml.model"),
        "tokenizer_pre": field("tokenizer.ggml.pre"),
        "has_chat_template": field("tokenizer.chat_template") is not None,
        "matrix_types": dict(kinds.most_common()),
    }


def our_dtype(facts: dict[str, Any], requested: str) -> str:
    """The bundle dtype for --dtype: forced, or (auto) the GGUF's own block format where a
    bundle dtype carries it exactly, else f16 (see aiobasert.models.convert)."""
    if requested != "auto":
        return requested
    kinds = facts["matrix_types"]
    top = max(kinds, key=kinds.get) if kinds else "F16"
    return {"Q4_1": "q4", "Q8_0": "q8"}.get(top, "f16")


def open_accepts_dtype() -> bool:
    from aiobasert import Engine

    return "dtype" in inspect.signature(Engine.open).parameters


def our_bundle(gguf_path: Path, dtype: str) -> Path:
    """The cached bundle the engine loads (converted on first use); ConversionError if refused."""
    from aiobasert.models.cache import gguf_bundle_path

    return gguf_bundle_path(gguf_path, dtype=dtype, progress=False)  # type: ignore[arg-type]


# ---- child processes, peak RSS by VmHWM -----------------------------------------------------------


def vm_hwm(pid: int | str, key: str = "VmHWM") -> int | None:
    """The process's peak RSS so far (VmHWM, bytes; key="VmRSS": its RSS now), None once it is
    gone. Not wait4's ru_maxrss: a child's ru_maxrss starts at its parent's RSS at fork (Linux
    keeps the pre-exec high-water mark), so it would report this bench's own RSS for any child
    smaller than it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_measured(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 3600.0) -> tuple[int, str, int]:
    """(exit code, output, peak RSS in bytes) of cmd, run in its own process group (killed as a
    whole on timeout or interrupt). The RSS is VmHWM sampled every 20 ms while it runs (growth in
    its last 20 ms can be missed; our workers report their own VmHWM at exit instead)."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        vls._LIVE[proc.pid] = proc
        peak = 0
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                peak = max(peak, vm_hwm(proc.pid) or 0)
                if time.monotonic() > deadline:
                    raise OracleError(f"{cmd[0]} did not finish within {timeout:.0f} s")
                time.sleep(0.02)
        finally:
            vls._stop(proc, grace=2.0)
        out.seek(0)
        return int(proc.returncode), out.read().decode(errors="replace"), peak


# ---- llama.cpp's side -----------------------------------------------------------------------------


def llama_tools(args: argparse.Namespace) -> tuple[Path, Path, str]:
    """(llama-server, llama-perplexity, version line)."""
    if args.llama_bin_dir is not None:
        server, ppl = args.llama_bin_dir / "llama-server", args.llama_bin_dir / "llama-perplexity"
    else:
        server = vls.build_llama_server(None, args.build_jobs, targets=("llama-server", "llama-perplexity"))
        ppl = server.parent / "llama-perplexity"
    for tool in (server, ppl):
        if not os.access(tool, os.X_OK):
            raise OracleError(f"{tool} is not an executable file")
    return server, ppl, vls.llama_server_version(server)


def llama_commit(server: Path, version: str, given: str | None) -> str:
    """The llama.cpp commit: --llama-commit, the builder's BUILD-INFO, or what --version names."""
    if given:
        return given
    for line in version.split("; "):
        if line.startswith("llama.cpp commit "):
            return line.removeprefix("llama.cpp commit ")
    m = re.search(r"commit ([0-9a-f]{7,40})", version)
    return m.group(1) if m else "unknown"


async def llama_server_side(server: Path, gguf_path: Path, facts: dict[str, Any], args: argparse.Namespace,
                            logdir: Path) -> tuple[dict[str, Any], dict[str, int]]:  # fmt: skip
    """(a) and (b) through one llama-server: the record's texts and prompts, and its peak RSS."""
    port = vls.free_port()
    cmd = [str(server), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
           "-c", str(args.ctx), "-t", str(args.threads), "-tb", str(args.threads), "--no-webui"]  # fmt: skip
    builtin = None if facts["has_chat_template"] else BUILTIN_TEMPLATE.get(str(facts["architecture"]))
    # a built-in name is only a name without jinja (with it, the text would be the template)
    cmd += ["--no-jinja", "--chat-template", builtin] if builtin else ["--jinja"]
    srv = vls.Server("llama-server", cmd, port, logdir / "llama-server.log")
    srv.start()
    assert srv.proc is not None
    record: dict[str, Any] = {
        "template": f"llama.cpp built-in {builtin!r} (the GGUF has no tokenizer.chat_template)"
        if builtin
        else "the GGUF's tokenizer.chat_template (llama-server --jinja)",
    }
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
            await srv.wait_ready(client, args.start_timeout)

            async def post(path: str, body: dict[str, Any]) -> Any:
                resp = await client.post(srv.base + path, json=body)
                if resp.status_code != 200:
                    raise OracleError(f"llama-server {path}: HTTP {resp.status_code}: {resp.text[:300]}")
                return resp.json()

            record["texts"] = [
                {"text": t, "ids": (await post("/tokenize", {"content": t, "add_special": False,
                                                             "parse_special": False}))["tokens"]}
                for t in TEXTS
            ]  # fmt: skip
            prompts = []
            for messages in CHATS:
                rendered = (await post("/apply-template", {"messages": messages}))["prompt"]
                # as llama-server's chat path: the vocab's BOS added, the template's markers parsed
                ids = (await post("/tokenize", {"content": rendered, "add_special": True, "parse_special": True}))[
                    "tokens"
                ]
                # greedy (temperature 0 keeps only the top logit), no penalties, full-softmax top-2 logprobs
                out = await post("/completion", {"prompt": ids, "n_predict": N_PREDICT, "temperature": 0.0,
                                                 "repeat_penalty": 1.0, "dry_multiplier": 0.0,
                                                 "return_tokens": True, "cache_prompt": False, "n_probs": 2,
                                                 "post_sampling_probs": False})  # fmt: skip
                top2 = [[[p["id"], p["logprob"]] for p in step["top_logprobs"][:2]]
                        for step in out["completion_probabilities"]]  # fmt: skip
                prompts.append({"messages": messages, "rendered": rendered, "ids": ids, "greedy": out["tokens"],
                                "top2": top2, "text": out["content"]})  # fmt: skip
            record["prompts"] = prompts
            ppl_text = HELD_OUT.read_text()
            record["ppl_ids"] = (await post("/tokenize", {"content": ppl_text, "add_special": True,
                                                          "parse_special": False}))["tokens"]  # fmt: skip
        # alive: its whole high-water mark, and what it holds once loaded and served
        rss = {"llama-server": vm_hwm(srv.proc.pid) or 0, "llama-server-end": vm_hwm(srv.proc.pid, "VmRSS") or 0}
    finally:
        srv.stop()
    return record, rss


def llama_perplexity(tool: Path, gguf_path: Path, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    cmd = [str(tool), "-m", str(gguf_path), "-f", str(HELD_OUT), "-c", str(args.ppl_ctx), "-b", str(args.ppl_ctx),
           "-t", str(args.threads), "-tb", str(args.threads)]  # fmt: skip
    rc, out, rss = run_measured(cmd)
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    if rc != 0 or m is None or chunks is None:
        raise OracleError(f"llama-perplexity failed (exit {rc}):\n  " + "\n  ".join(out.splitlines()[-15:]))
    return {"ppl": float(m.group(1)), "ppl_std": float(m.group(2)), "chunks": int(chunks.group(1))}, rss


def llama_side(args: argparse.Namespace, gguf_path: Path, facts: dict[str, Any]) -> dict[str, Any]:
    server, ppl_tool, version = llama_tools(args)
    print("llama.cpp:", version, flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="llama_oracle-"))
    record, server_rss = asyncio.run(llama_server_side(server, gguf_path, facts, args, logdir))
    ppl, ppl_rss = llama_perplexity(ppl_tool, gguf_path, args)
    sha = hashlib.sha256(HELD_OUT.read_bytes()).hexdigest()
    n_ctx = args.ppl_ctx
    ids = record.pop("ppl_ids")
    return {
        "format": FORMAT,
        "model": facts,
        "llama_cpp": {
            "source": args.llama_source,
            "version": version,
            "commit": llama_commit(server, version, args.llama_commit),
            "server_args": f"-np 1 -c {args.ctx} -t {args.threads}",
            "perplexity_args": f"-c {n_ctx} -b {n_ctx} -t {args.threads}",
        },
        "n_predict": N_PREDICT,
        "sampling": "temperature 0 (greedy), stops at an end-of-generation token (included in greedy)",
        **record,
        "perplexity": {
            "file": str(HELD_OUT.relative_to(ROOT)),
            "sha256": sha,
            "n_ctx": n_ctx,
            "n_tokens": len(ids),
            "scored_per_chunk": n_ctx - n_ctx // 2 - 1,
            "ids_sha256": ids_digest(ids),
            **ppl,
        },
        "rss": {**server_rss, "llama-perplexity": ppl_rss},
    }


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.uint32).tobytes()).hexdigest()


# ---- our side (child processes: python bench/llama_oracle.py --worker ...) ------------------------


async def engine_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """(a) and (b) through Engine.open on the bundle; on a divergence, our top-2 at its position."""
    from aiobasert import Engine

    kw: dict[str, Any] = {"max_batch_size": 1, "max_context": spec["ctx"]}
    if spec.get("open_dtype"):
        kw["dtype"] = spec["open_dtype"]
    out: dict[str, Any] = {}
    async with Engine.open(spec["model"], **kw) as engine:
        out["texts"] = [await engine.encode(t) for t in spec["texts"]]
        prompts = []
        for p in spec["prompts"]:
            ours_ids = await engine.encode(p["rendered"], special=True)
            done = await engine.generate(p["ids"], max_tokens=N_PREDICT, temperature=0.0)
            chat = await engine.chat(p["messages"], max_tokens=N_PREDICT, temperature=0.0)
            entry: dict[str, Any] = {"prompt_ids": ours_ids, "greedy": done.token_ids, "chat_greedy": chat.token_ids,
                                     "chat_prompt_tokens": chat.usage.prompt_tokens}  # fmt: skip
            k = first_divergence(p["greedy"], done.token_ids)
            if k is not None:
                entry["at_divergence"] = await top2_at(engine, p["ids"] + p["greedy"][:k], p["greedy"][k]
                                                       if k < len(p["greedy"]) else None)  # fmt: skip
            prompts.append(entry)
        out["prompts"] = prompts
        out["vm_rss_end"] = vm_hwm("self", "VmRSS")
    return out


async def top2_at(engine: Any, prefix: list[int], theirs: int | None) -> dict[str, Any]:
    """Our top-2 log-probabilities after `prefix`, and llama.cpp's choice's (if in our top 20)."""
    toks = [t async for t in engine.stream(prefix, max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=20)]
    assert toks and toks[-1].top_logprobs is not None
    top = sorted(((t.id, t.logprob) for t in toks[-1].top_logprobs), key=lambda kv: -kv[1])
    theirs_lp = dict(top).get(theirs) if theirs is not None else None
    return {"top2": [list(top[0]), list(top[1])], "theirs_logprob": theirs_lp}


def first_divergence(theirs: Sequence[int], ours: Sequence[int]) -> int | None:
    """First index where the sequences differ (one ending early counts), None when equal."""
    for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if a != b:
            return i
    return None if len(theirs) == len(ours) else min(len(theirs), len(ours))


def perplexity_ids(ids: list[int], n_ctx: int, bos: int | None) -> list[tuple[list[int], list[int]]]:
    """llama-perplexity's chunking: (fed tokens, scored targets) per chunk."""
    first = n_ctx // 2
    chunks = []
    for c in range(len(ids) // n_ctx):
        chunk = ids[c * n_ctx : (c + 1) * n_ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        chunks.append((chunk, ids[c * n_ctx + first + 1 : (c + 1) * n_ctx]))
    return chunks


def our_perplexity(lib: Any, model: int, ids: list[int], n_ctx: int, bos: int | None) -> tuple[float, float, int]:
    """(ppl, its standard error as llama-perplexity states it, scored tokens) from the engine's
    logit rows, llama-perplexity's chunking; each chunk on a fresh sequence."""
    from ctypes import c_int, c_uint32, c_void_p

    vocab = int(lib.baseRT_batch_logits_stride(model)) // 2
    first = n_ctx // 2
    piece = 8  # logit rows per step: the engine's scratch holds max_batch_size x 8 rows
    prefill = max(1, min(first, int(lib.baseRT_max_prefill_chunk(model))))
    nlls: list[float] = []
    rows = np.empty((piece, vocab), dtype=np.float16)
    for chunk, targets in perplexity_ids(ids, n_ctx, bos):
        seq = lib.baseRT_sequence_create(model)
        if not seq:
            raise OracleError(f"baseRT_sequence_create: {lib.baseRT_get_error()!r}")
        seqs = (c_void_p * 1)(seq)
        try:
            pos = 0
            while pos < first:  # the unscored first half: prefill, logits unread
                n = min(prefill, first - pos)
                if lib.baseRT_batch_step_fused_logits(model, seqs, 1, (c_uint32 * n)(*chunk[pos : pos + n]),
                                                      (c_int * 1)(n)) != 0:  # fmt: skip
                    raise OracleError(f"step failed: {lib.baseRT_get_error()!r}")
                pos += n
            scored = 0
            while pos < n_ctx - 1:
                n = min(piece, n_ctx - 1 - pos)
                feed = (c_uint32 * n)(*chunk[pos : pos + n])
                if lib.baseRT_batch_step_fused_logits_rows(model, seqs, 1, feed, (c_int * 1)(n), (c_int * 1)(n)) != 0:
                    raise OracleError(f"step failed: {lib.baseRT_get_error()!r}")
                if lib.baseRT_read_batch_logits(model, n, rows.ctypes.data_as(c_void_p)) != vocab:
                    raise OracleError("baseRT_read_batch_logits: short read")
                for r in range(n):
                    x = rows[r].astype(np.float64)
                    top = x.max()
                    nlls.append(float(top + math.log(np.exp(x - top).sum()) - x[targets[scored]]))
                    scored += 1
                pos += n
        finally:
            lib.baseRT_sequence_free(seq)
    mean = float(np.mean(nlls))
    var = float(np.mean(np.square(nlls))) - mean * mean
    ppl = math.exp(mean)
    return ppl, math.sqrt(max(var, 0.0) / (len(nlls) - 1)) * ppl, len(nlls)


def ppl_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """(c): the held-out text tokenized by our engine, scored from its logits."""
    from aiobasert._ffi import BaseRTLoadOptions, load_library

    lib = load_library()
    opts = BaseRTLoadOptions(struct_size=ctypes.sizeof(BaseRTLoadOptions), paged_kv=1, max_batch_size=1,
                             prefix_cache=0, prefill_chunk=spec["n_ctx"])  # fmt: skip
    model = lib.baseRT_load_model_ex(os.fsencode(spec["model"]), None, spec["n_ctx"], ctypes.byref(opts))
    if not model:
        raise OracleError(f"load failed: {lib.baseRT_get_error()!r}")
    try:
        text = HELD_OUT.read_text().encode()
        cap = len(text) + 8
        buf = (ctypes.c_uint32 * cap)()
        n = lib.baseRT_encode_plain(model, text, buf, cap)
        if n < 0:
            raise OracleError(f"encode failed: {lib.baseRT_get_error()!r}")
        ids = list(buf[:n])
        bos = int(lib.baseRT_bos_id(model)) if spec["add_bos"] else None
        if bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        ppl, std, scored = our_perplexity(lib, model, ids, spec["n_ctx"], bos)
        return {"ppl": ppl, "ppl_std": std, "scored": scored, "n_tokens": len(ids), "ids_sha256": ids_digest(ids)}
    finally:
        lib.baseRT_free_model(model)


def run_worker(kind: str, spec: dict[str, Any], threads: int) -> tuple[dict[str, Any], int]:
    with tempfile.TemporaryDirectory(prefix="llama_oracle-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {
            **os.environ,
            "BASERT_REF_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        cmd = [sys.executable, __file__, "--worker", kind, str(spec_path), str(out_path)]  # fmt: skip
        rc, out, rss = run_measured(cmd, env=env)
        if rc != 0 or not out_path.is_file():
            raise OracleError(f"our {kind} process failed (exit {rc}):\n  " + "\n  ".join(out.splitlines()[-20:]))
        result = json.loads(out_path.read_text())
        return result, max(rss, result.pop("vm_hwm"))


# ---- the report ---------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def bos_added(path: Path) -> list[int]:
    """[the BOS id] when the GGUF says its vocab adds one, else []: engine.encode adds it as llama.cpp's
    tokenizer does with add_special; the recorded texts are tokenized without it (add_special off)."""
    return list(_bos_added(path.resolve(), path.stat().st_mtime_ns))


@functools.cache
def _bos_added(path: Path, mtime_ns: int) -> tuple[int, ...]:
    # gguf-py reads every vocabulary entry to reach two keys (14 s of CPU for Gemma 3's 262k): once a file
    import gguf

    return tuple(bos_of(gguf.GGUFReader(path).fields))


def bos_of(fields: Any) -> list[int]:
    """bos_added from a GGUFReader's fields already read."""
    add = fields.get("tokenizer.ggml.add_bos_token")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return [int(bos.contents())] if add is not None and add.contents() and bos is not None else []


def compare(gguf_path: Path, rec: dict[str, Any], ours: dict[str, Any], ppl: dict[str, Any] | None,
            rss: dict[str, int]) -> tuple[list[str], bool]:  # fmt: skip
    lines, ok = [], True
    lines.append("(a) tokenization, llama-server /tokenize vs engine.encode:")
    bos = bos_added(gguf_path)
    for t, mine in zip(rec["texts"], ours["texts"], strict=True):
        k = first_divergence(bos + t["ids"], mine)
        ok &= k is None
        status = f"equal ({len(mine)} ids)"
        if k is not None:
            status = f"DIFFER at id {k}: llama {t['ids'][k : k + 4]} ours {mine[k : k + 4]}"
        lines.append(f"    {t['text'][:44]!r:50} {status}")
    for i, (p, mine) in enumerate(zip(rec["prompts"], ours["prompts"], strict=True)):
        k = first_divergence(p["ids"], mine["prompt_ids"])
        ok &= k is None
        status = f"equal ({len(p['ids'])} ids)" if k is None else f"DIFFER at id {k}"
        lines.append(f"    chat prompt {i} rendered by llama.cpp, special=True: {status}")
    lines.append(f"(b) greedy continuation ({rec['n_predict']} tokens, temperature 0), template: {rec['template']}:")
    for i, (p, mine) in enumerate(zip(rec["prompts"], ours["prompts"], strict=True)):
        k = first_divergence(p["greedy"], mine["greedy"])
        ok &= k is None
        msg = p["messages"][-1]["content"]
        if k is None:
            lines.append(f"    {i} {msg[:40]!r:44} identical ({len(p['greedy'])} tokens)")
        else:
            theirs_top = p["top2"][k] if k < len(p["top2"]) else None
            at = mine.get("at_divergence", {})
            lines.append(
                f"    {i} {msg[:40]!r:44} DIVERGES at position {k}: llama {p['greedy'][k : k + 3]} "
                f"ours {mine['greedy'][k : k + 3]}; llama top-2 (id, logprob) {theirs_top}; "
                f"ours top-2 {at.get('top2')}, ours logprob of llama's token {at.get('theirs_logprob')}"
            )
        kc = first_divergence(p["greedy"], mine["chat_greedy"])
        lines.append(
            f"      engine.chat (our template): prompt {mine['chat_prompt_tokens']} tokens vs llama's "
            f"{len(p['ids'])}; greedy " + ("identical" if kc is None else f"diverges at {kc}")
        )
        lines.append(f"      llama: {p['text'][:100]!r}")
    pp = rec["perplexity"]
    lines.append(
        f"(c) perplexity of {pp['file']} ({pp['n_tokens']} tokens, chunks of {pp['n_ctx']}, "
        f"{pp['chunks']} chunks, last {pp['scored_per_chunk']} predictions of each scored):"
    )
    lines.append(f"    llama-perplexity {pp['ppl']:.4f} +/- {pp['ppl_std']:.4f}")
    if ppl is not None:
        same = ppl["ids_sha256"] == pp["ids_sha256"]
        lines.append(
            f"    ours             {ppl['ppl']:.4f} +/- {ppl['ppl_std']:.4f} ({ppl['scored']} scored)   "
            f"ratio ours/llama {ppl['ppl'] / pp['ppl']:.4f}; token ids of the text "
            + ("identical" if same else "DIFFER")
        )
    lines.append("(d) RSS (peak: VmHWM of each process; after (b): VmRSS once served):")
    for name, v in rss.items():
        lines.append(f"    {name:34} {mib(v)}")
    return lines, ok


def llama_summary(rec: dict[str, Any]) -> list[str]:
    """llama.cpp's side alone (for a model the engine refuses)."""
    pp = rec["perplexity"]
    lines = [f"llama.cpp: {rec['llama_cpp']['version']} (commit {rec['llama_cpp']['commit']})",
             f"(a) {len(rec['texts'])} texts tokenized by llama.cpp: {sum(len(t['ids']) for t in rec['texts'])} ids",
             f"(b) greedy continuations, template: {rec['template']}:"]  # fmt: skip
    for i, p in enumerate(rec["prompts"]):
        lines.append(f"    {i} {p['messages'][-1]['content'][:40]!r:44} {len(p['greedy'])} tokens: {p['text'][:70]!r}")
    lines.append(f"(c) llama-perplexity {pp['ppl']:.4f} +/- {pp['ppl_std']:.4f} ({pp['n_tokens']} tokens, "
                 f"{pp['chunks']} chunks of {pp['n_ctx']})")  # fmt: skip
    labels = {"llama-server": "llama-server peak", "llama-server-end": "llama-server once served",
              "llama-perplexity": "llama-perplexity peak"}  # fmt: skip
    for name, v in rec.get("rss", {}).items():
        lines.append(f"(d) RSS, {labels.get(name, name)}: {mib(v)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, help="the GGUF (default: the SmolLM2 demo's)")
    ap.add_argument(
        "--llama-bin-dir",
        type=Path,
        default=None,
        help="directory with llama-server and llama-perplexity (else built from the sdist)",
    )
    ap.add_argument("--llama-commit", default=None, help="llama.cpp commit to record (else from the build info)")
    ap.add_argument("--llama-source", default=None, help="where the llama.cpp build came from, to record")
    ap.add_argument("--build-jobs", type=int, default=2)
    ap.add_argument("--record", type=Path, default=None, help="write llama.cpp's side as JSON here")
    ap.add_argument("--recorded", type=Path, default=None, help="compare against this recording (no llama.cpp)")
    ap.add_argument("--dtype", choices=("auto", "f16", "q8", "q4"), default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512, help="context of llama-server and of our engine")
    ap.add_argument("--ppl-ctx", type=int, default=128, help="perplexity chunk length (llama-perplexity -c)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--worker", nargs=3, metavar=("KIND", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        kind, spec_path, out_path = args.worker
        spec = json.loads(Path(spec_path).read_text())
        result = asyncio.run(engine_worker(spec)) if kind == "engine" else ppl_worker(spec)
        result["vm_hwm"] = vm_hwm("self")
        Path(out_path).write_text(json.dumps(result))
        return 0
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, vls._interrupt)
    try:
        from aiobasert.models.cache import smollm2_gguf_path

        gguf_path = (args.model or smollm2_gguf_path()).resolve()
        facts = gguf_facts(gguf_path)
        print(
            f"GGUF {gguf_path} ({facts['architecture']}, tokenizer {facts['tokenizer_model']}/"
            f"{facts['tokenizer_pre']}, matrices {facts['matrix_types']})",
            flush=True,
        )
        if args.recorded is not None:
            rec = json.loads(args.recorded.read_text())
            if rec["model"]["sha256"] != facts["sha256"]:
                raise OracleError(f"{args.recorded} was recorded on another file (sha256 {rec['model']['sha256']})")
        else:
            rec = llama_side(args, gguf_path, facts)
        if args.record is not None:
            args.record.parent.mkdir(parents=True, exist_ok=True)
            args.record.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
            print(f"recorded llama.cpp's side into {args.record}", flush=True)
        return ours_and_report(args, gguf_path, facts, rec)
    except OracleError as exc:
        print("error:", exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (every process the bench started is stopped)", file=sys.stderr)
        return 130
    finally:
        vls._stop_all()


def ours_and_report(args: argparse.Namespace, gguf_path: Path, facts: dict[str, Any], rec: dict[str, Any]) -> int:
    from aiobasert.models.convert import ConversionError

    add_bos = facts_add_bos(gguf_path)
    auto = args.dtype == "auto" and open_accepts_dtype()
    dtype = our_dtype(facts, args.dtype)
    try:
        bundle = gguf_path if auto else our_bundle(gguf_path, dtype)
    except ConversionError as exc:
        print("\n".join(llama_summary(rec)))
        print(f"aiobasert REFUSES this model: {exc}")
        return 3
    how = "Engine.open(gguf, dtype='auto')" if auto else f"bundle {bundle.name} (--dtype {args.dtype} -> {dtype})"
    print(f"aiobasert: {vls.git_head()}; {how}", flush=True)
    spec = {"model": str(bundle), "ctx": args.ctx, "texts": [t["text"] for t in rec["texts"]],
            "prompts": rec["prompts"], "add_bos": add_bos, "open_dtype": "auto" if auto else None,
            "n_ctx": rec["perplexity"]["n_ctx"]}  # fmt: skip
    ours, engine_rss = run_worker("engine", spec, args.threads)
    if auto:  # the engine converted into the cache: the perplexity process loads that bundle
        spec["model"] = str(our_bundle(gguf_path, "auto"))
    ppl, ppl_rss = run_worker("ppl", spec, args.threads)
    rss = {"aiobasert Engine (a)+(b), peak": engine_rss, "aiobasert Engine, after (b)": ours["vm_rss_end"],
           "aiobasert perplexity (c), peak": ppl_rss}  # fmt: skip
    if "rss" in rec and args.recorded is None:
        rss = {"llama-server (a)+(b), peak": rec["rss"]["llama-server"],
               "llama-server, after (b)": rec["rss"]["llama-server-end"], **rss,
               "llama-perplexity (c), peak": rec["rss"]["llama-perplexity"]}  # fmt: skip
    lines, ok = compare(gguf_path, rec, ours, ppl, rss)
    print(f"llama.cpp: {rec['llama_cpp']['version']} (commit {rec['llama_cpp']['commit']})")
    print("\n".join(lines))
    print("all tokens and greedy ids equal" if ok else "DIFFERENCES above")
    return 0 if ok else 1


def facts_add_bos(path: Path) -> bool:
    import gguf

    f = gguf.GGUFReader(path).fields.get("tokenizer.ggml.add_bos_token")
    return bool(f.contents()) if f is not None else False


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
