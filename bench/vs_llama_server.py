"""aiobasert serve against llama.cpp's llama-server: aggregate tok/s, TTFT p50 and peak RSS.

Issue 10's proof, in one run: `python -m aiobasert serve` and llama.cpp's own
`llama-server` (`-np N`, continuous batching) on the same GGUF (the SmolLM2 demo's
unless --gguf), at 1, 4, 16 and 32 concurrent streams of 128 greedy tokens, same
prompts, the same httpx async client streaming /v1/completions, both engines on the
same thread count (--threads, default 2: llama-server -t/-tb, ours BASERT_REF_THREADS).
Each server is started for one concurrency level (--max-batch-size N / -np N, 512
tokens of context per stream for both), warmed with one short request, measured, and
stopped before the other starts; which goes first alternates by level and round, so
a shared machine's load falls on both alike. Prints each run, then the median round
(with the rounds' range and the load average seen) and each server's best round,
with ours/theirs ratios. aggregate tok/s = every generated token / wall time from sending the N
requests to the last one's end; TTFT = request sent -> first streamed text; peak RSS =
the server process's VmHWM (load included) after its level, the highest of the rounds.

llama-server is built once from the llama.cpp vendored in the llama-cpp-python sdist
(pip download --no-binary :all:) into ~/.cache/aiobasert/bench/llama-server-VER-ISA/
with cmake (Release, static, AVX-512 without AMX when the CPU has AVX-512, AVX2
otherwise; GGML_NATIVE/OpenMP/OpenSSL/web UI off; only the llama-server target, under
nice) -- or pass --llama-server PATH. Each server runs in its own process group and is
always stopped (finally, atexit, SIGTERM/SIGHUP/Ctrl-C); a server that fails to start
is an error naming it with its log's tail (exit 2).

KV cache: both store it in the same element type, --kv-cache-dtype (default f16, llama-server's
own default; q8 = Q8_0 for both, llama-server `-ctk q8_0 -ctv q8_0 -fa on`).

Token counts: llama-server gets `ignore_eos`; aiobasert's HTTP API has no ignore_eos,
so the prompts are ones the model continues past 128 tokens, and the counts each
server actually generated (its `usage`) are in the table.

    python bench/vs_llama_server.py                    # builds llama-server on first use; our q4 (the demo)
    python bench/vs_llama_server.py --dtype f16        # serve our f16 bundle of the GGUF instead
    python bench/vs_llama_server.py --model X-Q4_K_M.gguf   # a K-quant GGUF side by side (kept quantized)
    python bench/vs_llama_server.py --build-only       # just build (~20 min on 2 shared cores)

Measured 2026-12-03 on this project's 2-core AMD EPYC (AVX-512 + VNNI: llama-server built for
AVX-512 without AMX), SmolLM2-135M-Instruct Q4_1 GGUF, llama-cpp-python 0.3.36 = llama.cpp
0c1e570, `--rounds 3`, commit 1643337, median round (the rounds' range in brackets; ratio = ours /
llama-server; columns abbreviated), load average 0.6-2.0 with the client on the same cores:

| streams | ours tok/s      | llama tok/s     | ratio | ours TTFT | llama TTFT | TTFT ratio | tokens    |
| 1       | 236.7 (230-259) | 113.1 (110-118) | 2.09x | 22 ms     | 86 ms      | 0.26x      | 128 / 128 |
| 4       | 513.0 (404-585) | 146.7 (108-175) | 3.50x | 77 ms     | 312 ms     | 0.25x      | 128 / 128 |
| 16      | 809.7 (715-904) | 225.0 (204-228) | 3.60x | 190 ms    | 1340 ms    | 0.14x      | 128 / 128 |
| 32      | 951.6 (691-952) | 258.3 (251-264) | 3.68x | 312 ms    | 2296 ms    | 0.14x      | 128 / 128 |

Under heavier load (an earlier run at load 2.4-4.1) llama-server's rounds ranged from 7 to 95
tok/s at 1 stream (its two spinning threads stall when one is descheduled): compare medians of
several rounds, and read the ranges.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiobasert.models.cache import smollm2_gguf_path
from tests.cpu_features import cpu_flags

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiobasert" / "bench"
ROOT = Path(__file__).resolve().parent.parent


class BenchError(Exception):
    """A failure the bench reports in one line and exits 2 on."""


# ---- llama-server: built once from the llama-cpp-python sdist ------------------------------------


def isa_cmake_flags(flags: set[str]) -> tuple[str, list[str]]:
    """(label, cmake -D flags): AVX-512 when the CPU has it, never AMX (the AMX build
    segfaults on this machine), AVX2 otherwise. GGML_NATIVE=OFF so the flags are exactly these."""
    base = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]  # fmt: skip
    base.append(f"-DGGML_BMI2={'ON' if 'bmi2' in flags else 'OFF'}")
    base.append(f"-DGGML_AVX_VNNI={'ON' if 'avx_vnni' in flags else 'OFF'}")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        extra = {"avx512_vnni": "VNNI", "avx512_bf16": "BF16", "avx512vbmi": "VBMI"}
        opts = ["-DGGML_AVX512=ON"] + [f"-DGGML_AVX512_{v}={'ON' if k in flags else 'OFF'}" for k, v in extra.items()]
        return "avx512", base + opts
    if "avx2" not in flags:
        raise BenchError("this CPU has neither AVX-512 nor AVX2: pass --llama-server PATH to a build of your own")
    return "avx2", [*base, "-DGGML_AVX512=OFF"]


def fetch_sdist(dest: Path, version: str | None) -> Path:
    """The llama-cpp-python sdist (pip download, no binary, no deps), reused once downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    have = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if version:
        have = [p for p in have if p.name == f"llama_cpp_python-{version}.tar.gz"]
    if have:
        return have[-1]
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    cmd = [sys.executable, "-m", "pip", "download", spec, "--no-binary", ":all:", "--no-deps",
           "--disable-pip-version-check", "-d", str(dest)]  # fmt: skip
    print("downloading the llama-cpp-python sdist:", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise BenchError("pip download llama-cpp-python failed (offline? pass --llama-server PATH)")
    have = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not have:
        raise BenchError(f"pip download left no llama_cpp_python-*.tar.gz in {dest}")
    return have[-1]


def build_llama_server(version: str | None, jobs: int, targets: tuple[str, ...] = ("llama-server",)) -> Path:
    """llama-server built from the sdist's vendor/llama.cpp into CACHE (once; later runs reuse it).

    Only the `targets` (llama-server, plus e.g. llama-perplexity for bench/llama_oracle.py), static,
    no OpenSSL/curl, no web UI download, under nice so a build on a shared machine yields to
    everything else. Returns llama-server's path; the other targets are beside it."""
    label, isa = isa_cmake_flags(cpu_flags())
    sdist = fetch_sdist(CACHE / "sdist", version)
    ver = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    out = CACHE / f"llama-server-{ver}-{label}"
    binary = out / "llama-server"
    if all((out / t).is_file() for t in targets):
        return binary
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=out))
    log = out / "build.log"
    try:
        print(f"building llama-server {ver} ({label}) into {out}; log: {log}", flush=True)
        with tarfile.open(sdist) as tar:
            if hasattr(tarfile, "data_filter"):  # 3.10.12+/3.11.4+: refuse paths outside `work`
                tar.extractall(work, filter="data")
            else:
                tar.extractall(work)  # pip's own sdist, as pip itself would unpack it
        top = work / f"llama_cpp_python-{ver}"
        src = top / "vendor" / "llama.cpp"
        if not (src / "CMakeLists.txt").is_file():
            raise BenchError(f"{sdist.name} has no vendor/llama.cpp")
        commit = top / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
        commit_id = commit.read_text().strip() if commit.is_file() else "unknown"
        configure = ["cmake", "-S", str(src), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
                     "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", *isa]  # fmt: skip
        build = ["cmake", "--build", str(work / "build"), "--target", *targets, "-j", str(jobs)]
        with open(log, "w") as fh:
            for cmd in (configure, build):
                fh.write("$ " + " ".join(cmd) + "\n")
                fh.flush()
                if _run_group(["nice", "-n", "10", *cmd], fh):
                    tail = log.read_text().splitlines()[-30:]
                    raise BenchError("llama-server build failed:\n  " + "\n  ".join(tail) + f"\n(full log: {log})")
        for target in targets:
            if not (work / "build" / "bin" / target).is_file():
                raise BenchError(f"the build finished without {work / 'build' / 'bin' / target}")
        (out / "BUILD-INFO").write_text(
            f"llama-cpp-python {ver}\nllama.cpp commit {commit_id}\nisa {label}\ncmake {' '.join(configure[5:])}\n"
        )
        for target in sorted(targets, key=lambda t: t == "llama-server"):  # llama-server last: it marks a build
            tmp = out / f".{target}.tmp"
            shutil.copy2(work / "build" / "bin" / target, tmp)
            os.replace(tmp, out / target)  # atomic: a half-copied binary is never taken for a build
        return binary
    finally:
        shutil.rmtree(work, ignore_errors=True)


def llama_server_version(binary: Path) -> str:
    info = binary.parent / "BUILD-INFO"
    extra = ""
    try:
        res = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        m = re.search(r"version: (.+)", res.stdout + res.stderr)
        extra = m.group(1) if m else ""
    except (OSError, subprocess.TimeoutExpired):
        pass
    lines = info.read_text().splitlines()[:3] if info.is_file() else []
    return "; ".join([*lines, f"--version {extra}" if extra else ""]).strip("; ")


# ---- processes: each in its own process group, always stopped -----------------------------------

_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def _run_group(cmd: list[str], out: IO[str]) -> int:
    """Run cmd to completion in its own process group; interrupted, the whole group
    (cmake, make, the compilers) is killed, not just its leader."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    _LIVE[proc.pid] = proc
    try:
        return proc.wait()
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` s; the group is killed even when
    its leader already exited, so no worker it forked is left behind."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        print(f"warning: process {proc.pid} did not exit after SIGKILL", file=sys.stderr)
    _LIVE.pop(proc.pid, None)


def _stop_all() -> None:
    for proc in list(_LIVE.values()):
        _stop(proc, grace=2.0)


atexit.register(_stop_all)  # the backstop; every server is also stopped in a finally


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "wb") as fh:  # the child keeps its own copy of the descriptor
            fh.write(("$ " + " ".join(self.cmd) + "\n").encode())
            fh.flush()
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,  # its own process group: stopped as a whole
            )  # fmt: skip
        _LIVE[self.proc.pid] = self.proc

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def peak_rss_mb(self) -> float:
        """The server process's peak resident set so far (VmHWM: load included), 0 when unreadable.
        Both servers are one process (threads only), so this is each one's whole footprint."""
        if self.proc is None:
            return 0.0
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except (OSError, ValueError):
            pass
        return 0.0

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return "(no log)"
        return "\n    ".join(lines)

    async def wait_ready(self, client: httpx.AsyncClient, timeout: float) -> None:
        """GET /health until 200 (llama-server answers 503 while loading); a server that
        exits or never answers is a BenchError naming it, with its log's tail."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise BenchError(f"{self.name} exited with code {rc} before it was ready. Log {self.log}:\n"
                                 f"    {self.log_tail()}")  # fmt: skip
            try:
                if (await client.get(self.base + "/health", timeout=5.0)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} was not ready within {timeout:.0f} s. Log {self.log}:\n"
                                 f"    {self.log_tail()}")  # fmt: skip
            await asyncio.sleep(0.25)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the client: the same httpx streaming request for both servers -----------------------------

SUBJECTS = [
    "the history of the printing press", "how bridges are built", "the life cycle of stars", "the rules of chess",
    "how bread is baked", "the water cycle", "the invention of the telephone", "how volcanoes form",
    "the migration of birds", "the Roman empire", "how computers store data", "the causes of ocean tides",
    "the growth of a tree", "how vaccines work", "the history of jazz", "the geography of Japan",
    "how airplanes fly", "the structure of the atom", "the ancient Egyptians", "how rainbows appear",
    "the culture of coffee", "the life of honey bees", "how electricity reaches homes",
    "the discovery of penicillin", "the Silk Road", "how glaciers move", "the first moon landing",
    "the science of sleep", "how languages change", "the building of railways", "the deep ocean",
    "the history of paper money",
]  # fmt: skip
# aiobasert's HTTP API has no ignore_eos (and logit_bias against EOS would move its lanes onto
# the slower host-logits sampler), so the prompts are ones SmolLM2 continues greedily past 128
# tokens without an end token (checked: all 32 run to 128 on the f16 bundle); the counts
# actually generated are printed per server.
PROMPT = "Write a long, detailed essay about {}. Begin with its origins, then explain each stage in order.\n\nEssay:\n"
WARMUP_PROMPT = PROMPT.format("the art of paper folding")


@dataclass
class StreamResult:
    ttft: float
    tokens: int
    usage_counted: bool
    finish: str | None
    end: float
    usage: dict[str, Any] | None = None  # the last usage object sent (extensions included)
    timings: dict[str, Any] | None = None  # llama-server's `timings` (its draft counts among them)


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> StreamResult:
    t0 = time.perf_counter()
    ttft: float | None = None
    chunks, usage, finish, timings = 0, None, None, None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise BenchError(f"POST {url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise BenchError(f"POST {url}: error event {obj['error']}")
            for choice in obj.get("choices") or []:
                if choice.get("text") or (choice.get("delta") or {}).get("content"):  # completions, chat
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                finish = choice.get("finish_reason") or finish
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
    end = time.perf_counter()
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return StreamResult(ttft if ttft is not None else end - t0, tokens, usage is not None, finish, end, usage, timings)


def request_body(prompt: str, max_tokens: int, extra: dict[str, object]) -> dict[str, object]:
    return {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip


@dataclass
class Run:
    tok_s: float
    ttft_p50: float
    tokens: list[int]
    usage_counted: bool
    wall: float
    load: float
    peak_rss_mb: float = 0.0  # the server process's VmHWM after its level (read before it is stopped)


async def measure(client: httpx.AsyncClient, server: Server, streams: int, max_tokens: int,
                  extra: dict[str, object], timeout: float) -> Run:  # fmt: skip
    """All `streams` requests at once; aggregate tok/s = every generated token / the batch's wall time."""
    url = server.base + "/v1/completions"
    bodies = [request_body(PROMPT.format(SUBJECTS[i % len(SUBJECTS)]), max_tokens, extra) for i in range(streams)]
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one_stream(client, url, b)) for b in bodies]
    try:
        done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if (exc := t.exception()) is not None:
                raise exc
        if pending:
            raise BenchError(f"{server.name}: {len(pending)} of {streams} streams unfinished after {timeout:.0f} s")
        results = [t.result() for t in tasks]
    finally:  # one failed or timed out stream ends them all, every exception retrieved
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = max(r.end for r in results) - t0
    tokens = [r.tokens for r in results]
    return Run(sum(tokens) / wall, statistics.median(r.ttft for r in results), tokens,
               all(r.usage_counted for r in results), wall, os.getloadavg()[0])  # fmt: skip


# ---- the bench -----------------------------------------------------------------------------------

OURS, THEIRS = "aiobasert", "llama-server"


def our_model(gguf: Path, dtype: str, model: Path | None) -> Path:
    """What `aiobasert serve` gets: --ours-model, the GGUF itself for auto / f16 (converted into
    aiobasert's cache here, by `aiobasert pull`, so no measured server's peak RSS holds a one-time
    conversion), else a q8/q4 bundle converted once into CACHE."""
    if model is not None:
        return model
    if dtype in ("auto", "f16"):  # serve --dtype finds the bundle pull made in aiobasert's cache
        cmd = [sys.executable, "-m", "aiobasert", "pull", str(gguf), "--dtype", dtype]
        print("converting:", " ".join(cmd), flush=True)
        if subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode != 0:
            raise BenchError(f"aiobasert pull {gguf} --dtype {dtype} failed")
        return gguf
    dst = CACHE / "models" / f"{gguf.stem}.{dtype}.base"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.stem}.tmp.base")
        cmd = [sys.executable, "-m", "aiobasert.models.convert", str(gguf), str(tmp), "--dtype", dtype, "--quiet"]
        print("converting:", " ".join(cmd), flush=True)
        if subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode != 0:
            raise BenchError(f"aiobasert.models.convert --dtype {dtype} failed")
        os.replace(tmp, dst)
    return dst


def make_server(who: str, streams: int, args: argparse.Namespace, logdir: Path) -> Server:
    port = free_port()
    log = logdir / f"{who}-{streams}.log"
    if who == OURS:
        cmd = [
            sys.executable,
            "-m",
            "aiobasert",
            "serve",
            str(args.ours_model),
            "--port",
            str(port),
            "--max-batch-size",
            str(streams),
            "--max-context",
            str(args.ctx),
            "--served-model-name",
            "bench",
            "--dtype",
            args.dtype,
            "--kv-cache-dtype",
            args.kv_cache_dtype,
            # text alone is measured: the grammar backend a default server builds at open (for the first
            # json_schema; ~70 MiB for a 49k vocabulary, docs/fairness.md) is left out, as llama-server
            # holds no grammar state until a request brings one
            "--no-grammar-backend-at-open",
        ]
        env = {
            **os.environ,
            "BASERT_REF_THREADS": str(args.threads),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        return Server(OURS, cmd, port, log, env)  # fmt: skip
    cmd = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(streams), "-cb", "-c", str(args.ctx * streams), "-t", str(args.threads),
           "-tb", str(args.threads), "--alias", "bench"]  # fmt: skip
    if args.kv_cache_dtype == "q8":  # a quantized V cache needs llama.cpp's flash attention
        cmd += ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    return Server(THEIRS, cmd, port, log)


async def bench(args: argparse.Namespace) -> dict[str, dict[int, list[Run]]]:
    # SIGTERM/SIGHUP cancel the bench like Ctrl-C does: the finally blocks stop the running server
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGHUP):
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    results: dict[str, dict[int, list[Run]]] = {OURS: {}, THEIRS: {}}
    extra: dict[str, dict[str, object]] = {OURS: {}, THEIRS: {"ignore_eos": True}}
    logdir = Path(tempfile.mkdtemp(prefix="vs_llama_server-"))
    print(f"server logs: {logdir}", flush=True)
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    timeout = httpx.Timeout(connect=10.0, read=600.0, write=30.0, pool=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        for r in range(args.rounds):
            for j, n in enumerate(args.streams):
                order = (OURS, THEIRS) if (r + j) % 2 == 0 else (THEIRS, OURS)  # alternate who goes first
                for who in order:
                    server = make_server(who, n, args, logdir)
                    server.start()
                    try:
                        await server.wait_ready(client, args.start_timeout)
                        warm = request_body(WARMUP_PROMPT, 8, extra[who])
                        await asyncio.wait_for(one_stream(client, server.base + "/v1/completions", warm),
                                               args.start_timeout)  # fmt: skip
                        run = await measure(client, server, n, args.max_tokens, extra[who], args.level_timeout)
                        run.peak_rss_mb = server.peak_rss_mb()
                    except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: bad JSON
                        raise BenchError(f"{who} at {n} streams failed: {exc!r}. Log {server.log}:\n"
                                         f"    {server.log_tail()}") from exc  # fmt: skip
                    finally:
                        server.stop()
                    results[who].setdefault(n, []).append(run)
                    print(f"  round {r + 1} streams {n:2d} {who:12s} {run.tok_s:8.1f} tok/s  TTFT p50 "
                          f"{run.ttft_p50 * 1000:7.0f} ms  wall {run.wall:6.1f} s  tokens/stream "
                          f"{min(run.tokens)}-{max(run.tokens)}  load {run.load:.2f}  "
                          f"peak RSS {run.peak_rss_mb:.0f} MiB", flush=True)  # fmt: skip
    shutil.rmtree(logdir, ignore_errors=True)  # kept on failure, for the error's log path
    return results


def report(results: dict[str, dict[int, list[Run]]], args: argparse.Namespace) -> str:
    """Two tables: the median round (the headline; with the spread of the rounds) and the
    best round of each server (its speed when the shared machine let it run)."""

    def tok(who: str, n: int, pick: Callable[[list[float]], float]) -> float:
        return pick([x.tok_s for x in results[who][n]])

    def ttft(who: str, n: int, pick: Callable[[list[float]], float]) -> float:
        return -pick([-x.ttft_p50 for x in results[who][n]])  # best TTFT = lowest

    def spread(who: str, n: int) -> str:
        runs = [x.tok_s for x in results[who][n]]
        return f"{min(runs):.0f}-{max(runs):.0f}"

    def tokens(who: str, n: int) -> str:
        toks = [t for x in results[who][n] for t in x.tokens]
        src = "" if all(x.usage_counted for x in results[who][n]) else " (chunks)"
        return (f"{min(toks)}" if min(toks) == max(toks) else f"{min(toks)}-{max(toks)}") + src

    def rss(who: str, n: int) -> float:
        return max(x.peak_rss_mb for x in results[who][n])  # the worst round: a peak is a bound

    med: Callable[[list[float]], float] = statistics.median
    lines = [
        "tok/s = all generated tokens / batch wall time; TTFT p50 = median over the streams; ratio = "
        "aiobasert / llama-server (tok/s: above 1 we are faster; TTFT: below 1 we are faster)",
        "",
        f"median of {args.rounds} round(s) (range of the rounds' tok/s in brackets):",
        "",
        "| streams | aiobasert tok/s | llama-server tok/s | ratio | aiobasert TTFT p50 | llama-server TTFT p50 "
        "| TTFT ratio | peak RSS MiB ours / theirs | tokens/stream ours / theirs | load avg (1 min) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for n in args.streams:
        o_tok, t_tok, o_ttft, t_ttft = tok(OURS, n, med), tok(THEIRS, n, med), ttft(OURS, n, med), ttft(THEIRS, n, med)
        loads = [x.load for who in (OURS, THEIRS) for x in results[who][n]]
        lines.append(
            f"| {n} | {o_tok:.1f} ({spread(OURS, n)}) | {t_tok:.1f} ({spread(THEIRS, n)}) | {o_tok / t_tok:.2f}x | "
            f"{o_ttft * 1000:.0f} ms | {t_ttft * 1000:.0f} ms | {o_ttft / t_ttft:.2f}x | "
            f"{rss(OURS, n):.0f} / {rss(THEIRS, n):.0f} | "
            f"{tokens(OURS, n)} / {tokens(THEIRS, n)} | {min(loads):.1f}-{max(loads):.1f} |"
        )
    lines += [
        "",
        "best round of each server:",
        "",
        "| streams | aiobasert tok/s | llama-server tok/s | ratio | aiobasert TTFT p50 | llama-server TTFT p50 "
        "| TTFT ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.streams:
        o_tok, t_tok, o_ttft, t_ttft = tok(OURS, n, max), tok(THEIRS, n, max), ttft(OURS, n, max), ttft(THEIRS, n, max)
        lines.append(
            f"| {n} | {o_tok:.1f} | {t_tok:.1f} | {o_tok / t_tok:.2f}x | {o_ttft * 1000:.0f} ms | "
            f"{t_ttft * 1000:.0f} ms | {o_ttft / t_ttft:.2f}x |"
        )
    return "\n".join(lines)


def git_head() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True,
                             text=True, timeout=10).stdout.strip()  # fmt: skip
        return out or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--llama-server", type=Path, default=None, help="an existing llama-server binary (else built)")
    ap.add_argument("--llama-cpp-python-version", default=None, help="sdist version to build (default: newest)")
    ap.add_argument("--build-jobs", type=int, default=2)
    ap.add_argument("--build-only", action="store_true", help="build llama-server, print its path and exit")
    ap.add_argument(
        "--model",
        "--gguf",
        dest="gguf",
        type=Path,
        default=None,
        help="the GGUF both serve, e.g. a K-quant (Q4_K_M) file (default: the SmolLM2 demo)",
    )
    ap.add_argument(
        "--dtype",
        choices=("auto", "f16", "q8", "q4"),
        default="auto",
        help="which aiobasert bundle of the GGUF to serve (default auto: the GGUF's own blocks, "
        "K-quants included, as `aiobasert serve` converts it)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=("f16", "q8"),
        default="f16",
        help="the KV cache's element type for both servers (default f16, llama-server's default)",
    )
    ap.add_argument("--ours-model", type=Path, default=None, help="serve this .base/.gguf instead of --dtype's")
    ap.add_argument(
        "--streams",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 16, 32],
        help="concurrency levels, comma-separated (default 1,4,16,32)",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--ctx", type=int, default=512, help="context per stream/lane for both (default 512)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--level-timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    # SIGTERM/SIGHUP unwind like Ctrl-C (the bench loop installs its own handlers, which cancel it)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        args.llama_server = args.llama_server or build_llama_server(args.llama_cpp_python_version, args.build_jobs)
        if not os.access(args.llama_server, os.X_OK):
            raise BenchError(f"--llama-server {args.llama_server} is not an executable file")
        version = llama_server_version(args.llama_server)
        print("llama-server:", args.llama_server, "|", version, flush=True)
        if args.build_only:
            return 0
        args.gguf = args.gguf or smollm2_gguf_path()
        served = "--ours-model" if args.ours_model else f"--dtype {args.dtype}"
        args.ours_model = our_model(args.gguf, args.dtype, args.ours_model)
        load0 = os.getloadavg()
        header = [
            f"aiobasert serve vs llama-server: {os.cpu_count()} CPUs "
            f"({len(os.sched_getaffinity(0))} usable), {args.threads} threads each, "
            f"{args.max_tokens} tokens/stream, greedy, same prompts, same httpx client, "
            f"KV cache {args.kv_cache_dtype} in both",
            f"GGUF: {args.gguf}",
            f"aiobasert: {git_head()}; serving {args.ours_model} ({served})",
            f"llama-server: {version}",
            f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} (a shared machine: the servers "
            "run one at a time, alternating which goes first, so both see the same load on average)",
        ]
        print("\n".join(header), flush=True)
        results = asyncio.run(bench(args))
        load1 = os.getloadavg()
        print()
        print("\n".join(header))
        print(f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
        print(report(results, args))
    except BenchError as exc:
        print("error:", exc, file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted (every process the bench started is stopped)", file=sys.stderr)
        return 130
    finally:
        _stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
