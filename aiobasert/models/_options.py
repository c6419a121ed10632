"""The conversion's choices and command line, importable without the GGUF reader: `aiobasert serve`
on a `.base` bundle never loads `gguf` (nor the converter), which keeps a few MB out of its RSS."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..types import DTYPES, Dtype

__all__ = ["DTYPES", "Dtype", "add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The converter's options, shared by ``python -m aiobasert.models.convert`` and ``aiobasert convert``."""
    parser.add_argument("src", type=Path, help="input .gguf file")
    parser.add_argument("dst", type=Path, help="output .base file")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="storage type of the matrices (q8 / q4: group-wise quantized, base_q8 / base_q4; "
        "auto: as the GGUF has them, quantized blocks carried exactly where they can be)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
