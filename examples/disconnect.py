"""A client that hangs up mid-stream: the server cancels its request and the engine frees the lane.

    python examples/disconnect.py [MODEL.base] [--max-tokens 1000]

Starts the OpenAI-compatible server (aiobasert.server) in this process on a
free port, streams a long completion with httpx, reads three events, hangs
up, and then reads the engine's stats (GET /v1/internal/stats) until the lane
is free again: `requests_cancelled` counts the abandoned request, and nothing
went on decoding for a client that was gone.
"""

from __future__ import annotations

import argparse
import os
import sys

import anyio
import httpx
import uvicorn

from aiobasert.server import create_app

EVENTS_TO_READ = 3


async def hang_up_mid_stream(base_url: str, max_tokens: int) -> bool:
    """Stream a completion, read a few events, hang up, then watch the lane being freed."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        request = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=request) as response:
            if response.status_code != 200:
                print(f"the server refused the request: {(await response.aread()).decode()}", file=sys.stderr)
                return False
            events = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    print(f"event {events}: {line[:100]}")
                    if events == EVENTS_TO_READ:
                        break
        # Leaving the `stream` block with the body unread closes the connection.
        print(f"client hung up after {events} of up to {max_tokens} tokens")

        for _ in range(500):
            stats = (await client.get("/v1/internal/stats")).json()
            if stats["live_sequences"] == 0:
                break
            await anyio.sleep(0.01)
        print(
            f"engine: live_sequences={stats['live_sequences']} active_lanes={stats['active_lanes']} "
            f"requests_cancelled={stats['requests_cancelled']} requests_finished={stats['requests_finished']}"
        )
        return True


async def main(model: str | None, max_tokens: int) -> bool:
    app = create_app(model, model_name="demo", max_batch_size=2, max_context=max_tokens + 64)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        try:
            while not server.started:
                await anyio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            ok = await hang_up_mid_stream(f"http://127.0.0.1:{port}", max_tokens)
        finally:
            server.should_exit = True
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=os.environ.get("AIOBASERT_MODEL"), help="a .base bundle")
    parser.add_argument("--max-tokens", type=int, default=1000, help="length of the abandoned completion")
    args = parser.parse_args()
    sys.exit(0 if anyio.run(main, args.model, args.max_tokens) else 1)
