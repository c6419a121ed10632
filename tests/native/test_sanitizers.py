"""The native tests again, against an ASan + UBSan build of the reference engine.

The library is compiled here from native/src with -fsanitize=address,undefined
and the ctypes-level suites run in a subprocess that preloads the sanitizer
runtimes (Python itself is not instrumented, so leak detection stays off:
CPython's own allocations would drown it). Any sanitizer report aborts the
subprocess and fails this test with the report.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITES = [
    "tests/native/test_native_load_tokenize_sample.py",
    "tests/native/test_native_batch_steps.py",
    "tests/native/test_native_grammar.py",
    "tests/native/test_native_structural_tag.py",
    "tests/native/test_native_safety.py",
    "tests/native/test_native_weights.py",
    "tests/native/test_native_kv.py",
    "tests/native/test_native_quant.py",
    "tests/native/test_native_quant_symmetric.py",
    "tests/native/test_native_taps.py",
    "tests/native/test_native_speculation.py",
    "tests/native/test_native_threads.py",
    "tests/sdk/test_embed_scheduling.py",
    "tests/sdk/test_engine.py",
    "tests/sdk/test_reliability.py",
    "tests/native/test_native_archs.py",
]


def _runtime(cc: str, name: str) -> str:
    out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isabs(out), f"{cc} has no {name}: install the compiler's sanitizer runtime (libasan, libubsan)"
    return out


def _compiler() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to build the sanitizer library"
    return cc


def sanitized_library(request: pytest.FixtureRequest, kind: str, flags: list[str]) -> Path:
    """native/src built with `flags` (plus -shared -fPIC), each source compiled in its own process (every core
    works) and linked as one library. It is kept in pytest's cache under a key of the compiler, the flags and
    every source and header byte, so a rerun over unchanged sources loads the library an identical build made
    instead of compiling again (an edit to native/ is a new key, and the stale build is removed)."""
    cc = _compiler()
    sources = sorted((ROOT / "native" / "src").glob("*.c"))
    inputs = sorted([*sources, *(ROOT / "native").rglob("*.h")])
    key = hashlib.sha256(subprocess.run([cc, "--version"], capture_output=True, check=True).stdout)
    key.update(repr(flags).encode())
    for path in inputs:
        key.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    name = f"{kind}-{key.hexdigest()[:16]}"
    cache = request.config.cache
    if cache is not None:
        home = cache.mkdir("sanitizer-libs")
    else:  # -p no:cacheprovider: built for this session alone
        home = request.getfixturevalue("tmp_path_factory").mktemp(kind)
    lib = home / name / "libbaseRT.so"
    if lib.is_file():
        return lib
    for stale in home.glob(f"{kind}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    work = home / f"{name}.{os.getpid()}"
    work.mkdir()
    includes = [f"-I{ROOT / 'native' / 'include'}", f"-I{ROOT / 'native' / 'src'}"]

    def compile_one(source: Path) -> Path:
        obj = work / f"{source.stem}.o"
        subprocess.run([cc, *flags, "-fPIC", *includes, "-c", str(source), "-o", str(obj)], check=True)
        return obj

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        objects = list(pool.map(compile_one, sources))
    subprocess.run(
        [cc, *flags, "-shared", *map(str, objects), "-o", str(work / "libbaseRT.so"), "-lm", "-lpthread"], check=True
    )
    for obj in objects:
        obj.unlink()
    work.rename(home / name)  # whole or not at all: a run stopped mid-build leaves no library under the key
    return lib


@pytest.fixture(scope="module")
def sanitized_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment that runs a suite against the ASan + UBSan build of native/src."""
    cc = _compiler()
    lib = sanitized_library(
        request,
        "asan",
        [
            "-std=c11",
            "-O1",
            "-g",
            "-D_GNU_SOURCE",
            "-fno-omit-frame-pointer",
            # float-cast-overflow is outside "undefined": a NaN or Inf reaching (int) is UB all the same
            "-fsanitize=address,undefined,float-cast-overflow",
            "-fno-sanitize-recover=undefined,float-cast-overflow",
        ],
    )
    env = dict(os.environ)
    env.update(
        BASERT_LIB_PATH=str(lib),
        LD_PRELOAD=" ".join([_runtime(cc, "libasan.so"), _runtime(cc, "libubsan.so")]),
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        BASERT_REF_THREADS="2",
    )
    return env


def _kernels(env: dict[str, str]) -> str:
    """The kernel sets the engine chooses in a process with `env` ("float=avx2-fma quant=avx2", ...)."""
    code = "from aiobasert._ffi import load_library; print(load_library().baseRT_ref_kernels().decode())"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True
    ).stdout.strip()


# Left out of the sanitized runs: the trio twin of every SDK test (the event loop does not change one C call:
# each runs here under asyncio, and under trio in the plain suite), and the SDK's open-order RSS test (its
# big-vocabulary loads run here in test_a_load_frees_the_header_before_the_weights).
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
SANITIZED_SELECTION = "not trio and not test_tokenizer_handles_load_before_the_weights"


def _run_sanitized(env: dict[str, str], suites: list[str], selection: str = SANITIZED_SELECTION) -> None:
    proc = subprocess.run(
        [*PYTEST, "-m", "not slow", "-k", selection, *suites],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    report = (proc.stdout[-4000:] + "\n" + proc.stderr[-6000:]).strip()
    assert proc.returncode == 0, f"sanitized run failed:\n{report}"
    assert "passed" in proc.stdout and "ERROR: AddressSanitizer" not in proc.stderr


@pytest.mark.slow
def test_native_suites_pass_under_asan_and_ubsan(sanitized_env: dict[str, str]) -> None:
    _run_sanitized(sanitized_env, SUITES)


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["avx2", "generic"])
def test_kernel_suites_pass_under_asan_with_each_kernel_set(sanitized_env: dict[str, str], cap: str) -> None:
    """The lower kernel sets (the main run above uses the CPU's best) read their own tails and layouts; the
    safety file's NaN / Inf weights reach the scalar activation quantizer here."""
    env = dict(sanitized_env, BASERT_REF_SIMD=cap)
    chosen, default = _kernels(env), _kernels(sanitized_env)
    if chosen == default:  # an AVX2 machine under the avx2 cap: the main run above ran these very files on them
        pytest.skip(f"BASERT_REF_SIMD={cap} chooses the main sanitized run's kernels ({chosen}): that run covered them")
    _run_sanitized(
        env,
        [
            "tests/native/test_native_quant.py",
            "tests/native/test_native_quant_symmetric.py",
            "tests/native/test_native_weights.py",
            "tests/native/test_native_batch_steps.py",
            "tests/native/test_native_safety.py",
        ],
        # not the load-footprint tests: a load repacks into the same panels for every kernel set (quant.c),
        # and their loads ran in the main sanitized run
        selection=f"{SANITIZED_SELECTION} and not test_a_load_",
    )


@pytest.mark.slow
def test_hostile_sdk_traffic_under_asan_and_ubsan(sanitized_env: dict[str, str]) -> None:
    """The SDK's hostile-traffic model test (never-read streams, cancels from other tasks, chained
    `$ref`s, huge and wrong-typed inputs) against the sanitized engine: the C side of issue 18."""
    _run_sanitized(sanitized_env, ["tests/sdk/test_group_hostile.py"])


@pytest.fixture(scope="module")
def tsan_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment that runs a suite against a ThreadSanitizer build of native/src."""
    cc = _compiler()
    lib = sanitized_library(request, "tsan", ["-std=c11", "-O1", "-g", "-D_GNU_SOURCE", "-fsanitize=thread"])
    return dict(
        os.environ,
        BASERT_LIB_PATH=str(lib),
        LD_PRELOAD=_runtime(cc, "libtsan.so"),
        BASERT_REF_THREADS="2",
        TSAN_OPTIONS="halt_on_error=1:exitcode=66:report_signal_unsafe=0",
    )


def _run_tsan(env: dict[str, str], args: list[str]) -> None:
    proc = subprocess.run(
        [*PYTEST, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = (proc.stdout[-4000:] + "\n" + proc.stderr[-6000:]).strip()
    assert proc.returncode == 0 and "passed" in proc.stdout, f"TSan run failed:\n{report}"
    assert "WARNING: ThreadSanitizer" not in proc.stderr, report


@pytest.mark.slow
def test_shared_tokenizers_under_tsan(tsan_env: dict[str, str]) -> None:
    """Tokenizer sharing (bpe_shared_get / _put, refcounted under one mutex) against a ThreadSanitizer build:
    the model test's threads load, encode with and free sibling handles of one file concurrently, and a
    reported data race fails the run."""
    _run_tsan(tsan_env, ["tests/native/test_native_load_tokenize_sample.py", "-k", "share or concurrent_random"])


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_thread_pool_under_tsan(tsan_env: dict[str, str]) -> None:
    """The pool's posts, joins, finishes, sleeps and wake-ups (threads.c) with 1..16 threads splitting every
    op of a model, oversubscribed: a data race between the caller and a worker fails the run."""
    _run_tsan(tsan_env, ["tests/native/test_native_threads.py", "-k", "bit_identical and f32"])
