"""Chat templates rendered by llama.cpp: llama-server's `/apply-template`, recorded for the tests.

Every template llama.cpp ships for its tests (`models/templates/*.jinja` in the llama-cpp-python
sdist, the same files the suite's `llama_cpp_templates_dir` fixture unpacks) is served in turn by
one llama-server (`--jinja --chat-template-file T`) and asked to render the CASES below: plain
turns, a system prompt, a multi-turn history, whitespace and non-ASCII content, thinking on and
off through `chat_template_kwargs` (where the template reads `enable_thinking`; llama.cpp always
gives it, on unless asked off, so every case here says it). What it answers (the prompt text, or
its error) is written to
`tests/data/llama_cpp/apply_template.json`, with llama.cpp's version, the model's BOS / EOS text
the server gave the templates, and each template file's sha256; tests/sdk/test_chat_template_parity.py
holds our renderer to it byte for byte, without building llama.cpp.

    python bench/llama_templates.py --record tests/data/llama_cpp/apply_template.json
    python bench/llama_templates.py --llama-server PATH --record FILE   # a build of your own

The model only supplies the vocabulary's BOS / EOS text (SmolLM2-135M-Instruct Q4_1, the demo);
the template is always the file's. `date_string` and `datetime` are given to templates that read them,
so a template that prints today's date prints the same date on every run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_llama_server as vls  # noqa: E402  (the llama.cpp builder and process helpers)

FORMAT = 1
DATE = "26 Jul 2024"
DATETIME = "Jul 26 2024"

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
CASES: list[dict[str, Any]] = [
    {"name": "user", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "system_user", "messages": [SYSTEM, {"role": "user", "content": "List three primary colors."}]},
    {
        "name": "multi_turn",
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Name a prime number."},
        ],
    },
    {
        "name": "whitespace_unicode",
        "messages": [
            {"role": "user", "content": "  Ünïcödé café 中文 🙂\n\n  with   spaces\tand tabs  \n"},
            {"role": "assistant", "content": "\n Noted: «ok» \n"},
            {"role": "user", "content": "{\"json\": [1, 2]} and <b>markup</b> & 'quotes'"},
        ],
    },
    {
        "name": "thinking_off",
        "messages": [{"role": "user", "content": "Add 2 and 3."}],
        "kwargs": {"enable_thinking": False},
        "needs": "enable_thinking",
    },
]


def templates_from_sdist(sdist: Path, dest: Path) -> Path:
    """The sdist's vendor/llama.cpp/models/templates, unpacked into dest."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/models/templates/" in m.name and m.isfile()]
        for m in members:
            m.name = Path(m.name).name
            tar.extract(m, dest, filter="data")
    return dest


def case_kwargs(case: dict[str, Any], template: str) -> dict[str, Any] | None:
    """The case's chat_template_kwargs for this template, or None when the case does not apply."""
    if case.get("needs") and case["needs"] not in template:
        return None
    kwargs = dict(case.get("kwargs", {}))
    if "enable_thinking" in template:  # llama.cpp always gives it (on unless asked off): said here
        kwargs.setdefault("enable_thinking", True)
    if "date_string" in template:
        kwargs["date_string"] = DATE
    if "datetime" in template:  # llama.cpp's other date variable (firefunction's)
        kwargs["datetime"] = DATETIME
    return kwargs


async def render_all(server: Path, gguf: Path, template: Path, logdir: Path) -> dict[str, Any]:
    text = template.read_text()
    port = vls.free_port()
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "512",
           "-t", "1", "--no-webui", "--jinja", "--chat-template-file", str(template)]  # fmt: skip
    srv = vls.Server("llama-server", cmd, port, logdir / f"{template.stem}.log")
    out: dict[str, Any] = {"sha256": hashlib.sha256(template.read_bytes()).hexdigest(), "cases": {}}
    srv.start()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), trust_env=False) as client:
            try:
                await srv.wait_ready(client, 60)
            except vls.BenchError:
                out["refused"] = srv.log_tail(5)
                return out
            props = (await client.get(srv.base + "/props")).json()
            out["bos_token"], out["eos_token"] = props.get("bos_token", ""), props.get("eos_token", "")
            for case in CASES:
                kwargs = case_kwargs(case, text)
                if kwargs is None:
                    continue
                body: dict[str, Any] = {"messages": case["messages"], "chat_template_kwargs": kwargs}
                if "add_generation_prompt" in case:
                    body["add_generation_prompt"] = case["add_generation_prompt"]
                r = await client.post(srv.base + "/apply-template", json=body)
                if r.status_code == 200:
                    out["cases"][case["name"]] = {"kwargs": kwargs, "prompt": r.json()["prompt"]}
                else:
                    out["cases"][case["name"]] = {"kwargs": kwargs, "error": f"HTTP {r.status_code}: {r.text[:300]}"}
    finally:
        srv.stop()
    return out


async def record(args: argparse.Namespace) -> dict[str, Any]:
    server = args.llama_server or vls.build_llama_server(None, args.build_jobs)
    sdist = vls.fetch_sdist(vls.CACHE / "sdist", None)
    if args.gguf is None:
        from aiobasert.models.cache import smollm2_gguf_path

        args.gguf = smollm2_gguf_path()
    logdir = Path(tempfile.mkdtemp(prefix="llama-templates-"))
    tdir = templates_from_sdist(sdist, logdir / "templates")
    result: dict[str, Any] = {
        "format": FORMAT,
        "llama.cpp": vls.llama_server_version(server),
        "sdist": sdist.name,
        "model": args.gguf.name,
        "cases": CASES,
        "templates": {},
    }
    for template in sorted(tdir.glob("*.jinja")):
        got = await render_all(server, args.gguf, template, logdir)
        result["templates"][template.name] = got
        rendered = sum("prompt" in c for c in got["cases"].values())
        status = "refused" if "refused" in got else f"{rendered}/{len(got['cases'])} rendered"
        print(f"{template.name}: {status}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, required=True, help="write llama.cpp's renderings here (JSON)")
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (default: build it from the sdist)")
    ap.add_argument("--gguf", type=Path, help="the model whose BOS / EOS the templates see (default: the demo)")
    ap.add_argument("--build-jobs", type=int, default=2)
    args = ap.parse_args(argv)
    result = asyncio.run(record(args))
    args.record.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
