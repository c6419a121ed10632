"""The app and its wiring: routes, auth, error handlers, `create_app` and `serve`."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config import EngineConfig
from ..errors import AioBaseRTError, InvalidConfigError
from ..reasoning import MAX_REASONING_BUDGET
from .connection import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES, bounded_http_protocol
from .endpoints import Service
from .errors import APIError, ClientGone, api_error
from .oplog import RequestOps, log_config, startup_line
from .provider import EngineFactory, EngineProvider, SingleEngineProvider
from .responses import DEFAULT_STORE_BYTES
from .router import GroupProvider, ModelRouter
from .streaming import DEFAULT_SSE_KEEPALIVE_S, DEFAULT_WRITE_TIMEOUT_S

logger = logging.getLogger("aiobasert.server")

_OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class _StartupFailure:
    """A model that cannot be loaded at startup is the server's one-line error (the engine's own
    message), not a traceback: Starlette reports a failed lifespan with the formatted traceback,
    which uvicorn prints; this replaces that text when the cause is one of ours."""

    def __init__(self, app: ASGIApp, failures: list[AioBaseRTError]) -> None:
        self.app = app
        self._failures = failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_one_line(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and self._failures:
                exc = self._failures[-1]
                message = {**message, "message": f"aiobasert: cannot start: {type(exc).__name__}: {exc}"}
            await send(message)

        await self.app(scope, receive, send_one_line)


class _BearerAuth:
    """Require `Authorization: Bearer <api_key>` (or Anthropic's `x-api-key: <api_key>`) on every
    path but the operator's unauthenticated ones (/health, /metrics, /version: probes and scrapers)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            # RFC 6750 / 7235: the scheme is case-insensitive ("bearer" is as good as "Bearer")
            ok = hmac.compare_digest(token.strip(b" "), self._expected) and scheme.lower() == b"bearer"
            if not ok and b"x-api-key" in headers:  # the Anthropic SDKs' header, worth the same
                ok = hmac.compare_digest(headers[b"x-api-key"].strip(b" "), self._expected)
            if not ok:
                err = APIError(
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await err.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    # Unexpected exceptions are logged by Starlette's error middleware, which re-raises them.
    return api_error(exc, log=False).response(request.url.path)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    headers = dict(exc.headers) if exc.headers else None
    return APIError(exc.status_code, str(exc.detail), code=code, headers=headers).response(request.url.path)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody is listening; uvicorn drops it


def build_app(
    provider: EngineProvider,
    *,
    api_key: str | None = None,
    allowed_origins: Sequence[str] | None = None,
    write_timeout: float | None = DEFAULT_WRITE_TIMEOUT_S,
    response_store_bytes: int = DEFAULT_STORE_BYTES,
    announce: bool = True,
    sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE_S,
    reasoning_budget: int = -1,
) -> tuple[Starlette, Service]:
    """The ASGI app over `provider`, and its `Service` (the endpoints).
    `allowed_origins`: CORS origins allowed to call it (None: no CORS headers);
    `write_timeout`, `response_store_bytes`, `sse_keepalive`, `reasoning_budget`: see `create_app`; `announce`: log the
    startup line once the models are open (`serve` logs it itself, with its address)."""
    for name, seconds in (("write_timeout", write_timeout), ("sse_keepalive", sse_keepalive)):
        if seconds is not None and not seconds >= 0:  # NaN too
            raise InvalidConfigError(f"{name} must be >= 0 seconds (0 or None: never), got {seconds!r}")
    if response_store_bytes < 0:
        raise InvalidConfigError(f"response_store_bytes must be >= 0, got {response_store_bytes}")
    b = reasoning_budget
    if isinstance(b, bool) or not isinstance(b, int) or not -1 <= b <= MAX_REASONING_BUDGET:
        raise InvalidConfigError(f"reasoning_budget must be an integer from -1 (no bound) to 2**30, got {b!r}")
    service = Service(
        provider,
        write_timeout=write_timeout,
        response_store_bytes=response_store_bytes,
        sse_keepalive=sse_keepalive,
        reasoning_budget=reasoning_budget,
    )
    routes = [
        Route("/health", service.health, methods=["GET"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", service.embeddings, methods=["POST"]),
        Route("/v1/responses", service.responses.create, methods=["POST"]),
        Route("/v1/messages", service.messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", service.messages.count_tokens, methods=["POST"]),
        Route("/v1/internal/stats", service.stats, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
        Route("/version", service.version, methods=["GET"]),
        Route("/tokenize", service.tokenize, methods=["POST"]),
        Route("/detokenize", service.detokenize, methods=["POST"]),
    ]

    startup_failures: list[AioBaseRTError] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started = False
        try:
            async with provider.lifespan(), anyio.create_task_group() as tg:
                tg.start_soon(service.metrics.probe_loop_lag)
                started = True
                if announce and logger.isEnabledFor(logging.INFO):
                    logger.info(await startup_line(provider.served(), None))
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        except AioBaseRTError as exc:
            if not started:  # a model that cannot load: _StartupFailure reports it in one line
                startup_failures.append(exc)
            raise

    middleware = [
        Middleware(_StartupFailure, failures=startup_failures),
        Middleware(RequestOps, metrics=service.metrics),
    ]
    if allowed_origins:
        # outside the auth check, so browsers' preflight requests get their answer
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(allowed_origins),
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["X-Request-Id"],
            )
        )
    if api_key is not None:
        middleware.append(Middleware(_BearerAuth, api_key=api_key))
    if isinstance(provider, GroupProvider):  # several models: route by `model`, lease for the request
        middleware.append(Middleware(ModelRouter, provider=provider))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: _on_http_exception,
            ClientGone: _on_client_gone,
            AioBaseRTError: _on_api_error,
            APIError: _on_api_error,
            Exception: _on_api_error,
        },
    )
    return app, service


def _provider(
    model: str | os.PathLike[str] | EngineFactory | EngineProvider | None,
    *,
    model_name: str | None,
    max_batch_size: int,
    max_context: int,
    config: EngineConfig | None,
) -> EngineProvider:
    if config is not None and (isinstance(model, EngineProvider) or callable(model)):
        raise InvalidConfigError("config applies to a model path; an EngineFactory or EngineProvider opens its own")
    if isinstance(model, EngineProvider):
        return model
    if callable(model):
        return SingleEngineProvider(model, model_name=model_name)
    return SingleEngineProvider.from_path(
        model, model_name=model_name, max_batch_size=max_batch_size, max_context=max_context, config=config
    )


def create_app(
    model: str | os.PathLike[str] | EngineFactory | EngineProvider | None = None,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    max_batch_size: int = 8,
    max_context: int = 2048,
    allowed_origins: Sequence[str] | None = None,
    write_timeout: float | None = DEFAULT_WRITE_TIMEOUT_S,
    response_store_bytes: int = DEFAULT_STORE_BYTES,
    config: EngineConfig | None = None,
    sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE_S,
    reasoning_budget: int = -1,
) -> Starlette:
    """The OpenAI-compatible ASGI app (run it with any ASGI server, e.g. uvicorn).

    model: a `.base` path (None = the default model, or $AIOBASERT_MODEL), an
        `EngineFactory` for full control over `Engine.open`'s arguments, or an
        `EngineProvider` (several models, engines of your own); the engines are
        opened when the app starts and aborted when it stops.
    api_key: when set, every endpoint but /health, /metrics and /version needs
        `Authorization: Bearer <api_key>`.
    model_name: the id reported by /v1/models and in responses (default: the file's stem).
    max_batch_size, max_context: passed to `Engine.open` when `model` is a path.
    config: every `Engine.open` option in one `EngineConfig` when `model` is a path (then leave
        max_batch_size and max_context out); checked here, before the app is built.
    allowed_origins: CORS origins allowed to call the API ("*" = any; None = no CORS).
    write_timeout: seconds a streamed response waits for its client to take
        bytes before the client is dropped and its generation aborted (None or 0:
        wait forever). See docs/fairness.md.
    response_store_bytes: the Responses API store's budget (stored
        conversations' encoded size; oldest dropped first).
    sse_keepalive: seconds a streamed response may send nothing (queued for a
        lane, preempted) before it sends an SSE comment, `: keep-alive`, so a
        proxy's idle timeout does not cut it (None or 0: never).
    reasoning_budget: the thought's token budget on a reasoning model for a request that sets
        none (llama-server's `--reasoning-budget`): -1 no bound, 0 thinking off, N the engine
        closes the thought after N tokens. A request's `reasoning_budget_tokens` /
        `thinking_token_budget` (chat completions), `reasoning_effort` / `reasoning.effort` or
        Anthropic's `thinking` overrides it (docs/reasoning.md).

    Under a server of your own, in-flight streams keep the shutdown waiting
    until they finish (uvicorn runs the lifespan shutdown last); use `serve()`
    or a graceful-shutdown timeout to bound that.
    """
    provider = _provider(
        model, model_name=model_name, max_batch_size=max_batch_size, max_context=max_context, config=config
    )
    return build_app(
        provider,
        api_key=api_key,
        allowed_origins=allowed_origins,
        write_timeout=write_timeout,
        response_store_bytes=response_store_bytes,
        sse_keepalive=sse_keepalive,
        reasoning_budget=reasoning_budget,
    )[0]


def serve(
    model: str | os.PathLike[str] | EngineFactory | EngineProvider | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch_size: int = 8,
    max_context: int = 2048,
    *,
    model_name: str | None = None,
    log_level: str = "info",
    allowed_origins: Sequence[str] | None = None,
    write_timeout: float | None = DEFAULT_WRITE_TIMEOUT_S,
    response_store_bytes: int = DEFAULT_STORE_BYTES,
    config: EngineConfig | None = None,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT_S,
    http: str = "auto",
    sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE_S,
    reasoning_budget: int = -1,
) -> None:
    """Run the server with uvicorn until SIGTERM or Ctrl-C.

    Logging: uvicorn's loggers and `aiobasert`'s at `log_level` (uvicorn's names: "trace",
    "debug", "info", "warning", "error", "critical"), lines on stderr with their time, level and logger (uvicorn's
    access lines on stdout); once listening, one line names the models, lanes, KV
    cache, engine threads and address. See docs/operations.md.

    On shutdown, in-flight generations are aborted at once (streams get an
    error event and `[DONE]`, waiting non-streamed requests a 503); a client
    that does not read its response is cut off after one second.
    `write_timeout`, `response_store_bytes`, `config`, `sse_keepalive`, `reasoning_budget`: see `create_app`.

    A request's head (request line and headers) may be `max_header_bytes` long (a longer one is
    answered 431) and must complete within `header_timeout` seconds of the connection's opening or
    its previous response (else 408; None or 0: no bound), checked before the API key
    (`bounded_http_protocol`, under an app of your own). `http`: uvicorn's HTTP/1.1 parser,
    "auto" (httptools when installed, else h11), "httptools" or "h11".
    """
    try:
        import uvicorn
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError("aiobasert serve needs uvicorn: pip install 'aiobasert[server]'") from exc

    from uvicorn.config import LOG_LEVELS

    if log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    protocol = bounded_http_protocol(max_header_bytes, header_timeout, http)  # checks them, before any load
    provider = _provider(
        model, model_name=model_name, max_batch_size=max_batch_size, max_context=max_context, config=config
    )
    app, _service = build_app(
        provider,
        api_key=api_key,
        allowed_origins=allowed_origins,
        write_timeout=write_timeout,
        response_store_bytes=response_store_bytes,
        announce=False,
        sse_keepalive=sse_keepalive,
        reasoning_budget=reasoning_budget,
    )

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.should_exit or not logger.isEnabledFor(logging.INFO):
                return
            bound = [s.getsockname() for server in self.servers for s in server.sockets or ()]
            address = None
            if bound and isinstance(bound[0], tuple):
                bound_host, bound_port = bound[0][:2]
                address = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
            logger.info(await startup_line(provider.served(), address))

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await provider.abort()
            await super().shutdown(sockets=sockets)

    # ws="none": no route here is a WebSocket, so uvicorn need not import a WebSocket library.
    server_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config(log_level),
        timeout_graceful_shutdown=1,
        lifespan="on",
        ws="none",
        http=protocol,
        h11_max_incomplete_event_size=2 * max_header_bytes,  # h11's own bound (16 KiB unless set), past ours
    )
    _Server(server_config).run()
