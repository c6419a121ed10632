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
import unicodedata
import uuid
from collections.abc import Sequence
from copy import copy
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..batcher import client_scope
from .errors import WITNESS, APIError
from .metrics import Metrics
from .provider import ServedModel

logger = logging.getLogger("aiobasert.server")

_MAX_MESSAGE = 300
"""Characters of an error message a log line keeps (a validation message can quote a whole body)."""

MAX_FIELD = 256
"""Characters of any other client-given field (path, param, request id...) a log line keeps."""

_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Cc: C0, DEL, C1 (NEL among them); Zl / Zp: U+2028 / U+2029; Cf: bidi overrides, zero-width
# characters (text that reads other than it is); Cs: a lone surrogate, which no log stream encodes.
_UNSAFE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape_char(ch: str, *, spaces: bool) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    if (ch == " " and spaces) or unicodedata.category(ch) in _UNSAFE:
        n = ord(ch)
        return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
    return ch


def escape_field(text: str, *, limit: int = MAX_FIELD, spaces: bool = False) -> str:
    """`text` (anything a client chose) made safe for one log line: no character that ends a line,
    or that a terminal or log viewer acts on, survives (they, and the backslash, become Python-style
    escapes, so distinct texts stay distinct); `spaces`: spaces too, for a field with others after
    it. Past `limit` characters the rest is cut, and a marker says how many were."""
    cut = len(text) - limit
    head = text[:limit] if cut > 0 else text
    if head.isprintable() and "\\" not in head and not (spaces and " " in head):  # the usual case
        escaped = head
    else:
        escaped = "".join(_escape_char(ch, spaces=spaces) for ch in head)
    return escaped + (f"...[{cut} more chars]" if cut > 0 else "")


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
        message = why if why is not None else detail.message if detail is not None else "(no detail)"
        logger.log(
            logging.INFO if refused else logging.WARNING,
            "%s %s %s: %d%s type=%s code=%s param=%s request_id=%s: %s",
            "refused" if refused else "failed",
            escape_field(self.method, spaces=True),
            escape_field(self.path, spaces=True),
            status,
            " in-band" if in_band else "",
            detail.type if detail is not None else None,
            None if code is None else escape_field(code, spaces=True),
            None if detail is None or detail.param is None else escape_field(detail.param, spaces=True),
            escape_field(self.request_id, spaces=True),
            escape_field(message, limit=_MAX_MESSAGE),  # the last field: its spaces are its own
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


class AccessFormatter(logging.Formatter):
    """uvicorn's access line (`uvicorn.logging.AccessFormatter`) with its client-given fields, the
    method and the path (a raw path may carry DEL and bytes 0x80-0x9f, C1 controls once decoded;
    it may be 60 KB), escaped and capped as `escape_field` does."""

    def __init__(self, fmt: str) -> None:
        from uvicorn.logging import AccessFormatter as Uvicorn

        super().__init__(fmt)
        self._uvicorn = Uvicorn(fmt=fmt, use_colors=False)

    def format(self, record: logging.LogRecord) -> str:
        if isinstance(record.args, tuple) and len(record.args) == 5:  # uvicorn's: addr, method, path, version, status
            addr, method, path, version, status = record.args
            record = copy(record)
            record.args = (addr, escape_field(str(method), spaces=True), escape_field(str(path)), version, status)
        return self._uvicorn.format(record)


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
                "()": f"{__name__}.AccessFormatter",
                "fmt": '%(asctime)s %(levelname)s %(name)s: %(client_addr)s - "%(request_line)s" %(status_code)s',
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
