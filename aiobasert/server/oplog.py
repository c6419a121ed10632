"""What an operator sees of each request: its id, and why it was refused or failed.

`RequestOps` is the app's outermost request middleware. It gives every request
an id (the client's `X-Request-Id`, or a fresh one, echoed in the response),
and for every request answered with an error it writes one line to the
`aiobasert.server` logger and counts it in /metrics:

- a refusal (4xx) at INFO, a failure (5xx, or an exception the app did not
  handle) at WARNING;
- the line names the method and path, the status, OpenAI's error `type`,
  `code` and `param`, the request id and the message;
- an error event inside a stream already started (HTTP 200 sent) is logged and
  counted alike, marked `in-band`.

A client that went away (499) is neither: the metrics count it as cancelled;
nor is /health's 503 while the server is not ready (a probe's answer).
The library installs no log handler; `aiobasert serve` configures logging.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..batcher import client_scope
from .errors import WITNESS, APIError
from .metrics import Metrics
from .provider import ServedModel

logger = logging.getLogger("aiobasert.server")

_MAX_MESSAGE = 300
"""Characters of an error message a log line keeps (a validation message can quote a whole body)."""


def _one_line(text: str) -> str:
    text = text.replace("\r", "\\r").replace("\n", "\\n")  # no forged log lines from client text
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


class _Witness:
    """One request's error reports (see `errors.WITNESS`)."""

    __slots__ = ("error", "method", "metrics", "path", "request_id")

    def __init__(self, metrics: Metrics, request_id: str, method: str, path: str) -> None:
        self.metrics = metrics
        self.request_id = request_id
        self.method = method
        self.path = path
        self.error: APIError | None = None

    def answered(self, err: APIError) -> None:
        self.error = err

    def in_band(self, err: APIError) -> None:
        self.report(err.status, err, in_band=True)

    def report(self, status: int, err: APIError | None, *, in_band: bool = False, why: str | None = None) -> None:
        detail = err.body.error if err is not None else None
        code = detail.code if detail is not None else None
        self.metrics.count_error(status, code)
        refused = status < 500
        logger.log(
            logging.INFO if refused else logging.WARNING,
            "%s %s %s: %d%s type=%s code=%s param=%s request_id=%s: %s",
            "refused" if refused else "failed",
            self.method,
            self.path,
            status,
            " in-band" if in_band else "",
            detail.type if detail is not None else None,
            code,
            detail.param if detail is not None else None,
            self.request_id,
            _one_line(why if why is not None else detail.message if detail is not None else "(no detail)"),
        )


def _an_error(status: int, path: str) -> bool:
    """Whether an error status not sent as an `APIError` is one to report: not 499 (the client
    went away, nobody was refused) nor /health's 503 (a probe's answer while not ready)."""
    return status != 499 and path != "/health"


class RequestOps:
    """Request ids, and a log line and a count for every refused or failed request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        rid = given if given and len(given) <= 128 else uuid.uuid4().hex.encode()
        request_id = rid.decode("latin-1")
        # for the handlers' logs (`request.state.request_id`) where no engine request id exists
        scope.setdefault("state", {})["request_id"] = request_id
        witness = _Witness(self.metrics, request_id, scope.get("method", ""), scope.get("path", ""))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                status = int(message["status"])
                if status >= 400 and (witness.error is not None or _an_error(status, witness.path)):
                    witness.report(status, witness.error)
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        token = WITNESS.set(witness)
        try:
            # each HTTP request is one client for fair admission (docs/fairness.md): its choices and
            # prompts share the lanes it is due; a fresh key, not the given id, so no client joins another's
            with client_scope(f"http-{uuid.uuid4().hex}"):
                await self.app(scope, receive, send_with_id)
        except Exception as exc:  # Starlette answers 500 outside this middleware, then re-raises
            witness.report(
                500, None, why=f"{'after the response started: ' if started else ''}{type(exc).__name__}: {exc}"
            )
            raise
        finally:
            WITNESS.reset(token)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_config(level: str) -> dict[str, Any]:
    """`aiobasert serve`'s logging (a `logging.config.dictConfig`, applied by uvicorn):
    uvicorn's loggers and `aiobasert`'s at `level`, each line with its time, level and
    logger; the access lines on stdout as uvicorn has them, the rest on stderr."""
    from uvicorn.config import LOG_LEVELS as UVICORN_LEVELS

    number = UVICORN_LEVELS[level]  # a number: "trace" (5) has no name until uvicorn registers it
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "default": {"format": LOG_FORMAT},
            "access": {
                "()": "uvicorn.logging.AccessFormatter",
                "fmt": '%(asctime)s %(levelname)s %(name)s: %(client_addr)s - "%(request_line)s" %(status_code)s',
                "use_colors": False,
            },
        },
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"},
            "access": {"class": "logging.StreamHandler", "formatter": "access", "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": number, "propagate": False},
            "uvicorn.error": {"level": number},
            "uvicorn.access": {"handlers": ["access"], "level": number, "propagate": False},
            "aiobasert": {"handlers": ["default"], "level": number, "propagate": False},
        },
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


async def startup_line(served: Sequence[ServedModel], address: str | None) -> str:
    """The one line a server logs when it is ready: models, lanes x context, KV cache
    (element type, bytes), engine threads and where it listens."""
    from .. import __version__

    models: list[str] = []
    threads: int | None = None
    for m in served:
        engine = m.engine
        if engine.closed:
            continue
        info, stats = engine.info, await engine.stats()
        models.append(
            f"{m.name!r} ({info.max_batch_size} lanes x {info.max_context} tokens, "
            f"KV {info.kv_cache_dtype or '?'} {_mib(stats.kv_cache_bytes)})"
        )
        if threads is None and info.engine_threads > 0:
            threads = info.engine_threads
    line = f"aiobasert {__version__} ready: " + (", ".join(models) or "no model loaded yet")
    if threads is not None:
        line += f"; {threads} engine threads"
    if address is not None:
        line += f"; listening on {address}"
    return line
