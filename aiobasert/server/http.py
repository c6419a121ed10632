"""Plain HTTP plumbing: JSON responses and bounded, typed request bodies."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .errors import SCHEMA_FIELDS, APIError, error_param

T = TypeVar("T")

MAX_BODY_BYTES = 16 * 1024 * 1024


def json_response(body: msgspec.Struct, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header declares JSON."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def not_json() -> APIError:
    return APIError(415, "send the request body as JSON with 'Content-Type: application/json'",
                    code="unsupported_media_type")


async def read_json(request: Request, body_type: type[T]) -> T:
    """Decode a request body into `body_type`, or raise a 400.

    The body must be declared JSON (415 otherwise): a web page may send a
    `text/plain` POST to any origin without a CORS preflight, so accepting one
    would let any page drive a local server that has no API key."""
    if not is_json(request.headers.get("content-type", "")):
        raise not_json()
    SCHEMA_FIELDS.set(getattr(body_type, "schema_fields", None))
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}", param=error_param(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
