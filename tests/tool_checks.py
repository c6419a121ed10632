"""Checks shared by the tool-calling tests (tests/sdk/test_tools.py: the Hermes format,
tests/sdk/test_tool_formats.py: the others)."""

from __future__ import annotations

import json

from aiobasert import Engine
from aiobasert.testing import snapshot


def json_complete(text: str) -> bool:
    """Whether `text` is one whole JSON value (a call's arguments not cut off)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def backends(engine: Engine) -> dict[str, int]:
    """How many grammars each backend ("engine": the structural tag, "llguidance") has served."""
    return (await snapshot(engine)).grammar_backends
