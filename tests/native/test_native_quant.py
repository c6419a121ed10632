"""Quantized weights (base_q8 / base_q4, CANONICAL_QUANT_SPEC.md) in the reference engine.

The engine repacks group-wise quantized matrices at load and multiplies them
with integer dot products against activations quantized per block of 32
(llama.cpp's Q8_0 x Q8 scheme). Checked here: logits of tiny quantized bundles
against the numpy oracle over the dequantized weights (the only difference is
the activation rounding), batch invariance, refusal of layouts the engine
cannot run, and -- on SmolLM2 -- the spec's quality bar: perplexity of the q8
and q4 bundles within 1% of the f16 bundle on a held-out text.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from ctypes import byref, c_uint32, c_void_p
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import raw_abi
from quantized import quantize_bundle
from raw_abi import ints, step_logits, u32

from aiobasert._ffi import BaseRTMemoryStats, Library
from aiobasert.models import cache as models
from aiobasert.models.bundle import read_bundle
from aiobasert.models.convert import convert_gguf
from aiobasert.models.tiny import build_tiny_model
from tests.oracle import LlamaForward, NumpyLlama, gguf_oracle
from tests.tiny_gguf import big_vocab_gguf, k_mix_gguf, real_blocks_gguf, write_gguf

OK, UNSUPPORTED = 0, 5


def load(lib: Library, path: Path, lanes: int = 4) -> int:
    return raw_abi.load(lib, path, 512, max_batch_size=lanes, prefill_chunk=64)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("quant") / "f32.base",
        dim=128,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=256,
        tied=False,
        seed=11,
    )


@pytest.mark.parametrize(
    ("dtype", "group_size", "symmetric"),
    [
        ("base_q8", 32, True),
        ("base_q8", 32, False),
        ("base_q4", 32, False),
        ("base_q4", 64, False),
        ("base_q8", 128, True),
        ("base_q8", 64, False),
    ],
)
def test_quantized_logits_match_the_oracle_over_dequantized_weights(
    lib: Library, tiny_f32: Path, tmp_path: Path, dtype: str, group_size: int, symmetric: bool
) -> None:
    path = quantize_bundle(tiny_f32, tmp_path / "q.base", dtype, group_size=group_size, symmetric=symmetric)
    oracle = NumpyLlama(path)
    m = load(lib, path)
    try:
        tokens = [int(t) for t in np.random.default_rng(2).integers(3, 200, size=30)]
        s = int(lib.baseRT_sequence_create(m))
        got = step_logits(lib, m, [s], [tokens])[0].astype(np.float64)
        ref = oracle.logits(tokens)[-1]
        # Activations are rounded to 8 bits per block of 32 before every matmul: ~1% of the logit scale;
        # the oracle that rounds them the same way leaves float32 / f16-logit noise (~0.03%) and the odd
        # near-tie input rounded the other way (q4 with groups of 64: 1.5%, from one such input).
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 0.03, err
        exact = NumpyLlama(path, q8_inputs=True).logits(tokens)[-1]
        assert np.abs(got - exact).max() / np.abs(exact).max() < 0.02
        assert np.corrcoef(got, ref)[0, 1] > 0.999
    finally:
        lib.baseRT_free_model(m)


# ---- kernel shapes: block tails, tile remainders, both weight layouts ------------------------------
# The kernels work on chunks of 4 blocks of 32 values; rows whose block count is not a multiple of 4 end
# in a short chunk (1, 2 or 3 blocks), and row counts that are not a multiple of the tile take the
# remainder tiles. These shapes walk every such path (dim 96: 3 blocks; 32: 1; ffn 160: 4 + 1;
# 224: 4 + 3; 64 + ffn 96: 2 and 3).
# Rows come in panels of 16: k/v with 8 rows (dim 32 in 4 heads, one kv head) fill half a panel, and the
# tiny vocabulary (not a multiple of 16) ends the LM head in a partial one.
KERNEL_SHAPES = [
    dict(dim=96, n_heads=3, n_kv_heads=1, ffn_dim=160),
    dict(dim=32, n_heads=2, n_kv_heads=1, ffn_dim=224),
    dict(dim=64, n_heads=2, n_kv_heads=2, ffn_dim=96),
    dict(dim=32, n_heads=4, n_kv_heads=1, ffn_dim=96),
]
KERNEL_DTYPES = [("base_q8", True), ("base_q8", False), ("base_q4", False)]


@pytest.fixture(
    scope="module", params=range(len(KERNEL_SHAPES)), ids=lambda i: "dim{dim}-ffn{ffn_dim}".format(**KERNEL_SHAPES[i])
)
def odd_f32(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = KERNEL_SHAPES[request.param]
    return build_tiny_model(tmp_path_factory.mktemp("odd") / "f32.base", tied=True, seed=5, **shape)


def _batched_is_alone_and_near_the_oracles(
    lib: Library,
    m: int,
    prompts: list[list[int]],
    q8_oracle: LlamaForward,
    ref_oracle: LlamaForward,
    *,
    near_ties: int,
    decode_steps: int,
) -> None:
    """Prefill `prompts` batched and each alone on fresh sequences: the rows are equal to the bit, within 2% of
    `q8_oracle` (and within 0.2% for all but `near_ties` prompts) and within 5% of `ref_oracle`; then
    `decode_steps` greedy steps, batched == alone again.

    Against the oracle that rounds every matmul input as the kernels do, what is left is float32
    accumulation and f16 logits (~0.03%), unless an input within float32 noise of a rounding tie goes the
    other way (one in thousands; through the layers of a tiny random model that can move the logits ~1%):
    `near_ties` is how many prompts may show such a flip. Against plain float64 activations the 8-bit
    rounding shows (1-3%, 4% once)."""
    batched = [int(lib.baseRT_sequence_create(m)) for _ in prompts]
    single = [int(lib.baseRT_sequence_create(m)) for _ in prompts]
    rows = step_logits(lib, m, batched, prompts)
    exact_errs: list[float] = []
    for i, p in enumerate(prompts):
        alone = step_logits(lib, m, [single[i]], [p])[0]
        assert alone.tobytes() == rows[i].tobytes(), f"prompt {i}: batched != alone"
        got = alone.astype(np.float64)
        exact = q8_oracle.logits(p)[-1]
        exact_errs.append(np.abs(got - exact).max() / np.abs(exact).max())
        ref = ref_oracle.logits(p)[-1]
        assert np.abs(got - ref).max() / np.abs(ref).max() < 0.05
        assert np.corrcoef(got, ref)[0, 1] > 0.999
    assert max(exact_errs) < 0.02 and sorted(exact_errs)[-1 - near_ties] < 0.002, exact_errs
    for _ in range(decode_steps):  # all rows batched, each row alone
        nxt = [[int(np.argmax(r))] for r in rows]
        rows = step_logits(lib, m, batched, nxt)
        for i in range(len(prompts)):
            assert step_logits(lib, m, [single[i]], nxt[i : i + 1])[0].tobytes() == rows[i].tobytes()


@pytest.mark.parametrize(("dtype", "symmetric"), KERNEL_DTYPES, ids=["q8sym", "q8", "q4"])
def test_quantized_tails_match_the_oracle_and_are_batch_invariant(
    lib: Library, odd_f32: Path, tmp_path: Path, dtype: str, symmetric: bool
) -> None:
    path = quantize_bundle(odd_f32, tmp_path / "q.base", dtype, symmetric=symmetric)
    oracle, q8_oracle = NumpyLlama(path), NumpyLlama(path, q8_inputs=True)
    m = load(lib, path, lanes=8)
    try:
        rng = np.random.default_rng(3)
        # prompt lengths: single rows, every remainder of the 8-row (AVX-512) and 4-row (AVX2) tiles, and a
        # prefill longer than one chunk (prefill_chunk 64)
        prompts = [[int(t) for t in rng.integers(3, 200, size=n)] for n in (1, 2, 3, 5, 6, 7, 9, 70)]
        _batched_is_alone_and_near_the_oracles(lib, m, prompts, q8_oracle, oracle, near_ties=2, decode_steps=3)
    finally:
        lib.baseRT_free_model(m)


# ---- GGUF block types carried into the integer kernels (convert --dtype auto) ---------------------
GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", [*GGUF_TYPES, "Q4_K+", "Q5_K+", "Q6_K+"])
def test_gguf_block_types_run_against_the_oracle_and_are_batch_invariant(
    lib: Library, tmp_path: Path, qtype: str
) -> None:
    """A tiny GGUF whose every matrix is `qtype` (K-quants: hand-written random blocks), converted with
    `auto` (carried exactly: K-quants as GGML's blocks, repacked into the K panels): the engine's
    logits against the oracle over the bundle's weights (which test_convert holds equal to gguf-py's
    dequantization) with the kernels' input rounding, and against the GGUF's own values; batched == alone.
    `+`: K rows of 2 and 3 super-blocks (dim 512, ffn 768) beside 1 and 2; the 585 vocabulary rows end in a
    partial panel."""
    wide, qtype = qtype.endswith("+"), qtype.rstrip("+")
    kind = gguf.GGMLQuantizationType[qtype]
    dims = ({"dim": 512, "ffn": 768} if wide else {"dim": 256, "ffn": 512}) if qtype.endswith("_K") else {}
    src = write_gguf(tmp_path / f"{qtype}.gguf", matrices=kind, seed=9, **dims)
    path = convert_gguf(src, tmp_path / "auto.base", dtype="auto", progress=False)
    q8_oracle, gguf_ref = NumpyLlama(path, q8_inputs=True), gguf_oracle(src)
    n_vocab = int(NumpyLlama(path).config.vocab_size)
    m = load(lib, path, lanes=8)
    try:
        rng = np.random.default_rng(6)
        prompts = [[int(t) for t in rng.integers(3, n_vocab, size=n)] for n in (1, 3, 5, 9, 70)]
        _batched_is_alone_and_near_the_oracles(lib, m, prompts, q8_oracle, gguf_ref, near_ties=1, decode_steps=1)
    finally:
        lib.baseRT_free_model(m)


K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _k_gguf(tmp_path: Path, qtype: str, edit: Any) -> Path:
    """A tiny all-`qtype` GGUF converted with `auto` (its K blocks carried as they are), then edit(block, row)
    rewriting the first four rows' first super-block of the first layer's q and down matrices in the bundle
    (as a hostile bundle may hold them: the converter refuses non-finite ones)."""
    tmp_path.mkdir(exist_ok=True)
    src = write_gguf(tmp_path / "k.gguf", matrices=gguf.GGMLQuantizationType[qtype], seed=4, dim=256, ffn=512)
    path = convert_gguf(src, tmp_path / "k.base", dtype="auto", progress=False)
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + hlen])
    blob = (16 + hlen + 65535) // 65536 * 65536
    size = K_BLOCK_BYTES[qtype]
    for t in header["tensors"]:
        if t["name"].endswith(("layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight")):
            per_row = t["shape"][1] // 256
            for row in range(4):
                at = blob + t["offset"] + row * per_row * size
                block = bytearray(data[at : at + size])
                edit(block, row)
                data[at : at + size] = block
    path.write_bytes(bytes(data))
    return path


F16_NON_FINITE = {"NaN": b"\x00\x7e", "+Inf": b"\x00\x7c", "-Inf": b"\x00\xfc"}


@pytest.mark.parametrize("what", sorted(F16_NON_FINITE))
@pytest.mark.parametrize(
    ("qtype", "field"), [("Q4_K", "d"), ("Q4_K", "dmin"), ("Q5_K", "d"), ("Q5_K", "dmin"), ("Q6_K", "d")]
)
def test_non_finite_k_super_block_scales_are_refused_at_load(
    lib: Library, tmp_path: Path, qtype: str, what: str, field: str
) -> None:
    """A NaN / Inf super-block d or dmin (f16) makes every value of its 256 non-finite, as a base group's NaN
    scale does (which test_native_safety holds refused): refused at load in one line naming the tensor, the
    field and what it is, as those are; the file otherwise the same loads."""
    at = (208 if qtype == "Q6_K" else 0) if field == "d" else 2

    def poison(block: bytearray, row: int) -> None:
        if row == 3:
            block[at : at + 2] = F16_NON_FINITE[what]

    m = lib.baseRT_load_model_ex(os.fsencode(_k_gguf(tmp_path, qtype, poison)), None, 64, None)
    assert not m
    code, msg = int(lib.baseRT_get_error_code()), raw_abi.error(lib)  # 4: BASERT_ERR_INVALID_FORMAT
    assert code == 4 and "layers.0" in msg and f" {field} " in msg, msg
    assert what.lstrip("+-") in msg and "\n" not in msg
    fine = lib.baseRT_load_model_ex(os.fsencode(_k_gguf(tmp_path / "fine", qtype, lambda b, r: None)), None, 64, None)
    assert fine, raw_abi.error(lib)
    lib.baseRT_free_model(fine)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_extreme_k_blocks_compute_without_undefined_behaviour(lib: Library, tmp_path: Path, qtype: str) -> None:
    """Finite but extreme K blocks: d and dmin at f16's largest and smallest, every sub-block scale and min
    at its maximum (Q6_K: int8 scales at -128 and 127). They load, and every step completes (their
    activations overflow to Inf / NaN): prefill, a batch, decode on the argmax. The sanitizer suite runs
    this under UBSan's float-cast-overflow, where a NaN or Inf reaching an integer conversion fails."""
    d_at = 208 if qtype == "Q6_K" else 0

    def extreme(block: bytearray, row: int) -> None:
        block[d_at : d_at + 2] = b"\xff\x7b" if row % 2 == 0 else b"\xff\xfb"  # +-65504
        if qtype == "Q6_K":
            block[192:208] = (b"\x80" if row < 2 else b"\x7f") * 16
        else:
            block[2:4] = b"\xff\x7b" if row < 2 else b"\x01\x00"  # dmin 65504 / the smallest subnormal
            block[4:16] = b"\xff" * 12  # 6-bit scales and mins all 63

    m = raw_abi.load(lib, _k_gguf(tmp_path, qtype, extreme), 64, max_batch_size=4)
    try:
        seqs = [int(lib.baseRT_sequence_create(m)) for _ in range(3)]
        rows = step_logits(lib, m, seqs, [[5, 9, 17, 33, 65], [21, 22], [40]])
        for _ in range(2):
            rows = step_logits(lib, m, seqs, [[int(np.nan_to_num(r.astype(np.float32)).argmax())] for r in rows])
    finally:
        lib.baseRT_free_model(m)


def _to_bf16_scales(src: Path, dst: Path, *, big_bias: bool) -> Path:
    """A copy of a quantized bundle whose first q_proj keeps its scales (and biases) as bf16; with
    big_bias one bias is 70000, past f16's range (it would become inf), so the engine must keep that tensor's
    scales as f32."""
    data = bytearray(src.read_bytes())
    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + hlen])
    blob = (16 + hlen + 65535) // 65536 * 65536
    t = next(t for t in header["tensors"] if t["name"].endswith("layers.0.self_attn.q_proj.weight"))
    for key in ("scale", "bias"):
        if t.get(f"{key}_offset") is None:
            continue
        lo, n = blob + t[f"{key}_offset"], t[f"{key}_length"]
        vals = np.frombuffer(bytes(data[lo : lo + n]), dtype="<f2").astype(np.float32)
        if key == "bias" and big_bias:
            vals[0] = 70000.0
        bits = (vals.view(np.uint32) >> 16).astype("<u2")  # truncation: the oracle reads the same bf16 values
        data[lo : lo + n] = bits.tobytes()
    t["scale_dtype"] = "bf16"
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert len(text) <= blob - 16
    data[8:16] = len(text).to_bytes(8, "little")
    data[16:blob] = text + b"\0" * (blob - 16 - len(text))
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("big_bias", [False, True], ids=["bf16-as-f16", "bf16-kept-f32"])
def test_bf16_scales_are_used_exactly(lib: Library, tiny_f32: Path, tmp_path: Path, big_bias: bool) -> None:
    q = quantize_bundle(tiny_f32, tmp_path / "q.base", "base_q4")
    path = _to_bf16_scales(q, tmp_path / "bf16.base", big_bias=big_bias)
    oracle = NumpyLlama(path)
    m = load(lib, path)
    try:
        tokens = [int(t) for t in np.random.default_rng(4).integers(3, 200, size=20)]
        got = step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], [tokens])[0].astype(np.float64)
        ref = oracle.logits(tokens)[-1]
        assert np.abs(got - ref).max() / np.abs(ref).max() < 0.03
        assert np.corrcoef(got, ref)[0, 1] > 0.999
    finally:
        lib.baseRT_free_model(m)


def _edit_first_quantized(src: Path, dst: Path, **fields: Any) -> Path:
    data = src.read_bytes()
    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + hlen])
    old_blob = (16 + hlen + 65535) // 65536 * 65536
    t = next(t for t in header["tensors"] if t["dtype"].startswith("base_q"))
    t.update(fields)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob = (16 + len(text) + 65535) // 65536 * 65536
    dst.write_bytes(
        data[:8] + len(text).to_bytes(8, "little") + text + b"\0" * (blob - 16 - len(text)) + data[old_blob:]
    )
    return dst


@pytest.mark.parametrize("fields", [{"layout": "metal_lane_strided_q4"}, {"group_size": 16}, {"scale_dtype": "e8m0"}])
def test_unsupported_quantization_is_refused(
    lib: Library, tiny_f32: Path, tmp_path: Path, fields: dict[str, Any]
) -> None:
    q = quantize_bundle(tiny_f32, tmp_path / "q.base", "base_q4")
    bad = _edit_first_quantized(q, tmp_path / "bad.base", **fields)
    assert not lib.baseRT_load_model_ex(os.fsencode(bad), None, 64, None)
    assert lib.baseRT_get_error_code() == UNSUPPORTED, (lib.baseRT_get_error() or b"").decode()


def test_quantized_region_outside_the_file_is_refused(lib: Library, tiny_f32: Path, tmp_path: Path) -> None:
    q = quantize_bundle(tiny_f32, tmp_path / "q.base", "base_q4")
    bad = _edit_first_quantized(q, tmp_path / "bad.base", scale_offset=2**63 - 8)
    assert not lib.baseRT_load_model_ex(os.fsencode(bad), None, 64, None)
    assert lib.baseRT_get_error_code() == 4 and "scale_offset" in (lib.baseRT_get_error() or b"").decode()


# ---- SmolLM2: the quality bar ---------------------------------------------------------------------

HELD_OUT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far faster "
    "than scribes. Within fifty years, presses were operating in more than two hundred cities across Europe, and "
    "millions of volumes had been printed. The spread of printed material changed how knowledge moved: scholars "
    "could compare identical copies of a text, errors could be corrected in later editions, and ideas reached "
    "readers who had never owned a manuscript. Religious reformers, scientists and merchants all used the new "
    "technology to spread their arguments, their discoveries and their prices. Historians still debate how much "
    "of the scientific revolution depended on print, but few doubt that cheap books made literacy more valuable. "
    "By the eighteenth century newspapers, pamphlets and novels filled the shops of every large town, and the "
    "habit of reading silently and alone had become common among the middle classes of many countries. "
    "Meanwhile the tides along the northern coast rose and fell twice a day, and the fishermen who worked them "
    "measured their lives by the weather rather than by any calendar. A storm could keep the boats in harbour for "
    "a week; a calm season could fill the smokehouses and pay the debts of a whole village. Children learned to "
    "mend nets before they learned to read, and the old men on the quay argued about the wind every morning. "
    "In the spring of that year a schoolteacher arrived from the city with two trunks of books and a plan to "
    "open a library in the back room of the chapel. Nobody asked her to do it, and at first few people came. "
    "She kept the door open every evening anyway, lit a lamp, and read aloud to whoever sat on the benches. "
    "By midsummer the benches were full. Fishermen who had never held a novel listened to stories about sailors "
    "on other seas, and their wives borrowed almanacs and cookery books and treatises on the care of bees. "
    "When the autumn storms came and the boats stayed in, the library became the warmest and busiest room in the "
    "village. The teacher wrote to her sister that she had never been so tired or so content. She stayed for "
    "forty years, and when she died the village named the new school after her and kept her lamp on the desk. "
    "Bees, it turns out, are more orderly than most people imagine. A hive in summer holds tens of thousands of "
    "workers, each passing through a sequence of jobs as it ages: cleaning cells, feeding larvae, building comb, "
    "guarding the entrance and finally foraging in the fields. The queen lays the eggs, but she does not rule; "
    "decisions such as where to found a new colony are made collectively, by scouts that dance to advertise the "
    "sites they have found until one site wins enough support."
)


def perplexity(lib: Library, path: Path, text: str, lanes: int = 8) -> float:
    """Perplexity of `text` split into `lanes` segments decoded side by side (teacher forcing)."""
    m = load(lib, path, lanes)
    try:
        data = text.encode()
        assert lanes * 60 < len(data) // 3, "the text is too short for a stable estimate"
        buf = (c_uint32 * (len(data) + 8))()
        n = int(lib.baseRT_encode(m, data, buf, len(buf)))
        per = n // lanes
        segs = [list(buf[i * per : (i + 1) * per]) for i in range(lanes)]
        seqs = [int(lib.baseRT_sequence_create(m)) for _ in range(lanes)]
        nll, count = 0.0, 0
        for t in range(per - 1):
            rows = step_logits(lib, m, seqs, [[s[t]] for s in segs]).astype(np.float64)
            rows -= rows.max(axis=1, keepdims=True)
            logp = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
            for i, s in enumerate(segs):
                nll -= logp[i, s[t + 1]]
                count += 1
        return math.exp(nll / count)
    finally:
        lib.baseRT_free_model(m)


@pytest.mark.slow
def test_smollm2_q8_and_q4_perplexity_within_1_percent_of_f16(
    lib: Library, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path_factory.mktemp("smollm2-quant")
    paths = {
        d: convert_gguf(smollm2_gguf, out / f"smollm2.{d}.base", dtype=d, progress=False)  # type: ignore[arg-type]
        for d in ("f16", "q8", "q4")
    }
    ppl = {d: perplexity(lib, p, HELD_OUT) for d, p in paths.items()}
    assert 5 < ppl["f16"] < 200, ppl  # a sane model on English text
    for d in ("q8", "q4"):
        assert abs(ppl[d] / ppl["f16"] - 1) < 0.01, ppl


# A fresh process's resident memory around one load: before, peak after, and the engine's own count.
LOAD_RSS = """
import ctypes, json, re, sys
sys.path.insert(0, "tests")
from pathlib import Path
from raw_abi import load
from aiobasert import _ffi
lib = _ffi.load_library()
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) * 1024
before = status("VmRSS")
m = load(lib, Path(sys.argv[1]), 512, max_batch_size=1, prefill_chunk=64)
st = _ffi.BaseRTMemoryStats()
assert lib.baseRT_model_memory_stats(m, ctypes.byref(st))
print(json.dumps({"before": before, "peak": status("VmHWM"), "steady": status("VmRSS"),
                  "engine": st.runtime_allocated_bytes}))
"""


def weight_bytes(lib: Library, m: int) -> int:
    """The engine's resident weight bytes: baseRT_model_memory counts them and the KV pool's capacity."""
    st = BaseRTMemoryStats()
    assert lib.baseRT_model_memory_stats(m, byref(st))
    return int(lib.baseRT_model_memory(m)) - int(st.kv_cache_capacity_bytes)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_weights_stay_near_their_gguf_size(lib: Library, tmp_path: Path, qtype: str) -> None:
    """GGML K-quant blocks stay resident at about their GGUF size: the panels keep each super-block's f16
    d / dmin and the 6-bit sub-block scales as bytes (Q4_K 18.5 bytes per row and 32 values against GGML's 18,
    Q5_K 22.5 against 22, Q6_K GGML's own 26.25), not one f32 scale and bias per block of 32."""
    src = write_gguf(tmp_path / f"{qtype}.gguf", matrices=gguf.GGMLQuantizationType[qtype], seed=4, dim=256, ffn=1024)
    path = convert_gguf(src, tmp_path / "auto.base", dtype="auto", progress=False)
    gguf_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(src).tensors)
    m = load(lib, path)
    try:
        resident = weight_bytes(lib, m)
    finally:
        lib.baseRT_free_model(m)
    # Q4_K 148 / 144 = 1.028 (Q5_K 1.023, Q6_K 1.0), plus the tiny vocabulary's padding rows in its last panel
    assert gguf_bytes * 0.99 < resident <= gguf_bytes * 1.035, (resident, gguf_bytes)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_embedding_rows_are_ggml_values(lib: Library, tmp_path: Path, qtype: str) -> None:
    """Embedding lookups read single rows out of the K panels (rt_qweight_row, not the kernels): tap 0 (the
    embedding rows, f16) holds gguf-py's dequantization of the same blocks, value for value, across panel
    boundaries (16 rows) and in the last, partial panel."""
    src = write_gguf(tmp_path / f"{qtype}.gguf", matrices=gguf.GGMLQuantizationType[qtype], seed=5, dim=256, ffn=512)
    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == "token_embd.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType[qtype]
    ref = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    path = convert_gguf(src, tmp_path / "auto.base", dtype="auto", progress=False)
    n_vocab = ref.shape[0]
    tokens = sorted(
        {0, 1, 15, 16, 17, 31, 32, n_vocab - 17, n_vocab - 16, n_vocab - 2, n_vocab - 1}
        | {int(x) for x in np.random.default_rng(1).integers(0, n_vocab, size=40)}
    )
    m = load(lib, path, lanes=1)
    try:
        s = int(lib.baseRT_sequence_create(m))
        n = len(tokens)
        rc = lib.baseRT_batch_step_fused_logits_rows_taps(
            m, (c_void_p * 1)(s), 1, u32(tokens), ints([n]), ints([1]), ints([0]), 1, ints([n])
        )
        assert rc == OK, raw_abi.error(lib)
        rows = np.empty((n, ref.shape[1]), dtype=np.float16)
        assert lib.baseRT_read_tap_rows(m, 0, n, rows.ctypes.data_as(c_void_p)) == ref.shape[1]
    finally:
        lib.baseRT_free_model(m)
    assert rows.tobytes() == ref[tokens].astype(np.float16).tobytes()


@pytest.mark.parametrize("qtype", ["Q6_K", "Q8_0"])
def test_a_load_peaks_near_its_steady_state(tmp_path: Path, qtype: str) -> None:
    """Big matrices are repacked in chunks of rows whose source pages are released as each is done (K-quant
    blocks and base_q groups alike): loading peaks at the steady state plus about a chunk, not plus a whole
    source tensor (each ffn matrix here is 14-18 MB of blocks). VmHWM in a fresh child process."""
    kind = gguf.GGMLQuantizationType[qtype]
    src = write_gguf(tmp_path / f"{qtype}.gguf", matrices=kind, seed=4, dim=256, ffn=65536, n_layers=1)
    path = convert_gguf(src, tmp_path / "auto.base", dtype="auto", progress=False)
    biggest = max(int(t.n_bytes) for t in gguf.GGUFReader(src).tensors)
    assert biggest > 12 << 20
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_RSS, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout)
    assert rss["peak"] - rss["steady"] < biggest // 2, (rss, biggest)


def test_a_load_frees_the_header_before_the_weights(tmp_path: Path) -> None:
    """The header's parse tree (for a big vocabulary tens of MB: Gemma 3's 262k tokens ~25 MB) is freed
    once the tokenizer and tensor table are read, before the weights are repacked: a load peaks at the
    weights, not at the weights plus the tree. Here 200k vocabulary strings and a 200k x 256 embedding."""
    src = big_vocab_gguf(tmp_path / "big-vocab.gguf")
    path = convert_gguf(src, tmp_path / "auto.base", dtype="auto", progress=False)
    # under the sanitizer suite ASan would hold the freed tree in its quarantine: RSS then counts it
    env = dict(os.environ, ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") + ":quarantine_size_mb=0")
    proc = subprocess.run([sys.executable, "-c", LOAD_RSS, str(path)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2], env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout)
    # the tree of these 200k strings is ~25 MB and the weights (mostly the Q8_0 embedding) ~55 MB: with the
    # tree held through the repack the load peaked that much above its steady state
    assert rss["peak"] - rss["steady"] < 10 << 20, rss


@pytest.mark.slow
def test_smollm2_q4_k_m_mix_stays_quantized(
    lib: Library, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SmolLM2-135M in llama.cpp's Q4_K_M type mix (Q5_0 / Q8_0 where rows are 576 wide, Q4_K / Q6_K in
    ffn_down), built here from the demo's weights by tiny_gguf.k_mix_gguf (llama.cpp's quantizer is not
    available here): `auto` keeps every block, the bundle is no bigger than the GGUF, a load peaks near the
    engine's own allocation (not that plus the file), and perplexity is within 1% of the same file's f16
    bundle."""
    out = tmp_path_factory.mktemp("kmix")
    src = k_mix_gguf(smollm2_gguf, out / "SmolLM2-135M-Instruct.Q4_K_M-mix.gguf")
    auto = convert_gguf(src, out / "auto.base", dtype="auto", progress=False)
    f16 = convert_gguf(src, out / "f16.base", dtype="f16", progress=False)
    assert auto.stat().st_size <= src.stat().st_size
    assert {info.dtype for info in read_bundle(auto).tensors.values()} == {
        "f32",
        "base_q5",
        "base_q8",
        "ggml_q4_k",
        "ggml_q6_k",
    }
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_RSS, str(auto)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout)
    # the file's pages are dropped as each tensor is repacked: the peak holds the engine's allocation and
    # at most a tensor or so of the file, not all of it
    assert rss["peak"] - rss["before"] < rss["engine"] + auto.stat().st_size // 4, rss
    ppl_auto, ppl_f16 = perplexity(lib, auto, HELD_OUT), perplexity(lib, f16, HELD_OUT)
    assert 5 < ppl_f16 < 200 and abs(ppl_auto / ppl_f16 - 1) < 0.01, (ppl_auto, ppl_f16)


GEMMA3_Q4_K_M = "gemma-3-270m-q4_k_m.gguf"  # in the cache's downloads once the Gemma 3 tests have fetched it


@pytest.mark.slow
def test_real_q4_k_and_q6_k_blocks_run_against_the_oracle(lib: Library, tmp_path: Path) -> None:
    """Blocks from a real llama.cpp Q4_K_M file (Gemma 3 270M's Q4_K and Q6_K tensors, their rows stacked
    into a one-layer llama): real scale / min distributions through the decode and the kernels."""
    # the session may point AIOBASERT_CACHE_DIR at pytest's cache: look in the user's cache too
    places = [models.cache_dir() / "downloads", Path.home() / ".cache" / "aiobasert" / "downloads"]
    src = next((d / GEMMA3_Q4_K_M for d in places if (d / GEMMA3_Q4_K_M).is_file()), None)
    if src is None:
        pytest.skip(f"{GEMMA3_Q4_K_M} is in neither {places[0]} nor {places[1]} (the Gemma 3 tests download it)")
    path = convert_gguf(
        real_blocks_gguf(src, tmp_path / "real.gguf"), tmp_path / "real.base", dtype="auto", progress=False
    )
    assert {i.dtype for i in read_bundle(path).tensors.values() if len(i.shape) == 2} == {"ggml_q4_k", "ggml_q6_k"}
    oracle = NumpyLlama(path, q8_inputs=True)
    m = load(lib, path)
    try:
        rng = np.random.default_rng(8)
        errs = []
        for n in (1, 5, 30):
            tokens = [int(t) for t in rng.integers(3, oracle.config.vocab_size, size=n)]
            got = step_logits(lib, m, [int(lib.baseRT_sequence_create(m))], [tokens])[0].astype(np.float64)
            exact = oracle.logits(tokens)[-1]
            errs.append(np.abs(got - exact).max() / np.abs(exact).max())
        assert max(errs) < 0.005, errs
    finally:
        lib.baseRT_free_model(m)
