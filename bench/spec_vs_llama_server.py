"""Speculative decoding, aiobasert serve against llama-server side by side in one run (issue 36 item 6).

The same GGUF, the same greedy `/v1/chat/completions` requests (each server renders the GGUF's
chat template) from the same httpx client, the same
thread count, four servers per row, one at a time (the order rotates every row, so load from
elsewhere falls on all alike). --method ngram (prompt lookup, the default):

    aiobasert off      aiobasert serve
    aiobasert ngram    aiobasert serve --speculative ngram --num-speculative-tokens K
    llama off          llama-server
    llama ngram        llama-server --spec-type ngram-simple (lookup n = our prompt_lookup_max, draft m = K)

--method draft (a draft model): the target is an F16 GGUF of the demo SmolLM2-135M, made once from the
demo's Q4_1 GGUF (every value gguf-py's dequantization of its blocks, every metadata field kept:
tests/tiny_gguf.py's f16_gguf; cached in ~/.cache/aiobasert/bench/), and the Q4_1 GGUF itself drafts
for it: the same model, quantized, so most drafts are accepted and a draft step costs what a q4 step does.

    aiobasert off      aiobasert serve TARGET
    aiobasert draft    aiobasert serve TARGET --speculative draft --draft-model DRAFT --num-speculative-tokens K
    llama off          llama-server -m TARGET
    llama draft        llama-server -m TARGET -md DRAFT --spec-type draft-simple --spec-draft-n-max K
                       --spec-draft-n-min 0 --spec-draft-p-min 0 -td T -tbd T (the draft on the target's threads)

Prompt sets: input-grounded (rewrite a passage with one change, quote it, copy it: what prompt
lookup is for) and free text (where it cannot pay, and must not cost); 1 / 4 / 16 streams. Per
server: tok/s (every generated token / the level's wall time), TTFT p50, peak RSS, the tokens each
stream made, drafted and accepted tokens (ours: usage's `draft_tokens` / `accepted_draft_tokens`;
llama-server: its `timings.draft_n` / `draft_n_accepted`). Neither gets ignore_eos (aiobasert's HTTP
API has none): a reply ends where the model ends it, in both (the token counts are printed).
Ratios printed: ours on / ours off (what speculation buys us), llama on / llama off, and ours on /
llama on (against the peer), each named by the method.

    python bench/spec_vs_llama_server.py                          # ngram, the demo SmolLM2-135M GGUF
    python bench/spec_vs_llama_server.py --method draft           # F16 SmolLM2 target, the demo Q4_1 drafting
    python bench/spec_vs_llama_server.py --streams 1 --rounds 3   # one stream, medians of 3
    python bench/spec_vs_llama_server.py --gguf model.gguf --llama-server PATH
    python bench/spec_vs_llama_server.py --method draft --gguf target.gguf --draft-gguf draft.gguf

llama-server is the one bench/vs_llama_server.py builds (once, ~20 minutes) or --llama-server PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from speculative import FREE, GROUNDED
from vs_llama_server import (
    CACHE,
    ROOT,
    BenchError,
    Server,
    StreamResult,
    _stop_all,
    build_llama_server,
    free_port,
    git_head,
    llama_server_version,
    our_model,
)
from vs_llama_server import one_stream as stream_request

from aiobasert.models.cache import smollm2_gguf_path
from tests.tiny_gguf import f16_gguf


def configs(method: str) -> tuple[str, str, str, str]:
    """The four servers of a row, in the order the rotation starts from."""
    return ("aiobasert off", f"aiobasert {method}", "llama off", f"llama {method}")


def f16_target(src: Path) -> Path:
    """An F16 GGUF of the GGUF `src` (the draft-model target), built once into CACHE, keyed by src's name and size."""
    dst = CACHE / f"{src.stem}.{src.stat().st_size}.f16.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp")
        print(f"writing the F16 target {dst} from {src}", flush=True)
        f16_gguf(src, tmp)
        os.replace(tmp, dst)
    return dst


@dataclass
class Level:
    tok_s: float
    ttft_p50: float
    tokens: list[int]
    drafted: int
    accepted: int
    peak_rss_mb: float


async def one_stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> StreamResult:
    """One greedy chat request, streamed (bench/vs_llama_server.py's client)."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    return await stream_request(client, url, body)


def drafts(r: StreamResult) -> tuple[int, int]:
    """(drafted, accepted) as each server reports them: llama-server's timings, our usage extensions."""
    if r.timings is not None:
        return int(r.timings.get("draft_n", 0)), int(r.timings.get("draft_n_accepted", 0))
    usage = r.usage or {}
    return int(usage.get("draft_tokens") or 0), int(usage.get("accepted_draft_tokens") or 0)


def spec_flags(config: str, args: argparse.Namespace) -> list[str]:
    """The flags that turn `config`'s speculation on (none for an off server): ours, or llama-server's."""
    if config.endswith(" off"):
        return []
    k = str(args.draft)
    if config.startswith("aiobasert"):
        source = ["--draft-model", str(args.ours_draft)] if args.method == "draft" else []
        return ["--speculative", args.method, *source, "--num-speculative-tokens", k]
    if args.method == "ngram":
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.lookup),
                "--spec-ngram-simple-size-m", k, "--spec-draft-n-max", k]  # fmt: skip
    t = str(args.threads)  # the draft model on the target's threads, greedy drafts of up to k, none refused
    return ["-md", str(args.draft_gguf), "--spec-type", "draft-simple", "--spec-draft-n-max", k,
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", t, "-tbd", t]  # fmt: skip


def make_server(config: str, streams: int, args: argparse.Namespace, logdir: Path) -> Server:
    port = free_port()
    log = logdir / f"{config.replace(' ', '-')}-{streams}.log"
    if config.startswith("aiobasert"):
        cmd = [sys.executable, "-m", "aiobasert", "serve", str(args.ours_model), "--port", str(port),
               "--max-batch-size", str(streams), "--max-context", str(args.ctx), "--served-model-name", "bench",
               "--no-grammar-backend-at-open", *spec_flags(config, args)]  # fmt: skip
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "BASERT_REF_THREADS": str(args.threads), "PYTHONPATH": path}
        return Server(config, cmd, port, log, env)
    cmd = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(streams), "-cb", "-c", str(args.ctx * streams), "-t", str(args.threads),
           "-tb", str(args.threads), "--alias", "bench", *spec_flags(config, args)]  # fmt: skip
    return Server(config, cmd, port, log)


async def level(client: httpx.AsyncClient, server: Server, prompts: list[str], streams: int, max_tokens: int) -> Level:
    url = server.base + "/v1/chat/completions"
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(client, url, prompts[i % len(prompts)], max_tokens)
                                     for i in range(streams)))  # fmt: skip
    wall = max(r.end for r in results) - t0
    tokens = [r.tokens for r in results]
    counts = [drafts(r) for r in results]
    return Level(sum(tokens) / wall, statistics.median(r.ttft for r in results), tokens,
                 sum(d for d, _ in counts), sum(a for _, a in counts), server.peak_rss_mb())  # fmt: skip


async def bench(args: argparse.Namespace) -> list[tuple[str, int, dict[str, Level]]]:
    logdir = Path(tempfile.mkdtemp(prefix="spec_vs_llama_server-"))
    print(f"server logs: {logdir}", flush=True)
    rows: list[tuple[str, int, dict[str, Level]]] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    timeout = httpx.Timeout(connect=10.0, read=600.0, write=30.0, pool=60.0)
    turn = 0
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        for name in args.prompts:
            prompts = GROUNDED if name == "grounded" else FREE
            for streams in args.streams:
                four = configs(args.method)
                runs: dict[str, list[Level]] = {c: [] for c in four}
                for _ in range(args.rounds):
                    order = four[turn % 4 :] + four[: turn % 4]  # who goes first rotates
                    turn += 1
                    for config in order:
                        server = make_server(config, streams, args, logdir)
                        server.start()
                        try:
                            await server.wait_ready(client, args.start_timeout)
                            await one_stream(client, server.base + "/v1/chat/completions", "Warm up:", 4)
                            runs[config].append(await level(client, server, prompts, streams, args.max_tokens))
                        except (httpx.HTTPError, ValueError) as exc:
                            raise BenchError(f"{config} at {streams} streams failed: {exc!r}. Log {server.log}:\n"
                                             f"    {server.log_tail()}") from exc  # fmt: skip
                        finally:
                            server.stop()
                best = {c: sorted(rs, key=lambda r: r.tok_s)[len(rs) // 2] for c, rs in runs.items()}
                rows.append((name, streams, best))
                print(row_text(name, streams, best, args.method), flush=True)
    return rows


def row_text(name: str, streams: int, best: dict[str, Level], method: str) -> str:
    def cell(lv: Level) -> str:
        acc = f"{lv.accepted}/{lv.drafted}" if lv.drafted else "-"
        return (f"{lv.tok_s:7.1f} tok/s ttft {lv.ttft_p50 * 1000:5.0f} ms rss {lv.peak_rss_mb:4.0f} MiB "
                f"tokens {min(lv.tokens)}-{max(lv.tokens)} accepted {acc}")  # fmt: skip

    ours_off, ours_on, peer_off, peer_on = (best[c].tok_s for c in configs(method))
    lines = [f"{name:8} {streams:2d} streams: ours {method}/off {ours_on / ours_off:.2f}x, llama {method}/off "
             f"{peer_on / peer_off:.2f}x, ours {method} / llama {method} {ours_on / peer_on:.2f}x, "
             f"ours off / llama off {ours_off / peer_off:.2f}x"]  # fmt: skip
    lines += [f"    {c:15} {cell(lv)}" for c, lv in best.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=None, help="an existing llama-server (else built once)")
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram",
                    help="ngram: prompt lookup; draft: a draft model (--draft-gguf) for --gguf")  # fmt: skip
    ap.add_argument("--gguf", type=Path, default=None,
                    help="the GGUF both serve (default: the SmolLM2 demo; --method draft: its F16 GGUF)")  # fmt: skip
    ap.add_argument("--draft-gguf", type=Path, default=None,
                    help="--method draft: the draft model both use (default: the SmolLM2 demo, Q4_1)")  # fmt: skip
    ap.add_argument("--dtype", choices=("auto", "f16", "q8", "q4"), default="auto",
                    help="the aiobasert bundle of the GGUF served (default auto: the GGUF's own blocks)")  # fmt: skip
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--prompts", nargs="*", choices=["grounded", "free"], default=["grounded", "free"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", type=int, default=4, help="drafts per step at most (both)")
    ap.add_argument("--lookup", type=int, default=4, help="llama-server's n-gram lookup size (our prompt_lookup_max)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per server and row; medians reported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    try:
        args.llama_server = args.llama_server or build_llama_server(None, 2)
        if args.method == "draft":
            args.draft_gguf = args.draft_gguf or smollm2_gguf_path()
            args.gguf = args.gguf or f16_target(args.draft_gguf)
            args.ours_draft = our_model(args.draft_gguf, "auto", None)  # converted before any server is measured
        args.gguf = args.gguf or smollm2_gguf_path()
        args.ours_model = our_model(args.gguf, args.dtype, None)
        load0 = os.getloadavg()
        source = f", draft model {args.draft_gguf}" if args.method == "draft" else ""
        print(f"speculative decoding ({args.method}), aiobasert vs llama-server: {args.gguf}{source}, "
              f"{args.threads} threads each, {args.max_tokens} tokens at most, greedy, k <= {args.draft}; "
              f"aiobasert {git_head()}; {llama_server_version(args.llama_server)}; "
              f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)  # fmt: skip
        rows = asyncio.run(bench(args))
        load1 = os.getloadavg()
        print(f"\nload average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
        for name, streams, best in rows:
            print(row_text(name, streams, best, args.method))
    except BenchError as exc:
        print("error:", exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        _stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
