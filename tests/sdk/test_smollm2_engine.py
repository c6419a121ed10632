"""The reference engine on the real demo model, SmolLM2-135M-Instruct, through
the C ABI: its logits (f16 bundle and the q4 demo) against a numpy forward over
the dequantized GGUF, its
tokenizer against HF `tokenizers` on the same vocabulary, and a short greedy
completion through the SDK."""

from __future__ import annotations

import os
from ctypes import byref, c_int, c_uint32, c_void_p, sizeof
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import tokenizers
from oracle import gguf_oracle
from tokenizer_corpus import corpus

from aiobasert import Engine, _ffi
from aiobasert.models import cache as models
from aiobasert.models._hf_tokenizer import hf_tokenizer_json
from aiobasert.models.bundle import read_bundle

pytestmark = pytest.mark.slow

TEXT = "The capital of France is Paris, and the capital of Germany is"


def engine_logits(lib: _ffi.Library, path: Path, ids: list[int]) -> npt.NDArray[np.float64]:
    """The last logit row of `ids` fed in two chunks, as a batched prefill would feed them."""
    opts = _ffi.BaseRTLoadOptions(struct_size=sizeof(_ffi.BaseRTLoadOptions), paged_kv=1, max_batch_size=2)
    model = lib.baseRT_load_model_ex(os.fsencode(path), None, 256, byref(opts))
    assert model, lib.last_error("baseRT_load_model_ex")
    try:
        seq = lib.baseRT_sequence_create(model)
        for chunk in (ids[:7], ids[7:]):
            rc = lib.baseRT_batch_step_fused_logits(
                model, (c_void_p * 1)(seq), 1, _ffi.u32_array(chunk), (c_int * 1)(len(chunk))
            )
            lib.check(rc, "baseRT_batch_step_fused_logits")
        stride = lib.baseRT_batch_logits_stride(model)
        row = np.zeros(stride // 2, dtype=np.float16)
        assert lib.baseRT_read_batch_logits(model, 1, row.ctypes.data) == 49152
        lib.baseRT_sequence_free(seq)
    finally:
        lib.baseRT_free_model(model)
    return row[:49152].astype(np.float64)


def text_ids(lib: _ffi.Library, path: Path) -> list[int]:
    model = lib.baseRT_load_tokenizer_only(os.fsencode(path))
    assert model, lib.last_error("baseRT_load_tokenizer_only")
    try:
        buf = (c_uint32 * 64)()
        return list(buf[: lib.baseRT_encode(model, TEXT.encode(), buf, 64)])
    finally:
        lib.baseRT_free_model(model)


def test_engine_logits_match_the_gguf_oracle(smollm2_f16_path: Path, lib: _ffi.Library) -> None:
    """The float path (f16 weights, f32 activations) against the dequantized GGUF in float64."""
    ids = text_ids(lib, smollm2_f16_path)
    ours = engine_logits(lib, smollm2_f16_path, ids)
    reference = gguf_oracle(models.smollm2_gguf_path()).logits(ids)[-1]
    print(f"max |logit difference| engine vs GGUF oracle: {np.abs(ours - reference).max():.4f}")
    np.testing.assert_allclose(ours, reference, atol=0.2)
    assert int(ours.argmax()) == int(reference.argmax())
    top_ours = set(np.argsort(-ours)[:10].tolist())
    top_ref = set(np.argsort(-reference)[:10].tolist())
    assert len(top_ours & top_ref) >= 9


def test_demo_q4_logits_track_the_gguf_oracle(smollm2_path: Path, lib: _ffi.Library) -> None:
    """The demo's integer path (the GGUF's own blocks, activations rounded to 8 bits per block of 32, as
    llama.cpp does): the same next token and top 10 as the float64 oracle, logits within ~1.1 (measured;
    the f16 path's distance is 0.02)."""
    ids = text_ids(lib, smollm2_path)
    ours = engine_logits(lib, smollm2_path, ids)
    reference = gguf_oracle(models.smollm2_gguf_path()).logits(ids)[-1]
    print(f"max |logit difference| q4 engine vs GGUF oracle: {np.abs(ours - reference).max():.4f}")
    assert np.abs(ours - reference).max() < 2.0
    assert np.corrcoef(ours, reference)[0, 1] > 0.998
    assert int(ours.argmax()) == int(reference.argmax())
    assert len(set(np.argsort(-ours)[:10].tolist()) & set(np.argsort(-reference)[:10].tolist())) >= 8


def test_abi_encode_matches_hf_tokenizers(smollm2_path: Path, lib: _ffi.Library) -> None:
    """baseRT_encode / baseRT_encode_plain on the .base vs HF on the tokenizer.json
    built from the same header, over 2,500 varied strings."""
    fields = read_bundle(smollm2_path).header["tokenizer"]
    hf = tokenizers.Tokenizer.from_str(hf_tokenizer_json(fields))
    model = lib.baseRT_load_tokenizer_only(os.fsencode(smollm2_path))
    assert model, lib.last_error("baseRT_load_tokenizer_only")
    mismatches = []
    try:
        strings = [s for s in corpus(n=2500) if "\x00" not in s]
        assert len(strings) >= 2000
        for s in strings:
            data = s.encode()
            cap = len(data) + 8
            out = (c_uint32 * cap)()
            n = lib.baseRT_encode(model, data, out, cap)
            assert n >= 0, lib.last_error("baseRT_encode")
            if list(out[:n]) != hf.encode(s, add_special_tokens=False).ids:
                mismatches.append(s)
    finally:
        lib.baseRT_free_model(model)
    assert not mismatches, f"{len(mismatches)} strings differ, e.g. {mismatches[:3]!r}"


@pytest.mark.anyio
async def test_sdk_completes_on_smollm2(smollm2_path: Path) -> None:
    async with Engine.open(smollm2_path, max_batch_size=4, max_context=512) as engine:
        assert engine.info.vocab_size == 49152 and engine.info.n_layers == 30
        out = await engine.generate("The capital of France is", max_tokens=4)
        assert "Paris" in out.text
        # The demo's q4 weights with 8-bit activations answer this chat as llama.cpp's own server does on
        # the same GGUF (a French list, not "Paris"); the f16 test below checks the answer itself.
        chat = await engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
        assert chat.text.strip() and chat.finish_reason in ("stop", "length")


@pytest.mark.anyio
async def test_sdk_chat_answers_on_smollm2_f16(smollm2_f16_path: Path) -> None:
    async with Engine.open(smollm2_f16_path, max_batch_size=4, max_context=512) as engine:
        chat = await engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
        assert "Paris" in chat.text
        assert chat.finish_reason in ("stop", "length")
