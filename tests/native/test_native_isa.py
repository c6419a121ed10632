"""Every kernel set of the reference engine, not only the one this CPU picks.

The engine chooses its float and integer kernels once per process from the CPU
(AVX-512 / AVX-512 VNNI, AVX2 + FMA, portable C); $BASERT_REF_SIMD caps the
choice. The default set runs in the main suite; here the kernel suites (their
tiny-model tests: the SmolLM2 ones run on the default set) run again in a
subprocess under each lower cap, after checking that the process
really chose the set the cap and the CPU call for (a cap the CPU cannot honour
falls back, which this test states instead of skipping). The integer kernels of
every set compute the same values by construction (quant.h): their logits are
compared bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from quantized import asymmetric_twin, quantize_bundle
from tiny_gguf import write_gguf

from aiobasert.models.convert import convert_gguf
from aiobasert.models.tiny import build_tiny_model
from tests.cpu_features import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SUITES = [
    "tests/native/test_native_dot.py",
    "tests/native/test_native_quant.py",
    "tests/native/test_native_quant_symmetric.py",
    "tests/native/test_native_weights.py",
    "tests/native/test_native_batch_steps.py",
    "tests/native/test_native_kv.py",
    "tests/native/test_native_archs.py",
]


def expected_kernels(cap: str | None, flags: set[str]) -> str:
    """What the engine must report under `cap` on a CPU with `flags` (x86-64 Linux; others run generic)."""
    if cap == "generic" or not {"avx2", "fma", "f16c"} <= flags:
        return "float=generic quant=generic"
    if cap == "avx2" or "avx512f" not in flags:
        return "float=avx2-fma quant=avx2"
    vnni = {"avx512bw", "avx512vl", "avx512_vnni"} <= flags
    return f"float=avx512 quant={'avx512-vnni' if vnni else 'avx2'}"


def chosen_kernels(env: dict[str, str]) -> str:
    code = "from aiobasert._ffi import load_library; print(load_library().baseRT_ref_kernels().decode())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip()


# The kernel sets the process chose (its first line), then for each bundle named, the logits of a prefill
# (9 rows) and two decode steps of 3 lanes, as a digest (a line each): one process per kernel cap.
LOGITS_DIGEST = """
import hashlib, sys
from pathlib import Path
sys.path.insert(0, "tests")
from raw_abi import load, step_logits
from aiobasert._ffi import load_library
lib = load_library()
print(lib.baseRT_ref_kernels().decode())
for path in sys.argv[1:]:
    m = load(lib, Path(path), 64, max_batch_size=4, prefill_chunk=64)
    seqs = [int(lib.baseRT_sequence_create(m)) for _ in range(3)]
    h = hashlib.sha256()
    rows = step_logits(lib, m, seqs, [[5, 9, 17, 33, 65, 129, 7, 11, 13], [21, 22], [40]])
    h.update(rows.tobytes())
    for _ in range(2):
        rows = step_logits(lib, m, seqs, [[int(r.argmax())] for r in rows])
        h.update(rows.tobytes())
    print(h.hexdigest())
"""


def kernels_and_digests(env: dict[str, str], *bundles: Path) -> tuple[str, list[str]]:
    """LOGITS_DIGEST in a process with `env`: the quant kernel set it chose, and each bundle's digest."""
    out = subprocess.run(
        [sys.executable, "-c", LOGITS_DIGEST, *map(str, bundles)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    kernels, *digests = out.stdout.splitlines()
    return kernels.split("quant=")[1], digests


@pytest.mark.parametrize(
    ("dtype", "symmetric"),
    [
        ("base_q4", False),
        ("base_q8", False),
        ("base_q8", True),
        ("Q4_K", False),
        ("Q5_K", False),
        ("Q5_0", False),
        ("Q6_K", False),
        ("Q4_K+", False),
        ("Q5_K+", False),
        ("Q6_K+", False),
    ],
    ids=[
        "q4",
        "q8",
        "q8sym",
        "gguf-q4k",
        "gguf-q5k",
        "gguf-q5_0",
        "gguf-q6k",
        "gguf-q4k-wide",
        "gguf-q5k-wide",
        "gguf-q6k-wide",
    ],
)
def test_kernel_sets_compute_bit_identical_quantized_logits(tmp_path: Path, dtype: str, symmetric: bool) -> None:
    """`+`: K-quant rows of 2 and 3 super-blocks (an odd count, past what one 512-bit pass covers), beside
    1 and 2; the vocabulary's 585 rows end in a partial panel either way."""
    if dtype.startswith("base_"):
        f32 = build_tiny_model(tmp_path / "f32.base", dim=96, n_heads=3, n_kv_heads=1, ffn_dim=160, seed=7)
        q = quantize_bundle(f32, tmp_path / "q.base", dtype, symmetric=symmetric)
    else:  # GGUF blocks carried (convert --dtype auto): K-quants in their K panels, 5-bit ones as base_q5
        wide = dtype.endswith("+")
        dtype = dtype.rstrip("+")
        dims = ({"dim": 512, "ffn": 768} if wide else {"dim": 256, "ffn": 512}) if dtype.endswith("_K") else {}
        src = write_gguf(tmp_path / "k.gguf", matrices=gguf.GGMLQuantizationType[dtype], **dims)
        q = convert_gguf(src, tmp_path / "q.base", dtype="auto", progress=False)
    digests = {}
    for cap in ("generic", "avx2", ""):  # the float kernels (attention) stay the CPU's best
        env = {k: v for k, v in os.environ.items() if k != "BASERT_REF_SIMD"} | {"BASERT_REF_QUANT_SIMD": cap}
        kernels, (digest,) = kernels_and_digests(env, q)
        digests[kernels] = digest
    assert len(set(digests.values())) == 1, digests


def test_default_kernels_are_the_best_this_cpu_has() -> None:
    env = {k: v for k, v in os.environ.items() if k != "BASERT_REF_SIMD"}
    assert chosen_kernels(env) == expected_kernels(None, cpu_flags())


# Tests of the loader's memory (a load's peak RSS, the header freed before the repack): the loader packs
# weights the same way under every kernel set and these compute nothing, so the main suite's run is theirs.
LOADER_ONLY = [
    "tests/native/test_native_quant.py::test_a_load_frees_the_header_before_the_weights",
    "tests/native/test_native_quant.py::test_a_load_peaks_near_its_steady_state",
]


@pytest.mark.slow  # a nested run of six kernel suites (-m "not slow" there, so it never nests again)
@pytest.mark.parametrize("cap", ["avx2", "generic"])
def test_kernel_suites_pass_under_each_cap(cap: str) -> None:
    env = dict(os.environ, BASERT_REF_SIMD=cap)
    chosen = chosen_kernels(env)
    assert chosen == expected_kernels(cap, cpu_flags())
    default = chosen_kernels({k: v for k, v in os.environ.items() if k != "BASERT_REF_SIMD"})
    if chosen == default:  # an AVX2 machine under the avx2 cap: the main suite ran these very kernels
        pytest.skip(f"BASERT_REF_SIMD={cap} chooses this CPU's default kernels ({chosen}): the main suite ran them")
    deselect = [arg for test in LOADER_ONLY for arg in ("--deselect", test)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", *deselect, *KERNEL_SUITES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"kernel suites under BASERT_REF_SIMD={cap}:\n{report}"
    assert " passed" in proc.stdout


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0"])
def test_kernel_sets_compute_symmetric_q4_q5_as_their_asymmetric_twin(tmp_path: Path, qtype: str) -> None:
    """GGML Q4_0 / Q5_0 carried as symmetric base_q4 / base_q5 (panels without the per-block m, which the
    kernels form as d * -8 / -16) give, under every kernel set, the logits of the same bundle with the
    implied biases stored (the asymmetric panels and kernels)."""
    src = write_gguf(tmp_path / "s.gguf", matrices=gguf.GGMLQuantizationType[qtype])
    sym = convert_gguf(src, tmp_path / "sym.base", dtype="auto", progress=False)
    asym = asymmetric_twin(sym, tmp_path / "asym.base")
    digests = {}
    for cap in ("generic", "avx2", ""):
        env = {k: v for k, v in os.environ.items() if k != "BASERT_REF_SIMD"} | {"BASERT_REF_QUANT_SIMD": cap}
        kernels, (sym_digest, asym_digest) = kernels_and_digests(env, sym, asym)
        digests |= {f"{kernels}/sym": sym_digest, f"{kernels}/asym": asym_digest}
    assert len(set(digests.values())) == 1, digests
