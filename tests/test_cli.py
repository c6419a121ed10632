"""The `aiobasert` command on a tiny model: run (text and --json), convert's errors, chat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec

from aiobasert import Completion


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aiobasert", *args], capture_output=True, text=True,
                          input=stdin, timeout=120)


def test_run_streams_text(tiny_model_path: Path) -> None:
    proc = cli("run", "Once upon a time", "--model", str(tiny_model_path), "-n", "8", "-v")
    assert proc.returncode == 0, proc.stderr
    assert "[8 tokens, length" in proc.stderr or "tokens, stop" in proc.stderr
    assert proc.stdout.endswith("\n")


def test_run_json_is_a_completion(tiny_model_path: Path) -> None:
    proc = cli("run", "Once upon a time", "--model", str(tiny_model_path), "-n", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    done = msgspec.json.decode(proc.stdout.strip(), type=Completion)
    assert done.usage.completion_tokens == len(done.token_ids) <= 5
    assert json.loads(proc.stdout)["finish_reason"] in ("stop", "length")


def test_run_reports_a_bad_model_clearly(tmp_path: Path) -> None:
    proc = cli("run", "hi", "--model", str(tmp_path / "nope.base"))
    assert proc.returncode == 1
    assert "nope.base" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_keeps_history(tiny_model_path: Path) -> None:
    proc = cli("chat", "--model", str(tiny_model_path), "-n", "4", stdin="hello\nagain\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") >= 2


def test_convert_refuses_a_non_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all")
    proc = cli("convert", str(bogus), str(tmp_path / "x.base"))
    assert proc.returncode != 0
    assert "x.gguf" in proc.stderr and "Traceback" not in proc.stderr
