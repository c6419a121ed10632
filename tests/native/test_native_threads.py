"""The thread pool: results are bit-identical for every thread count, however many cores there are.

The shared pool is sized when the first model of the process loads ($BASERT_REF_THREADS, read then), so
each thread count gets its own load. A run takes no more threads than the process has CPUs unless
$BASERT_REF_POOL_OVERSUBSCRIBE lifts that cap, which the sweep does: the models are wide enough (256 / 512
wide, a few hundred vocabulary rows) that their prefill matmuls, attention and activation passes are split
over all of a pool's threads, and with 16 threads on a 2-core machine most workers are descheduled at any
moment, so the split a run ends up with differs from run to run -- which is the point: no value may depend
on it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from ctypes import c_float
from pathlib import Path

import numpy as np
import pytest
from oracle import prompt
from quantized import quantize_bundle
from raw_abi import error, load, step_logits, u32

from aiobasert._ffi import Library
from aiobasert.models.tiny import build_tiny_model

THREAD_COUNTS = range(1, 17)
DIM = 256
LANES = 4


@pytest.fixture(scope="module")
def wide_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama wide enough for every op to be split: f32, untied (a 256-wide head)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("wide") / "wide.base",
        dim=DIM,
        n_heads=8,
        n_kv_heads=2,
        ffn_dim=512,
        tied=False,
        seed=11,
    )


@pytest.fixture(scope="module", params=["f32", "base_q4", "base_q8"])
def threaded_model_path(
    request: pytest.FixtureRequest, wide_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The wide model as stored, and quantized (the integer kernels' panels of 16 rows)."""
    if request.param == "f32":
        return wide_model_path
    return quantize_bundle(wide_model_path, tmp_path_factory.mktemp("wideq") / f"{request.param}.base", request.param)


@pytest.fixture
def no_pool(lib: Library) -> Iterator[None]:
    """No model is alive: the next load creates the shared pool afresh, at the size the environment says."""
    assert lib.baseRT_ref_counter(b"thread_pools") == 0
    yield
    assert lib.baseRT_ref_counter(b"thread_pools") == 0


def run_digest(lib: Library, path: Path, threads: int) -> tuple[str, list[list[int]]]:
    """A digest of every value a load computes: f32 pooled embeddings of a long prompt, the f16 logit rows
    of a fused prefill of four lanes of different lengths and of six greedy decode steps after it; and
    the greedy ids themselves (to print when the digests differ)."""
    m = load(lib, path, 256, max_batch_size=LANES, prefix_cache=0)
    digest = hashlib.sha256()
    ids: list[list[int]] = []
    seqs: list[int] = []
    try:
        assert lib.baseRT_ref_counter(b"pool_threads") == threads  # the environment sized this load's pool
        assert lib.baseRT_ref_counter(b"pool_run_threads") == threads  # and every thread may take part
        vocab = int(lib.baseRT_batch_logits_stride(m)) // 2
        dim = DIM
        long_prompt = prompt(150, 1, vocab)
        emb = (c_float * dim)()
        assert lib.baseRT_embed(m, u32(long_prompt), len(long_prompt), emb, dim) == dim, error(lib)
        digest.update(bytes(emb))
        seqs = [int(lib.baseRT_sequence_create(m) or 0) for _ in range(LANES)]
        assert all(seqs), error(lib)
        rows = step_logits(lib, m, seqs, [prompt(17 + 29 * i, 2 + i, vocab) for i in range(LANES)])
        for _ in range(6):
            digest.update(rows.tobytes())
            nxt = [int(np.argmax(r)) for r in rows]
            ids.append(nxt)
            rows = step_logits(lib, m, seqs, [[t] for t in nxt])
        digest.update(rows.tobytes())
    finally:
        for s in seqs:
            lib.baseRT_sequence_free(s)
        lib.baseRT_free_model(m)
    return digest.hexdigest(), ids


@pytest.mark.usefixtures("no_pool")
def test_results_bit_identical_for_every_thread_count(
    lib: Library, threaded_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each output element is computed by exactly one thread in a fixed order, so 1..16 threads (most of
    them oversubscribed here) give the same bits: embeddings, logits of prefill and decode, greedy ids."""
    results: dict[int, tuple[str, list[list[int]]]] = {}
    monkeypatch.setenv("BASERT_REF_POOL_OVERSUBSCRIBE", "1")
    for n in THREAD_COUNTS:
        monkeypatch.setenv("BASERT_REF_THREADS", str(n))
        results[n] = run_digest(lib, threaded_model_path, n)
    differing = {n: ids for n, (d, ids) in results.items() if d != results[1][0]}
    assert not differing, f"1 thread: {results[1][1]}; differing counts: {differing}"


@pytest.mark.usefixtures("no_pool")
def test_runs_take_no_more_threads_than_cpus(
    lib: Library, wide_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool has the threads asked for, but a run takes at most the usable CPUs (a preempted worker
    would hold its item for a time slice), unless BASERT_REF_POOL_OVERSUBSCRIBE lifts the cap."""
    for over in ("", "0", "1"):
        monkeypatch.setenv("BASERT_REF_POOL_OVERSUBSCRIBE", over)
        for n in (1, 3, 16):
            monkeypatch.setenv("BASERT_REF_THREADS", str(n))
            m = load(lib, wide_model_path, 64)
            try:
                cpus = lib.baseRT_ref_counter(b"usable_cpus")
                assert lib.baseRT_ref_counter(b"pool_threads") == n
                assert lib.baseRT_ref_counter(b"thread_pools") == 1
                assert lib.baseRT_ref_counter(b"pool_run_threads") == (n if over == "1" else min(n, cpus))
            finally:
                lib.baseRT_free_model(m)


# ---- threads=auto: physical cores of the affinity mask, capped by the cgroup quota ----------------------

# name: ((package, core) of the mask's first and second CPU, or None for no topology files; CPUs of the
# mask (0: the first, 1: the second); the cgroup quota in CPUs or None; the threads auto gives)
AUTO_CASES: dict[str, tuple[tuple[tuple[int, int], tuple[int, int]] | None, tuple[int, ...], int | None, int]] = {
    "SMT siblings": (((0, 0), (0, 0)), (0, 1), None, 1),
    "two cores": (((0, 0), (0, 1)), (0, 1), None, 2),
    "same core id, two packages": (((0, 3), (1, 3)), (0, 1), None, 2),
    "one sibling in the mask": (((0, 0), (0, 0)), (0,), None, 1),
    "no topology: each CPU a core": (None, (0, 1), None, 2),
    "quota below the cores": (((0, 0), (0, 1)), (0, 1), 1, 1),
    "quota above the cores": (((0, 0), (0, 0)), (0, 1), 2, 1),
}


@pytest.mark.usefixtures("no_pool")
@pytest.mark.parametrize("case", sorted(AUTO_CASES))
def test_auto_threads_count_physical_cores_within_quota(
    lib: Library, wide_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """threads=auto is one thread per physical core of the affinity mask (SMT siblings share one core's load
    ports: a memory-bound decode gains nothing from the second), capped by the cgroup CPU quota; the pool
    made with BASERT_REF_THREADS=auto (or unset) has that size. Fake sysfs / cgroup trees, a real mask."""
    topology, in_mask, quota, expected = AUTO_CASES[case]
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs in the affinity mask")
    cpus = allowed[:2]
    if topology:
        for cpu, (package, core) in zip(cpus, topology, strict=True):
            d = tmp_path / "sys" / "sys/devices/system/cpu" / f"cpu{cpu}" / "topology"
            d.mkdir(parents=True)
            (d / "physical_package_id").write_text(f"{package}\n")
            (d / "core_id").write_text(f"{core}\n")
    cg = tmp_path / "cg"
    (cg / "proc" / "self").mkdir(parents=True)
    (cg / "proc" / "self" / "cgroup").write_text("0::/job\n")
    (cg / "proc" / "self" / "mountinfo").write_text("29 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    if quota:
        (cg / "sys/fs/cgroup/job").mkdir(parents=True)
        (cg / "sys/fs/cgroup/job/cpu.max").write_text(f"{quota * 100000} 100000\n")
    monkeypatch.setenv("BASERT_REF_SYSFS_ROOT", str(tmp_path / "sys"))
    monkeypatch.setenv("BASERT_REF_CGROUP_ROOT", str(cg))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[i] for i in in_mask})  # this thread's mask: the one the C call reads
    try:
        assert lib.baseRT_ref_counter(b"auto_threads") == expected
        for setting in ("auto", None):
            if setting:
                monkeypatch.setenv("BASERT_REF_THREADS", setting)
            else:
                monkeypatch.delenv("BASERT_REF_THREADS", raising=False)
            m = load(lib, wide_model_path, 64)
            try:
                assert lib.baseRT_ref_counter(b"pool_threads") == expected
            finally:
                lib.baseRT_free_model(m)
    finally:
        os.sched_setaffinity(0, before)
