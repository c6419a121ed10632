"""The tiny random model: a valid llama bundle with a real byte-level BPE vocabulary."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
from oracle import NumpyLlama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from aiobasert.models import tiny
from aiobasert.models.bundle import read_bundle
from aiobasert.models.tiny import build_tiny_model, bytes_to_unicode, pretokenize, tiny_vocab

TRICKY_TEXTS = [
    "Hello world's 12ab  x\n\n  y  ",
    "a 1,234.5 '?'s 🎉🎉 Ñandú  -- it'll they've I'M",
    "  leading spaces\tand\ttabs\r\n\r\nand ²³ Ⅻ ٣ digits",
    "def f(x):\n    return x**2  # comment\n",
    "敏捷的棕色狐狸 こんにちは 안녕하세요 \u3000\xa0nbsp \x85 \x1c",
    "",
    " ",
]


def _hf_pretokenizer() -> pre_tokenizers.PreTokenizer:
    """HF's equivalent of SmolLM2's "smollm" pre-tokenizer."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def test_build_and_contents(tiny_model_path: Path) -> None:
    started = time.perf_counter()
    path = build_tiny_model(tiny_model_path.with_name("again.base"))
    print(f"tiny model built in {1000 * (time.perf_counter() - started):.1f} ms")
    bundle = read_bundle(path)
    header = bundle.header
    assert header["arch"] == "llama" and header["schema"] == 1 and header["quant_scheme"] == "f32"
    assert header["source"]["format"] == "synthetic" and len(header["source"]["sha256"]) == 64
    assert header["flags"] == "0x00000400"
    vocab = tiny_vocab("bpe")
    assert bundle.config == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": len(vocab.tokens),
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "eos_token_ids": [],
    }  # fmt: skip
    tok = bundle.tokenizer
    assert tok["tokenizer_type"] == "gguf" and tok["tokenizer.ggml.model"] == "gpt2"
    assert tok["tokenizer.ggml.pre"] == "smollm"
    assert tok["tokenizer.ggml.tokens"] == list(vocab.tokens)
    assert tok["tokenizer.ggml.merges"] == list(vocab.merges)
    assert tok["tokenizer.chat_template"] == header["metadata"]["tokenizer.chat_template"]
    assert "<|im_start|>" in tok["tokenizer.chat_template"]
    names = set(bundle.tensors)
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 2 * 9
    for name, info in bundle.tensors.items():
        is_norm = name.endswith("norm.weight")
        assert info.dtype == "f32"
        assert info.compute_region == ("gpu" if is_norm or name.startswith("embed") else "accelerator")
    assert bundle.tensor("embed_tokens.weight").shape == (len(vocab.tokens), 64)
    assert bundle.tensor("layers.1.self_attn.k_proj.weight").shape == (32, 64)
    assert bundle.tensor("layers.1.mlp.down_proj.weight").shape == (64, 128)


def test_vocabulary_layout() -> None:
    vocab = tiny_vocab("bpe")
    assert vocab.tokens[:3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert vocab.token_types[:3] == (3, 3, 3)
    assert set(vocab.token_types[3:]) == {1}
    assert set(vocab.tokens[3:259]) == set(bytes_to_unicode().values())
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    assert len(set(vocab.merges)) == len(vocab.merges)
    assert 512 <= len(vocab.tokens) <= 1000
    known = set(vocab.tokens)
    for merge in vocab.merges:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known
    assert tiny_vocab("bytes").merges == () and len(tiny_vocab("bytes").tokens) == 259


def test_merges_stay_inside_pretokens() -> None:
    """Every learned token is a piece of one pre-token of the training text: no
    merge joins two digits or crosses a word / whitespace boundary."""
    pieces = [_byte_level(piece) for piece in pretokenize(tiny._CORPUS)]
    for token in tiny_vocab("bpe").tokens[259:]:
        assert any(token in piece for piece in pieces), token
        assert sum(ch.isdigit() for ch in token) <= 1 or set(token) <= set("0123456789"), token
    assert _byte_level(" the") in tiny_vocab("bpe").tokens  # and it did learn real words


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_pretokenize_matches_hf(text: str) -> None:
    expected = [piece for piece, _ in _hf_pretokenizer().pre_tokenize_str(text)]
    assert [_byte_level(piece) for piece in pretokenize(text)] == expected


def test_pretokenize_matches_hf_fuzzed() -> None:
    alphabet = [*"aZé ß\n\t  '’sltdmrev1٣²Ⅻ,.?!-_😀中\u3000\xa0\x1c\r\x85", "'s", "'ll", "  ", "\n\n"]
    rng = random.Random(0)
    hf = _hf_pretokenizer()
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert [_byte_level(p) for p in pretokenize(text)] == [p for p, _ in hf.pre_tokenize_str(text)], text


def test_vocabulary_loads_in_hf_bpe() -> None:
    """The tokens and merges form a consistent BPE model: HF tokenizers accepts
    them, round-trips text through them, and the merges actually compress."""
    vocab = tiny_vocab("bpe")
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=[(left, right) for left, right in (m.split(" ") for m in vocab.merges)],
    )
    hf = Tokenizer(bpe)
    hf.pre_tokenizer = _hf_pretokenizer()
    hf.decoder = decoders.ByteLevel()
    for text in [*TRICKY_TEXTS, tiny._CORPUS]:
        ids = hf.encode(text).ids
        assert all(i >= 3 for i in ids)
        assert hf.decode(ids) == text
    assert len(hf.encode(tiny._CORPUS).ids) < len(tiny._CORPUS.encode()) / 2


def test_deterministic_by_seed(tmp_path: Path) -> None:
    a = read_bundle(build_tiny_model(tmp_path / "a.base", seed=7))
    b = read_bundle(build_tiny_model(tmp_path / "b.base", seed=7))
    c = read_bundle(build_tiny_model(tmp_path / "c.base", seed=8))
    assert a.header["source"] == b.header["source"] != c.header["source"]
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensor(name), b.tensor(name))
    q_proj = "layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(a.tensor(q_proj), c.tensor(q_proj))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_low_precision_dtypes(tmp_path: Path, dtype: str) -> None:
    ref = read_bundle(build_tiny_model(tmp_path / "ref.base", tied=False))
    low = read_bundle(build_tiny_model(tmp_path / "low.base", tied=False, dtype=dtype))  # type: ignore[arg-type]
    assert low.header["quant_scheme"] == dtype
    tolerance = 2**-11 if dtype == "f16" else 2**-8
    for name, info in low.tensors.items():
        assert info.dtype == ("f32" if name.endswith("norm.weight") else dtype)
        np.testing.assert_allclose(low.tensor(name), ref.tensor(name), rtol=tolerance, atol=1e-7)


def test_untied_and_custom_shapes(tmp_path: Path) -> None:
    path = build_tiny_model(
        tmp_path / "m.base", n_layers=3, dim=96, n_heads=6, n_kv_heads=3, ffn_dim=160, tied=False, vocab="bytes"
    )
    bundle = read_bundle(path)
    assert bundle.header["flags"] == "0x00000000"
    assert bundle.config["tie_word_embeddings"] is False
    assert bundle.config["vocab_size"] == 259
    assert bundle.tensor("lm_head.weight").shape == (259, 96)
    assert bundle.tensor("layers.2.self_attn.q_proj.weight").shape == (96, 96)
    assert bundle.tensor("layers.2.self_attn.v_proj.weight").shape == (48, 96)


def test_forward_is_sane(tiny_model_path: Path) -> None:
    logits = NumpyLlama(tiny_model_path).logits([1, 72, 101, 108, 108, 111, 2, 300])
    assert np.isfinite(logits).all()
    spread = logits.std(axis=1)
    assert (spread > 0.5).all() and (spread < 10).all(), spread  # neither flat nor one-hot
    assert len({int(i) for i in logits.argmax(axis=1)}) > 1  # the prediction depends on the context


def test_eos_bias(tmp_path: Path) -> None:
    prompt = [1, 40, 41, 42, 43, 44, 45, 46]
    likely = NumpyLlama(build_tiny_model(tmp_path / "stop.base", tied=False, eos_bias=30.0)).logits(prompt)
    assert (likely.argmax(axis=1) == tiny.EOS_ID).all()
    never = NumpyLlama(build_tiny_model(tmp_path / "go.base", tied=False, eos_bias=-30.0)).logits(prompt)
    log_probs = never - np.log(np.exp(never).sum(axis=1, keepdims=True))
    assert (log_probs[:, tiny.EOS_ID] < np.log(1e-6)).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 60, "n_heads": 8}, "heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "multiple"),
        ({"eos_bias": 5.0}, "untied"),
        ({"dtype": "q8"}, "dtype"),
        ({"vocab": "words"}, "vocab"),
    ],
)
def test_rejects_bad_parameters(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path / "bad.base", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "bad.base").exists()
