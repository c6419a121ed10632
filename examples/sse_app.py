"""The simplest useful streaming app: one Engine shared by every client, tokens as server-sent events.

    python examples/sse_app.py [MODEL.base] [--port 8000]
    AIOBASERT_MODEL=model.base uvicorn examples.sse_app:app     # the same app under your own uvicorn
    curl -N 'http://127.0.0.1:8000/stream?prompt=Once+upon+a+time&max_tokens=64'

Each request streams `data: {"text": ...}` events and a last `data: {"finish_reason": ...}`.
All clients share the engine's lanes (continuous batching); a client that
hangs up cancels its request, because leaving `async with stream` frees the lane.
For an OpenAI-compatible server, see `aiobasert serve`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aiobasert import Engine


def create_app(model: str | None) -> Starlette:
    """The app for `model` (a .base path; None = $AIOBASERT_MODEL or the default model)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Opened here, the engine belongs to the server's event loop.
        async with Engine.open(model, max_batch_size=8, max_context=2048) as engine:
            app.state.engine = engine
            yield

    async def stream(request: Request) -> Response:
        engine: Engine = request.app.state.engine
        prompt = request.query_params.get("prompt", "Once upon a time")
        try:
            max_tokens = int(request.query_params.get("max_tokens", "64"))
        except ValueError:
            return JSONResponse({"error": "max_tokens must be an integer"}, status_code=400)

        async def events() -> AsyncIterator[str]:
            async with engine.stream(prompt, max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=0) as tokens:
                async for tok in tokens:
                    if tok.text:
                        yield f"data: {json.dumps({'text': tok.text})}\n\n"
                yield f"data: {json.dumps({'finish_reason': tokens.finish_reason})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", stream)], lifespan=lifespan)


app = create_app(os.environ.get("AIOBASERT_MODEL"))


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=os.environ.get("AIOBASERT_MODEL"), help="a .base bundle")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 = any free port (printed at startup)")
    args = parser.parse_args()
    # A bounded graceful shutdown: streams still running after 2 s are cut off.
    uvicorn.run(create_app(args.model), host=args.host, port=args.port, timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
