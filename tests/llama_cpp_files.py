"""llama.cpp's own test files (its tokenizer vocabularies with their expected ids, the models' chat
templates), taken from the llama-cpp-python sdist: the sdist file alone, read off pip's index page and
checked against its sha256, nothing built; a fetch that fails, is damaged or is too slow skips the tests
that need it, with the reason. The fixtures that hand these folders out live in conftest.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from aiobasert.models.cache import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"


# What the tests take from the llama-cpp-python sdist: kind -> (folder under vendor/llama.cpp, file name
# prefix, a file that must be there).
_LLAMA_CPP_FILES = {
    "vocab": ("models", "ggml-vocab-", "ggml-vocab-llama-spm.gguf.out"),
    "templates": ("models/templates", "", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
}


# Bounds the whole sdist fetch (the index page and about 50 MB), so a slow network skips instead of erroring.
_SDIST_FETCH_S = 240.0


def _pip_index_urls() -> list[str]:
    """The indexes pip is configured with ($PIP_INDEX_URL / index-url, else PyPI; then the extra ones)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    found: dict[str, list[str]] = {"index-url": [], "extra-index-url": []}
    for line in proc.stdout.splitlines():
        match = re.fullmatch(r"[\w:-]*\.(index-url|extra-index-url)='(.*)'", line.strip())
        if match:
            found[match[1]] = match[2].split()
    main = os.environ.get("PIP_INDEX_URL") or next(iter(found["index-url"]), "https://pypi.org/simple")
    extra = os.environ.get("PIP_EXTRA_INDEX_URL", "").split() or found["extra-index-url"]
    return [main, *extra]


def fetch_sdist(distribution: str, version: str, dest: Path) -> Path:
    """The sdist file itself from the first index that lists it (PEP 503 pages, as pip reads them), checked
    against the page's sha256: nothing is built or installed (`pip download` would prepare the package's
    metadata with its build backend). Raises OSError / ValueError / TimeoutError when it cannot."""
    deadline = time.monotonic() + _SDIST_FETCH_S
    project = re.sub(r"[-_.]+", "-", distribution).lower()
    filenames = {f"{project.replace('-', '_')}-{version}.tar.gz", f"{project}-{version}.tar.gz"}
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    tried = []
    for index in _pip_index_urls():
        page_url = f"{index.rstrip('/')}/{project}/"
        if page_url.startswith("file:"):  # a local index, as pip reads one: the folder's index.html
            page_url += "index.html"
        try:
            with urllib.request.urlopen(page_url, timeout=30, context=context) as page:
                html = page.read().decode("utf-8", "replace")
        except (OSError, ValueError) as exc:
            tried.append(f"{page_url}: {exc}")
            continue
        for href in re.findall(r'href="([^"]+)"', html):
            url = urllib.parse.urljoin(page_url, href.replace("&amp;", "&"))
            path, _, fragment = url.partition("#")
            if path.rsplit("/", 1)[-1] not in filenames:
                continue
            target = dest / path.rsplit("/", 1)[-1]
            digest = hashlib.sha256()
            with urllib.request.urlopen(path, timeout=30, context=context) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{path} not fetched in {_SDIST_FETCH_S:.0f} s")
                    digest.update(chunk)
                    out.write(chunk)
            expected = dict(p.split("=", 1) for p in fragment.split("&") if "=" in p).get("sha256")
            if expected and digest.hexdigest() != expected:
                raise ValueError(f"{path}: sha256 {digest.hexdigest()}, the index says {expected}")
            return target
        tried.append(f"{page_url}: no {' / '.join(sorted(filenames))}")
    raise FileNotFoundError("; ".join(tried))


def from_llama_cpp_sdist(kind: str) -> Path:
    """The `kind` files of the llama-cpp-python sdist (not part of this repository): the sdist file fetched
    once from pip's index into the aiobasert cache dir, where only those files are kept (every kind's, from
    one download); skipped, with the reason, where the fetch fails or takes too long."""

    def target(k: str) -> Path:
        return cache_dir() / f"llama.cpp-{k}-{LLAMA_CPP_PYTHON_VERSION}"

    if (target(kind) / _LLAMA_CPP_FILES[kind][2]).is_file():
        return target(kind)
    target(kind).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target(kind).parent) as tmp:
        try:
            sdist = fetch_sdist("llama-cpp-python", LLAMA_CPP_PYTHON_VERSION, Path(tmp))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # TimeoutError is an OSError
            pytest.skip(f"cannot fetch the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist "
                        f"(llama.cpp's {kind} files): {str(exc)[-1000:]}")  # fmt: skip
        for k in _LLAMA_CPP_FILES:
            (Path(tmp) / k).mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                parent, _, name = member.name.rpartition("/")
                for k, (folder, prefix, _) in _LLAMA_CPP_FILES.items():
                    if member.isfile() and parent.endswith(f"vendor/llama.cpp/{folder}") and name.startswith(prefix):
                        source = tar.extractfile(member)
                        assert source is not None
                        (Path(tmp) / k / name).write_bytes(source.read())
        for k, (folder, _, check) in _LLAMA_CPP_FILES.items():
            if not (Path(tmp) / k / check).is_file():
                pytest.fail(f"the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist has no {folder}/{check}")
            with contextlib.suppress(OSError):  # another process may have finished first (or an older run)
                os.replace(Path(tmp) / k, target(k))
    return target(kind)
