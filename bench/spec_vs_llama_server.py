"""Speculative decoding, aiobasert serve against llama-server side by side in one run (issue 36 item 6).

The same GGUF, the same greedy `/v1/chat/completions` requests (each server renders the GGUF's
chat template) from the same httpx client, the same
thread count, four servers per row, one at a time (the order rotates every row, so load from
elsewhere falls on all alike):

    aiobasert off      aiobasert serve
    aiobasert ngram    aiobasert serve --speculative ngram --num-speculative-tokens K
    llama off          llama-server
    llama ngram        llama-server --spec-type ngram-simple (lookup n = our prompt_lookup_max, draft m = K)

Prompt sets: input-grounded (rewrite a passage with one change, quote it, copy it: what prompt
lookup is for) and free text (where it cannot pay, and must not cost); 1 / 4 / 16 streams. Per
server: tok/s (every generated token / the level's wall time), TTFT p50, peak RSS, the tokens each
stream made, drafted and accepted tokens (ours: usage's `draft_tokens` / `accepted_draft_tokens`;
llama-server: its `timings.draft_n` / `draft_n_accepted`). Neither gets ignore_eos (aiobasert's HTTP
API has none): a reply ends where the model ends it, in both (the token counts are printed).
Ratios printed: our ngram / our off (what speculation buys us), our ngram / llama ngram (against
the peer).

A draft model (`-md`) is not compared here: llama-server needs the target and the draft as GGUFs,
and the demo ships one (Q4_1); bench/speculative.py --pair measures our draft-model speculation.

    python bench/spec_vs_llama_server.py                          # the demo SmolLM2-135M GGUF
    python bench/spec_vs_llama_server.py --streams 1 --rounds 3   # one stream, medians of 3
    python bench/spec_vs_llama_server.py --gguf model.gguf --llama-server PATH

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

CONFIGS = ("aiobasert off", "aiobasert ngram", "llama off", "llama ngram")


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


def make_server(config: str, streams: int, args: argparse.Namespace, logdir: Path) -> Server:
    port = free_port()
    log = logdir / f"{config.replace(' ', '-')}-{streams}.log"
    if config.startswith("aiobasert"):
        cmd = [sys.executable, "-m", "aiobasert", "serve", str(args.ours_model), "--port", str(port),
               "--max-batch-size", str(streams), "--max-context", str(args.ctx), "--served-model-name", "bench",
               "--no-grammar-backend-at-open"]  # fmt: skip
        if config.endswith("ngram"):
            cmd += ["--speculative", "ngram", "--num-speculative-tokens", str(args.draft)]
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "BASERT_REF_THREADS": str(args.threads), "PYTHONPATH": path}
        return Server(config, cmd, port, log, env)
    cmd = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(streams), "-cb", "-c", str(args.ctx * streams), "-t", str(args.threads),
           "-tb", str(args.threads), "--alias", "bench"]  # fmt: skip
    if config.endswith("ngram"):
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.lookup),
                "--spec-ngram-simple-size-m", str(args.draft), "--spec-draft-n-max", str(args.draft)]  # fmt: skip
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
                runs: dict[str, list[Level]] = {c: [] for c in CONFIGS}
                for _ in range(args.rounds):
                    order = CONFIGS[turn % 4 :] + CONFIGS[: turn % 4]  # who goes first rotates
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
                print(row_text(name, streams, best), flush=True)
    return rows


def row_text(name: str, streams: int, best: dict[str, Level]) -> str:
    def cell(lv: Level) -> str:
        acc = f"{lv.accepted}/{lv.drafted}" if lv.drafted else "-"
        return (f"{lv.tok_s:7.1f} tok/s ttft {lv.ttft_p50 * 1000:5.0f} ms rss {lv.peak_rss_mb:4.0f} MiB "
                f"tokens {min(lv.tokens)}-{max(lv.tokens)} accepted {acc}")  # fmt: skip

    ours = best["aiobasert ngram"].tok_s / best["aiobasert off"].tok_s
    peer = best["llama ngram"].tok_s / best["llama off"].tok_s
    vs = best["aiobasert ngram"].tok_s / best["llama ngram"].tok_s
    lines = [f"{name:8} {streams:2d} streams: ours on/off {ours:.2f}x, llama on/off {peer:.2f}x, "
             f"ours ngram / llama ngram {vs:.2f}x"]  # fmt: skip
    lines += [f"    {c:15} {cell(lv)}" for c, lv in best.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=None, help="an existing llama-server (else built once)")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF both serve (default: the SmolLM2 demo)")
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
        args.gguf = args.gguf or smollm2_gguf_path()
        args.ours_model = our_model(args.gguf, args.dtype, None)
        load0 = os.getloadavg()
        print(f"speculative decoding, aiobasert vs llama-server: {args.gguf}, {args.threads} threads each, "
              f"{args.max_tokens} tokens at most, greedy, k <= {args.draft}; aiobasert {git_head()}; "
              f"{llama_server_version(args.llama_server)}; load average {load0[0]:.2f}", flush=True)  # fmt: skip
        rows = asyncio.run(bench(args))
        load1 = os.getloadavg()
        print(f"\nload average at end {load1[0]:.2f}")
        for name, streams, best in rows:
            print(row_text(name, streams, best))
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
