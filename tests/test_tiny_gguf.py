"""tests/tiny_gguf.py's GGUF rewriters: what bench/spec_vs_llama_server.py serves as a draft model's F16
target must be the source model exactly, every metadata field kept and every value gguf-py's dequantization
of the source's blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tiny_gguf import f16_gguf, write_gguf

Q = gguf.GGMLQuantizationType


def fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata field's decoded value (strings as str, arrays as lists), the reader's own ones left out."""
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def test_f16_gguf_keeps_every_field_and_the_dequantized_values(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "q4_1.gguf", matrices=Q.Q4_1)
    dst = f16_gguf(src, tmp_path / "f16.gguf")
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    want = fields(before)
    got = fields(after)
    assert got.pop("general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    want.pop("general.file_type", None)
    assert got == want  # the tokenizer, the chat template and the hyperparameters, as they were
    assert "tokenizer.chat_template" in got and len(got["tokenizer.ggml.tokens"]) > 100
    sources = {t.name: t for t in before.tensors}
    assert [t.name for t in after.tensors] == list(sources)
    assert Q.Q4_1 in {t.tensor_type for t in before.tensors}
    for t in after.tensors:
        source = sources[t.name]
        reference = gguf.quants.dequantize(source.data, source.tensor_type).astype(np.float32)
        if reference.ndim == 1:  # norms stay F32, exactly
            assert t.tensor_type == Q.F32 and np.array_equal(t.data, reference), t.name
        else:  # matrices: the dequantized values rounded to f16 (Q4_1's values are f16 products: most exact)
            assert t.tensor_type == Q.F16, t.name
            assert np.array_equal(t.data, reference.astype(np.float16)), t.name
