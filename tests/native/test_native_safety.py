"""Memory safety of the reference engine's ABI under any call order and any handle value.

A foreign binding (Rust, Swift, C) can pass a stale, freed, foreign or reused
handle, settle a prefix match twice, seed blocks it does not hold, or keep a
sequence past its model. Each such call must fail with a code and a message,
never corrupt the KV pool or crash. The regression tests pin the holes issue 10
lists; the fuzz test drives random call sequences with valid and invalid handles
and checks the pool's bookkeeping (baseRT_ref_check_kv) after every call.
Under tests/native/test_sanitizers.py the same file runs against the ASan + UBSan build.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
from collections.abc import Sequence
from ctypes import byref, c_uint32, c_void_p
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from quantized import quantize_bundle
from raw_abi import error, ints, u32

from aiobasert._ffi import TOKEN_CALLBACK, BaseRTLoadOptions, BaseRTMemoryStats, BaseRTSamplingConfig, Library
from aiobasert.models.tiny import build_tiny_model

OK, INVALID_ARGUMENT, INVALID_FORMAT, OUT_OF_MEMORY = 0, 2, 4, 6
PAGE = 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("safety") / "tiny.base", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False
    )


def load(lib: Library, path: Path, max_context: int = 128, **opts: int) -> int:
    options = dict(paged_kv=1, max_batch_size=4, prefix_cache=1, prefill_chunk=16) | opts
    o = BaseRTLoadOptions(struct_size=ctypes.sizeof(BaseRTLoadOptions), **options)
    m = lib.baseRT_load_model_ex(os.fsencode(path), None, max_context, byref(o))
    assert m, error(lib)
    return int(m)


def step(lib: Library, m: int, seqs: Sequence[int], feeds: Sequence[Sequence[int]]) -> int:
    flat = [t for f in feeds for t in f]
    arr = (c_void_p * max(len(seqs), 1))(*seqs)
    return int(lib.baseRT_batch_step_fused_logits(m, arr, len(seqs), u32(flat), ints([len(f) for f in feeds])))


def rows(lib: Library, m: int, n: int) -> np.ndarray[Any, np.dtype[np.float16]]:
    vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
    out = np.empty((n, vocab), dtype=np.float16)
    assert lib.baseRT_read_batch_logits(m, n, out.ctypes.data_as(c_void_p)) == vocab, error(lib)
    return out


def match(lib: Library, m: int, tokens: Sequence[int]) -> tuple[int, list[int]]:
    r = lib.baseRT_prefix_match(m, u32(tokens), len(tokens))
    return int(r.handle), [r.blocks[i] for i in range(r.n_blocks)]


def seed(lib: Library, s: int, blocks: Sequence[int]) -> int:
    return int(lib.baseRT_sequence_seed_prefix(s, ints(blocks), len(blocks), len(blocks) * PAGE))


def check_pool(lib: Library, m: int) -> None:
    assert lib.baseRT_ref_check_kv(m) == OK, error(lib)


def blocks_used(lib: Library, m: int) -> int:
    st = BaseRTMemoryStats()
    assert lib.baseRT_model_memory_stats(m, byref(st)), error(lib)
    return int(st.kv_cache_blocks_used)


@pytest.fixture(scope="module")
def model_options() -> dict[str, int]:
    return {"max_context": 128, "max_batch_size": 4, "prefix_cache": 1, "prefill_chunk": 16}  # as `load`


PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 200, size=40)]


def cached_prefix(lib: Library, m: int) -> None:
    """Run PROMPT on a sequence and publish its two full blocks to the cache."""
    s = int(lib.baseRT_sequence_create(m))
    assert step(lib, m, [s], [PROMPT]) == OK, error(lib)
    assert lib.baseRT_prefix_insert(m, u32(PROMPT), len(PROMPT), s) == OK
    lib.baseRT_sequence_free(s)


def cold_logits(lib: Library, m: int, tokens: Sequence[int]) -> bytes:
    s = int(lib.baseRT_sequence_create(m))
    assert step(lib, m, [s], [tokens]) == OK, error(lib)
    out = rows(lib, m, 1)[0].tobytes()
    lib.baseRT_sequence_free(s)
    return out


# ---- regressions: the holes of issue 10 ----------------------------------------------------------


def test_seed_twice_and_release_after_seed_keep_the_pool_consistent(lib: Library, model: int) -> None:
    cached_prefix(lib, model)
    want = cold_logits(lib, model, PROMPT)
    handle, blocks = match(lib, model, PROMPT)
    assert blocks and handle
    a, b = int(lib.baseRT_sequence_create(model)), int(lib.baseRT_sequence_create(model))
    assert seed(lib, a, blocks) == OK, error(lib)
    assert seed(lib, b, blocks) == OK, error(lib)  # one match seeding two sequences: each holds a reference
    lib.baseRT_prefix_release(model, handle)  # after seeding: drops only the match's own references
    check_pool(lib, model)
    lib.baseRT_prefix_release(model, handle)  # settled twice: an error, nothing freed
    assert lib.baseRT_get_error_code() == INVALID_ARGUMENT and "already settled" in error(lib)
    assert lib.baseRT_prefix_evict(model, 1000) == 0  # both sequences still hold the blocks
    check_pool(lib, model)
    rest = PROMPT[len(blocks) * PAGE :]
    for s in (a, b):
        assert step(lib, model, [s], [rest]) == OK, error(lib)
        assert rows(lib, model, 1)[0].tobytes() == want  # the cached KV, not another sequence's
    for s in (a, b):
        lib.baseRT_sequence_free(s)
    check_pool(lib, model)
    assert lib.baseRT_prefix_evict(model, 1000) == len(blocks)
    assert blocks_used(lib, model) == 0


def test_seed_refuses_blocks_that_are_not_a_cached_prefix(lib: Library, model: int) -> None:
    other = int(lib.baseRT_sequence_create(model))
    assert step(lib, model, [other], [PROMPT]) == OK
    victim = int(lib.baseRT_sequence_create(model))
    for blocks in ([0], [0, 1], [1], [-1], [10**6]):  # another sequence's private blocks, or no block at all
        assert seed(lib, victim, blocks) == INVALID_ARGUMENT, blocks
        assert "not a cached prefix" in error(lib) or "not a live KV block" in error(lib)
    cached_prefix(lib, model)
    handle, blocks = match(lib, model, PROMPT)
    assert seed(lib, victim, blocks[::-1]) == INVALID_ARGUMENT  # the cached blocks, out of order
    assert seed(lib, victim, blocks[:1]) == OK  # a prefix of the path is a cached prefix
    lib.baseRT_prefix_unlock(model, handle)
    check_pool(lib, model)
    lib.baseRT_sequence_free(victim)
    lib.baseRT_sequence_free(other)
    lib.baseRT_prefix_evict(model, 1000)
    assert blocks_used(lib, model) == 0


def test_unlock_without_seed_does_not_leak(lib: Library, model: int) -> None:
    cached_prefix(lib, model)
    handle, blocks = match(lib, model, PROMPT)
    lib.baseRT_prefix_unlock(model, handle)
    check_pool(lib, model)
    assert lib.baseRT_prefix_evict(model, 1000) == len(blocks)
    assert blocks_used(lib, model) == 0


def test_sequence_handles_die_with_their_model(lib: Library, raw: ctypes.CDLL, model_path: Path) -> None:
    m = load(lib, model_path)
    s = int(lib.baseRT_sequence_create(m))
    assert step(lib, m, [s], [PROMPT[:5]]) == OK
    lib.baseRT_free_model(m)
    assert lib.baseRT_sequence_rollback(s, 0) == INVALID_ARGUMENT
    assert "freed" in error(lib)
    assert seed(lib, s, [0]) == INVALID_ARGUMENT
    lib.baseRT_sequence_free(s)
    assert lib.baseRT_get_error_code() == INVALID_ARGUMENT
    # A new model (possibly at the old address) does not revive the old handles.
    m2 = load(lib, model_path)
    try:
        assert lib.baseRT_sequence_rollback(s, 0) == INVALID_ARGUMENT
        assert step(lib, m2, [s], [[5]]) == INVALID_ARGUMENT
        assert raw.baseRT_get_position(m) == -1 and "freed" in error(lib)
    finally:
        lib.baseRT_free_model(m2)


def test_stale_sequence_handle_never_reaches_a_new_sequence(lib: Library, model: int) -> None:
    """Far more than 256 create/free cycles: no new sequence answers to a freed handle."""
    live_before = lib.baseRT_ref_counter(b"sequences")
    stale = int(lib.baseRT_sequence_create(model))
    lib.baseRT_sequence_free(stale)
    live = []
    for i in range(600):
        s = int(lib.baseRT_sequence_create(model))
        assert s and s != stale
        if i % 2:
            live.append(s)
        else:
            lib.baseRT_sequence_free(s)
        assert lib.baseRT_sequence_rollback(stale, 0) == INVALID_ARGUMENT
    assert step(lib, model, [live[0]], [[7, 8, 9]]) == OK
    lib.baseRT_sequence_free(stale)  # must not free live[...]
    assert lib.baseRT_sequence_rollback(live[0], 1) == OK, error(lib)
    for s in live:
        lib.baseRT_sequence_free(s)
    assert lib.baseRT_ref_counter(b"sequences") == live_before
    check_pool(lib, model)


def test_foreign_handles_are_refused(lib: Library, raw: ctypes.CDLL, model: int) -> None:
    s = int(lib.baseRT_sequence_create(model))
    for bogus in (1, 0xDEADBEEF, model, s + 8, s ^ (1 << 40), 2**64 - 8):
        assert lib.baseRT_sequence_rollback(bogus, 0) == INVALID_ARGUMENT
        assert raw.baseRT_get_position(bogus if bogus != model else s) == -1
        assert lib.baseRT_ref_check_kv(bogus if bogus != model else s) == INVALID_ARGUMENT
    lib.baseRT_sequence_free(s)


def _rewrite_header(src: Path, dst: Path, edit: Any) -> Path:
    """Copy a bundle with its header JSON edited (padding re-computed, blob moved)."""
    data = src.read_bytes()
    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + hlen])
    old_blob = (16 + hlen + 65535) // 65536 * 65536
    edit(header)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob = (16 + len(text) + 65535) // 65536 * 65536
    out = data[:8] + len(text).to_bytes(8, "little") + text + b"\0" * (blob - 16 - len(text)) + data[old_blob:]
    dst.write_bytes(out)
    return dst


@pytest.mark.parametrize("theta", [1e-300, 1e-30, 0.5, 1.0])
def test_rope_theta_that_breaks_rope_is_refused(lib: Library, model_path: Path, tmp_path: Path, theta: float) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["config"]["rope_theta"] = theta

    bad = _rewrite_header(model_path, tmp_path / "theta.base", edit)
    assert not lib.baseRT_load_model_ex(os.fsencode(bad), None, 64, None)
    assert lib.baseRT_get_error_code() == INVALID_FORMAT and "rope_theta" in error(lib)


def test_tiny_norm_eps_is_refused(lib: Library, model_path: Path, tmp_path: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["config"]["rms_norm_eps"] = 1e-300

    bad = _rewrite_header(model_path, tmp_path / "eps.base", edit)
    assert not lib.baseRT_load_model_ex(os.fsencode(bad), None, 64, None)
    assert "rms_norm_eps" in error(lib)


@pytest.mark.parametrize("offset", [2**63 - 1, 2**63 - 2**20, 2**62])
def test_tensor_offset_near_2_63_is_refused(lib: Library, model_path: Path, tmp_path: Path, offset: int) -> None:
    def edit(h: dict[str, Any]) -> None:
        t = h["tensors"][-1]
        t["offset"] = offset
        # A length near 2^63 too: offset + length wraps a uint64 unless compared by subtraction.
        if offset == 2**63 - 1:
            t["shape"] = [2**40, 2**21 // 2]
            t["length"] = 2**40 * (2**21 // 2) * {"f32": 4, "f16": 2, "bf16": 2}[t["dtype"]]

    bad = _rewrite_header(model_path, tmp_path / "offset.base", edit)
    assert not lib.baseRT_load_model_ex(os.fsencode(bad), None, 64, None)
    assert lib.baseRT_get_error_code() == INVALID_FORMAT, error(lib)


def test_kv_block_count_overflow_is_refused_at_load(lib: Library, model_path: Path, tmp_path: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        h["config"]["max_position_embeddings"] = 1 << 24

    long_ctx = _rewrite_header(model_path, tmp_path / "long.base", edit)
    o = BaseRTLoadOptions(
        struct_size=ctypes.sizeof(BaseRTLoadOptions), paged_kv=1, max_batch_size=4096, prefill_chunk=4096
    )
    assert not lib.baseRT_load_model_ex(os.fsencode(long_ctx), None, 1 << 24, byref(o))
    assert lib.baseRT_get_error_code() == 2 and "KV pool" in error(lib), error(lib)


# ---- re-entrant calls from baseRT_generate's token callback ---------------------------------------

EOS = 2  # the tiny vocabulary's end of text


def sampled_no_eos() -> tuple[BaseRTSamplingConfig, Any]:
    """Seeded sampling that never picks EOS (so a generation runs to its limits); the arrays kept alive."""
    toks, vals = (ctypes.c_int32 * 1)(EOS), (ctypes.c_float * 1)(-1e9)
    cfg = BaseRTSamplingConfig(
        temperature=1.0,
        top_p=1.0,
        repeat_penalty=1.0,
        seed=7,
        n_logit_bias=1,
        logit_bias_tokens=toks,
        logit_bias_values=vals,
    )
    return cfg, (toks, vals)


def generate(lib: Library, m: int, prompt: Sequence[int], max_tokens: int, on_token: Any) -> Any:
    cfg, keep = sampled_no_eos()
    stats = lib.baseRT_generate(m, u32(prompt), len(prompt), max_tokens, cfg, TOKEN_CALLBACK(on_token), None)
    del keep
    return stats


REENTRANT_CALLS = [
    "reset",
    "generate",
    "free_model",
    "prefill",
    "sequence_create",
    "sequence_free",
    "step",
    "prefix_insert",
    "prefix_evict",
    "read_logits",
]


def reentrant_call(lib: Library, m: int, what: str, seq: int) -> None:
    """One call on the model whose generation is running the callback."""
    if what == "reset":
        lib.baseRT_reset(m)
    elif what == "generate":
        generate(lib, m, PROMPT[:5], 50, lambda *_: True)
    elif what == "free_model":
        lib.baseRT_free_model(m)
    elif what == "prefill":
        lib.baseRT_prefill(m, u32(PROMPT[:3]), 3)
    elif what == "sequence_create":
        lib.baseRT_sequence_create(m)
    elif what == "sequence_free":
        lib.baseRT_sequence_free(seq)
    elif what == "step":
        step(lib, m, [seq], [[5, 6]])
    elif what == "prefix_insert":
        lib.baseRT_prefix_insert(m, u32(PROMPT), len(PROMPT), seq)
    elif what == "prefix_evict":
        lib.baseRT_prefix_evict(m, 1000)
    else:
        lib.baseRT_read_logits(m, (ctypes.c_float * 4096)(), 4096)


@pytest.mark.parametrize("what", REENTRANT_CALLS)
def test_generate_callback_cannot_reenter_its_model(
    lib: Library, raw: ctypes.CDLL, model_path: Path, what: str
) -> None:
    """Reset, generate, free, prefill, sequences, steps and the prefix cache from inside the callback of a
    generation on the same model are refused with INVALID_ARGUMENT (they used to pull the generation's
    buffers away: a heap overflow past its history for reset / generate, a use-after-free for free); the
    generation then runs on to its own limit undisturbed."""
    m = load(lib, model_path, max_context=48)
    seq = int(lib.baseRT_sequence_create(m))
    assert step(lib, m, [seq], [PROMPT[:33]]) == OK
    inside: list[tuple[int, str]] = []

    def on_token(tok: int, text: bytes | None, _: Any) -> bool:
        reentrant_call(lib, m, what, seq)
        inside.append((int(lib.baseRT_get_error_code()), error(lib)))
        return True

    stats = generate(lib, m, PROMPT, 200, on_token)
    # 40 prompt tokens in a 48-token context: at most 9 generated, whatever the callback tried.
    assert stats.generated_tokens == len(inside) == 9, (stats.generated_tokens, inside[:2])
    assert all(code == INVALID_ARGUMENT and "token callback" in msg for code, msg in inside), inside[0]
    assert lib.baseRT_get_error_code() == OK, error(lib)  # the generation itself succeeded
    assert raw.baseRT_get_position(m) == 48
    check_pool(lib, m)
    lib.baseRT_sequence_free(seq)  # outside the callback: allowed again
    lib.baseRT_reset(m)
    assert lib.baseRT_get_error_code() == OK, error(lib)
    lib.baseRT_free_model(m)
    assert lib.baseRT_get_error_code() == OK, error(lib)


def test_generate_callback_may_use_tokenizer_and_another_model(lib: Library, model_path: Path) -> None:
    """Only the generating model is busy: tokenizer calls on it and any call on another model work."""
    m, other = load(lib, model_path), load(lib, model_path)
    seen: list[tuple[bool, int]] = []

    def on_token(tok: int, text: bytes | None, _: Any) -> bool:
        encoded = lib.baseRT_encode(m, b"hello", (c_uint32 * 16)(), 16)
        inner = generate(lib, other, PROMPT[:5], 2, lambda *_: True)
        seen.append((encoded > 0, int(inner.generated_tokens)))
        return len(seen) < 3

    stats = generate(lib, m, PROMPT[:10], 50, on_token)
    assert stats.generated_tokens == 3 and seen == [(True, 2)] * 3, seen
    lib.baseRT_free_model(other)
    lib.baseRT_free_model(m)


# ---- prefix cache: one block, two token paths ------------------------------------------------------


def test_block_inserted_under_two_token_paths_stays_evictable(lib: Library, model: int) -> None:
    """Inserting one sequence under two prompts used to give its blocks a second trie node each: a second
    reference eviction (which frees blocks the trie alone holds) never dropped. A block is cached under one
    path; the second insert stops where it would reuse a cached block, and everything evicts."""
    s = int(lib.baseRT_sequence_create(model))
    assert step(lib, model, [s], [PROMPT]) == OK, error(lib)
    other = [t + 1 for t in PROMPT]
    assert lib.baseRT_prefix_insert(model, u32(PROMPT), len(PROMPT), s) == OK, error(lib)
    assert lib.baseRT_prefix_insert(model, u32(other), len(other), s) == OK, error(lib)
    check_pool(lib, model)
    lib.baseRT_sequence_free(s)
    assert match(lib, model, [*other, 1])[0] == 0  # the other prompt was not cached over foreign KV
    assert lib.baseRT_prefix_evict(model, 1000) == 2
    check_pool(lib, model)
    assert blocks_used(lib, model) == 0
    cached = ctypes.c_int(-1)
    lib.baseRT_prefix_cache_stats(model, None, None, None, byref(cached))
    assert cached.value == 0


# ---- NaN / Inf quantization scales --------------------------------------------------------------------


def _poison(src: Path, dst: Path, tensor: str, region: str, index: int, value: bytes) -> Path:
    """Copy a bundle with element `index` of a tensor's region ("scale" / "bias" of a quantized tensor, ""
    for its data) overwritten by the raw bytes `value`."""
    data = bytearray(src.read_bytes())
    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + hlen])
    blob = (16 + hlen + 65535) // 65536 * 65536
    t = next(t for t in header["tensors"] if t["name"] == tensor)
    at = blob + t[f"{region}_offset" if region else "offset"] + len(value) * index
    data[at : at + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


NON_FINITE = {  # (scale_dtype, raw bytes little-endian, what)
    "f16 NaN": ("f16", b"\x00\x7e", "NaN"),
    "f16 +Inf": ("f16", b"\x00\x7c", "Inf"),
    "f16 -Inf": ("f16", b"\x00\xfc", "Inf"),
    "bf16 NaN": ("bf16", b"\xc0\x7f", "NaN"),
    "bf16 -Inf": ("bf16", b"\x80\xff", "Inf"),
}


@pytest.mark.parametrize("region", ["scale", "bias"])
@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_non_finite_quant_scales_are_refused_at_load(
    lib: Library, q4_model_path: Path, tmp_path: Path, case: str, region: str
) -> None:
    """A NaN / Inf group scale or bias made every value of its group non-finite, and the activations
    quantized from them reached a float-to-int conversion (UB). Refused at load, naming the tensor."""
    dtype, raw, what = NON_FINITE[case]

    def edit(h: dict[str, Any]) -> None:
        for t in h["tensors"]:
            if t["dtype"] == "base_q4":
                t["scale_dtype"] = dtype  # f16 scales read as bf16 are other finite numbers

    src = _rewrite_header(q4_model_path, tmp_path / "dtype.base", edit)
    name = "layers.1.mlp.down_proj.weight"
    bad = _poison(src, tmp_path / "bad.base", name, region, 3, raw)
    assert not lib.baseRT_load_model_ex(os.fsencode(bad), None, 64, None)
    msg = error(lib)
    assert lib.baseRT_get_error_code() == INVALID_FORMAT and name in msg and region in msg and what in msg, msg
    fine = lib.baseRT_load_model_ex(os.fsencode(src), None, 64, None)  # the unpoisoned bundle loads
    assert fine, error(lib)
    lib.baseRT_free_model(fine)


def test_non_finite_weights_compute_without_undefined_behaviour(
    lib: Library, nonfinite_paths: tuple[list[Path], list[Path]]
) -> None:
    """A NaN or Inf norm weight loads (only quantization parameters are checked) and makes NaN / Inf
    activations: the activation quantizer of the integer kernels and the Q8 KV pool clamp them before their
    float-to-int conversions (UB, which the UBSan run of this file reports), and every call still answers."""
    for path in nonfinite_paths[1]:
        for kv_bits in (0, 8):
            m = load(lib, path, kv_bits=kv_bits)
            s = int(lib.baseRT_sequence_create(m))
            assert step(lib, m, [s], [PROMPT]) == OK, error(lib)
            assert step(lib, m, [s], [[5]]) == OK, error(lib)
            rows(lib, m, 1)
            stats = generate(lib, m, PROMPT[:20], 4, lambda *_: True)
            assert stats.generated_tokens <= 4 and lib.baseRT_get_error_code() == OK, error(lib)  # NaN rows: any stop
            lib.baseRT_sequence_free(s)
            check_pool(lib, m)
            lib.baseRT_free_model(m)


# ---- cgroup CPU quotas ------------------------------------------------------------------------------


def _fake_cgroups(root: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    (root / "proc" / "self" / "mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)
V2_MOUNTS = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
V2_HYBRID_MOUNT = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"  # v1 + v2, systemd hybrid

CGROUP_TREES: dict[str, tuple[str, str, dict[str, str], int | None]] = {
    # name: (/proc/self/cgroup, mountinfo, files, expected CPU limit or None for none)
    "v1 quota": (
        "4:memory:/job\n2:cpu,cpuacct:/job/step\n0::/\n",
        V1_MOUNTS,
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n",
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/job/step/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/job/step/cpu.cfs_period_us": "100000\n",
        },
        1,
    ),
    "v2 nested": (
        "0::/user.slice/app.scope\n",
        V2_MOUNTS,
        {
            "sys/fs/cgroup/cpu.max": "max 100000\n",  # the root's own file is ignored by the kernel; "max"
            "sys/fs/cgroup/user.slice/cpu.max": "150000 200000\n",  # 0.75 CPU: rounds up to 1
            "sys/fs/cgroup/user.slice/app.scope/cpu.max": "max 100000\n",
        },
        1,
    ),
    "v2 container view": (
        "0::/kubepods/pod1/c1\n",
        "29 23 0:26 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        {
            "sys/fs/cgroup/cpu.max": "100000 100000\n",  # the pod's level, seen at the mount point
            "sys/fs/cgroup/c1/cpu.max": "max 100000\n",
        },
        1,
    ),
    "no limit": (
        "2:cpu,cpuacct:/a\n0::/b\n",
        V1_MOUNTS + V2_HYBRID_MOUNT,
        {
            "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/unified/b/cpu.max": "max 100000\n",
        },
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CGROUP_TREES))
def test_usable_cpus_follow_the_processs_own_cgroup_quota(
    lib: Library, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The pool's CPU count is the affinity mask capped by the smallest quota from the process's own cgroup
    (read from /proc/self/cgroup) up its hierarchy, v1 and v2; a fake tree stands in for / here."""
    cgroup, mounts, files, limit = CGROUP_TREES[case]
    monkeypatch.setenv("BASERT_REF_CGROUP_ROOT", str(_fake_cgroups(tmp_path, cgroup, mounts, files)))
    affinity = len(os.sched_getaffinity(0))
    assert lib.baseRT_ref_counter(b"usable_cpus") == (affinity if limit is None else min(limit, affinity))


MEMORY_TREES: dict[str, tuple[str, str, dict[str, str], int | None]] = {
    # name: (/proc/self/cgroup, mountinfo, files, expected memory limit in bytes or None for none)
    "v2 nested": (
        "0::/user.slice/app.scope\n",
        V2_MOUNTS,
        {
            "sys/fs/cgroup/user.slice/memory.max": "3221225472\n",  # 3 GiB at the slice
            "sys/fs/cgroup/user.slice/app.scope/memory.max": "max\n",
        },
        3 << 30,
    ),
    "v2 container view": (
        "0::/kubepods/pod1/c1\n",
        "29 23 0:26 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        {
            "sys/fs/cgroup/memory.max": "2147483648\n",  # the pod's level, seen at the mount point
            "sys/fs/cgroup/c1/memory.max": "4294967296\n",
        },
        2 << 30,
    ),
    "v1 limit": (
        "4:memory:/job\n2:cpu,cpuacct:/job\n0::/\n",
        V1_MOUNTS,
        {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "none"
            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": "1073741824\n",
        },
        1 << 30,
    ),
    "no limit": (
        "4:memory:/a\n0::/b\n",
        V1_MOUNTS + V2_HYBRID_MOUNT,
        {
            "sys/fs/cgroup/memory/a/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/unified/b/memory.max": "max\n",
        },
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(MEMORY_TREES))
def test_memory_budget_follows_the_processs_own_cgroup_limit(
    raw: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The engine plans within half of the memory the process may use: physical RAM, capped by the smallest
    memory limit from its own cgroup up (v2 memory.max, v1 memory.limit_in_bytes): in a container with a
    2 GiB limit on a large host, context sizing must not plan for half the host."""
    cgroup, mounts, files, limit = MEMORY_TREES[case]
    monkeypatch.setenv("BASERT_REF_CGROUP_ROOT", str(_fake_cgroups(tmp_path, cgroup, mounts, files)))
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
    assert raw.baseRT_device_memory_budget() == (ram if limit is None else min(limit, ram)) // 2


# ---- shared thread pool ------------------------------------------------------------------------


def test_two_models_share_one_thread_pool(lib: Library, model_path: Path) -> None:
    before = lib.baseRT_ref_counter(b"thread_pools")
    a = load(lib, model_path)
    b = load(lib, model_path)
    try:
        pools = lib.baseRT_ref_counter(b"thread_pools")
        threads = lib.baseRT_ref_counter(b"pool_threads")
        cpus = lib.baseRT_ref_counter(b"usable_cpus")
        assert cpus >= 1 and cpus <= (os.cpu_count() or 1)
        assert cpus == len(os.sched_getaffinity(0)) or cpus < len(os.sched_getaffinity(0))  # cgroup quota
        if threads > 1:
            assert pools == max(before, 1), (before, pools)
        else:
            assert pools <= 1
        if os.environ.get("BASERT_REF_THREADS", "auto") == "auto":
            assert threads == min(lib.baseRT_ref_counter(b"auto_threads"), 64)
            assert 1 <= threads <= cpus  # physical cores within the usable CPUs
        # Both models still step (the second one runs on the pool too).
        for m in (a, b):
            s = int(lib.baseRT_sequence_create(m))
            assert step(lib, m, [s], [PROMPT[:20]]) == OK, error(lib)
            lib.baseRT_sequence_free(s)
    finally:
        lib.baseRT_free_model(a)
        lib.baseRT_free_model(b)
    assert lib.baseRT_ref_counter(b"thread_pools") == before
    assert lib.baseRT_ref_counter(b"nonsense") == -1


# ---- fuzz ------------------------------------------------------------------------------------------

FUZZ_PROMPTS = [PROMPT, PROMPT[:33], PROMPT[:17] + [9] * 20, [11] * 50, [*PROMPT[:16], 3]]


@pytest.fixture(scope="module")
def nonfinite_paths(q4_model_path: Path, model_path: Path) -> tuple[list[Path], list[Path]]:
    """(bundles the loader must refuse: NaN / Inf quantization scales and biases; bundles that load but
    compute NaN / Inf: a NaN and an Inf norm weight, which the integer kernels' activation quantizer and
    the Q8 KV pool then meet)."""
    q4, name = q4_model_path, "layers.0.mlp.up_proj.weight"
    refused = [
        _poison(q4, q4.with_name("nan-scale.base"), name, "scale", 5, b"\x00\x7e"),
        _poison(q4, q4.with_name("inf-bias.base"), name, "bias", 0, b"\x00\xfc"),
    ]
    loadable = [
        _poison(q4, q4.with_name("nan-norm.q4.base"), "layers.0.input_norm.weight", "", 7, np.float32("nan").tobytes()),
        _poison(
            model_path,
            model_path.with_name("inf-norm.base"),
            "layers.1.post_attn_norm.weight",
            "",
            0,
            np.float32("inf").tobytes(),
        ),
    ]
    return refused, loadable


class Fuzzer:
    """Random ABI calls on up to two live models, with every handle ever seen kept for reuse.

    baseRT_generate's token callback runs ops too: it stops the generation, calls the busy model (reset,
    generate, free, steps, sequences, prefix cache: each refused), or runs any other op, another model's
    generation (and its callback) included. Loads sometimes pick a bundle with NaN / Inf weights."""

    def __init__(
        self,
        lib: Library,
        raw: ctypes.CDLL,
        path: Path,
        rng: random.Random,
        nonfinite: tuple[list[Path], list[Path]] = ([], []),
    ) -> None:
        self.lib, self.raw, self.path, self.rng = lib, raw, path, rng
        self.refused_paths, self.nonfinite_paths = nonfinite
        self.busy: list[int] = []  # models whose generation is inside its callback, outermost first
        self.depth = 0  # ops nested in callbacks
        self.seen: dict[str, int] = dict.fromkeys(["callbacks", "refused", "nested", "nonfinite"], 0)
        self.models: list[int] = []  # live
        self.dead_models: list[int] = []
        self.seqs: dict[int, int] = {}  # live sequence -> model
        self.dead_seqs: list[int] = []
        self.matches: list[tuple[int, int, list[int]]] = []  # (model, handle, blocks), settled or not
        self.calls = 0

    def any_model(self) -> int:
        pool = self.models * 4 + self.dead_models + [0, 8, 0xDEAD0001]
        return self.rng.choice(pool) if pool else 0

    def any_seq(self) -> int:
        live = list(self.seqs)
        pool = live * 4 + self.dead_seqs[-20:] + self.models[:1] + [0, 16, 0xBAD0002]
        return self.rng.choice(pool)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 200) for _ in range(n)]

    def usable(self, m: int) -> bool:
        return m in self.models and m not in self.busy

    def generate(self) -> None:
        lib, r = self.lib, self.rng
        m = r.choice(self.models) if self.models and r.random() < 0.8 else self.any_model()
        prompt = r.choice(FUZZ_PROMPTS)[: r.choice([1, 5, 17, 40])]
        max_tokens = r.choice([0, 1, 3, 8, 100])
        usable = self.usable(m)
        emitted: list[int] = []
        failures: list[BaseException] = []

        def on_token(tok: int, text: bytes | None, _: Any) -> bool:
            try:  # ctypes would swallow an exception raised here: carried out instead
                emitted.append(tok)
                self.seen["callbacks"] += 1
                assert text is not None and 0 <= tok < 600
                roll = r.random()
                if roll < 0.15:
                    return False
                if roll < 0.6:
                    self.reenter(m)
                elif self.depth < 2:
                    self.seen["nested"] += 1
                    self.depth += 1
                    try:
                        self.op()
                    finally:
                        self.depth -= 1
                return True
            except BaseException as exc:
                failures.append(exc)
                return False

        toks, vals = (ctypes.c_int32 * 1)(EOS), (ctypes.c_float * 1)(r.choice([0.0, -1e9]))
        cfg = BaseRTSamplingConfig(
            temperature=r.choice([0.0, 0.7]),
            top_k=r.choice([0, 5]),
            top_p=1.0,
            repeat_penalty=r.choice([1.0, 1.3]),
            seed=r.randrange(100),
            n_logit_bias=1,
            logit_bias_tokens=toks,
            logit_bias_values=vals,
        )
        if usable:
            self.busy.append(m)
        try:
            stats = lib.baseRT_generate(m, u32(prompt), len(prompt), max_tokens, cfg, TOKEN_CALLBACK(on_token), None)
        finally:
            if usable:
                self.busy.pop()
        if failures:
            raise failures[0]
        code = int(lib.baseRT_get_error_code())
        if not usable:
            assert stats.generated_tokens == 0 and not emitted and code == INVALID_ARGUMENT, (code, error(lib))
        else:
            assert stats.generated_tokens == len(emitted) <= max_tokens and code in (OK, OUT_OF_MEMORY), error(lib)

    def reenter(self, m: int) -> None:
        """A call on the model whose callback is running: refused, nothing changes."""
        lib, r = self.lib, self.rng
        own = [s for s, owner in self.seqs.items() if owner == m]
        what = r.choice(
            [
                "reset",
                "generate",
                "free_model",
                "prefill",
                "create",
                "free_seq",
                "rollback",
                "step",
                "insert",
                "evict",
                "match",
                "check",
                "read_logits",
                "embed",
            ]
        )
        code = None
        if what == "reset":
            lib.baseRT_reset(m)
        elif what == "generate":
            lib.baseRT_generate(
                m, u32(PROMPT[:3]), 3, 4, BaseRTSamplingConfig(top_p=1.0), TOKEN_CALLBACK(lambda *_: True), None
            )
        elif what == "free_model":
            lib.baseRT_free_model(m)
        elif what == "prefill":
            lib.baseRT_prefill(m, u32(PROMPT[:3]), 3)
        elif what == "create":
            assert not lib.baseRT_sequence_create(m)
        elif what == "free_seq" and own:
            lib.baseRT_sequence_free(r.choice(own))
        elif what == "rollback" and own:
            code = lib.baseRT_sequence_rollback(r.choice(own), 0)
        elif what == "step":
            code = step(lib, m, own[:1], [[5]] if own else [])
        elif what == "insert" and own:
            code = lib.baseRT_prefix_insert(m, u32(PROMPT), len(PROMPT), own[0])
        elif what == "evict":
            assert lib.baseRT_prefix_evict(m, 1000) == 0
        elif what == "match":
            assert match(lib, m, PROMPT)[0] == 0
        elif what == "check":
            code = lib.baseRT_ref_check_kv(m)
        elif what == "read_logits":
            assert lib.baseRT_read_logits(m, (ctypes.c_float * 1024)(), 1024) == 0
        elif what == "embed":
            assert lib.baseRT_embed(m, u32(PROMPT[:3]), 3, (ctypes.c_float * 64)(), 64) == 0
        else:
            return  # a sequence call without a sequence of this model
        assert code in (None, INVALID_ARGUMENT), code
        self.seen["refused"] += 1
        assert lib.baseRT_get_error_code() == INVALID_ARGUMENT and "token callback" in error(lib), (what, error(lib))

    def op(self) -> None:
        lib, r = self.lib, self.rng
        kind = r.choice(
            [
                "load",
                "free_model",
                "create",
                "create",
                "free_seq",
                "rollback",
                "step",
                "step",
                "step",
                "match",
                "seed",
                "insert",
                "settle",
                "evict",
                "query",
                "tap_step",
                "tap_read",
                "generate",
                "generate",
            ]
        )
        self.calls += 1
        if kind == "load" and len(self.models) < 2:
            if self.refused_paths and r.random() < 0.2:  # NaN / Inf quantization parameters
                bad = r.choice(self.refused_paths)
                assert not lib.baseRT_load_model_ex(os.fsencode(bad), None, 64, None)
                assert lib.baseRT_get_error_code() == INVALID_FORMAT and "weight" in error(lib), error(lib)
            else:
                path = r.choice(self.nonfinite_paths) if self.nonfinite_paths and r.random() < 0.3 else self.path
                self.seen["nonfinite"] += path != self.path
                self.models.append(load(lib, path, max_context=r.choice([48, 128]), max_batch_size=r.choice([1, 4])))
        elif kind == "generate":
            self.generate()
        elif kind == "free_model":
            m = self.any_model()
            lib.baseRT_free_model(m)
            if m in self.busy:
                assert lib.baseRT_get_error_code() == INVALID_ARGUMENT and "token callback" in error(lib)
            elif m in self.models:
                self.models.remove(m)
                self.dead_models.append(m)
                for s in [s for s, owner in self.seqs.items() if owner == m]:
                    del self.seqs[s]
                    self.dead_seqs.append(s)
        elif kind == "create":
            m = self.any_model()
            s = lib.baseRT_sequence_create(m)
            assert bool(s) == self.usable(m), error(lib)
            if s:
                self.seqs[int(s)] = m
        elif kind == "free_seq":
            s = self.any_seq()
            lib.baseRT_sequence_free(s)
            if s in self.seqs and self.seqs[s] not in self.busy:
                del self.seqs[s]
                self.dead_seqs.append(s)
        elif kind == "rollback":
            rc = lib.baseRT_sequence_rollback(self.any_seq(), r.choice([-1, 0, 1, 15, 16, 17, 40, 1000]))
            assert rc in (OK, INVALID_ARGUMENT)
        elif kind == "step":
            m = self.any_model()
            n = r.choice([1, 1, 2, 3, 5])
            seqs = [self.any_seq() for _ in range(n)]
            feeds = [
                FUZZ_PROMPTS[r.randrange(len(FUZZ_PROMPTS))][: r.choice([1, 3, 16, 33])]
                if r.random() < 0.5
                else self.tokens(r.choice([1, 2, 17]))
                for _ in seqs
            ]
            rc = step(lib, m, seqs, feeds)
            assert rc in (OK, INVALID_ARGUMENT, OUT_OF_MEMORY), error(lib)
            if rc == OK and r.random() < 0.5:
                rows(lib, m, len(seqs))
        elif kind == "tap_step":  # multi-row / tapped steps with valid and invalid rows, layers and handles
            valid = r.random() < 0.6 and bool(self.models)
            m = r.choice(self.models) if valid else self.any_model()
            n = r.choice([1, 1, 2, 3])
            own = [s for s, owner in self.seqs.items() if owner == m]
            if valid and own:  # a well-formed call: distinct live lanes, rows in bounds
                seqs = r.sample(own, min(n, len(own)))
                feeds = [self.tokens(r.choice([1, 2, 5, 7])) for _ in seqs]
                out_rows = [r.randint(1, len(f)) for f in feeds]
                layers = [r.choice([0, 1, 2]) for _ in range(r.choice([0, 1, 2, 8]))]
                tap_rows = [r.randint(0, len(f)) for f in feeds]
            else:
                seqs = [self.any_seq() for _ in range(n)]
                feeds = [self.tokens(r.choice([1, 2, 5, 17, 33])) for _ in seqs]
                out_rows = [r.choice([0, 1, 1, len(f), len(f) + 1]) for f in feeds]
                layers = [r.choice([-1, 0, 1, 2, 2, 3]) for _ in range(r.choice([0, 1, 2, 9]))]
                tap_rows = [r.choice([-1, 0, 1, len(f), len(f) + 1]) for f in feeds]
            flat = [t for f in feeds for t in f]
            rc = lib.baseRT_batch_step_fused_logits_rows_taps(
                m,
                (c_void_p * len(seqs))(*seqs),
                len(seqs),
                u32(flat),
                ints([len(f) for f in feeds]),
                ints(out_rows),
                ints(layers) if r.random() < 0.95 else None,
                len(layers),
                ints(tap_rows) if r.random() < 0.95 else None,
            )
            assert rc in (OK, INVALID_ARGUMENT, OUT_OF_MEMORY), error(lib)
            if rc == OK:
                rows(lib, m, sum(out_rows))
        elif kind == "tap_read":
            buf = np.empty((40, 64), dtype=np.float16)
            rc = lib.baseRT_read_tap_rows(
                self.any_model(),
                r.choice([-1, 0, 1, 8]),
                r.choice([-1, 0, 1, 17, 40]),
                buf.ctypes.data_as(c_void_p) if r.random() < 0.9 else None,
            )
            assert rc in (64, -INVALID_ARGUMENT), error(lib)
        elif kind == "match":
            m = self.any_model()
            handle, blocks = match(lib, m, r.choice(FUZZ_PROMPTS))
            if handle:
                self.matches.append((m, handle, blocks))
        elif kind == "seed":
            s = self.any_seq()
            if self.matches and r.random() < 0.8:
                _, _, blocks = r.choice(self.matches)
                blocks = blocks[: r.randint(1, len(blocks))]
            else:
                blocks = [r.randrange(-2, 40) for _ in range(r.randint(0, 3))]
            assert seed(lib, s, blocks) in (OK, INVALID_ARGUMENT, 5)
        elif kind == "insert":
            p = r.choice(FUZZ_PROMPTS)
            assert lib.baseRT_prefix_insert(self.any_model(), u32(p), len(p), self.any_seq()) in (OK, INVALID_ARGUMENT)
        elif kind == "settle":
            if self.matches and r.random() < 0.8:
                m, handle, _ = r.choice(self.matches)
                if r.random() < 0.2:
                    m = self.any_model()
            else:
                m, handle = self.any_model(), r.randrange(0, 50)
            settle = r.choice([lib.baseRT_prefix_unlock, lib.baseRT_prefix_release, self.raw.baseRT_prefix_discard])
            settle(m, handle)
        elif kind == "evict":
            lib.baseRT_prefix_evict(self.any_model(), r.choice([0, 1, 3, 1000]))
        else:
            m = self.any_model()
            self.raw.baseRT_get_position(m)
            st = BaseRTMemoryStats()
            lib.baseRT_model_memory_stats(m, byref(st))
            lib.baseRT_read_batch_logits(m, r.choice([0, 1, 9]), None)
        for m in self.models:
            if m not in self.busy:
                check_pool(lib, m)

    def drain(self) -> None:
        """Settle everything and free every sequence: each live model's pool must then be empty."""
        lib = self.lib
        for m, handle, _ in self.matches:
            lib.baseRT_prefix_release(m, handle)
        for s in list(self.seqs):
            lib.baseRT_sequence_free(s)
        self.seqs.clear()
        for m in self.models:
            check_pool(lib, m)
            lib.baseRT_reset(m)  # the default sequence's KV (generate)
            lib.baseRT_prefix_evict(m, 10**6)
            assert blocks_used(lib, m) == 0
            lib.baseRT_free_model(m)
        self.models.clear()


@pytest.fixture(scope="module")
def q4_model_path(model_path: Path) -> Path:
    """The same model with q4 matrices (the integer kernels, 16-row panels: k/v here fill two)."""
    return quantize_bundle(model_path, model_path.with_name("tiny.q4.base"), "base_q4")


@pytest.mark.parametrize("seed_value", range(6))
def test_fuzz_random_abi_call_sequences(
    lib: Library, raw: ctypes.CDLL, model_path: Path, seed_value: int, nonfinite_paths: tuple[list[Path], list[Path]]
) -> None:
    fuzz(lib, raw, model_path, seed_value, nonfinite_paths)


@pytest.mark.parametrize("seed_value", range(3))
def test_fuzz_random_abi_call_sequences_on_a_q4_model(
    lib: Library, raw: ctypes.CDLL, q4_model_path: Path, seed_value: int, nonfinite_paths: tuple[list[Path], list[Path]]
) -> None:
    fuzz(lib, raw, q4_model_path, 2000 + seed_value, nonfinite_paths)


def fuzz(
    lib: Library,
    raw: ctypes.CDLL,
    model_path: Path,
    seed_value: int,
    nonfinite: tuple[list[Path], list[Path]] = ([], []),
) -> None:
    live_before = lib.baseRT_ref_counter(b"sequences"), lib.baseRT_ref_counter(b"models")
    f = Fuzzer(lib, raw, model_path, random.Random(1000 + seed_value), nonfinite)
    f.models.append(load(lib, model_path))
    for _ in range(500):
        f.op()
    f.drain()
    # The generate callback's paths and the non-finite bundles were exercised (structural, not by luck).
    assert all(f.seen[k] > 0 for k in ("callbacks", "refused", "nested")), f.seen
    assert f.seen["nonfinite"] > 0 or not nonfinite[1], f.seen
    assert (lib.baseRT_ref_counter(b"sequences"), lib.baseRT_ref_counter(b"models")) == live_before


def test_stale_stream_and_grammar_handles_are_refused(lib: Library, model: int) -> None:
    """Decode streams and grammars are table handles too: a freed one stays refused after its slot or
    address could have been reused, and one whose model was freed reports that model as freed."""
    old_stream = lib.baseRT_decode_stream_create(model)
    old_grammar = lib.baseRT_grammar_create_json(model)
    assert old_stream and old_grammar, error(lib)
    lib.baseRT_decode_stream_free(old_stream)
    lib.baseRT_grammar_free(old_grammar)
    streams = [lib.baseRT_decode_stream_create(model) for _ in range(300)]
    grammars = [lib.baseRT_grammar_create_json(model) for _ in range(20)]
    assert old_stream not in streams and old_grammar not in grammars
    assert lib.baseRT_decode_stream_token(old_stream, 5) is None and "freed" in error(lib)
    assert lib.baseRT_grammar_bitmask_size(old_grammar) <= 0 and "freed" in error(lib)
    lib.baseRT_decode_stream_free(old_stream)  # double free: refused, the live streams are untouched
    lib.baseRT_grammar_free(old_grammar)
    assert lib.baseRT_decode_stream_token(streams[-1], 5) is not None, error(lib)
    assert lib.baseRT_grammar_bitmask_size(grammars[-1]) > 0, error(lib)
    for s in streams:
        lib.baseRT_decode_stream_free(s)
    for g in grammars:
        lib.baseRT_grammar_free(g)


def test_stream_outliving_its_model(lib: Library, model_path: Path) -> None:
    m = load(lib, model_path)
    stream = lib.baseRT_decode_stream_create(m)
    lib.baseRT_free_model(m)
    assert lib.baseRT_decode_stream_token(stream, 5) is None
    assert "freed" in error(lib)
    lib.baseRT_decode_stream_free(stream)
    assert lib.baseRT_get_error_code() == OK
