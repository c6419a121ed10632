"""Memory an engine may take (issue 37, item 5): a KV pool larger than the memory available is refused
at open, naming the knobs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lifecycle_model import engine_threads

from aiobasert import Engine, InvalidConfigError
from aiobasert._core.memory import available_memory
from aiobasert.models.tiny import build_tiny_model

pytestmark = pytest.mark.anyio

LANES = 256


@pytest.fixture(scope="module")
def wide_kv_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny weights, wide KV (2 layers x 128 KV floats per token) and a 1M-token window: a pool as large
    as a test needs at a small cost to load."""
    return build_tiny_model(tmp_path_factory.mktemp("widekv") / "widekv.base", dim=64, n_heads=4, n_kv_heads=2,
                            head_dim=64, max_position_embeddings=1 << 20)  # fmt: skip


async def test_a_kv_pool_larger_than_the_memory_available_is_refused(wide_kv_model_path: Path) -> None:
    got = available_memory()
    assert got is not None
    per_token = 2 * 2 * 128 * 4  # K and V, 2 layers, kv_dim 128, f32
    # (LANES + 1) full-context sequences, half again the memory available (each of K and V below it, so
    # the reservation itself succeeds: untouched pages are not committed; the bug was that it opened)
    context = int(got[0] * 1.5 / ((LANES + 1) * per_token))
    before = engine_threads()
    with pytest.raises(InvalidConfigError) as refused:
        await Engine.open(wide_kv_model_path, max_batch_size=LANES, max_context=context, kv_cache_dtype="f32")
    message = str(refused.value)
    assert "\n" not in message
    assert f"max_batch_size={LANES}" in message and f"max_context={context}" in message
    assert re.search(r"more than the [\d.]+ GiB available \((MemAvailable|cgroup [\w. -]+)\)", message), message
    assert engine_threads() == before  # the thread ended and freed the model before the open raised
    # the same model with a pool that fits opens
    async with Engine.open(wide_kv_model_path, max_batch_size=4, max_context=4096, kv_cache_dtype="f32") as engine:
        assert (await engine.generate("fits", max_tokens=3, ignore_eos=True)).token_ids
