"""The lifecycle model (tests/lifecycle_model.py), short: a few seeded random
walks per backend. bench/lifecycle_soak.py runs the same walk long."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lifecycle_model import LifecycleWalk

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_lifecycle_random_walk(untied_model_path: Path, seed: int) -> None:
    stats = await LifecycleWalk(untied_model_path, seed).run(steps=80)
    assert stats.steps == 80 and stats.opens >= 1 and stats.closes >= 1
    assert stats.streams > 0 and stats.embeds > 0
