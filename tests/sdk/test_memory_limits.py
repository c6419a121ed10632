"""Memory an engine may take (issue 37, item 5): a KV pool larger than the memory available is refused
at open, naming the knobs."""

from __future__ import annotations

import random
import re
from pathlib import Path

import anyio
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


async def distinct_prompts(engine: Engine, n: int, length: int) -> None:
    """n requests of distinct `length`-token prompts, 4 at a time, each finishing (so its KV is published)."""
    rng = random.Random(37)

    async def one(i: int) -> None:
        ids = [rng.randrange(10, 200) for _ in range(length)]
        await engine.generate(ids, max_tokens=2, ignore_eos=True)

    for start in range(0, n, 4):
        async with anyio.create_task_group() as tg:
            for i in range(start, min(n, start + 4)):
                tg.start_soon(one, i)


@pytest.mark.parametrize(("prefix_cache_mb", "bound"), [(None, "quarter"), (1, "1 MiB"), (0, "none")])
async def test_the_prefix_cache_keeps_at_most_its_bound_at_idle(
    tiny_model_path: Path, prefix_cache_mb: int | None, bound: str
) -> None:
    """Issue 37 item 5b: distinct prompts, each published to the prefix cache when it ends; at idle the
    cache holds at most its bound (the default: a quarter of the pool), not the whole pool."""
    async with Engine.open(tiny_model_path, max_batch_size=8, max_context=2048, prefix_cache_mb=prefix_cache_mb) as e:
        stats = await e.stats()
        block_bytes = stats.kv_cache_bytes // stats.kv_blocks_total
        limit = {"quarter": stats.kv_blocks_total // 4, "1 MiB": 2**20 // block_bytes, "none": 0}[bound]
        assert limit < stats.kv_blocks_total // 2  # a bound this test can exceed without it
        with anyio.fail_after(120):
            await distinct_prompts(e, 64, 300)  # 19 blocks each: 1,216 blocks published, over the pool
        stats = await e.stats()
        assert stats.active_lanes == 0 and stats.live_sequences == 0
        assert stats.prefix_blocks_cached <= limit
        assert stats.kv_blocks_used == stats.prefix_blocks_cached  # what the idle engine holds is the cache
        if limit:  # the cache still serves: a prompt seen last is reused
            assert stats.prefix_blocks_cached > 0
