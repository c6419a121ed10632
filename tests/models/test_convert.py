"""GGUF -> .base conversion: synthetic GGUFs (fast) and the real SmolLM2-135M-Instruct (slow)."""

from __future__ import annotations

import copy
import math
import os
import struct
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import NumpyLlama, gguf_oracle
from tiny_gguf import ARCH_GGUFS, DIM, FFN, HEAD_DIM, HEADS, KV_HEADS, LAYERS, write_gguf
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE

from aiobasert._ffi import Library
from aiobasert.models import cache as models
from aiobasert.models import convert as convert_module
from aiobasert.models.bundle import Bundle, read_bundle
from aiobasert.models.convert import ConversionError, convert_gguf, main
from aiobasert.models.tiny import CHATML_TEMPLATE, tiny_vocab

# phi3's fused GGUF matrices and the bundle matrices their rows become, in row order (llama.cpp's
# build_qkv views; ggml_swiglu takes the first half of ffn_up as the gate).
PHI3_FUSED = {
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),
}


def assert_matches_gguf(bundle: Bundle, gguf_path: Path, dtype: str) -> None:
    """Every bundle tensor equals the dequantized GGUF tensor it came from (up to f16 rounding); a fused
    phi3 tensor equals its bundle parts stacked."""
    reader = gguf.GGUFReader(gguf_path)
    sources = {t.name: t for t in reader.tensors}
    phi3 = bundle.header["arch"] == "phi3"

    def names_of(gguf_name: str) -> list[str]:
        stem, _, suffix = gguf_name.rpartition(".")
        blk, _, part = stem.rpartition(".")
        if phi3 and part in PHI3_FUSED:
            return [f"layers.{blk.split('.')[1]}.{p}.{suffix}" for p in PHI3_FUSED[part]]
        name = convert_module._canonical_name(gguf_name)
        assert name is not None
        return [name]

    assert set(bundle.tensors) == {name for gguf_name in sources for name in names_of(gguf_name)}
    for gguf_name, source in sources.items():
        names = names_of(gguf_name)
        reference = gguf.quants.dequantize(source.data, source.tensor_type).astype(np.float32)
        got = np.concatenate([bundle.tensor(name) for name in names])
        assert got.shape == reference.shape, names
        infos = [bundle.tensors[name] for name in names]
        if reference.ndim == 1 or dtype == "f32":
            assert all(info.dtype == "f32" for info in infos)
            np.testing.assert_array_equal(got, reference, err_msg=gguf_name)
        else:
            assert all(info.dtype == "f16" for info in infos)
            # Round to nearest f16: within half an f16 ulp (2^-11 relative), or the subnormal step.
            np.testing.assert_allclose(got, reference, rtol=2**-11, atol=2**-25, err_msg=gguf_name)


@pytest.fixture
def synthetic_gguf(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "synthetic.gguf")


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_converts_synthetic_llama(tmp_path: Path, synthetic_gguf: Path, dtype: str) -> None:
    out = convert_gguf(synthetic_gguf, tmp_path / "out.base", dtype=dtype, progress=False)  # type: ignore[arg-type]
    bundle = read_bundle(out)
    assert_matches_gguf(bundle, synthetic_gguf, dtype)
    header = bundle.header
    assert header["quant_scheme"] == dtype and header["arch"] == "llama"
    assert header["flags"] == "0x00000000"
    assert header["source"]["format"] == "gguf" and header["source"]["filename"] == "synthetic.gguf"
    assert bundle.config == {
        "hidden_size": DIM, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FFN,
        "vocab_size": len(tiny_vocab("bpe").tokens), "max_position_embeddings": 512, "rope_theta": 50000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "eos_token_ids": [0],
    }  # fmt: skip
    regions = {name: info.compute_region for name, info in bundle.tensors.items()}
    assert regions["embed_tokens.weight"] == regions["lm_head.weight"] == regions["final_norm.weight"] == "gpu"
    assert regions["layers.1.input_norm.weight"] == "gpu"
    assert regions["layers.1.mlp.down_proj.weight"] == regions["layers.0.self_attn.q_proj.weight"] == "accelerator"
    tokenizer = bundle.tokenizer
    assert tokenizer["tokenizer_type"] == "gguf"
    assert tokenizer["tokenizer.ggml.tokens"] == list(tiny_vocab("bpe").tokens)
    assert tokenizer["tokenizer.ggml.merges"] == list(tiny_vocab("bpe").merges)
    assert tokenizer["tokenizer.ggml.add_bos_token"] is False
    assert tokenizer["tokenizer.ggml.eot_token_id"] == 0
    assert tokenizer["tokenizer.chat_template"] == header["metadata"]["tokenizer.chat_template"] == CHATML_TEMPLATE


def test_synthetic_forward_agrees_with_gguf_oracle(tmp_path: Path, synthetic_gguf: Path) -> None:
    out = convert_gguf(synthetic_gguf, tmp_path / "out.base", dtype="f32", progress=False)
    tokens = [1, 300, 301, 302, 77, 2, 5]
    oracle = gguf_oracle(synthetic_gguf)
    np.testing.assert_allclose(NumpyLlama(out).logits(tokens), oracle.logits(tokens), atol=1e-9)
    np.testing.assert_allclose(oracle.next_logits(tokens), oracle.logits(tokens)[-1], atol=1e-12)  # head on one row


@pytest.mark.parametrize("kind", list(ARCH_GGUFS))
def test_each_architecture_converts_and_agrees_with_the_gguf_oracle(tmp_path: Path, kind: str) -> None:
    """The bundle's forward (its config read by the oracle) equals the forward over the GGUF read as
    llama.cpp reads it: the converter carries every architecture parameter over."""
    src = write_gguf(tmp_path / f"{kind}.gguf", **ARCH_GGUFS[kind])
    out = convert_gguf(src, tmp_path / "out.base", dtype="f32", progress=False)
    bundle = read_bundle(out)
    assert_matches_gguf(bundle, src, "f32")
    assert bundle.header["arch"] == ARCH_GGUFS[kind].get("arch", "llama")
    tokens = [1, 300, 301, 302, 77, 2, 5, 9, 400, 401, 12]
    np.testing.assert_allclose(NumpyLlama(out).logits(tokens), gguf_oracle(src).logits(tokens), atol=1e-9)


def test_gemma3_config(tmp_path: Path) -> None:
    bundle = read_bundle(
        convert_gguf(write_gguf(tmp_path / "g.gguf", arch="gemma3", n_layers=6), tmp_path / "g.base", progress=False)
    )
    config = bundle.config
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == 4 and config["rope_local_base_freq"] == 10000.0
    assert config["head_dim"] == 32 and config["query_pre_attn_scalar"] == 32.0
    assert "final_logit_softcapping" not in config


def test_fast_metadata_reader_agrees_with_gguf_py(tmp_path: Path) -> None:
    extra = {"t.bools": [True, False], "t.floats": [0.1, 2.5], "t.ints": [1, -2, 3], "t.flag": True,
             "t.f64": 0.1, "t.text": "héllo ✓"}  # fmt: skip
    src = write_gguf(tmp_path / "kinds.gguf", extra_kv=extra)
    reader, meta = convert_module._read_gguf(src)
    reference = gguf.GGUFReader(src)
    assert reader.metadata is meta  # the fast path ran
    assert meta == {n: convert_module._field_value(f) for n, f in reference.fields.items() if not n.startswith("GGUF.")}
    assert meta["t.floats"] == [0.1, 2.5] and meta["llama.attention.layer_norm_rms_epsilon"] == 1e-6
    assert [t.name for t in reader.tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(reader.tensors, reference.tensors, strict=True):
        np.testing.assert_array_equal(ours.data, theirs.data)

    aligned = gguf.GGUFWriter(tmp_path / "aligned.gguf", "llama")
    aligned.add_custom_alignment(64)  # general.alignment moves the tensor data
    aligned.add_uint64("t.u64", 2**40)
    aligned.add_tensor("a", np.arange(5, dtype=np.float32))
    aligned.add_tensor("b", np.arange(7, dtype=np.float32))
    aligned.write_header_to_file()
    aligned.write_kv_data_to_file()
    aligned.write_tensors_to_file()
    aligned.close()
    reader, meta = convert_module._read_gguf(tmp_path / "aligned.gguf")
    assert meta["general.alignment"] == 64 and meta["t.u64"] == 2**40 and reader.alignment == 64
    assert [t.data.tolist() for t in reader.tensors] == [list(range(5)), list(range(7))]


def test_tied_embeddings(tmp_path: Path) -> None:
    src = write_gguf(tmp_path / "tied.gguf", tied=True)
    bundle = read_bundle(convert_gguf(src, tmp_path / "tied.base", progress=False))
    assert "lm_head.weight" not in bundle.tensors
    assert bundle.header["flags"] == "0x00000400"
    assert bundle.config["tie_word_embeddings"] is True


def test_progress_callback(tmp_path: Path, synthetic_gguf: Path) -> None:
    calls: list[tuple[int, int]] = []
    convert_gguf(synthetic_gguf, tmp_path / "p.base", progress=lambda done, total: calls.append((done, total)))
    assert len(calls) == 2 + LAYERS * 9 + 1
    assert calls[-1][0] == calls[-1][1] > 0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: write_gguf(p, arch="phi2"), "unsupported architecture 'phi2'"),
        # LongRoPE (Phi-3's 128k variants): both factor tensors, phi3 only; its attn_factor not without them
        (
            lambda p: write_gguf(p, arch="phi3", extra_tensors=("rope_factors_long.weight",)),
            "missing tensors: rope_factors_short.weight",
        ),
        (
            lambda p: write_gguf(p, extra_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
            "unsupported tensor\\(s\\) for a llama model: rope_factors_long.weight",
        ),
        (
            lambda p: write_gguf(p, arch="phi3", extra_kv={"phi3.rope.scaling.attn_factor": 1.19}),
            "attn_factor without LongRoPE's factor tensors",
        ),
        (
            lambda p: write_gguf(
                p,
                arch="phi3",
                longrope=True,
                extra_kv={"phi3.rope.scaling.type": "linear", "phi3.rope.scaling.factor": 2.0},
            ),
            "LongRoPE factor tensors beside another RoPE scaling type",
        ),
        (
            lambda p: write_gguf(p, arch="phi3", extra_kv={"phi3.feed_forward_length": 100}),
            r"'blk\.0\.ffn_up\.weight' has shape \[192, 64\], expected \[200, 64\]",
        ),
        (
            lambda p: write_gguf(p, arch="phi3", extra_tensors=("blk.0.attn_q.weight",)),
            "'blk.0.attn_q.weight' holds 'layers.0.self_attn.q_proj.weight', which another tensor already holds",
        ),
        (
            lambda p: write_gguf(p, arch="phi3", extra_tensors=("blk.1.ffn_gate.weight",)),
            "'blk.1.ffn_gate.weight' holds 'layers.1.mlp.gate_proj.weight'",
        ),
        (lambda p: write_gguf(p, extra_kv={"llama.rope.scaling.type": "longrope"}), "RoPE scaling type 'longrope'"),
        (lambda p: write_gguf(p, extra_kv={"llama.expert_count": 8}), "mixture of experts"),
        (lambda p: write_gguf(p, extra_kv={"llama.attention.key_length": 32}), "partial rotary"),
        (lambda p: write_gguf(p, extra_kv={"llama.attention.value_length": 32}), "value_length 32"),
        (lambda p: write_gguf(p, extra_tensors=("rope_freqs.weight",)), r"'rope_freqs.weight' has shape \[64\]"),
        (
            lambda p: write_gguf(p, extra_tensors=("blk.0.attn_q.bias",)),
            "unsupported tensor\\(s\\) for a llama model: layers.0.self_attn.q_proj.bias",
        ),
        (lambda p: write_gguf(p, arch="qwen2", drop=("blk.1.attn_v.bias",)), "missing tensors: layers.1.self_attn.v"),
        (
            lambda p: write_gguf(p, arch="qwen2", rope_freqs=True),
            "unsupported tensor\\(s\\) for a qwen2 model: rope_freqs.weight",
        ),
        (lambda p: write_gguf(p, arch="qwen3", extra_kv={"qwen3.attention.sliding_window": 8}), "sliding-window"),
        (lambda p: write_gguf(p, extra_tensors=("blk.2.attn_norm.weight",)), "beyond the 2 configured layers"),
        (lambda p: write_gguf(p, drop=("blk.1.ffn_up.weight",)), "missing tensors: layers.1.mlp.up_proj"),
        (lambda p: write_gguf(p, extra_kv={"llama.feed_forward_length": 100}), "expected \\[100, 64\\]"),
        # Tokenizers the engine would not tokenize as llama.cpp does: refused before any tensor is looked at
        # (the unknown tensor of the second one is not what the message names).
        (lambda p: write_gguf(p, pre="deepseek-llm"), "^[^\n]*pre-tokenizer 'deepseek-llm' is not one the engine runs"),
        (lambda p: write_gguf(p, pre="qwen35", extra_tensors=("blk.0.attn_q.bias",)), "pre-tokenizer 'qwen35'"),
        (lambda p: write_gguf(p, pre="default"), "pre-tokenizer 'default'"),
        (
            lambda p: write_gguf(p, tokenizer={"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a", "b"]}),
            "tokenizer model 't5'",
        ),
        (lambda p: p.write_bytes(b"not a model at all"), "not a GGUF file"),
        (lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00"), "unreadable GGUF"),
    ],
)
def test_rejects_unsupported_input(tmp_path: Path, make: Callable[[Path], object], match: str) -> None:
    src = tmp_path / "input.gguf"
    make(src)
    with pytest.raises(ConversionError, match=match) as info:
        convert_gguf(src, tmp_path / "out.base", progress=False)
    assert str(src) in str(info.value)
    assert not (tmp_path / "out.base").exists()


def test_cli(tmp_path: Path, synthetic_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.base"
    assert main([str(synthetic_gguf), str(out), "--dtype", "f32"]) == 0
    assert read_bundle(out).header["quant_scheme"] == "f32"
    assert "wrote" in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert main([str(text), str(tmp_path / "x.base"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "error" in err and str(text) in err and "not a GGUF file" in err
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "x.base"), "--quiet"]) == 1
    assert "missing.gguf" in capsys.readouterr().err


# ---- GGML block types: carried exactly, or converted ----------------------------------------------
Q = gguf.GGMLQuantizationType
K_DIMS = {"dim": 256, "ffn": 512}  # K-quant rows are whole 256-value super-blocks
# (type, --dtype) -> (bundle dtype of the matrices, scale dtype, symmetric); every one is carried exactly
# (auto keeps K-quant blocks as they are, the engine decodes them at load)
CARRIED = {
    (Q.Q4_0, "auto"): ("base_q4", "f16", True), (Q.Q4_0, "q4"): ("base_q4", "f16", True),
    (Q.Q4_0, "q8"): ("base_q8", "f16", False), (Q.Q4_1, "auto"): ("base_q4", "f16", False),
    (Q.Q4_1, "q8"): ("base_q8", "f16", False), (Q.Q5_0, "auto"): ("base_q5", "f16", True),
    (Q.Q5_0, "q8"): ("base_q8", "f16", False), (Q.Q5_1, "auto"): ("base_q5", "f16", False),
    (Q.Q8_0, "auto"): ("base_q8", "f16", True), (Q.Q8_0, "q4"): ("base_q8", "f16", True),
    (Q.Q4_K, "auto"): ("ggml_q4_k", None, None), (Q.Q4_K, "q4"): ("base_q4", "f32", False),
    (Q.Q4_K, "q8"): ("base_q8", "f32", False), (Q.Q5_K, "auto"): ("ggml_q5_k", None, None),
    (Q.Q5_K, "q8"): ("base_q8", "f32", False), (Q.Q6_K, "auto"): ("ggml_q6_k", None, None),
}  # fmt: skip


def _gguf_of(tmp_path: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    dims = K_DIMS if qtype.name.endswith("_K") else {}
    return write_gguf(tmp_path / f"{qtype.name}.gguf", matrices=qtype, **dims)


@pytest.mark.parametrize(("qtype", "dtype"), list(CARRIED), ids=[f"{q.name}-{d}" for q, d in CARRIED])
def test_gguf_blocks_are_carried_exactly(tmp_path: Path, qtype: gguf.GGMLQuantizationType, dtype: str) -> None:
    """Every matrix of the bundle dequantizes to exactly gguf-py's dequantization of the GGUF's blocks
    (value = scale * u + bias in f32, as the engine's rt_qweight_row and the integer kernels use it)."""
    src = _gguf_of(tmp_path, qtype)
    bundle = read_bundle(convert_gguf(src, tmp_path / "out.base", dtype=dtype, progress=False))  # type: ignore[arg-type]
    want = CARRIED[(qtype, dtype)]
    for source in gguf.GGUFReader(src).tensors:
        name = convert_module._canonical_name(source.name)
        assert name is not None
        reference = gguf.quants.dequantize(source.data, source.tensor_type).astype(np.float32)
        info = bundle.tensors[name]
        if reference.ndim == 2:
            assert (info.dtype, info.scale_dtype, info.symmetric) == want, name
            assert info.group_size == (32 if info.dtype.startswith("base_") else None)
        np.testing.assert_array_equal(bundle.tensor(name), reference, err_msg=name)  # -0.0 == 0.0 allowed
    if dtype == "auto":  # the GGUF's own width and blocks: exactly as big
        size = sum(math.prod(t.shape) for t in gguf.GGUFReader(src).tensors if len(t.shape) == 2)
        stored = sum(
            i.length + (i.scale_length or 0) + (i.bias_length or 0)
            for i in bundle.tensors.values()
            if len(i.shape) == 2
        )
        assert stored == size // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize(
    ("qtype", "dtype", "stored"),
    [(Q.Q6_K, "q8", "base_q8"), (Q.Q6_K, "q4", "base_q4"), (Q.Q5_K, "q4", "base_q4"), (Q.Q5_0, "q4", "base_q4")],
)
def test_blocks_without_an_exact_form_are_converted(
    tmp_path: Path, qtype: gguf.GGMLQuantizationType, dtype: str, stored: str
) -> None:
    """Q6_K's 16-value sub-blocks (and a 5-bit type asked for q4) are quantized from their f32 values:
    close to the GGUF's (within half a step of the group's range / 255 or / 15), not equal."""
    src = _gguf_of(tmp_path, qtype)
    bundle = read_bundle(convert_gguf(src, tmp_path / "out.base", dtype=dtype, progress=False))  # type: ignore[arg-type]
    source = next(t for t in gguf.GGUFReader(src).tensors if t.name == "blk.0.ffn_down.weight")
    reference = gguf.quants.dequantize(source.data, source.tensor_type).astype(np.float32)
    info = bundle.tensors["layers.0.mlp.down_proj.weight"]
    assert (info.dtype, info.scale_dtype) == (stored, "f16")
    got = bundle.tensor(info.name)
    groups = reference.reshape(reference.shape[0], -1, 32)
    step = (groups.max(axis=2) - groups.min(axis=2)) / (255 if stored == "base_q8" else 15)
    err = np.abs(got - reference).reshape(groups.shape).max(axis=2)
    # half a step, plus the f16 rounding of the group's scale (x up to the top level) and bias
    assert (err <= step * 0.52 + 2**-10 * np.abs(groups).max(axis=2)).all()
    assert not np.array_equal(got, reference)


@pytest.mark.parametrize("dtype", ["auto", "q8", "f16"])
def test_a_type_nothing_dequantizes_is_refused_before_writing(tmp_path: Path, dtype: str) -> None:
    src = write_gguf(tmp_path / "i32.gguf", matrices=Q.I32)
    with pytest.raises(ConversionError, match="cannot dequantize GGML type I32") as info:
        convert_gguf(src, tmp_path / "out.base", dtype=dtype, progress=False)  # type: ignore[arg-type]
    assert str(src) in str(info.value) and "token_embd.weight" in str(info.value)
    assert list(tmp_path.iterdir()) == [src]  # nothing written, not even a temporary file


def test_auto_keeps_float_matrices_and_mixes_types(tmp_path: Path, synthetic_gguf: Path) -> None:
    """`auto` on the mixed synthetic GGUF: Q8_0 matrices stay base_q8, F16 / F32 ones become f16."""
    bundle = read_bundle(convert_gguf(synthetic_gguf, tmp_path / "auto.base", dtype="auto", progress=False))
    assert bundle.header["quant_scheme"] == "auto" and bundle.header["target_backend"] == "cpu_avx2"
    dtypes = {n.split(".", 2)[-1]: info.dtype for n, info in bundle.tensors.items() if n.startswith("layers.0")}
    assert dtypes == {
        "input_norm.weight": "f32",
        "self_attn.q_proj.weight": "base_q8",
        "self_attn.k_proj.weight": "f16",
        "self_attn.v_proj.weight": "f16",
        "self_attn.o_proj.weight": "base_q8",
        "post_attn_norm.weight": "f32",
        "mlp.gate_proj.weight": "f16",
        "mlp.up_proj.weight": "base_q8",
        "mlp.down_proj.weight": "f16",
    }
    assert main([str(synthetic_gguf), str(tmp_path / "cli.base"), "--dtype", "auto", "--quiet"]) == 0
    assert read_bundle(tmp_path / "cli.base").header["quant_scheme"] == "auto"


# ---- SmolLM2-135M-Instruct ------------------------------------------------


@pytest.mark.slow
def test_smollm2_config_and_tokenizer(smollm2_path: Path) -> None:
    bundle = read_bundle(smollm2_path)
    assert bundle.config == {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "eos_token_ids": [],
    }  # fmt: skip
    header = bundle.header
    assert header["flags"] == "0x00000400" and header["quant_scheme"] == "base_q4"  # the demo is q4
    assert header["target_backend"] == "cpu_avx2"
    assert header["source"]["filename"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(header["source"]["sha256"]) == 64
    tokenizer = bundle.tokenizer
    assert tokenizer["tokenizer_type"] == "gguf"
    assert tokenizer["tokenizer.ggml.model"] == "gpt2" and tokenizer["tokenizer.ggml.pre"] == "smollm"
    assert len(tokenizer["tokenizer.ggml.tokens"]) == len(tokenizer["tokenizer.ggml.token_type"]) == 49152
    assert tokenizer["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer["tokenizer.ggml.merges"][0] == "Ġ t"
    assert len(tokenizer["tokenizer.ggml.merges"]) > 40000
    assert tokenizer["tokenizer.ggml.bos_token_id"] == 1 and tokenizer["tokenizer.ggml.eos_token_id"] == 2
    assert "<|im_start|>" in header["metadata"]["tokenizer.chat_template"]
    assert tokenizer["tokenizer.chat_template"] == header["metadata"]["tokenizer.chat_template"]
    assert len(bundle.tensors) == 2 + 30 * 9


@pytest.mark.slow
def test_smollm2_tensors_equal_dequantized_gguf(smollm2_f16_path: Path) -> None:
    assert_matches_gguf(read_bundle(smollm2_f16_path), models.smollm2_gguf_path(), "f16")


@pytest.mark.slow
def test_smollm2_demo_bundle_carries_the_gguf_blocks_exactly(smollm2_path: Path) -> None:
    """The demo (q4) bundle holds the GGUF's own Q4_1 and Q8_0 blocks: every matrix dequantizes to exactly
    the GGUF's values (no requantization error on top of the GGUF's)."""
    bundle = read_bundle(smollm2_path)
    reader = gguf.GGUFReader(models.smollm2_gguf_path())
    for source in reader.tensors:
        name = convert_module._canonical_name(source.name)
        assert name is not None
        reference = gguf.quants.dequantize(source.data, source.tensor_type).astype(np.float32)
        info = bundle.tensors[name]
        if reference.ndim == 2:
            want = "base_q8" if source.tensor_type == gguf.GGMLQuantizationType.Q8_0 else "base_q4"
            assert (info.dtype, info.group_size) == (want, 32), name
        np.testing.assert_array_equal(bundle.tensor(name), reference, err_msg=name)


def _hf_tokenizer(bundle: Bundle) -> Tokenizer:
    """HF tokenizers over the bundle's own vocabulary, SmolLM2-style (individual digits + byte-level)."""
    tokenizer = bundle.tokenizer
    vocab = {token: i for i, token in enumerate(tokenizer["tokenizer.ggml.tokens"])}
    merges = [(left, right) for left, right in (m.split(" ") for m in tokenizer["tokenizer.ggml.merges"])]
    hf = Tokenizer(BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return hf


def _mean_nll(logits: npt.NDArray[np.float64], ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of ids[1:]."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))


@pytest.mark.slow
def test_smollm2_forward_agrees_with_gguf_oracle(smollm2_path: Path) -> None:
    bundle = read_bundle(smollm2_path)
    text = (
        "The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital of "
        "Germany is Berlin. Water boils at 100 degrees Celsius."
    )
    ids = _hf_tokenizer(bundle).encode(text).ids
    ours = NumpyLlama(smollm2_path).logits(ids)
    reference = gguf_oracle(models.smollm2_gguf_path()).logits(ids)
    print(f"max |logit difference| (f16 weights vs dequantized GGUF): {np.abs(ours - reference).max():.4f}")
    np.testing.assert_allclose(ours, reference, atol=0.15)
    np.testing.assert_array_equal(ours.argmax(axis=1), reference.argmax(axis=1))
    # The forward is the real one: the model reads plain English well (mean NLL 2.47 nats/token;
    # rotating q/k halves instead of adjacent pairs gives 4.2) and knows the capital of France.
    nll = _mean_nll(reference, ids)
    print(f"mean next-token NLL: {nll:.3f} (ours {_mean_nll(ours, ids):.3f})")
    assert nll < 3.0
    vocab = bundle.tokenizer["tokenizer.ggml.tokens"]
    after_is = ids.index(vocab.index("ĠParis")) - 1
    assert int(reference[after_is].argmax()) == int(ours[after_is].argmax()) == ids[after_is + 1]


def test_sentencepiece_fields_reach_the_bundle(tmp_path: Path) -> None:
    # The scores (float32 in the GGUF, +-inf as +-FLT_MAX since JSON has no infinity), token types and flags
    # of a SentencePiece vocabulary are what the header's tokenizer object carries.
    tokens = ["<unk>", "<s>", "</s>", "<0x41>", "\u2581", "a", "\u2581a"]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, -1.5, -2.25, float("-inf")],
        "tokenizer.ggml.token_type": [2, 3, 3, 6, 1, 1, 1],
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    out = convert_gguf(write_gguf(tmp_path / "spm.gguf", tokenizer=fields), tmp_path / "spm.base", progress=False)
    tok = read_bundle(out).header["tokenizer"]
    assert tok["tokenizer.ggml.scores"] == [0.0, 0.0, 0.0, 0.0, -1.5, -2.25, -3.4028234663852886e38]
    assert tok["tokenizer.ggml.token_type"] == [2, 3, 3, 6, 1, 1, 1]
    assert tok["tokenizer.ggml.add_space_prefix"] is False and tok["tokenizer.ggml.model"] == "llama"


@pytest.mark.parametrize(
    ("tokens", "scores", "match"),
    [
        (["a", "", "b"], [0.0, 0.0, 0.0], r"tokens\[1\] is ''"),
        (["a", "b\0", "c"], [0.0, 0.0, 0.0], r"tokens\[1\]"),
        (["a", "b", "c"], [0.0, float("nan"), 0.0], "NaN"),
    ],
)
def test_vocabularies_the_engine_cannot_hold_are_refused(
    tmp_path: Path, tokens: list[str], scores: list[float], match: str
) -> None:
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    src = write_gguf(tmp_path / "bad.gguf", tokenizer=fields)
    with pytest.raises(ConversionError, match=match):
        convert_gguf(src, tmp_path / "bad.base", progress=False)
    assert not (tmp_path / "bad.base").exists()


# ---- malformed metadata: every path ends in ConversionError ---------------------------------------

_VT = gguf.GGUFValueType
_INT_TYPES = {_VT.UINT8: ("<B", 0, 2**8 - 1), _VT.INT8: ("<b", -(2**7), 2**7 - 1),
              _VT.UINT16: ("<H", 0, 2**16 - 1), _VT.INT16: ("<h", -(2**15), 2**15 - 1),
              _VT.UINT32: ("<I", 0, 2**32 - 1), _VT.INT32: ("<i", -(2**31), 2**31 - 1),
              _VT.UINT64: ("<Q", 0, 2**64 - 1), _VT.INT64: ("<q", -(2**63), 2**63 - 1)}  # fmt: skip


class RawGGUF:
    """A little-endian GGUF split into its parts, to be written back with its metadata edited at the byte level
    (the tensor table and data are copied; the data section is re-aligned after the new metadata)."""

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        self.kv: dict[str, tuple[int, bytes]] = {}  # key -> (value type, encoded value)
        offs = 24
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", data, offs)
            key = data[offs + 8 : offs + 8 + n].decode()
            (kind,) = struct.unpack_from("<I", data, offs + 8 + n)
            _, _, end = convert_module._parse_metadata(memoryview(data), offs, 1)
            self.kv[key] = (kind, data[offs + 12 + n : end])
            offs = end
        info_start = offs
        self.offsets: dict[str, int] = {}  # tensor -> its data's offset in the data section
        for _ in range(n_tensors):
            (n,) = struct.unpack_from("<Q", data, offs)
            (dims,) = struct.unpack_from("<I", data, offs + 8 + n)
            name = data[offs + 8 : offs + 8 + n].decode()
            offs += 8 + n + 4 + 8 * dims + 4 + 8
            (self.offsets[name],) = struct.unpack_from("<Q", data, offs - 8)
        self.n_tensors, self.infos = n_tensors, data[info_start:offs]
        self.body = data[(offs + 31) // 32 * 32 :]

    def edited(self, kv: Iterable[tuple[str, tuple[int, bytes] | None]]) -> RawGGUF:
        """A copy with the metadata edits `kv` applied in order (None removes the key); tensors shared."""
        raw = copy.copy(self)
        raw.kv = dict(self.kv)
        for key, value in kv:
            if value is None:
                raw.kv.pop(key, None)
            else:
                raw.kv[key] = value
        return raw

    def write(self, path: Path, *, n_tensors: int | None = None, n_kv: int | None = None) -> Path:
        kv = b"".join(
            struct.pack("<Q", len(k.encode())) + k.encode() + struct.pack("<I", t) + v for k, (t, v) in self.kv.items()
        )
        head = b"GGUF" + struct.pack(
            "<IQQ",
            self.version,
            self.n_tensors if n_tensors is None else n_tensors,
            len(self.kv) if n_kv is None else n_kv,
        )
        meta = head + kv + self.infos
        path.write_bytes(meta + b"\0" * (-len(meta) % 32) + self.body)
        return path


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@st.composite
def gguf_values(draw: st.DrawFn) -> tuple[int, bytes]:
    """A (type, encoded value): well-formed values of every type, extreme numbers, bad UTF-8, arrays whose
    declared length is larger than the file, unknown types with junk bytes."""
    shape = draw(st.sampled_from(["int", "float", "bool", "string", "array", "raw"]))
    if shape == "int":
        kind = draw(st.sampled_from(sorted(_INT_TYPES)))
        fmt, lo, hi = _INT_TYPES[kind]
        value = draw(
            st.one_of(
                st.sampled_from([lo, hi, 0, 1, 2, 16, 2**31 - 1]).filter(lambda v: lo <= v <= hi), st.integers(lo, hi)
            )
        )
        return int(kind), struct.pack(fmt, value)
    if shape == "float":
        kind = draw(st.sampled_from([_VT.FLOAT32, _VT.FLOAT64]))
        real = draw(st.floats(width=32 if kind == _VT.FLOAT32 else 64))
        return int(kind), struct.pack("<f" if kind == _VT.FLOAT32 else "<d", real)
    if shape == "bool":
        return int(_VT.BOOL), bytes([draw(st.sampled_from([0, 1, 2, 255]))])
    if shape == "string":
        text = draw(
            st.one_of(
                st.text(max_size=12).map(str.encode),
                st.binary(max_size=12),
                st.sampled_from([b"llama", b"qwen2", b"qwen3", b"gemma3", b"yarn", b"linear", b"none"]),
            )
        )
        return int(_VT.STRING), gguf_string(text)
    if shape == "array":
        item = draw(st.sampled_from([_VT.UINT32, _VT.INT32, _VT.FLOAT32, _VT.STRING, _VT.UINT64, _VT.BOOL, _VT.ARRAY]))
        items = draw(st.lists(st.integers(0, 2**31 - 1), max_size=4))
        if item == _VT.STRING:
            body = b"".join(gguf_string(str(i).encode()) for i in items)
        elif item == _VT.FLOAT32:
            body = b"".join(struct.pack("<f", float(i)) for i in items)
        elif item == _VT.UINT64:
            body = b"".join(struct.pack("<Q", i) for i in items)
        elif item == _VT.BOOL:
            body = bytes(i & 1 for i in items)
        else:
            body = b"".join(struct.pack("<I", i) for i in items)
        count = draw(st.sampled_from([len(items), len(items), 2**32 - 1, 2**63, 2**64 - 1]))
        return int(_VT.ARRAY), struct.pack("<IQ", item, count) + body
    return draw(st.integers(0, 2**32 - 1)), draw(st.binary(max_size=16))


_KEYS = [
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.context_length",
    "llama.rope.dimension_count",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.vocab_size",
    "llama.expert_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.rope.scale_linear",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "general.architecture",
    "general.alignment",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
    "x.other",
    "llama.rope.scaling.original_context_length",
    "llama.rope.scaling.yarn_log_multiplier",
    "llama.rope.scaling.yarn_beta_fast",
    "llama.rope.scaling.attn_factor",
    "llama.attention.sliding_window",
    "gemma3.attention.sliding_window",
    "gemma3.final_logit_softcapping",
]


@pytest.fixture(scope="module")
def raw_tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> RawGGUF:
    return RawGGUF(write_gguf(tmp_path_factory.mktemp("mutate") / "tiny.gguf"))


def convert_mutated(
    lib: Library, raw: RawGGUF, dtype: str, *, n_tensors: int | None = None, n_kv: int | None = None
) -> None:
    """Convert the edited file: success or ConversionError naming the file, nothing else; a bundle it wrote
    loads in the engine or is refused with a code (INVALID_FORMAT, UNSUPPORTED), never a crash."""
    with tempfile.TemporaryDirectory() as tmp:
        src = raw.write(Path(tmp) / "m.gguf", n_tensors=n_tensors, n_kv=n_kv)
        try:
            out = convert_gguf(src, Path(tmp) / "m.base", dtype=dtype, progress=False)  # type: ignore[arg-type]
        except ConversionError as exc:
            assert str(src) in str(exc)
            return
        m = lib.baseRT_load_model_ex(os.fsencode(out), None, 64, None)
        if m:
            lib.baseRT_free_model(m)
        else:
            assert lib.baseRT_get_error_code() in (4, 5), lib.baseRT_get_error()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(st.tuples(st.sampled_from(_KEYS), st.none() | gguf_values()), min_size=1, max_size=3),
    counts=st.sampled_from(
        [(None, None)] * 4 + [(2**64 - 1, None), (None, 2**64 - 1), (10**6, None), (None, 10**6), (0, None)]
    ),
    dtype=st.sampled_from(["f32", "q4"]),
)
def test_mutated_metadata_converts_or_raises_conversion_error(
    lib: Library,
    raw_tiny_gguf: RawGGUF,
    edits: list[tuple[str, tuple[int, bytes] | None]],
    counts: tuple[int | None, int | None],
    dtype: str,
) -> None:
    """Any metadata key set to any type and value (or removed), and the header's counts, over a valid tiny
    GGUF: the converter succeeds or raises ConversionError, never another exception and never a runaway."""
    raw = raw_tiny_gguf.edited(edits)
    convert_mutated(lib, raw, dtype, n_tensors=counts[0], n_kv=counts[1])


def edit_tensor_info(raw: RawGGUF, name: str, dims: list[int] | None, kind: int | None) -> None:
    """Rewrite one tensor's entry in raw's tensor table: its dims (GGUF order, fastest first) and / or its
    GGML type; its data offset is kept (the data is not resized)."""
    out, offs, infos = b"", 0, raw.infos
    while offs < len(infos):
        (n,) = struct.unpack_from("<Q", infos, offs)
        (nd,) = struct.unpack_from("<I", infos, offs + 8 + n)
        start, at = offs, offs + 8 + n + 4
        old_dims = list(struct.unpack_from(f"<{nd}Q", infos, at))
        old_kind, off = struct.unpack_from("<IQ", infos, at + 8 * nd)
        offs = at + 8 * nd + 12
        if infos[start + 8 : start + 8 + n].decode() != name:
            out += infos[start:offs]
            continue
        d = old_dims if dims is None else dims
        out += infos[start : start + 8 + n] + struct.pack(f"<I{len(d)}Q", len(d), *d)
        out += struct.pack("<IQ", old_kind if kind is None else kind, off)
    raw.infos = out


_PHI3_TENSORS = [
    "blk.0.attn_qkv.weight",
    "blk.1.attn_qkv.weight",
    "blk.0.ffn_up.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
    "blk.0.ffn_down.weight",
    "token_embd.weight",
]
_Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def raw_phi3_ggufs(tmp_path_factory: pytest.TempPathFactory) -> list[RawGGUF]:
    """phi3's fused GGUFs (attn_qkv, gate|up ffn_up): plain, with LongRoPE's factor tensors, and in Q4_K."""
    d = tmp_path_factory.mktemp("mutate-phi3")
    return [
        RawGGUF(write_gguf(d / "phi3.gguf", arch="phi3")),
        RawGGUF(write_gguf(d / "phi3-long.gguf", arch="phi3", longrope=True)),
        RawGGUF(write_gguf(d / "phi3-k.gguf", arch="phi3", matrices=_Q.Q4_K, dim=256, ffn=256)),
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    base=st.integers(0, 2),
    edits=st.lists(
        st.tuples(st.sampled_from([k.replace("llama.", "phi3.") for k in _KEYS]), st.none() | gguf_values()), max_size=2
    ),
    tensors=st.lists(
        st.tuples(
            st.sampled_from(_PHI3_TENSORS),
            st.none()
            | st.lists(
                st.sampled_from([0, 1, 2, 3, 31, 32, 64, 96, 128, 192, 256, 320, 585, 2**40]), min_size=1, max_size=3
            ),
            st.none() | st.sampled_from([_Q.F32, _Q.F16, _Q.Q8_0, _Q.Q4_K, _Q.Q6_K, _Q.I32, _Q.BF16, 99]),
        ),
        min_size=1,
        max_size=2,
    ),
    dtype=st.sampled_from(["auto", "q4"]),
)
def test_mutated_phi3_converts_or_raises_conversion_error(
    lib: Library,
    raw_phi3_ggufs: list[RawGGUF],
    base: int,
    edits: list[tuple[str, tuple[int, bytes] | None]],
    tensors: list[tuple[str, list[int] | None, int | None]],
    dtype: str,
) -> None:
    """phi3's fused GGUFs with their tensor table edited (a fused attn_qkv / ffn_up of other shapes: rows not
    q + 2 kv heads or not 2 x ffn, the wrong width, a type the split cannot carry; LongRoPE factor tensors
    of the wrong length or type, or given to a file without them) and phi3.* metadata of any value: the
    converter succeeds or raises ConversionError, and what it writes loads or is refused with a code."""
    raw = raw_phi3_ggufs[base].edited(edits)
    for name, dims, kind in tensors:
        edit_tensor_info(raw, name, dims, None if kind is None else int(kind))
    convert_mutated(lib, raw, dtype)


@pytest.mark.parametrize(
    "kind, value", [(_VT.UINT32, 2**32 - 1), (_VT.UINT64, 2**64 - 1), (_VT.INT64, 2**62), (_VT.UINT32, 3)]
)
def test_block_count_beyond_the_tensor_table_is_refused_before_allocating(
    raw_tiny_gguf: RawGGUF, tmp_path: Path, kind: gguf.GGUFValueType, value: int
) -> None:
    """block_count 2^32 - 1 used to build a 2^32-layer table of expected shapes (memory without bound); every
    count is bounded by what the file holds before anything is sized by it."""
    raw = raw_tiny_gguf.edited([("llama.block_count", (int(kind), struct.pack(_INT_TYPES[kind][0], value)))])
    src = raw.write(tmp_path / "layers.gguf")
    with pytest.raises(ConversionError, match="block_count"):
        convert_gguf(src, tmp_path / "out.base", progress=False)


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_weights_whose_group_scale_overflows_f16_are_refused(
    raw_tiny_gguf: RawGGUF, tmp_path: Path, dtype: str
) -> None:
    """Finite f32 weights of a range past f16 (|w| ~ 1e7: scale = range / 15 or / 255 > 65504) used to be
    written with an Inf group scale, which the engine now refuses at load: the converter refuses first,
    naming the tensor."""
    raw = copy.copy(raw_tiny_gguf)
    body = bytearray(raw.body)
    at = raw.offsets["blk.0.attn_v.weight"]  # an F32 tensor of the tiny GGUF
    body[at : at + 8] = np.array([3e7, -3e7], dtype="<f4").tobytes()
    raw.body = bytes(body)
    src = raw.write(tmp_path / "big.gguf")
    with pytest.raises(ConversionError, match=r"blk\.0\.attn_v\.weight.*non-finite group scale"):
        convert_gguf(src, tmp_path / "out.base", dtype=dtype, progress=False)  # type: ignore[arg-type]
    convert_gguf(src, tmp_path / "out.base", dtype="f32", progress=False)  # representable as f32


@pytest.mark.parametrize(("qtype", "at"), [("Q4_K", 0), ("Q4_K", 2), ("Q5_K", 0), ("Q5_K", 2), ("Q6_K", 208)])
@pytest.mark.parametrize("value", [b"\x00\x7e", b"\x00\x7c", b"\x00\xfc"], ids=["NaN", "+Inf", "-Inf"])
def test_k_blocks_with_a_non_finite_super_block_scale_are_refused(
    tmp_path: Path, qtype: str, at: int, value: bytes
) -> None:
    """K blocks `auto` carries byte for byte, one of whose f16 d / dmin is NaN or Inf (every value of its
    super-block non-finite): the engine refuses such a bundle at load, so the converter refuses first, naming
    the tensor (the other dtypes dequantize it and refuse the non-finite values, as before)."""
    kind = gguf.GGMLQuantizationType[qtype]
    raw = RawGGUF(write_gguf(tmp_path / "k.gguf", matrices=kind, dim=256, ffn=512))
    body = bytearray(raw.body)
    start = raw.offsets["blk.1.ffn_down.weight"] + 5 * gguf.GGML_QUANT_SIZES[kind][1] + at  # the 6th super-block
    body[start : start + 2] = value
    raw.body = bytes(body)
    src = raw.write(tmp_path / "bad.gguf")
    with pytest.raises(ConversionError, match=r"blk\.1\.ffn_down\.weight.*super-block 5.*non-finite"):
        convert_gguf(src, tmp_path / "out.base", dtype="auto", progress=False)
    with pytest.raises(ConversionError, match=r"blk\.1\.ffn_down\.weight"):
        convert_gguf(src, tmp_path / "out.base", dtype="f32", progress=False)


@pytest.mark.parametrize("value", [0.0, -1.0])
@pytest.mark.parametrize("name", ["rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight"])
def test_rope_divisors_that_are_not_positive_are_refused(tmp_path: Path, name: str, value: float) -> None:
    """A zero or negative RoPE frequency divisor (Llama 3's rope_freqs, Phi-3's LongRoPE factors), which the
    engine refuses at load: the converter refuses first, naming the tensor."""
    kw: dict[str, object] = {"rope_freqs": True} if name == "rope_freqs.weight" else {"arch": "phi3", "longrope": True}
    raw = RawGGUF(write_gguf(tmp_path / "r.gguf", **kw))  # type: ignore[arg-type]
    body = bytearray(raw.body)
    at = raw.offsets[name] + 4 * 3
    body[at : at + 4] = struct.pack("<f", value)
    raw.body = bytes(body)
    with pytest.raises(ConversionError, match=name.replace(".", r"\.") + ".*must be positive"):
        convert_gguf(raw.write(tmp_path / "bad.gguf"), tmp_path / "out.base", progress=False)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("tokenizer.ggml.add_bos_token", (int(_VT.FLOAT32), struct.pack("<f", float("inf"))), "NaN or infinite"),
        (
            "tokenizer.ggml.token_type",
            (int(_VT.ARRAY), struct.pack("<IQf", _VT.FLOAT32, 1, float("nan"))),
            "NaN or infinite",
        ),
        ("tokenizer.chat_template", (int(_VT.UINT8), b"\x05"), "chat_template must be a string"),
        ("llama.rope.freq_base", (int(_VT.STRING), gguf_string(b"")), "freq_base' must be a finite number"),
    ],
)
def test_metadata_the_bundle_header_cannot_hold_is_refused(
    raw_tiny_gguf: RawGGUF, tmp_path: Path, key: str, value: tuple[int, bytes], match: str
) -> None:
    """Examples the metadata property found: a NaN / Inf the strict-JSON header cannot carry, a template that
    is not text, a number that is a string (they escaped as ValueError)."""
    raw = raw_tiny_gguf.edited([(key, value)])
    with pytest.raises(ConversionError, match=match):
        convert_gguf(raw.write(tmp_path / "m.gguf"), tmp_path / "m.base", progress=False)
