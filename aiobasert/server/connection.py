"""The HTTP connection under the app: a request's head (its request line and headers) bounded in
bytes and in time, before any of it reaches the app (so before the API key is checked).

uvicorn's parsers bound neither: httptools (what uvicorn picks when it is installed) keeps a
header line growing for as long as a client sends it, and neither parser ever times out a
connection whose head never completes. `bounded_http_protocol` wraps the parser uvicorn would
pick (`http="auto"`), keeping its speed: it counts the bytes a connection sends while it waits
for a head, answers 431 and closes once they pass `max_header_bytes`, and answers 408 and closes
a connection whose head has not completed `header_timeout` seconds after it opened or after its
previous response ended. h11 also gets its own bound (`max_incomplete_event_size`), as a backstop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..errors import InvalidConfigError

logger = logging.getLogger("aiobasert.server")

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
"""A request's head (request line and headers) may be this many bytes (nginx: 4 x 8 KiB buffers,
Node.js 16 KiB; a JWT or a few cookies are well under it)."""

DEFAULT_HEADER_TIMEOUT_S = 10.0
"""Seconds a connection has to complete a request's head, from its opening or its previous
response's end (nginx's client_header_timeout is 60 s; a client that means it needs milliseconds)."""


def _refusal(status: str, text: str) -> bytes:
    body = text.encode() + b"\n"
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def bounded_http_protocol(
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT_S,
    http: str = "auto",
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol `http` ("auto", "httptools", "h11") with request heads bounded:
    pass it as `uvicorn.Config(app, http=...)` (`serve` does). `header_timeout`: None or 0, no
    time bound. Refused connections are logged at INFO on the `aiobasert.server` logger."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    if not (isinstance(max_header_bytes, int) and max_header_bytes >= 1024):
        raise InvalidConfigError(f"max_header_bytes must be an integer >= 1024, got {max_header_bytes!r}")
    if header_timeout is not None and not header_timeout >= 0:  # NaN too
        raise InvalidConfigError(f"header_timeout must be >= 0 (0 or None: no bound), got {header_timeout!r}")
    if http not in ("auto", "httptools", "h11"):
        raise InvalidConfigError(f"http must be 'auto', 'httptools' or 'h11', got {http!r}")
    base: type[Any] = import_from_string(HTTP_PROTOCOLS[http])
    timeout = header_timeout or None
    too_large = _refusal("431 Request Header Fields Too Large", f"request headers exceed {max_header_bytes} bytes")
    too_slow = _refusal("408 Request Timeout", f"request headers not complete within {header_timeout} s")

    # httptools says where a head begins and ends (its callbacks); h11 buffers a pipelined head
    # unparsed (uvicorn stops reading), so there a head is open while no request is in progress.
    hooks = hasattr(base, "on_message_begin") and hasattr(base, "on_headers_complete")

    class BoundedHTTP(base):  # type: ignore[misc]  # a class uvicorn imports at run time
        _pending = 0  # bytes received while the current head is open
        _in_head = False  # httptools: between on_message_begin and on_headers_complete
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or bool(self.cycle.response_complete)

        def _head_open(self) -> bool:
            return self._in_head if hooks else self._waiting_for_head()

        def on_message_begin(self) -> None:  # httptools: a request's first byte
            super().on_message_begin()
            self._in_head, self._pending = True, 0

        def on_headers_complete(self) -> None:  # httptools: its head is whole
            self._in_head = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return  # refused: the parser is fed no more
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a head completed (the app has its request)
                self._disarm()
                if not hooks:
                    self._pending = 0
            if self._head_open() and not self.transport.is_closing():
                # the chunk's bytes are head's (at most: a chunk may have ended the last request)
                self._pending += len(data)
                if self._pending > max_header_bytes:
                    self._refuse(too_large, f"headers over {max_header_bytes} bytes")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not hooks:  # (httptools counts a pipelined head from its first byte)
                self._pending = 0
            self._arm()  # the next request's head, on a kept-alive connection

        def _arm(self) -> None:
            self._disarm()
            if timeout is not None:
                self._timer = self.loop.call_later(timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _head_timed_out(self) -> None:
            self._timer = None
            if self.transport.is_closing() or not self._waiting_for_head():
                return
            if self._pending:  # a head begun and never finished
                self._refuse(too_slow, f"headers not complete within {timeout} s")
            else:  # nothing sent: close quietly, as uvicorn's keep-alive timeout does
                self.transport.close()

        def _refuse(self, response: bytes, why: str) -> None:
            self._disarm()
            client = self.client
            logger.info("refused a connection from %s: %s", f"{client[0]}:{client[1]}" if client else "?", why)
            self.transport.write(response)
            self.transport.close()

    BoundedHTTP.__qualname__ = BoundedHTTP.__name__ = f"Bounded{base.__name__}"
    return BoundedHTTP
