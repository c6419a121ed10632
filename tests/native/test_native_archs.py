"""Every architecture the reference engine runs (docs/models.md), on tiny random models the suite
builds: logits against the numpy oracle of that architecture (tests/oracle.py, written from
llama.cpp's graphs), batched == solo bit for bit, and the loader's refusals. The kernel sets
other than this CPU's best run this file again (tests/native/test_native_isa.py)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from quantized import quantize_bundle
from raw_abi import coded_error, load, step_logits

from aiobasert._ffi import BaseRTModelConfig, Library
from aiobasert.models.bundle import read_bundle, write_bundle
from aiobasert.models.convert import convert_gguf
from aiobasert.models.tiny import build_tiny_model, llama3_rope_factors
from tests.oracle import LlamaForward, NumpyLlama, f16_close, gguf_oracle, prompt
from tests.tiny_gguf import ARCH_GGUFS, write_gguf

UNSUPPORTED, INVALID_FORMAT = 5, 4
MAX_CONTEXT = 256

# One tiny model per architecture feature. Small windows, few heads and a prefill chunk
# of 16 make a 40-token prompt cross pages, chunks and the sliding window.
MODELS: dict[str, dict[str, Any]] = {
    "llama3_rope_freqs": dict(arch="llama", rope_freqs=llama3_rope_factors(16, 10000.0, original_context_length=256)),
    "llama_linear": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # HF's config form of Llama 3.1's scaling (no rope_freqs tensor): the engine computes the divisors
    "llama3_config": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "qwen2_yarn": dict(
        arch="qwen2",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "qwen3": dict(arch="qwen3", head_dim=32),  # q_dim 128 != dim 64
    "phi3": dict(arch="phi3"),  # llama's tensors (the converter split the fused ones), NeoX RoPE
    "gemma3": dict(
        arch="gemma3",
        n_layers=3,
        head_dim=32,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16.0,  # not head_dim: the attention scale comes from the config
        final_logit_softcapping=5.0,
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def arch_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kwargs = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False) | MODELS[request.param]
    return build_tiny_model(tmp_path_factory.mktemp("arch") / f"{request.param}.base", **kwargs)


@pytest.fixture
def engine(lib: Library, arch_model: Path) -> Iterator[int]:
    m = load(lib, arch_model, MAX_CONTEXT, max_batch_size=8, prefix_cache=1, prefill_chunk=16)
    yield m
    lib.baseRT_free_model(m)


def test_logits_match_the_architecture_oracle(lib: Library, engine: int, arch_model: Path) -> None:
    oracle = NumpyLlama(arch_model)
    tokens = prompt(40, 1, oracle.config.vocab_size)
    s = int(lib.baseRT_sequence_create(engine))
    rows = step_logits(lib, engine, [s], [tokens])
    assert f16_close(rows[0], oracle.logits(tokens)[-1]) <= 1.0
    for _ in range(4):  # decode steps read the KV the prefill wrote
        tokens.append(int(rows[0].argmax()))
        rows = step_logits(lib, engine, [s], [[tokens[-1]]])
        assert f16_close(rows[0], oracle.logits(tokens)[-1]) <= 1.0


def test_batched_equals_solo(lib: Library, engine: int, arch_model: Path) -> None:
    """Lanes of different lengths share steps (prefill chunks next to decode rows); each
    lane's logits equal, bit for bit, those of the same lane stepped alone."""
    vocab = read_bundle(arch_model).config["vocab_size"]
    prompts = [prompt(n, 20 + i, vocab) for i, n in enumerate([37, 3, 21, 1])]
    batched = [int(lib.baseRT_sequence_create(engine)) for _ in prompts]
    alone = [int(lib.baseRT_sequence_create(engine)) for _ in prompts]
    feeds = prompts
    for _ in range(4):  # the prompts, then decode steps next to each other
        rows = step_logits(lib, engine, batched, feeds)
        solo = [step_logits(lib, engine, [s], [f])[0] for s, f in zip(alone, feeds, strict=True)]
        for i in range(len(prompts)):
            np.testing.assert_array_equal(rows[i], solo[i])
        feeds = [[int(r.argmax())] for r in rows]


def test_quantized_matrices_track_the_oracle(lib: Library, arch_model: Path, tmp_path: Path) -> None:
    """base_q4 matrices (biases and norms stay f32): within the bound test_native_quant holds the llama
    layout to, against the oracle that rounds every matmul input as the integer kernels do."""
    path = quantize_bundle(arch_model, tmp_path / "q4.base", "base_q4")
    m = load(lib, path, MAX_CONTEXT, max_batch_size=2, prefill_chunk=16)
    try:
        tokens = prompt(30, 4, read_bundle(path).config["vocab_size"])
        got = step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], [tokens])[0].astype(np.float64)
        exact = NumpyLlama(path, q8_inputs=True).logits(tokens)[-1]
        assert np.abs(got - exact).max() / np.abs(exact).max() < 0.02
        assert np.corrcoef(got, NumpyLlama(path).logits(tokens)[-1])[0, 1] > 0.999
    finally:
        lib.baseRT_free_model(m)


def test_the_architecture_matters(arch_model: Path) -> None:
    """The oracle is not blind to the features: read as a plain llama, each model's logits differ."""
    bundle = read_bundle(arch_model)
    oracle = NumpyLlama(arch_model)
    cfg = oracle.config
    plain = LlamaForward(
        dataclasses.replace(
            cfg, arch="llama", rope=None, local_rope=None, sliding=(), attn_scale=None, final_softcap=0.0
        ),
        bundle.tensor,
    )
    tokens = prompt(24, 3, cfg.vocab_size)
    assert np.abs(oracle.logits(tokens) - plain.logits(tokens)).max() > 0.05


@pytest.mark.parametrize("kind", list(ARCH_GGUFS))
def test_converted_gguf_runs_within_the_gguf_oracle_bound(lib: Library, tmp_path: Path, kind: str) -> None:
    """A GGUF of each architecture (llama.cpp's key and tensor names), converted, runs in the engine
    with logits within the bound of the oracle that reads the GGUF itself."""
    src = write_gguf(tmp_path / f"{kind}.gguf", **ARCH_GGUFS[kind])
    out = convert_gguf(src, tmp_path / "out.base", dtype="f32", progress=False)
    oracle = gguf_oracle(src)
    m = load(lib, out, MAX_CONTEXT, max_batch_size=2, prefill_chunk=16)
    try:
        tokens = prompt(30, 5, oracle.config.vocab_size)
        rows = step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], [tokens])
        assert f16_close(rows[0], oracle.logits(tokens)[-1]) <= 1.0
    finally:
        lib.baseRT_free_model(m)


@pytest.mark.parametrize("context", [64, 65, MAX_CONTEXT])
def test_phi3_longrope_takes_the_factors_llama_cpp_takes_for_the_context(
    lib: Library, tmp_path: Path, context: int
) -> None:
    """Phi-3's 128k LongRoPE (original context 64): loaded for a context above 64 per sequence, the engine
    divides by rope_factors_long, else by rope_factors_short (llama.cpp's get_rope_factors), q and k scaled
    by attn_factor; against the GGUF-reading oracle for that context, which the choice changes."""
    src = write_gguf(tmp_path / "long.gguf", arch="phi3", longrope=True, qk_std=0.5)
    out = convert_gguf(src, tmp_path / "long.base", dtype="f32", progress=False)
    oracle, other = gguf_oracle(src, context), gguf_oracle(src, 64 if context > 64 else MAX_CONTEXT)
    m = load(lib, out, context, max_batch_size=2, prefill_chunk=16)
    try:
        tokens = prompt(40, 8, oracle.config.vocab_size)
        rows = step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], [tokens])
        want = oracle.logits(tokens)[-1]
        assert f16_close(rows[0], want) <= 1.0
        assert f16_close(rows[0], other.logits(tokens)[-1]) > 10.0  # the other factors give other logits
        assert oracle.config.rope is not None and oracle.config.rope.attn_factor > 1.0
        unscaled = dataclasses.replace(oracle.config, rope=dataclasses.replace(oracle.config.rope, attn_factor=1.0))
        assert f16_close(rows[0], LlamaForward(unscaled, oracle._weight).logits(tokens)[-1]) > 10.0
        np.testing.assert_allclose(NumpyLlama(out, context=context).logits(tokens)[-1], want, rtol=0, atol=1e-9)
    finally:
        lib.baseRT_free_model(m)


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan")])
@pytest.mark.parametrize(("context", "factors"), [(64, "rope_factors_short"), (MAX_CONTEXT, "rope_factors_long")])
def test_phi3_longrope_factors_that_are_no_divisors_are_refused(
    lib: Library, tmp_path: Path, context: int, factors: str, value: float
) -> None:
    """A LongRoPE factor (the set the context picks) of zero, below zero or NaN in a hostile bundle is refused
    in one line naming the tensor: a zero one made the logits NaN. The other set is not read."""
    src = write_gguf(tmp_path / "long.gguf", arch="phi3", longrope=True)
    out = convert_gguf(src, tmp_path / "long.base", dtype="f32", progress=False)
    bad = _rewrite(out, tmp_path / "bad.base", value=(f"{factors}.weight", 5, value))
    assert not lib.baseRT_load_model(str(bad).encode(), None, context)
    code, text = coded_error(lib)
    assert code == INVALID_FORMAT and f"'{factors}.weight': RoPE frequency divisor 5 is" in text, text
    other = "rope_factors_long" if factors == "rope_factors_short" else "rope_factors_short"
    unread = _rewrite(out, tmp_path / "fine.base", value=(f"{other}.weight", 5, value))
    fine = lib.baseRT_load_model(str(unread).encode(), None, context)
    assert fine, coded_error(lib)
    lib.baseRT_free_model(fine)


PHI3_STORED = {"F16": "f16", "Q8_0": "base_q8", "Q4_K": "ggml_q4_k"}


@pytest.mark.parametrize("qtype", list(PHI3_STORED))
def test_phi3_fused_matrices_split_exactly_in_their_own_type(lib: Library, tmp_path: Path, qtype: str) -> None:
    """Phi-3's fused attn_qkv and gate|up ffn_up, every matrix in one GGML type, converted with auto: each
    part stays in the GGUF's type (a row split of whole blocks, no requantization) and holds exactly the
    rows the oracle cuts from the fused tensor itself; the engine tracks that oracle, batched == solo."""
    kind = gguf.GGMLQuantizationType[qtype]
    dims = {"dim": 256, "ffn": 512} if qtype.endswith("_K") else {}
    src = write_gguf(tmp_path / "phi3.gguf", arch="phi3", matrices=kind, seed=9, **dims)
    path = convert_gguf(src, tmp_path / "auto.base", dtype="auto", progress=False)
    bundle, ref = read_bundle(path), gguf_oracle(src)
    for layer in range(ref.config.n_layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            name = f"layers.{layer}.{part}.weight"
            assert bundle.tensors[name].dtype == PHI3_STORED[qtype], name
            np.testing.assert_array_equal(bundle.tensor(name).astype(np.float32), ref._weight(name), err_msg=name)
    m = load(lib, path, MAX_CONTEXT, max_batch_size=4, prefill_chunk=16)
    try:
        prompts = [prompt(n, 30 + n, ref.config.vocab_size) for n in (29, 4, 1)]
        batched = [int(lib.baseRT_sequence_create(m)) for _ in prompts]
        rows = step_logits(lib, m, batched, prompts)
        for p, row in zip(prompts, rows, strict=True):
            assert step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], [p])[0].tobytes() == row.tobytes()
            want = ref.logits(p)[-1]
            if qtype == "F16":
                assert f16_close(row, want) <= 1.0
            else:  # the integer kernels round each matmul input to q8 (test_native_quant's bound)
                exact = NumpyLlama(path, q8_inputs=True).logits(p)[-1]
                assert np.abs(row - exact).max() / np.abs(exact).max() < 0.02
                assert np.corrcoef(row, want)[0, 1] > 0.999
    finally:
        lib.baseRT_free_model(m)


def test_a_zero_soft_cap_is_none(lib: Library, tmp_path: Path) -> None:
    """HF configs write 0 or null for "no soft-capping": both load as none."""
    kwargs = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False) | MODELS["gemma3"]
    path = build_tiny_model(tmp_path / "g.base", **(kwargs | {"final_logit_softcapping": 0.0}))
    m = load(lib, path, MAX_CONTEXT)
    try:
        tokens = prompt(12, 6, read_bundle(path).config["vocab_size"])
        rows = step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], [tokens])
        ref = NumpyLlama(path).logits(tokens)[-1]
        assert np.abs(ref).max() > 5.0  # a cap of 5 would have bounded these
        assert f16_close(rows[0], ref) <= 1.0
    finally:
        lib.baseRT_free_model(m)


# ---- refusals: one line naming the reason -------------------------------------------------


def _rewrite(
    src: Path,
    dst: Path,
    *,
    arch: str | None = None,
    drop: str | None = None,
    config: dict[str, Any] | None = None,
    value: tuple[str, int, float] | None = None,
) -> Path:
    """src's bundle with its arch / config changed, a tensor dropped or (value) one element of one set."""
    bundle = read_bundle(src)
    header = json.loads(json.dumps(bundle.header))
    del header["tensors"]
    if arch is not None:
        header["arch"] = arch
    header["config"] |= config or {}

    def data(name: str) -> Any:
        t = np.array(bundle.tensor(name), dtype=np.float32)
        if value is not None and value[0] == name:
            t.reshape(-1)[value[1]] = value[2]
        return t

    tensors = [(name, data(name), info.compute_region, "f32") for name, info in bundle.tensors.items() if name != drop]
    write_bundle(dst, header, tensors)
    return dst


@pytest.mark.parametrize(
    ("model", "change", "code", "message"),
    [
        ("qwen2_yarn", dict(arch="llama"), UNSUPPORTED, "is not part of the llama layout"),
        (
            "qwen2_yarn",
            dict(drop="layers.1.self_attn.k_proj.bias"),
            INVALID_FORMAT,
            "missing tensor 'layers.1.self_attn.k_proj.bias'",
        ),
        ("qwen3", dict(arch="phi2"), UNSUPPORTED, "arch 'phi2' is not supported"),
        ("qwen3", dict(arch="phi3"), UNSUPPORTED, "'layers.0.self_attn.q_norm.weight' is not part of the phi3 layout"),
        ("phi3", dict(config={"sliding_window": 4}), UNSUPPORTED, "sliding-window layers are not part of arch 'phi3'"),
        ("gemma3", dict(drop="layers.0.mlp.out_norm.weight"), INVALID_FORMAT, "mlp.out_norm.weight"),
        ("qwen3", dict(config={"sliding_window": 4}), UNSUPPORTED, "sliding-window layers are not part of arch"),
        (
            "llama_linear",
            dict(config={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
            UNSUPPORTED,
            "rope_type 'dynamic' is not supported",
        ),
        (
            "phi3",
            dict(config={"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 64}}),
            INVALID_FORMAT,
            "missing tensor 'rope_factors_long.weight' (config.rope_scaling is longrope)",
        ),
        (
            "llama_linear",
            dict(config={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
            INVALID_FORMAT,
            "original_max_position_embeddings is missing",
        ),
        ("gemma3", dict(config={"layer_types": ["full_attention"]}), INVALID_FORMAT, "one type per layer"),
        ("gemma3", dict(config={"final_logit_softcapping": -30.0}), INVALID_FORMAT, "final_logit_softcapping"),
        ("gemma3", dict(config={"sliding_window": 0}), INVALID_FORMAT, "sliding_window"),
        ("llama3_rope_freqs", dict(arch="qwen2"), UNSUPPORTED, "'rope_freqs.weight' is not part of the qwen2 layout"),
        # frequency divisors a hostile bundle may hold: RoPE's angles would be NaN (zero) or nonsense
        *(
            (
                "llama3_rope_freqs",
                dict(value=("rope_freqs.weight", 3, v)),
                INVALID_FORMAT,
                "'rope_freqs.weight': RoPE frequency divisor 3 is",
            )
            for v in (0.0, -1.0, float("nan"), float("inf"))
        ),
    ],
)
def test_refusals_name_the_reason(
    lib: Library, tmp_path: Path, model: str, change: dict[str, Any], code: int, message: str
) -> None:
    kwargs = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False) | MODELS[model]
    src = build_tiny_model(tmp_path / "src.base", **kwargs)
    bad = _rewrite(src, tmp_path / "bad.base", **change)
    assert not lib.baseRT_load_model(str(bad).encode(), None, MAX_CONTEXT)
    got_code, text = coded_error(lib)
    assert message in text and "\n" not in text, text
    assert got_code == code, text


def test_a_foreign_architecture_still_loads_its_tokenizer(lib: Library, tmp_path: Path) -> None:
    """Tokenizer-only loads read any architecture's vocabulary, whatever its config says; the
    full load refuses the architecture."""
    kwargs = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, tied=False) | MODELS["gemma3"]
    src = build_tiny_model(tmp_path / "src.base", **kwargs)
    bad = _rewrite(src, tmp_path / "phi2.base", arch="phi2")  # keeps gemma3's sliding_window keys
    m = lib.baseRT_load_tokenizer_only(str(bad).encode())
    assert m, coded_error(lib)
    try:
        config = BaseRTModelConfig()
        lib.baseRT_get_config_into(m, ctypes.byref(config), ctypes.sizeof(config))
        assert config.architecture == b"phi2"
        assert lib.baseRT_is_eos_token(m, 2)
    finally:
        lib.baseRT_free_model(m)
    assert not lib.baseRT_load_model(str(bad).encode(), None, MAX_CONTEXT)


# ---- end markers: each family's, asked of the engine -----------------------------------------

# Appended to the tiny vocabulary: Gemma's turn markers (older Gemma GGUFs store <end_of_turn> as a
# normal token, type 1), Llama 3's end-of-turn / end-of-message markers, and a token only the GGUF's
# tokenizer.ggml.eot_token_id names.
FAMILY_TOKENS = (("<start_of_turn>", 3), ("<end_of_turn>", 1), ("<|eot_id|>", 3), ("<|eom_id|>", 3), ("<|my_end|>", 3))


@pytest.fixture(scope="module")
def family_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = len(
        read_bundle(build_tiny_model(tmp_path_factory.mktemp("v") / "v.base")).tokenizer["tokenizer.ggml.tokens"]
    )
    return build_tiny_model(
        tmp_path_factory.mktemp("family") / "family.base",
        extra_tokens=FAMILY_TOKENS,
        tokenizer_keys={"tokenizer.ggml.eot_token_id": base + 4},
    )


def test_every_family_end_marker_ends_generation(lib: Library, family_vocab_model: Path) -> None:
    """llama.cpp's end-of-generation set: the markers by their text whatever their token type, and
    the GGUF's eot / eom ids; a turn's opening marker and ordinary tokens are not in it."""
    tokens = read_bundle(family_vocab_model).tokenizer["tokenizer.ggml.tokens"]
    m = lib.baseRT_load_tokenizer_only(str(family_vocab_model).encode())
    assert m, coded_error(lib)
    try:
        ends = {t for t in range(len(tokens)) if lib.baseRT_is_eos_token(m, t)}
    finally:
        lib.baseRT_free_model(m)
    named = {tokens[t] for t in ends}
    assert named == {"<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|my_end|>"}
