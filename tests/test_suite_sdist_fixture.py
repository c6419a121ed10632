"""tests/llama_cpp_files.py's llama-cpp-python sdist fetch (llama.cpp's vocab and template files): the sdist file
alone, read off pip's index page and checked against its sha256, nothing built; a fetch that fails, is
damaged or is too slow SKIPS the tests that need it, with the reason, instead of erroring. Offline: a
local PEP 503 index (file:// URLs, as pip takes them) stands in for PyPI."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import llama_cpp_files
import pytest

VERSION = llama_cpp_files.LLAMA_CPP_PYTHON_VERSION
ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp"


def _sdist(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _index(tmp_path: Path, sdist: bytes, *, sha256: str | None = None) -> str:
    """A one-project simple index holding `sdist`; its URL."""
    project = tmp_path / "simple" / "llama-cpp-python"
    project.mkdir(parents=True)
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / name).write_bytes(sdist)
    digest = sha256 or hashlib.sha256(sdist).hexdigest()
    (project / "index.html").write_text(f'<html><body><a href="../../files/{name}#sha256={digest}">{name}</a>'
                                        "</body></html>")  # fmt: skip
    return (tmp_path / "simple").as_uri()


@pytest.fixture()
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache, and no index but the ones a test sets."""
    monkeypatch.setenv("AIOBASERT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", (tmp_path / "no-such-index").as_uri())
    return tmp_path / "cache"


GOOD = {
    f"{ROOT}/models/ggml-vocab-llama-spm.gguf.out": b"1 2 3\n",
    f"{ROOT}/models/ggml-vocab-llama-spm.gguf": b"GGUF",
    f"{ROOT}/models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja": b"{{ messages }}",
    f"{ROOT}/src/llama.cpp": b"int main(void) { return 0; }",
}


def test_fetches_the_sdist_file_and_keeps_only_the_test_files(tmp_path: Path, isolated: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("PIP_INDEX_URL", _index(tmp_path, _sdist(GOOD)))
    vocab = llama_cpp_files.from_llama_cpp_sdist("vocab")
    assert sorted(p.name for p in vocab.iterdir()) == ["ggml-vocab-llama-spm.gguf", "ggml-vocab-llama-spm.gguf.out"]
    templates = llama_cpp_files.from_llama_cpp_sdist("templates")
    assert (templates / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_bytes() == b"{{ messages }}"
    assert not list(isolated.glob("*.tar.gz")) and not list(isolated.glob("tmp*"))


@pytest.mark.parametrize("case", ["no-index", "not-listed", "damaged", "too-slow"])
def test_a_fetch_that_cannot_finish_skips_with_the_reason(tmp_path: Path, isolated: Path, case: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    if case == "no-index":
        url = (tmp_path / "nowhere").as_uri()
        reason = "nowhere/llama-cpp-python/"
    elif case == "not-listed":
        url = _index(tmp_path, _sdist(GOOD))
        (tmp_path / "simple" / "llama-cpp-python" / "index.html").write_text("<html></html>")
        reason = f"no llama-cpp-python-{VERSION}.tar.gz / llama_cpp_python-{VERSION}.tar.gz"
    elif case == "damaged":
        url = _index(tmp_path, _sdist(GOOD), sha256="0" * 64)
        reason = "the index says " + "0" * 64
    else:  # the deadline passes during the download (here: before its first chunk is written)
        url = _index(tmp_path, _sdist(GOOD))
        monkeypatch.setattr(llama_cpp_files, "_SDIST_FETCH_S", -1.0)
        reason = "not fetched in -1 s"
    monkeypatch.setenv("PIP_INDEX_URL", url)
    with pytest.raises(pytest.skip.Exception) as skipped:
        llama_cpp_files.from_llama_cpp_sdist("vocab")
    assert f"cannot fetch the llama-cpp-python {VERSION} sdist (llama.cpp's vocab files)" in str(skipped.value)
    assert reason in str(skipped.value), str(skipped.value)
    assert not list(isolated.glob("llama.cpp-*")) and not list(isolated.glob("tmp*"))
