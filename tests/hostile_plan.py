"""What the two hostile-traffic model tests (tests/sdk/test_group_hostile.py over the SDK,
tests/server/test_server_hostile.py over HTTP) share: which plans and hostile kinds run, how a
plan is drawn, the hostile inputs and the words both send, and how both read RSS."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

SEEDS = [int(seed) for seed in os.environ.get("AIOBASERT_HOSTILE_SEEDS", "18").split(",")]
"""The plans run (each a different mix); AIOBASERT_HOSTILE_SEEDS=1,2,3 runs others."""


def chosen_kinds(known: tuple[str, ...]) -> tuple[str, ...]:
    """The hostile kinds to run: all of `known`, or those AIOBASERT_HOSTILE_KINDS names ("none": none)."""
    chosen = os.environ.get("AIOBASERT_HOSTILE_KINDS")
    if not chosen:
        return known
    kinds = tuple(k.strip() for k in chosen.split(",") if k.strip() and k.strip() != "none")
    unknown = set(kinds) - set(known)
    assert not unknown, f"unknown hostile kinds {unknown}; known: {known}"
    return kinds


def ref_chain(depth: int) -> dict[str, Any]:
    """A schema of `depth` chained `$ref`s (issue 18 item 1: llguidance recursed per $ref on the
    engine thread's stack; ~100 kB at 1,000)."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}},
                                      "required": ["next"]} for i in range(depth)}  # fmt: skip
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


WORDS = ["river", "stone", "lamp", "cloud", "seven", "green", "quiet", "market", "window", "salt"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]  # fmt: skip


def random_text(rng: random.Random, n: int) -> str:
    """`n` words drawn from WORDS."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def draw_hostile_plan(rng: random.Random, known: tuple[str, ...], counts: dict[str, tuple[int, int]]) -> list[str]:
    """The hostile calls of one run, shuffled: each kind of chosen_kinds(known) as many times as
    `rng.randint(*counts[kind])` draws (once for a kind `counts` does not name)."""
    plan = [kind for kind in chosen_kinds(known) for _ in range(rng.randint(*counts.get(kind, (1, 1))))]
    rng.shuffle(plan)
    return plan


def rss_mb(pid: int | str = "self") -> float:
    """The resident set size of process `pid` (this one by default), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")
