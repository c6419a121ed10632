"""aiobasert on Ray Serve: engine replicas behind Serve's HTTP proxy, with prefix/session affinity.

```bash
pip install 'aiobasert[ray]'
aiobasert serve --ray --replicas 4 model.base          # or: ray start --head; RAY_ADDRESS=auto ...
```

Two deployments, as Ray's own `ray.serve.llm` OpenAI app is built:

- `OpenAIIngress` receives every HTTP request from Serve's proxy, reads its
  body once, derives an affinity key (the `X-Session-Id` header or the body's
  `user` field; else the prompt text) and forwards the request, unchanged, to
  an engine replica through a streaming `DeploymentHandle` call. It relays the
  replica's response (status, headers, body chunks: SSE included) back to the
  client. Serve's proxy hands a replica only the ASGI scope, never the body, so
  a router that looks at prompts needs this hop.
- `EngineReplica` runs one aiobasert engine (or an `EngineGroup` of several
  models) and the very same OpenAI-compatible ASGI app `aiobasert serve` runs,
  in process; a forwarded request goes through it exactly as over a socket.
  Every response carries `X-Aiobasert-Replica` (the replica's id).
- `AffinityRouter`, the engine deployment's Serve request router, sends
  requests of one session, or sharing a prompt prefix, to the same replica, so
  they hit that replica's prefix cache, unless that replica is overloaded
  (its queue longer than the shortest by more than `imbalance`, or full):
  then the least loaded of two random replicas takes it (power of two choices).

A client that disconnects cancels the ingress call; Serve propagates the
cancellation to the engine replica's generator, which tells the app the client
is gone (`http.disconnect`): the stream closes and frees its lane. A replica
that dies fails only the requests it was serving; Serve starts a replacement.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

try:
    import ray
    import ray.exceptions
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError("aiobasert on Ray Serve needs ray[serve]: pip install 'aiobasert[ray]'") from exc

from ..config import EngineConfig
from ..group import ModelSource
from .app import build_app
from .errors import APIError
from .provider import EngineProvider, SingleEngineProvider
from .ray_router import AffinityRouter, replica_tag
from .responses import tag_of
from .router import GroupProvider
from .streaming import SSE_DONE, sse

__all__ = [
    "REPLICA_HEADER",
    "SESSION_HEADER",
    "AffinityRouter",
    "EngineReplica",
    "ForwardedRequest",
    "OpenAIIngress",
    "build_ray_app",
    "run_ray",
]

logger = logging.getLogger("aiobasert.server")

SESSION_HEADER = "x-session-id"
"""Requests carrying the same value go to the same replica (else the body's `user` field is the session)."""
REPLICA_HEADER = "x-aiobasert-replica"
"""Set on every response: the full id of the engine replica that served it."""


class ForwardedRequest(msgspec.Struct, kw_only=True):
    """One HTTP request as the ingress forwards it to an engine replica (and the router sees it)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    session: str | None = None
    """A session key: requests sharing it go to one replica."""
    prompt: str | None = None
    """The prompt's text (chat messages concatenated), for prefix affinity."""
    replica: str | None = None
    """The tag of the replica storing the request's `previous_response_id` (it must go there)."""


class _Start(msgspec.Struct, kw_only=True):
    """The first item a replica streams back: the response's status and headers."""

    status: int
    headers: list[tuple[bytes, bytes]]


class _AffinityFields(msgspec.Struct):
    """What the ingress reads from a body to route it (unknown fields ignored)."""

    user: str | None = None
    prompt: Any = None
    messages: Any = None
    input: Any = None


def _text_of(value: Any) -> str:
    """The text of a prompt / messages / content value, for prefix matching only."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text_of(v) for v in value)
    if isinstance(value, dict):
        parts = [str(value.get("role", "")), _text_of(value.get("content")), _text_of(value.get("text"))]
        return "\x1e".join(parts)
    if isinstance(value, int):
        return f"{value},"  # token-id prompts: ids as text keep their prefixes aligned
    return ""


def affinity_of(headers: Mapping[str, str], body: bytes) -> tuple[str | None, str | None]:
    """(session, prompt text) of a request."""
    session = headers.get(SESSION_HEADER) or None
    try:
        fields = msgspec.json.decode(body, type=_AffinityFields) if body else _AffinityFields()
    except msgspec.MsgspecError:
        return session, None  # the replica's app answers it with its 400
    session = session or fields.user or None
    for value in (fields.messages, fields.prompt, fields.input):
        if value is not None:
            return session, _text_of(value) or None
    return session, None


class _Continues(msgspec.Struct):
    previous_response_id: Any = None


def continued_on(body: bytes) -> str | None:
    """The replica tag of a request's `previous_response_id` (the replica storing it), if any."""
    try:
        previous = msgspec.json.decode(body, type=_Continues).previous_response_id if body else None
    except msgspec.MsgspecError:
        return None
    return tag_of(previous) if isinstance(previous, str) else None


def _provider(
    models: Sequence[ModelSource | None], keep_alive: float | None, options: dict[str, Any]
) -> EngineProvider:
    named = [m for m in models if m is not None]
    config = EngineConfig(**options)  # every Engine.open option, for one model or several
    if len(named) > 1 or keep_alive is not None or any("=" in os.fspath(m) for m in named):
        return GroupProvider(named, keep_alive=keep_alive, config=config)
    return SingleEngineProvider.from_path(named[0] if named else None, config=config)


class EngineReplica:
    """One Serve replica: an engine (or group) and the OpenAI app, driven in process."""

    async def __init__(  # type: ignore[misc]  # Ray actors may have an async constructor
        self,
        models: Sequence[ModelSource | None],
        keep_alive: float | None = None,
        engine_options: dict[str, Any] | None = None,
        api_key: str | None = None,
    ) -> None:
        self._provider = _provider(models, keep_alive, dict(engine_options or {}))
        self._app, service = build_app(self._provider, api_key=api_key)
        self._replica = serve.get_replica_context().replica_id.to_full_id_str()
        service.responses.id_tag = replica_tag(self._replica)  # follow-ups are routed back here
        self._lifespan_events: asyncio.Queue[Message] = asyncio.Queue()
        self._lifespan_sent: asyncio.Queue[Message] = asyncio.Queue()
        self._lifespan = asyncio.create_task(
            self._app(
                {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                self._lifespan_events.get,
                self._lifespan_sent.put,
            )
        )
        await self._lifespan_events.put({"type": "lifespan.startup"})
        reply = await self._lifespan_sent.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the engine failed to start: {reply.get('message', reply['type'])}")

    async def check_health(self) -> None:
        """Serve's health check: the engine(s) must be running."""
        if not self._provider.ready:
            raise RuntimeError("the engine is not running")

    async def __del__(self) -> None:
        # Serve calls this on a graceful replica shutdown: close the engines (abort in-flight).
        await self._provider.abort()
        if not self._lifespan.done():
            await self._lifespan_events.put({"type": "lifespan.shutdown"})
            await asyncio.wait({self._lifespan}, timeout=10)

    async def handle(self, fwd: ForwardedRequest) -> AsyncGenerator[_Start | bytes, None]:
        """Run one forwarded request through the app: a `_Start`, then body chunks."""
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": fwd.method,
            "scheme": "http",
            "path": fwd.path,
            "raw_path": fwd.path.encode(),
            "root_path": "",
            "query_string": fwd.query_string,
            "headers": fwd.headers,
            "client": None,
            "server": None,
            "state": {},
        }
        sent: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": fwd.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await sent.put(message)

        task = asyncio.create_task(self._app(scope, receive, send))
        task.add_done_callback(lambda _t: sent.put_nowait(None))
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self._replica.encode())]
                    yield _Start(status=message["status"], headers=headers)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
            await task
        finally:
            # The caller went away (Serve cancelled this generator) or the response is done:
            # tell the app the client is gone, so a live stream closes and frees its lane.
            gone.set()
            if not task.done():
                await asyncio.wait({task}, timeout=30)

    def replica_id(self) -> str:
        """This replica's full id (as in `X-Aiobasert-Replica`)."""
        return self._replica


class _Relay(Response):
    """Streams an engine replica's response to the client. A client that disconnects
    cancels the upstream call (freeing the replica's lane); a replica that dies
    mid-stream ends an SSE response with an error event and `[DONE]`."""

    def __init__(self, start: _Start, chunks: Any) -> None:
        self.status_code = start.status
        self.raw_headers = start.headers
        self._chunks = chunks
        self.background = None
        self._sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except ray.exceptions.RayError as exc:
            logger.warning("an engine replica failed mid-response: %s", exc)
            if self._sse:
                err = APIError(
                    503, "the engine replica serving this stream failed", type="server_error", code="replica_failed"
                )
                await send({"type": "http.response.body", "body": sse(err.body) + SSE_DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        relay = asyncio.ensure_future(self._relay(send))
        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if relay in done:
                relay.result()
        finally:
            relay.cancel()
            watcher.cancel()
            self._chunks.cancel()  # a no-op once the stream is complete


class OpenAIIngress:
    """The HTTP entry point: forwards each request to an engine replica and relays the answer."""

    def __init__(self, engines: DeploymentHandle[Any]) -> None:
        self._engines = engines.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        session, prompt = affinity_of(request.headers, body)
        fwd = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]),
            body=body,
            session=session,
            prompt=prompt,
            replica=continued_on(body),
        )
        chunks = cast(DeploymentResponseGenerator[Any], self._engines.handle.remote(fwd))
        try:
            start = await chunks.__anext__()
        except (StopAsyncIteration, ray.exceptions.RayError) as exc:
            chunks.cancel()  # type: ignore[no-untyped-call]
            logger.warning("the engine replica failed before answering: %s", exc)
            err = APIError(503, "the engine replica failed; retry", type="server_error", code="replica_failed")
            return err.response()
        if not isinstance(start, _Start):  # pragma: no cover - a protocol bug, not a runtime condition
            raise TypeError(f"engine replica sent {type(start).__name__} first")
        return _Relay(start, chunks)


def build_ray_app(
    models: Sequence[ModelSource | None],
    *,
    replicas: int = 1,
    keep_alive: float | None = None,
    api_key: str | None = None,
    max_batch_size: int = 8,
    max_context: int = 2048,
    engine_options: dict[str, Any] | None = None,
    engine_num_cpus: float = 1,
    router_options: dict[str, Any] | None = None,
    request_router: str | None = "aiobasert.server.ray_router.AffinityRouter",
) -> Any:
    """The Serve application (`serve.run(build_ray_app([...]))`): ingress + `replicas` engine replicas.

    models: what `aiobasert serve` takes (paths, `name=path`; [None] = the default model).
    engine_num_cpus: Ray CPUs reserved per engine replica (the scheduler places replicas by it).
    router_options: `AffinityRouter` settings (block_chars, imbalance, table_size).
    request_router: the engine deployment's Serve request router (None: Serve's default,
        power of two choices without affinity; bench/ray_affinity.py compares the two).
    """
    options = {"max_batch_size": max_batch_size, "max_context": max_context, **(engine_options or {})}
    routing: dict[str, Any] = {}
    if request_router is not None:
        routing["request_router_config"] = RequestRouterConfig(  # (its **kwargs annotation is wrong: cast)
            **cast(Any, {"request_router_class": request_router, "request_router_kwargs": dict(router_options or {})})
        )
    engines = serve.deployment(
        name="aiobasert-engine",
        num_replicas=replicas,
        # Beyond its lanes a replica queues in its engine; past this Serve routes elsewhere.
        max_ongoing_requests=max(2 * max_batch_size, 4),
        ray_actor_options={"num_cpus": engine_num_cpus},
        health_check_period_s=2,
        graceful_shutdown_timeout_s=5,
        **routing,
    )(EngineReplica)
    ingress = serve.deployment(name="aiobasert-ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)(
        OpenAIIngress
    )
    return ingress.bind(engines.bind(list(models), keep_alive, options, api_key))


def run_ray(
    models: Sequence[ModelSource | None],
    *,
    replicas: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    keep_alive: float | None = None,
    max_batch_size: int = 8,
    max_context: int = 2048,
    engine_num_cpus: float = 1,
    engine_options: dict[str, Any] | None = None,
) -> None:
    """`aiobasert serve --ray`: start (or join, with $RAY_ADDRESS) a Ray cluster, run the
    app behind Serve's proxy on host:port, and block until SIGTERM or Ctrl-C. `engine_options`:
    further `Engine.open` keywords (e.g. kv_cache_dtype), over max_batch_size / max_context."""
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    app = build_ray_app(
        models,
        replicas=replicas,
        keep_alive=keep_alive,
        api_key=api_key,
        max_batch_size=max_batch_size,
        max_context=max_context,
        engine_options=engine_options,
        engine_num_cpus=engine_num_cpus,
    )
    serve.run(app, name="aiobasert", route_prefix="/")
    print(f"aiobasert on Ray Serve: http://{host}:{port}/v1 ({replicas} replica(s))", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
