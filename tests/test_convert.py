"""GGUF -> .base conversion: synthetic GGUFs (fast) and the real SmolLM2-135M-Instruct (slow)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from oracle import NumpyLlama, gguf_oracle
from tiny_gguf import DIM, FFN, HEAD_DIM, HEADS, KV_HEADS, LAYERS, write_gguf
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE

from aiobasert import convert as convert_module
from aiobasert import models
from aiobasert.bundle import Bundle, read_bundle
from aiobasert.convert import ConversionError, convert_gguf, main
from aiobasert.tiny import CHATML_TEMPLATE, tiny_vocab


def assert_matches_gguf(bundle: Bundle, gguf_path: Path, dtype: str) -> None:
    """Every bundle tensor equals the dequantized GGUF tensor it came from (up to f16 rounding)."""
    reader = gguf.GGUFReader(gguf_path)
    sources = {t.name: t for t in reader.tensors}
    expected_names = {convert_module._canonical_name(name) for name in sources}
    assert set(bundle.tensors) == expected_names
    for gguf_name, source in sources.items():
        name = convert_module._canonical_name(gguf_name)
        assert name is not None
        reference = gguf.quants.dequantize(source.data, source.tensor_type).astype(np.float32)
        got = bundle.tensor(name)
        assert got.shape == reference.shape, name
        info = bundle.tensors[name]
        if reference.ndim == 1 or dtype == "f32":
            assert info.dtype == "f32"
            np.testing.assert_array_equal(got, reference, err_msg=name)
        else:
            assert info.dtype == "f16"
            # Round to nearest f16: within half an f16 ulp (2^-11 relative), or the subnormal step.
            np.testing.assert_allclose(got, reference, rtol=2**-11, atol=2**-25, err_msg=name)


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
    np.testing.assert_allclose(NumpyLlama(out).logits(tokens), gguf_oracle(synthetic_gguf).logits(tokens), atol=1e-9)


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
        (lambda p: write_gguf(p, arch="qwen2"), "unsupported architecture 'qwen2'"),
        (lambda p: write_gguf(p, extra_kv={"llama.rope.scaling.type": "linear"}), "RoPE scaling"),
        (lambda p: write_gguf(p, extra_kv={"llama.rope.scaling.factor": 4.0}), "RoPE scaling"),
        (lambda p: write_gguf(p, extra_kv={"llama.expert_count": 8}), "mixture of experts"),
        (lambda p: write_gguf(p, extra_kv={"llama.attention.key_length": 32}), "key_length"),
        (lambda p: write_gguf(p, extra_tensors=("rope_freqs.weight",)), "unsupported tensor 'rope_freqs.weight'"),
        (lambda p: write_gguf(p, extra_tensors=("blk.0.attn_q.bias",)), "unsupported tensor 'blk.0.attn_q.bias'"),
        (lambda p: write_gguf(p, extra_tensors=("blk.2.attn_norm.weight",)), "beyond the 2 configured layers"),
        (lambda p: write_gguf(p, drop=("blk.1.ffn_up.weight",)), "missing tensors: layers.1.mlp.up_proj"),
        (lambda p: write_gguf(p, extra_kv={"llama.feed_forward_length": 100}), "expected \\[100, 64\\]"),
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
        stored = sum(i.length + (i.scale_length or 0) + (i.bias_length or 0)
                     for i in bundle.tensors.values() if len(i.shape) == 2)
        assert stored == size // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize(("qtype", "dtype", "stored"), [(Q.Q6_K, "q8", "base_q8"), (Q.Q6_K, "q4", "base_q4"),
                                                        (Q.Q5_K, "q4", "base_q4"), (Q.Q5_0, "q4", "base_q4")])
def test_blocks_without_an_exact_form_are_converted(tmp_path: Path, qtype: gguf.GGMLQuantizationType, dtype: str,
                                                    stored: str) -> None:
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
    assert dtypes == {"input_norm.weight": "f32", "self_attn.q_proj.weight": "base_q8",
                      "self_attn.k_proj.weight": "f16", "self_attn.v_proj.weight": "f16",
                      "self_attn.o_proj.weight": "base_q8", "post_attn_norm.weight": "f32",
                      "mlp.gate_proj.weight": "f16", "mlp.up_proj.weight": "base_q8",
                      "mlp.down_proj.weight": "f16"}
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
