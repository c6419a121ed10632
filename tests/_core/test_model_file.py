"""The model's bundle is read by the host once per engine (`_core.model_file.ModelFile`, made at
configure time and handed down): the grammar backend and the embedding probe both used to reopen
and re-parse the file by its path (issue 29 #2)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import aiobasert
from aiobasert.testing import snapshot


@pytest.mark.anyio
async def test_the_grammar_backend_and_the_embed_path_share_one_read_of_the_bundle(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiobasert import _ffi as ffi
    from aiobasert.models import bundle

    reads: list[str] = []
    real = bundle.read_bundle

    def read_bundle(path: Any) -> bundle.Bundle:
        reads.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(bundle, "read_bundle", read_bundle)
    has = ffi.Library.has  # no grammar compiler in the engine: llguidance's backend reads the tokenizer
    monkeypatch.setattr(ffi.Library, "has", lambda self, name: "grammar" not in name and has(self, name))
    async with aiobasert.Engine.open(tiny_model_path, max_batch_size=2) as engine:
        assert reads == ["aiobasert-grammar-1"]  # the backend, built at open on a worker
        done = await engine.generate("x", max_tokens=12, json_schema={"type": "boolean"})
        assert done.text in ("true", "false")
        assert len(await engine.embed("a cat")) == engine.info.dim
        assert (await snapshot(engine)).embedding_path == "tapped"  # its probe read the final norm
        # private on purpose: that the preparer and the embedder share one parsed file has no public view
        assert engine._thread.prep.model_file is engine._thread.embedder.model_file
    assert len(reads) == 1
