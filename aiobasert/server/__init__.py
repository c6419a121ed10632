"""An OpenAI-compatible HTTP server over `Engine`s (Starlette + uvicorn).

```bash
pip install 'aiobasert[server]'
aiobasert serve model.base --port 8000
```

```python
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
print(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}]))
```

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (tools,
`n`, `stream=true` as server-sent events), `POST /v1/responses` (the
Responses API), `POST /v1/embeddings`, `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, `GET /version`, `GET /health`, `GET /metrics`
(Prometheus) and `GET /v1/internal/stats` (the engine's `EngineStats`).
Every request field is honoured or refused with a 400 naming it (`compat`).
With the default `SingleEngineProvider` the `model` field of a request is
accepted whatever it names: the server serves one model and reports its own
name back; an `EngineProvider` of your own decides otherwise (`resolve`).

The engine is opened in the app's lifespan, so it belongs to the server's
event loop. A client that disconnects cancels its request: the engine frees
the lane before its next step. `serve()` aborts in-flight generations as
soon as shutdown begins (their streams end with an error event and
`[DONE]`), so the process exits promptly on SIGTERM or Ctrl-C.

Modules (one concept each): `protocol` (the wire structs), `errors` (APIError
and the exception mapping), `http` (JSON bodies), `streaming` (SSE and client
disconnects), `events` (the one event driver of every streamed endpoint),
`params` (request fields -> SamplingParams and messages), `logprobs`,
`provider` (where engines come from; the per-request model resolution),
`endpoints` (the routes' handlers), `responses` (the Responses API and its
store), `metrics` (Prometheus), `oplog` (request ids, the log line and
count of every refused or failed request, the startup line, `serve`'s logging),
`compat` (the field table), `connection` (request heads bounded in bytes and time, under the app),
`app` (wiring, `build_app`, `create_app`, `serve`), `_malloc` (the malloc arenas of the
`aiobasert serve` process).
"""

from __future__ import annotations

try:
    import starlette  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(f"aiobasert.server needs {exc.name}: pip install 'aiobasert[server]'") from exc

from .app import build_app, create_app, serve
from .connection import bounded_http_protocol
from .errors import APIError
from .protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelList,
)
from .provider import EngineFactory, EngineProvider, ServedModel, SingleEngineProvider
from .router import GroupProvider

__all__ = [
    "APIError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "CompletionRequest",
    "CompletionResponse",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EngineFactory",
    "EngineProvider",
    "ErrorResponse",
    "GroupProvider",
    "ModelList",
    "ServedModel",
    "SingleEngineProvider",
    "bounded_http_protocol",
    "build_app",
    "create_app",
    "serve",
]
