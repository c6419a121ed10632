"""What the bench scripts share: the model a run measures.

A script takes ``--tiny`` (`add_model_arguments`) and runs `bench_model(args.tiny)`:
SmolLM2-135M (the default model, downloaded once into the cache) or, with ``--tiny``,
a small random model built for the run (no download; speeds mean little, steps and
orderings still do).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

# Big enough that a step's forward, not the Python around it, is what is timed.
TINY_SHAPE: dict[str, Any] = {"n_layers": 4, "dim": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 512, "tied": False}


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tiny", action="store_true", help="use a tiny random model instead")


def bench_model(tiny: bool, model: str | None = None, **shape: Any) -> str:
    """With `tiny` a random model of `TINY_SHAPE` (updated by `shape`) in a fresh temporary directory;
    else `model` when given; else the default model's cached bundle."""
    if tiny:
        from aiobasert.models.tiny import build_tiny_model

        return str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny.base", **(TINY_SHAPE | shape)))
    if model:
        return model
    from aiobasert.models.cache import default_model_path

    return str(default_model_path())
