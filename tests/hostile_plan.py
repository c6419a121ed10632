"""What the two hostile-traffic model tests (tests/core/test_group_hostile.py over the SDK,
tests/server/test_server_hostile.py over HTTP) share: which plans and hostile kinds run, and
the hostile inputs both send."""

from __future__ import annotations

import os
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
