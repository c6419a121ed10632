"""Render stall: the longest gap between two events of a running HTTP stream while
another client sends a chat whose rendering is request-sized (150,000 tiny messages,
3,000 tools, or the largest chat allowed), and how long that request took to be
answered. Run it against two checkouts to compare (issue 26 item 2):

    python bench/render_stall.py                         # this checkout
    PYTHONPATH=/path/to/other python bench/render_stall.py --no-local   # another one
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

if "--no-local" not in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import uvicorn

HOSTILE = {
    "150k_messages": {"messages": [{"role": "user", "content": "hi"}] * 150_000, "max_tokens": 1},
    "3k_tools": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": "A tool.",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                },
            }
            for i in range(3000)
        ],
    },
    "10k_messages": {"messages": [{"role": "user", "content": "hi"}] * 10_000, "max_tokens": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-local", action="store_true", help="import aiobasert from PYTHONPATH")
    args = ap.parse_args()
    del args
    from aiobasert.models.tiny import build_tiny_model
    from aiobasert.server import create_app

    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny.base", n_layers=2, dim=64, max_position_embeddings=8192)
    server = uvicorn.Server(
        uvicorn.Config(create_app(model, model_name="tiny", max_context=4096), port=0, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    for name, body in HOSTILE.items():
        stamps: list[float] = []
        done = threading.Event()

        def read(stamps: list[float], done: threading.Event) -> None:
            with (
                httpx.Client(base_url=url, timeout=120) as http,
                http.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "Once",
                        "max_tokens": 4000,
                        "stream": True,
                        "logit_bias": {"0": -100, "1": -100, "2": -100},
                    },
                ) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.perf_counter())
                    if done.is_set():
                        break

        reader = threading.Thread(target=read, args=(stamps, done))
        reader.start()
        while len(stamps) < 20:
            time.sleep(0.001)
        data = json.dumps({"model": "tiny", **body}).encode()  # encoded first: this process shares its GIL
        with httpx.Client(base_url=url, timeout=300) as http:
            sent = time.perf_counter()
            r = http.post("/v1/chat/completions", content=data, headers={"Content-Type": "application/json"})
            answered = time.perf_counter()
        time.sleep(0.2)
        done.set()
        reader.join()
        gaps = [b - a for a, b in itertools.pairwise(stamps) if b > sent and a < answered]
        print(
            f"{name}: answered {r.status_code} in {answered - sent:.2f} s; "
            f"neighbour's longest gap {max(gaps, default=0):.3f} s"
        )
    server.should_exit = True


if __name__ == "__main__":
    main()
