"""The `aiobasert` command: run, chat, convert, serve, bench.

    aiobasert run "Once upon a time"        # stream a completion (default model)
    aiobasert chat                          # interactive chat, keeps history
    aiobasert convert SRC.gguf OUT.base     # GGUF -> .base
    aiobasert serve --port 8000             # OpenAI-compatible HTTP server
    aiobasert serve a.base chat=b.base      # several models, routed by the request's `model`
    aiobasert serve --ray --replicas 2 m.base  # replicas on Ray Serve, prefix/session affinity
    aiobasert bench                         # the engine benchmark (bench/engine.py)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec

from .engine import Engine
from .errors import AioBaseRTError
from .types import ChatMessage, SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="a .base bundle (default: SmolLM2-135M-Instruct, prepared on first use)")
    p.add_argument("--max-context", type=int, default=2048, help="tokens per lane (default 2048)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )


async def _run(args: argparse.Namespace) -> int:
    async with Engine.open(args.model, max_batch_size=1, max_context=args.max_context) as engine:
        stream = (
            engine.chat([ChatMessage(role="user", content=args.prompt)], _params(args))
            if args.chat
            else engine.stream(args.prompt, _params(args))
        )
        if args.json:
            completion = await stream
            sys.stdout.buffer.write(msgspec.json.encode(completion) + b"\n")
            return 0
        if not args.chat:  # a completion continues the prompt: show it first
            sys.stdout.write(args.prompt)
        async for tok in stream:
            sys.stdout.write(tok.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        final = stream.final
        if final is not None and args.verbose:
            t = final.timing
            print(
                f"[{final.usage.completion_tokens} tokens, {final.finish_reason}, "
                f"first token {t.time_to_first_token_s * 1000:.0f} ms, total {t.total_s:.2f} s]",
                file=sys.stderr,
            )
    return 0


async def _chat(args: argparse.Namespace) -> int:
    history: list[ChatMessage] = []
    if args.system:
        history.append(ChatMessage(role="system", content=args.system))
    async with Engine.open(args.model, max_batch_size=1, max_context=args.max_context) as engine:
        print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append(ChatMessage(role="user", content=line))
            reply: list[str] = []
            async for tok in engine.chat(history, _params(args)):
                reply.append(tok.text)
                sys.stdout.write(tok.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            history.append(ChatMessage(role="assistant", content="".join(reply)))
    return 0


def _serve(args: argparse.Namespace) -> int:
    # Models: positional PATH or NAME=PATH, and --model (repeatable); several are routed by `model`.
    models: list[str] = [*args.models, *(args.model or [])]
    if args.ray:
        from .server.ray_serve import run_ray

        run_ray(
            models or [None],
            replicas=args.replicas,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            keep_alive=args.keep_alive,
            max_batch_size=args.max_batch_size,
            max_context=args.max_context,
        )
        return 0
    from .server import GroupProvider, serve

    if len(models) > 1 or args.keep_alive is not None or any("=" in m for m in models):
        provider = GroupProvider(
            models, keep_alive=args.keep_alive, max_batch_size=args.max_batch_size, max_context=args.max_context
        )
        serve(provider, host=args.host, port=args.port, api_key=args.api_key)
        return 0
    serve(
        model=models[0] if models else None,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_batch_size=args.max_batch_size,
        max_context=args.max_context,
    )
    return 0


def _bench(args: argparse.Namespace, rest: Sequence[str]) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.which}.py"
    if not script.is_file():
        print(f"aiobasert bench: {script} not found (the bench scripts live in the source tree)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiobasert", description="Stream text from a BaseRT model.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="stream a completion of PROMPT to the terminal")
    run.add_argument("prompt")
    run.add_argument("--chat", action="store_true", help="wrap PROMPT as a user turn in the chat template")
    run.add_argument("--json", action="store_true", help="print the whole Completion as JSON")
    run.add_argument("--verbose", "-v", action="store_true", help="print token count and timing to stderr")
    _add_model_args(run)
    _add_sampling_args(run, 64)

    chat = sub.add_parser("chat", help="interactive chat that keeps the history")
    chat.add_argument("--system", help="a system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat, 256)

    conv = sub.add_parser("convert", help="convert a GGUF (llama family) into a .base bundle")
    conv.add_argument("args", nargs=argparse.REMAINDER)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this bearer token")
    serve.add_argument("--max-batch-size", type=int, default=8)
    serve.add_argument("models", nargs="*", metavar="MODEL", help="PATH or NAME=PATH; several are routed by `model`")
    serve.add_argument("--model", "-m", action="append", help="a model (PATH or NAME=PATH); repeatable")
    serve.add_argument("--max-context", type=int, default=2048, help="tokens per lane (default 2048)")
    serve.add_argument("--keep-alive", type=float, default=None, help="unload a model after this many idle seconds")
    serve.add_argument("--ray", action="store_true", help="serve on Ray Serve (pip install 'aiobasert[ray]')")
    serve.add_argument("--replicas", type=int, default=1, help="with --ray: engine replicas (default 1)")

    bench = sub.add_parser("bench", help="run a benchmark script from bench/")
    bench.add_argument("which", nargs="?", default="engine", choices=["engine", "sdk_overhead", "soak"])

    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "convert":
            from .convert import main as convert_main

            return convert_main([*args.args, *rest])
        if rest and args.command != "bench":
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "bench":
            return _bench(args, rest)
        if args.command == "serve":
            return _serve(args)
        runner: Any = _run if args.command == "run" else _chat
        return int(anyio.run(runner, args))
    except AioBaseRTError as exc:
        print(f"aiobasert: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
