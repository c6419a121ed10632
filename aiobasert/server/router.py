"""Several models behind one endpoint: `GroupProvider` and the `ModelRouter` in front of the endpoints.

```bash
aiobasert serve a.base chat=b.base --keep-alive 300
```

`GroupProvider` serves an `EngineGroup` (one engine thread per model). The
`ModelRouter` is the ASGI layer that makes model routing a property of the
whole request rather than of a handler: it reads the body's `model` field,
answers an unknown name with OpenAI's 404 (`model_not_found`), and holds a
lease on the named model for as long as the request runs, streamed responses
included. The lease loads a model that keep-alive unloaded and keeps it from
being unloaded mid-request; the endpoints then resolve the (loaded) model
synchronously through the ordinary `EngineProvider.resolve` seam.

It also answers `GET /v1/models` with every model the group serves, loaded or
not (as Ollama lists local models), and `GET /v1/internal/models` with each
model's `ModelStats` (load state, leases, loads/unloads and engine stats),
keyed by model name.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine import Engine
from ..errors import EngineClosedError
from ..group import EngineGroup, ModelSource, UnknownModelError
from .errors import APIError, api_error
from .http import MAX_BODY_BYTES, is_json, json_response, not_json
from .protocol import ModelCard, ModelList
from .provider import EngineProvider, ServedModel

__all__ = ["GroupProvider", "ModelRouter", "model_not_found"]

logger = logging.getLogger("aiobasert.server")


def model_not_found(name: str | None) -> APIError:
    """OpenAI's 404 for a model the server does not serve (the openai client's NotFoundError)."""
    return APIError(404, f"The model {name!r} does not exist", param="model", code="model_not_found")


class GroupProvider(EngineProvider):
    """Serves several models, one engine each, routed by the request's `model` field.

    models: as `EngineGroup.open` takes them (paths named by their stem,
        `"name=path"`, `(name, path)` pairs or a name -> path mapping).
    keep_alive: unload a model after this many idle seconds; the next request reloads it.
    engine_options: `Engine.open` keywords for every model (max_batch_size, max_context, ...).
    """

    def __init__(
        self,
        models: Mapping[str, ModelSource] | Iterable[ModelSource | tuple[str, ModelSource]],
        *,
        keep_alive: float | None = None,
        **engine_options: Any,
    ) -> None:
        self._models = models
        self._keep_alive = keep_alive
        self._options = engine_options
        self._group: EngineGroup | None = None
        self._served: dict[str, ServedModel] = {}
        self.created = int(time.time())

    @property
    def group(self) -> EngineGroup | None:
        """The running group (None outside the app's lifespan)."""
        return self._group

    @contextlib.asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[None]:
        async with EngineGroup.open(self._models, keep_alive=self._keep_alive, **self._options) as group:
            self._group = group
            logger.info("serving %s", ", ".join(group.names))
            try:
                yield
            finally:
                self._group = None

    def lifespan(self) -> AbstractAsyncContextManager[None]:
        return self._lifespan()

    def _running(self) -> EngineGroup:
        group = self._group
        if group is None or group.closed:
            raise EngineClosedError("the engines are not running")
        return group

    def _served_model(self, name: str, engine: Engine) -> ServedModel:
        # A reload brings a new engine: its ServedModel (and caches) start afresh.
        served = self._served.get(name)
        if served is None or served.engine is not engine:
            served = self._served[name] = ServedModel(name, engine)
        return served

    def resolve(self, model: str | None) -> ServedModel:
        group = self._running()
        name = group.default if model is None else model
        try:
            engine = group.loaded(name)
        except UnknownModelError:
            raise model_not_found(model) from None
        if engine is None:  # only for requests the ModelRouter does not lease (GET): it loads models first
            raise APIError(503, f"the model {name!r} is not loaded now", type="server_error", code="model_not_loaded")
        return self._served_model(name, engine)

    def served(self) -> Sequence[ServedModel]:
        group = self._group
        if group is None:
            return []
        out = []
        for name in group.names:
            engine = group.loaded(name)
            if engine is not None:
                out.append(self._served_model(name, engine))
        return out

    @property
    def ready(self) -> bool:
        # Unloaded (idle) models are ready too: the next request loads them.
        return self._group is not None and not self._group.closed

    async def abort(self) -> None:
        if self._group is not None:
            await self._group.aclose(abort=True)


class _ModelField(msgspec.Struct):
    """The one field the router reads from a request body (unknown fields ignored)."""

    model: str | None = None


def _model_of(body: bytes) -> str | None:
    # A body that does not decode is the endpoint's to refuse (with its own 400).
    try:
        return msgspec.json.decode(body, type=_ModelField).model
    except msgspec.MsgspecError:
        return None


class ModelRouter:
    """ASGI middleware in front of the endpoints of a `GroupProvider` app (see the module docs)."""

    def __init__(self, app: ASGIApp, provider: GroupProvider) -> None:
        self.app = app
        self.provider = provider

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        group = self.provider.group
        if scope["type"] != "http" or group is None:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and (path.startswith("/v1/models") or path == "/v1/internal/models"):
            response = await self._introspect(group, path)
            if response is not None:
                await response(scope, receive, send)
                return
        if method != "POST":
            await self.app(scope, receive, send)
            return
        if not is_json(dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")):
            await not_json().response(scope["path"])(scope, receive, send)  # refused before any model loads for it
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before the request was read: nothing to answer
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES:
                await APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes").response(scope["path"])(
                    scope, receive, send
                )
                return
            if not message.get("more_body", False):
                break
        name = _model_of(bytes(body))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        try:
            lease = group.lease(name)
            await lease.__aenter__()
        except UnknownModelError:
            await model_not_found(name).response(scope["path"])(scope, receive, send)
            return
        except Exception as exc:  # a model that fails to (re)load, a closing group
            await api_error(exc).response(scope["path"])(scope, receive, send)
            return
        try:
            await self.app(scope, replay, send)  # the lease lasts the whole response, streams included
        finally:
            await lease.__aexit__(None, None, None)

    async def _introspect(self, group: EngineGroup, path: str) -> Response | None:
        def card(name: str) -> ModelCard:
            return ModelCard(id=name, object="model", created=self.provider.created, owned_by="aiobasert")

        if path == "/v1/models":
            return json_response(ModelList(object="list", data=[card(n) for n in group.names]))
        if path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            return json_response(card(name)) if name in group else model_not_found(name).response()
        if path == "/v1/internal/models":
            return Response(msgspec.json.encode(await group.stats()), media_type="application/json")
        return None
