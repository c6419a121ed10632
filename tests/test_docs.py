"""The API reference page is generated from the docstrings and must be current."""

from __future__ import annotations

import runpy
from pathlib import Path

import aiobasert

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_api_reference_is_current() -> None:
    render = runpy.run_path(str(DOCS / "gen_api.py"))["render"]
    assert (DOCS / "API.md").read_text() == render(), "docs/API.md is stale: run python docs/gen_api.py"


def test_every_public_object_has_a_docstring() -> None:
    for name in aiobasert.__all__:
        assert getattr(aiobasert, name).__doc__, f"aiobasert.{name} has no docstring"
