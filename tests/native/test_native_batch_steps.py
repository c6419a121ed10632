"""The reference engine's runtime through its C ABI (ctypes): the paged KV pool and
sequences, batched steps, the prefix cache and the single-sequence API.

The invariants the SDK relies on are checked bit for bit: a lane's logits do not
depend on what else is in its batch, on how its prompt was chunked, or on
whether its prefix came from the cache. Values are checked against the numpy
oracle (tests/oracle.py). The library is the one aiobasert._ffi finds (the
bundled build, or $BASERT_LIB_PATH).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Iterator, Sequence
from ctypes import byref, c_float, c_int, c_uint64, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from raw_abi import ints, u32

from aiobasert._ffi import (
    TOKEN_CALLBACK,
    BaseRTGenerationStats,
    BaseRTLoadOptions,
    BaseRTMemoryStats,
    BaseRTRowSampling,
    BaseRTSamplingConfig,
    Library,
)
from aiobasert.models.tiny import build_tiny_model
from tests.oracle import LlamaForward, NumpyLlama, f16_close, prompt

OK, INVALID_ARGUMENT, UNSUPPORTED, OUT_OF_MEMORY, GENERATION_FAILED = 0, 2, 5, 6, 8
PAGE = 16
MAX_CONTEXT = 256
FAULT_STEP, FAULT_SEQ_CREATE = 1, 2


# ---- library, models and a thin driver ------------------------------------------------


@pytest.fixture(scope="module", params=[(64, 4, 2), (128, 2, 1)], ids=["head_dim16", "head_dim64"])
def tiny_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """f32 weights, untied head: the oracle reads exactly the engine's weights.
    Two head sizes: one shorter than a vector register, one a multiple of it."""
    dim, n_heads, n_kv_heads = request.param
    return build_tiny_model(
        tmp_path_factory.mktemp("runtime") / "tiny.base",
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=96,
        tied=False,
    )


@pytest.fixture(scope="module")
def oracle(tiny_path: Path) -> NumpyLlama:
    return NumpyLlama(tiny_path)


class Runtime:
    """One loaded model and the calls the tests make on it."""

    def __init__(self, lib: Library, raw: ctypes.CDLL, path: Path, **opts: int) -> None:
        self.lib, self.raw = lib, raw
        options = dict(paged_kv=1, max_batch_size=8, prefix_cache=1, prefill_chunk=16) | opts
        o = BaseRTLoadOptions(struct_size=ctypes.sizeof(BaseRTLoadOptions), **options)
        self.m = lib.baseRT_load_model_ex(os.fsencode(path), None, MAX_CONTEXT, byref(o))
        assert self.m, self.error()
        self.vocab = int(lib.baseRT_batch_logits_stride(self.m)) // 2

    def error(self) -> str:
        return (self.lib.baseRT_get_error() or b"").decode()

    def code(self) -> int:
        return int(self.lib.baseRT_get_error_code())

    def free(self) -> None:
        self.lib.baseRT_free_model(self.m)

    def seq(self) -> int:
        s = self.lib.baseRT_sequence_create(self.m)
        assert s, self.error()
        return int(s)

    def _args(self, seqs: Sequence[int], feeds: Sequence[Sequence[int]]) -> tuple[Any, Any, Any]:
        flat = [t for f in feeds for t in f]
        return (c_void_p * len(seqs))(*seqs), u32(flat), ints([len(f) for f in feeds])

    def step_logits(self, seqs: Sequence[int], feeds: Sequence[Sequence[int]]) -> npt.NDArray[np.float16]:
        """A fused step; the f16 logits rows it leaves, one per lane."""
        s, t, c = self._args(seqs, feeds)
        rc = self.lib.baseRT_batch_step_fused_logits(self.m, s, len(seqs), t, c)
        assert rc == OK, self.error()
        return self.read_rows(len(seqs))

    def read_rows(self, n: int) -> npt.NDArray[np.float16]:
        rows = np.empty((n, self.vocab), dtype=np.float16)
        assert self.lib.baseRT_read_batch_logits(self.m, n, rows.ctypes.data_as(c_void_p)) == self.vocab
        return rows

    def step_greedy(self, seqs: Sequence[int], feeds: Sequence[Sequence[int]]) -> list[int]:
        s, t, c = self._args(seqs, feeds)
        out = u32([0] * len(seqs))
        rc = self.lib.baseRT_batch_step_fused(self.m, s, len(seqs), t, c, out)
        assert rc == OK, self.error()
        return list(out)[: len(seqs)]

    def step_rc(self, seqs: Sequence[int], feeds: Sequence[Sequence[int]]) -> int:
        s, t, c = self._args(seqs, feeds)
        return int(self.lib.baseRT_batch_step_fused(self.m, s, len(seqs), t, c, u32([0] * len(seqs))))

    def argmax(self, row: npt.NDArray[np.float16]) -> int:
        return int(self.lib.baseRT_argmax_logits_row(self.m, row.ctypes.data_as(c_void_p)))

    def stats(self) -> BaseRTMemoryStats:
        st = BaseRTMemoryStats()
        assert self.lib.baseRT_model_memory_stats(self.m, byref(st))
        return st

    def cached_blocks(self) -> int:
        blocks = c_int()
        self.lib.baseRT_prefix_cache_stats(self.m, None, None, None, byref(blocks))
        return blocks.value


@pytest.fixture
def rt(lib: Library, raw: ctypes.CDLL, tiny_path: Path) -> Iterator[Runtime]:
    r = Runtime(lib, raw, tiny_path)
    yield r
    r.free()


# ---- values against the oracle -----------------------------------------------------------


def test_logits_match_numpy_oracle(rt: Runtime, oracle: NumpyLlama) -> None:
    tokens = prompt(40, 1, rt.vocab)
    s = rt.seq()
    rows = rt.step_logits([s], [tokens])
    ref = oracle.logits(tokens)[-1]
    assert f16_close(rows[0], ref) <= 1.0
    # Decode steps read the KV the prefill wrote.
    for _ in range(5):
        nxt = rt.argmax(rows[0])
        tokens.append(nxt)
        rows = rt.step_logits([s], [[nxt]])
        assert f16_close(rows[0], oracle.logits(tokens)[-1]) <= 1.0


def test_embedding_matches_numpy_oracle_in_f32(rt: Runtime, oracle: NumpyLlama) -> None:
    """baseRT_embed is f32 end to end: the mean-pooled final-normed hidden state,
    checked at 1e-4 relative. The oracle's hidden state is read through an
    identity lm_head (logits[:dim] == the final-normed hidden)."""
    cfg = dataclasses.replace(oracle.config, tied=False)
    eye = np.zeros((cfg.vocab_size, cfg.dim), dtype=np.float32)
    eye[: cfg.dim] = np.eye(cfg.dim, dtype=np.float32)
    hidden = LlamaForward(cfg, lambda name: eye if name == "lm_head.weight" else oracle.bundle.tensor(name))
    tokens = prompt(37, 2, rt.vocab)
    ref = hidden.logits(tokens)[:, : cfg.dim].mean(axis=0)
    out = (c_float * cfg.dim)()
    assert rt.lib.baseRT_embed(rt.m, u32(tokens), len(tokens), out, cfg.dim) == cfg.dim, rt.error()
    got = np.array(out, dtype=np.float32)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    assert rt.stats().kv_cache_blocks_used == 0  # the scratch sequence is gone


# ---- batch invariance --------------------------------------------------------------------


def test_batched_equals_unbatched(rt: Runtime) -> None:
    """Six lanes join at different steps and feed their prompts in different
    chunk sizes, so prefill and decode lanes share steps; every lane's logits
    row must equal, bit for bit, the row of the same lane stepped alone."""
    plen, join, feed = [5, 40, 1, 23, 17, 64], [0, 0, 3, 1, 7, 2], [5, 13, 1, 23, 4, 64]
    prompts = [prompt(n, 10 + i, rt.vocab) for i, n in enumerate(plen)]
    batched = [rt.seq() for _ in plen]
    single = [rt.seq() for _ in plen]
    fed, last = [0] * len(plen), [0] * len(plen)
    compared = 0
    for step in range(34):
        lanes = [i for i in range(len(plen)) if step >= join[i]]
        feeds = []
        for i in lanes:
            if fed[i] < plen[i]:
                feeds.append(prompts[i][fed[i] : fed[i] + feed[i]])
            else:
                feeds.append([last[i]])
        rows = rt.step_logits([batched[i] for i in lanes], feeds)
        for k, i in enumerate(lanes):
            alone = rt.step_logits([single[i]], [feeds[k]])
            assert alone[0].tobytes() == rows[k].tobytes(), f"lane {i} differs at step {step}"
            compared += 1
            if fed[i] < plen[i]:
                fed[i] += len(feeds[k])
            last[i] = rt.argmax(rows[k])
    assert compared > 150
    # Greedy outputs of the fused path agree with the host argmax of the rows.
    s = rt.seq()
    feeds = [prompt(9, 99, rt.vocab)]
    tok = rt.step_greedy([s], feeds)[0]
    assert tok == rt.argmax(rt.read_rows(1)[0])


def test_chunked_prefill_equals_one_shot(lib: Library, raw: ctypes.CDLL, tiny_path: Path) -> None:
    small, big = Runtime(lib, raw, tiny_path, prefill_chunk=16), Runtime(lib, raw, tiny_path, prefill_chunk=256)
    try:
        assert lib.baseRT_max_prefill_chunk(small.m) == 16
        tokens = prompt(100, 3, small.vocab)
        a, b = small.seq(), big.seq()
        ra, rb = small.step_logits([a], [tokens]), big.step_logits([b], [tokens])
        assert ra.tobytes() == rb.tobytes()
        for _ in range(6):
            t = small.argmax(ra[0])
            ra, rb = small.step_logits([a], [[t]]), big.step_logits([b], [[t]])
            assert ra.tobytes() == rb.tobytes()
        # One step whose rows overflow the chunk several times over.
        feeds = [prompt(40, 20 + i, small.vocab) for i in range(3)]
        packed = small.step_logits([small.seq() for _ in feeds], feeds)
        for i, f in enumerate(feeds):
            assert big.step_logits([big.seq()], [f])[0].tobytes() == packed[i].tobytes()
    finally:
        small.free()
        big.free()


# ---- prefix cache ------------------------------------------------------------------------


def test_prefix_seeded_equals_cold(rt: Runtime) -> None:
    lib = rt.lib
    p1 = prompt(70, 4, rt.vocab)
    p2 = p1[:40] + prompt(30, 5, rt.vocab)  # 2 full shared blocks
    a = rt.seq()
    rt.step_greedy([a], [p1])
    assert lib.baseRT_prefix_insert(rt.m, u32(p1), len(p1), a) == OK
    assert lib.baseRT_prefix_insert(rt.m, u32(p1), len(p1), a) == OK  # idempotent
    assert rt.cached_blocks() == 4

    match = lib.baseRT_prefix_match(rt.m, u32(p2), len(p2))
    assert (match.matched_tokens, match.n_blocks) == (32, 2) and match.handle
    b = rt.seq()
    assert lib.baseRT_sequence_seed_prefix(b, match.blocks, match.n_blocks, match.matched_tokens) == OK
    warm = rt.step_logits([b], [p2[32:]])
    lib.baseRT_prefix_unlock(rt.m, match.handle)
    c = rt.seq()
    cold = rt.step_logits([c], [p2])
    assert warm.tobytes() == cold.tobytes()
    for _ in range(8):
        t = rt.argmax(warm[0])
        warm, cold = rt.step_logits([b], [[t]]), rt.step_logits([c], [[t]])
        assert warm.tobytes() == cold.tobytes()

    # Roll b back into its shared block and write other tokens there: they
    # must land in a private copy, leaving the cached block (p1's) intact.
    p3 = p2[:20] + prompt(50, 6, rt.vocab)
    assert lib.baseRT_sequence_rollback(b, 20) == OK
    warm = rt.step_logits([b], [p3[20:]])
    assert warm.tobytes() == rt.step_logits([rt.seq()], [p3]).tobytes()
    again = lib.baseRT_prefix_match(rt.m, u32(p1), len(p1))
    assert again.matched_tokens == 64
    d = rt.seq()
    assert lib.baseRT_sequence_seed_prefix(d, again.blocks, again.n_blocks, again.matched_tokens) == OK
    warm = rt.step_logits([d], [p1[64:]])
    lib.baseRT_prefix_unlock(rt.m, again.handle)
    assert warm.tobytes() == rt.step_logits([rt.seq()], [p1]).tobytes()

    hits, misses, reused = c_uint64(), c_uint64(), c_uint64()
    lib.baseRT_prefix_cache_stats(rt.m, byref(hits), byref(misses), byref(reused), None)
    assert (hits.value, misses.value, reused.value) == (2, 0, 96)


def test_prefix_match_rules(rt: Runtime) -> None:
    lib = rt.lib
    p = prompt(64, 7, rt.vocab)
    s = rt.seq()
    rt.step_greedy([s], [p])
    lib.baseRT_prefix_insert(rt.m, u32(p), len(p), s)
    # Never the whole prompt: 64 tokens match 3 of the 4 cached blocks.
    m = lib.baseRT_prefix_match(rt.m, u32(p), 64)
    assert m.matched_tokens == 48
    rt.raw.baseRT_prefix_discard(rt.m, m.handle)
    assert lib.baseRT_prefix_match(rt.m, u32(p), 16).handle == 0  # 16 tokens: nothing may match
    assert lib.baseRT_prefix_match(rt.m, u32(p[1:]), 63).handle == 0  # misaligned: a miss
    m = lib.baseRT_prefix_match(rt.m, u32(p), 33)
    assert m.matched_tokens == 32
    lib.baseRT_prefix_release(rt.m, m.handle)
    hits, misses = c_uint64(), c_uint64()
    lib.baseRT_prefix_cache_stats(rt.m, byref(hits), byref(misses), None, None)
    assert (hits.value, misses.value) == (0, 3)  # two empty matches + one release; the discard counts nowhere
    # Seeding rules: a non-empty sequence, a mismatched token count.
    m = lib.baseRT_prefix_match(rt.m, u32(p), 40)
    assert lib.baseRT_sequence_seed_prefix(s, m.blocks, m.n_blocks, m.matched_tokens) == INVALID_ARGUMENT
    fresh = rt.seq()
    assert lib.baseRT_sequence_seed_prefix(fresh, m.blocks, m.n_blocks, 31) == INVALID_ARGUMENT
    assert lib.baseRT_sequence_seed_prefix(fresh, None, 0, 0) == OK  # an empty match is a no-op
    lib.baseRT_prefix_release(rt.m, m.handle)


def test_block_accounting(rt: Runtime) -> None:
    lib = rt.lib
    assert rt.stats().kv_cache_layout == 2 and lib.baseRT_page_size(rt.m) == PAGE
    seqs = [rt.seq() for _ in range(3)]
    ps = [prompt(n, 30 + n, rt.vocab) for n in (33, 50, 16)]
    rt.step_greedy(seqs, ps)
    st = rt.stats()
    assert st.kv_cache_blocks_used == 3 + 4 + 1
    assert st.kv_cache_tokens_used == st.kv_cache_blocks_used * PAGE
    for s, p in zip(seqs, ps, strict=True):
        lib.baseRT_prefix_insert(rt.m, u32(p), len(p), s)
    cached = rt.cached_blocks()
    assert cached == 2 + 3 + 1
    assert lib.baseRT_sequence_rollback(seqs[1], 10) == OK
    for s in seqs:
        lib.baseRT_sequence_free(s)
    assert rt.stats().kv_cache_blocks_used == cached
    assert lib.baseRT_prefix_evict(rt.m, 1_000) == cached
    assert rt.stats().kv_cache_blocks_used == 0 and rt.cached_blocks() == 0


# ---- failure paths -----------------------------------------------------------------------


def test_invalid_steps_change_nothing(rt: Runtime) -> None:
    a, b = rt.seq(), rt.seq()
    assert rt.step_rc([a, a], [[5], [6]]) == INVALID_ARGUMENT and "same sequence" in rt.error()
    assert rt.step_rc([a], [[rt.vocab]]) == INVALID_ARGUMENT
    assert rt.step_rc([a], [[]]) == INVALID_ARGUMENT
    assert rt.step_rc([rt.seq() for _ in range(9)], [[1]] * 9) == INVALID_ARGUMENT  # > max_batch_size
    rt.lib.baseRT_sequence_free(b)
    assert rt.step_rc([a, b], [[5], [6]]) == INVALID_ARGUMENT and "freed" in rt.error()
    assert rt.stats().kv_cache_blocks_used == 0

    rt.step_greedy([a], [prompt(MAX_CONTEXT - 3, 8, rt.vocab)])
    c = rt.seq()
    assert rt.step_rc([c, a], [[1, 2], [3, 4, 5, 6]]) == INVALID_ARGUMENT
    assert "lane 1" in rt.error() and str(MAX_CONTEXT) in rt.error()
    assert rt.step_rc([c], [[1, 2]]) == OK  # c was untouched by the failed step

    assert rt.raw.baseRT_ref_inject_fault(FAULT_STEP, 1) == OK
    used = rt.stats().kv_cache_blocks_used
    assert rt.step_rc([c], [[7]]) == GENERATION_FAILED
    assert rt.stats().kv_cache_blocks_used == used
    assert rt.step_rc([c], [[7]]) == OK  # the fault fires once
    assert rt.raw.baseRT_ref_inject_fault(FAULT_SEQ_CREATE, 1) == OK
    assert not rt.lib.baseRT_sequence_create(rt.m) and rt.code() == OUT_OF_MEMORY


def test_pool_exhaustion_is_atomic_and_evicts_the_cache(lib: Library, raw: ctypes.CDLL, tiny_path: Path) -> None:
    # 2 lanes + the default sequence: 3 * 256 / 16 = 48 blocks.
    rt = Runtime(lib, raw, tiny_path, max_batch_size=2)
    try:
        assert rt.stats().kv_cache_blocks_total == 48
        a, b, c = rt.seq(), rt.seq(), rt.seq()
        pa = prompt(250, 9, rt.vocab)
        rt.step_greedy([a], [pa])
        lib.baseRT_prefix_insert(rt.m, u32(pa), len(pa), a)
        lib.baseRT_sequence_rollback(a, 0)  # a's 15 full blocks now live in the cache only
        rt.step_greedy([a], [prompt(200, 10, rt.vocab)])  # 13 blocks
        pd = prompt(100, 11, rt.vocab)
        lib.baseRT_prefill(rt.m, u32(pd), len(pd))  # the default sequence: 7 blocks
        assert rt.cached_blocks() == 15 and rt.stats().kv_cache_blocks_used == 15 + 13 + 7
        # b + c need 32 blocks: 13 are free, 28 even with the cache evicted.
        pb, pc = prompt(256, 12, rt.vocab), prompt(256, 13, rt.vocab)
        assert rt.step_rc([b, c], [pb, pc]) == OUT_OF_MEMORY
        assert "exhausted" in rt.error()
        # Nothing changed, the cache included (evicting it would not have helped).
        assert rt.cached_blocks() == 15 and rt.stats().kv_cache_blocks_used == 35
        # b alone needs 16: three cached blocks make way.
        assert rt.step_rc([b], [pb]) == OK
        assert rt.cached_blocks() == 12 and rt.stats().kv_cache_blocks_used == 48
    finally:
        rt.free()


def test_contiguous_model_has_no_sequences(lib: Library, raw: ctypes.CDLL, tiny_path: Path) -> None:
    rt = Runtime(lib, raw, tiny_path, paged_kv=0, prefix_cache=0, max_batch_size=1)
    try:
        assert not lib.baseRT_sequence_create(rt.m) and rt.code() == UNSUPPORTED
        assert lib.baseRT_page_size(rt.m) == 0
        tokens = prompt(20, 13, rt.vocab)
        first = lib.baseRT_prefill(rt.m, u32(tokens), len(tokens))
        st = rt.stats()
        assert st.kv_cache_layout == 1 and st.kv_cache_tokens_used == 20
        logits = (c_float * rt.vocab)()
        assert lib.baseRT_read_logits(rt.m, logits, rt.vocab) == rt.vocab
        assert int(np.argmax(np.array(logits, dtype=np.float32))) == first
    finally:
        rt.free()


# ---- sampling and the single-sequence API --------------------------------------------------


def test_fused_sample(rt: Runtime) -> None:
    p = prompt(12, 14, rt.vocab)
    seqs = [rt.seq() for _ in range(4)]
    rows = (BaseRTRowSampling * 4)()
    for i in range(4):
        rows[i].temperature = 0.0 if i == 0 else 0.8
        rows[i].top_p, rows[i].top_k, rows[i].repeat_penalty = 1.0, 0, 1.0
        rows[i].seed = 1234 if i < 3 else 99
    s, t, c = rt._args(seqs, [p] * 4)
    out = u32([0] * 4)
    assert rt.lib.baseRT_batch_step_fused_sample(rt.m, s, 4, t, c, rows, out) == OK, rt.error()
    logits = rt.read_rows(4)
    assert out[0] == rt.argmax(logits[0])  # temperature 0: greedy
    assert out[1] == out[2]  # same logits, same seed: same token
    assert all(row.tobytes() == logits[0].tobytes() for row in logits)


def test_generate_matches_batched_greedy(rt: Runtime) -> None:
    lib = rt.lib
    tokens = prompt(30, 15, rt.vocab)
    got: list[int] = []

    def collect(tok: int, text: bytes | None, _: Any) -> bool:
        got.append(tok)
        return True

    on_token = TOKEN_CALLBACK(collect)

    greedy = BaseRTSamplingConfig(temperature=0.0, top_p=1.0, repeat_penalty=1.0)
    stats: BaseRTGenerationStats = lib.baseRT_generate(rt.m, u32(tokens), len(tokens), 12, greedy, on_token, None)
    assert rt.code() == OK, rt.error()
    assert stats.prompt_tokens == 30 and stats.generated_tokens == len(got)
    # The same continuation through a sequence, stopping where generate did (EOS or 12).
    s = rt.seq()
    nxt = rt.step_greedy([s], [tokens])[0]
    expect: list[int] = []
    while len(expect) < 12 and nxt != 2:  # 2: the tiny vocabulary's EOS
        expect.append(nxt)
        nxt = rt.step_greedy([s], [[nxt]])[0]
    assert got == expect
    # Every emitted token is fed back except the last one of a max_tokens stop.
    assert rt.raw.baseRT_get_position(rt.m) == 30 + (len(got) if len(got) < 12 else 11)

    lib.baseRT_reset(rt.m)
    assert rt.raw.baseRT_get_position(rt.m) == 0
    first = lib.baseRT_prefill(rt.m, u32(tokens), len(tokens))
    logits = (c_float * rt.vocab)()
    assert lib.baseRT_read_logits(rt.m, logits, rt.vocab) == rt.vocab
    values = np.array(logits, dtype=np.float32)
    assert int(np.argmax(values)) == first == rt.step_greedy([rt.seq()], [tokens])[0]
    assert np.array_equal(values.astype(np.float16).astype(np.float32), values)  # f16-rounded, widened


def test_generate_callback_false_stops(rt: Runtime) -> None:
    tokens = prompt(10, 3, rt.vocab)
    got: list[tuple[int, bytes | None]] = []

    def collect(tok: int, text: bytes | None, _: Any) -> bool:
        got.append((tok, text))
        return len(got) < 3  # stop after the third token

    on_token = TOKEN_CALLBACK(collect)
    greedy = BaseRTSamplingConfig(temperature=0.0, top_p=1.0, repeat_penalty=1.0)
    stats = rt.lib.baseRT_generate(rt.m, u32(tokens), len(tokens), 50, greedy, on_token, None)
    assert rt.code() == OK, rt.error()
    assert len(got) == 3 and stats.generated_tokens == 3
    assert all(isinstance(text, bytes) for _, text in got)
