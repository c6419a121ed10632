"""Small GGUFs of each architecture the engine runs (llama, qwen2, qwen3, gemma3, phi3), written with the
`gguf` package under llama.cpp's key and tensor names: the converter's and the model cache's test input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from aiobasert.models.tiny import CHATML_TEMPLATE, llama3_rope_factors, tiny_vocab

Q = gguf.GGMLQuantizationType
DIM, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = DIM // HEADS
WIDE_HEAD = 32  # qwen3 / gemma3: key_length != embedding_length / head_count


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tied: bool = False,
    extra_kv: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    extra_tensors: tuple[str, ...] = (),
    n_layers: int = LAYERS,
    rope_freqs: bool = False,
    head_dim: int | None = None,
    pre: str = "smollm",
    tokenizer: dict[str, Any] | None = None,
    matrices: gguf.GGMLQuantizationType | None = None,
    dim: int = DIM,
    ffn: int = FFN,
    seed: int = 3,
    fused_qkv: bool = True,
    longrope: bool = False,
    qk_std: float = 0.1,
) -> Path:
    """A small GGUF of `arch` with a mix of F32, F16 and Q8_0 tensors and the tiny BPE vocabulary (with the
    pre-tokenizer name `pre`), or with the GGUF `tokenizer.*` fields given (another GGUF's vocabulary).

    qwen2 adds q/k/v biases; qwen3 and gemma3 a wider head (attention.key_length) and q/k norms;
    gemma3 the post-attention / post-FFN norms and a sliding window (every 6th layer global, as
    llama.cpp reads gemma3); phi3 its fused matrices as llama.cpp's converter writes them: attn_qkv (q, k, v
    rows; separate attn_q/k/v with `fused_qkv` False) and ffn_up holding gate then up (2 x ffn rows), and a
    sliding window (which llama.cpp ignores for phi3); `longrope` adds the 128k variants' LongRoPE (factor
    tensors rope_factors_long / _short, original context 64, attn_factor). `rope_freqs` adds Llama 3's
    per-frequency divisors. `qk_std`: the spread of the q / k (phi3: qkv) weights; larger ones make attention
    peaked, so that RoPE shows in the logits.
    Any other arch gets the llama tensors (for refusals). `head_dim` overrides the head size (key_length). With
    `matrices`, every matrix in that GGML type (K-quants: rows of a multiple of 256 values, `dim` / `ffn`)."""
    vocab = tiny_vocab("bpe")
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"]) if tokenizer else len(vocab.tokens)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    head_dim = head_dim or (WIDE_HEAD if arch in ("qwen3", "gemma3") else dim // HEADS)
    writer.add_block_count(n_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(dim)
    extra_kv = extra_kv or {}
    if f"{arch}.feed_forward_length" not in extra_kv:  # GGUFWriter refuses duplicate keys
        writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != dim // HEADS:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("gemma3", "phi3"):
        writer.add_sliding_window(4)
    if tokenizer:
        for key, value in tokenizer.items():  # (floats, scores included, are written as float32)
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(list(vocab.tokens))
        writer.add_token_types(list(vocab.token_types))
        writer.add_token_merges(list(vocab.merges))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_eot_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML_TEMPLATE)
    for key, value in extra_kv.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))

    def add(
        name: str,
        shape: tuple[int, ...],
        qtype: gguf.GGMLQuantizationType = Q.F32,
        center: float = 0.0,
        std: float = 0.1,
    ) -> None:
        if name in drop:
            return
        if matrices is not None and len(shape) == 2:
            qtype = matrices
        if qtype in K_BLOCKS:
            writer.add_tensor(name, k_quant_blocks(rng, qtype, shape), raw_dtype=qtype)
            return
        if qtype == Q.I32:  # a type no converter dequantizes
            writer.add_tensor(name, rng.integers(-9, 9, size=shape, dtype=np.int32), raw_dtype=qtype)
            return
        values = (center + rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
        if qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif qtype == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (n_vocab, dim), Q.Q8_0)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, 50000.0, original_context_length=256))
    if longrope:  # growing toward the slow frequencies as Phi-3.5's; the long ones far from 1 throughout, so
        # that which set is used shows in a tiny model's logits
        ramp = np.linspace(0.0, 1.0, head_dim // 2, dtype=np.float32)
        writer.add_tensor("rope_factors_long.weight", (2.5 + 13.5 * ramp**2).astype(np.float32))
        writer.add_tensor("rope_factors_short.weight", (1.0 + 0.5 * ramp).astype(np.float32))
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_rope_scaling_attn_factors(1.1902380714238083)  # sqrt(1 + ln(32) / ln(4096)): Phi-3.5's
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (dim,))
        if arch == "phi3" and fused_qkv:
            add(f"blk.{i}.attn_qkv.weight", ((HEADS + 2 * KV_HEADS) * head_dim, dim), Q.Q8_0, std=qk_std)
        else:
            add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, dim), Q.Q8_0, std=qk_std)
            add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, dim), Q.F16, std=qk_std)
            add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, dim))
        add(f"blk.{i}.attn_output.weight", (dim, HEADS * head_dim), Q.Q8_0)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", (HEADS * head_dim,))
            add(f"blk.{i}.attn_k.bias", (KV_HEADS * head_dim,))
            add(f"blk.{i}.attn_v.bias", (KV_HEADS * head_dim,))
        if arch in ("qwen3", "gemma3"):  # norm weights near 1 (gemma's GGUF holds 1 + w)
            add(f"blk.{i}.attn_q_norm.weight", (head_dim,), center=1.0)
            add(f"blk.{i}.attn_k_norm.weight", (head_dim,), center=1.0)
        if arch == "gemma3":
            add(f"blk.{i}.post_attention_norm.weight", (dim,), center=1.0)
            add(f"blk.{i}.post_ffw_norm.weight", (dim,), center=1.0)
        add(f"blk.{i}.ffn_norm.weight", (dim,))
        if arch == "phi3":
            add(f"blk.{i}.ffn_up.weight", (2 * ffn, dim), Q.F16)
        else:
            add(f"blk.{i}.ffn_gate.weight", (ffn, dim), Q.F16)
            add(f"blk.{i}.ffn_up.weight", (ffn, dim), Q.Q8_0)
        add(f"blk.{i}.ffn_down.weight", (dim, ffn))
    add("output_norm.weight", (dim,))
    if not tied:
        add("output.weight", (n_vocab, dim), Q.F16)
    for name in extra_tensors:
        add(name, (dim,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


#: One GGUF per architecture feature the engine runs (write_gguf keyword arguments).
ARCH_GGUFS: dict[str, dict[str, Any]] = {
    "llama3_rope_freqs": dict(rope_freqs=True),
    "llama_linear": dict(extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
    "qwen2_yarn": dict(
        arch="qwen2",
        extra_kv={
            "qwen2.rope.scaling.type": "yarn",
            "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 64,
        },
    ),
    "llama_wide_head": dict(head_dim=WIDE_HEAD),  # Mistral Nemo's kind: key_length x heads != embedding_length
    "qwen3": dict(arch="qwen3"),
    "gemma3": dict(arch="gemma3", n_layers=6),
    "phi3": dict(arch="phi3"),
    "phi3_separate_qkv": dict(arch="phi3", fused_qkv=False),
    "phi3_longrope": dict(arch="phi3", longrope=True),  # run with a context above 64: the long factors
}


# GGML's K-quant super-blocks (ggml-common.h): 256 values each; bytes per block, and where the f16 d sits.
K_BLOCKS = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def big_vocab_gguf(path: Path, *, extra_tokens: int = 200_000, dim: int = 256, ffn: int = 512) -> Path:
    """A 2-layer Q8_0 GGUF whose vocabulary is the tiny one plus `extra_tokens` USER_DEFINED strings: a
    header as big as a 262k-vocabulary model's (its parse tree ~25 MB for 200k), weights mostly the
    [vocab, dim] embedding (~55 MB at the defaults)."""
    vocab = tiny_vocab("bpe")
    extra = [f"<extra_token_{i:06d}>" for i in range(extra_tokens)]
    tokenizer = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": [*vocab.tokens, *extra],
        "tokenizer.ggml.token_type": [*vocab.token_types, *([4] * len(extra))],  # USER_DEFINED
        "tokenizer.ggml.merges": list(vocab.merges),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }  # fmt: skip
    return write_gguf(path, tokenizer=tokenizer, matrices=gguf.GGMLQuantizationType.Q8_0, dim=dim, ffn=ffn,
                      n_layers=2)  # fmt: skip


def k_quant_blocks(
    rng: np.random.Generator, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Random K-quant blocks for a [rows, cols] matrix, as raw GGUF bytes [rows, cols / 256 * block bytes].

    gguf-py cannot quantize K-quants, so the blocks are written by hand: random quants, sub-block scales
    and mins (every bit pattern is a valid block), and f16 super-block scales sized so values stay ~0.1."""
    rows, cols = shape
    size = K_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    n = rows * (cols // 256)

    def f16(scale: float) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return (rng.uniform(0.5, 1.5, n) * scale).astype("<f2").view(np.uint8).reshape(rows, cols // 256, 2)

    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d
        blocks[..., 208:210] = f16(1.5e-4)
    else:  # d dmin scales[12] (qh[32]) qs[128]
        blocks[..., 0:2] = f16(1.5e-4 if qtype == Q.Q4_K else 8e-5)
        blocks[..., 2:4] = f16(1e-4)
    return blocks.reshape(rows, -1)


def quantize_k(
    values: np.ndarray[Any, np.dtype[np.float32]], qtype: gguf.GGMLQuantizationType
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Round-to-nearest K-quant blocks (Q4_K / Q6_K) of a [rows, cols] matrix, in ggml's block layout.

    Not llama.cpp's search-based quantizer (gguf-py has none for K-quants): per 32 (Q4_K) or 16 (Q6_K)
    values a plain min/max or absmax scale, the sub-block scales themselves quantized to 6 / 8 bits
    against the super-block's d as ggml stores them. Enough for real weights in real block types."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(rows, cols // 256, 256)
    f16 = np.float16
    if qtype == Q.Q6_K:
        sub = x.reshape(rows, -1, 16, 16)
        amax_i = np.argmax(np.abs(sub), axis=3)
        top = np.take_along_axis(sub, amax_i[..., None], axis=3)[..., 0]
        scale = -top / 32.0  # ggml's sign trick: the largest magnitude maps to -32
        d = (np.abs(scale).max(axis=2) / 127.0).astype(f16)
        df = d.astype(np.float32)[..., None]
        sc = np.clip(np.rint(np.where(df > 0, scale / np.where(df > 0, df, 1), 0)), -128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.clip(np.rint(np.where(step != 0, sub / np.where(step != 0, step, 1), 0)) + 32, 0, 63).astype(np.uint8)
        q = q.reshape(rows, -1, 2, 4, 32)  # [half n][quarter t][l]
        ql = np.concatenate(
            [(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4), (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)],
            axis=3,
        )  # [n][64]
        qh = sum((q[:, :, :, t] >> 4) << (2 * t) for t in range(4)).astype(np.uint8)
        out = np.concatenate(
            [
                ql.reshape(rows, -1, 128),
                qh.reshape(rows, -1, 64),
                sc.view(np.uint8),
                d[..., None].view(np.uint8).reshape(rows, -1, 2),
            ],
            axis=2,
        )
        return out.reshape(rows, -1).astype(np.uint8)
    if qtype != Q.Q4_K:
        raise ValueError(f"quantize_k: {qtype.name}")
    sub = x.reshape(rows, -1, 8, 32)
    lo = np.minimum(sub.min(axis=3), 0.0)
    scale = (sub.max(axis=3) - lo) / 15.0
    d = (scale.max(axis=2) / 63.0).astype(f16)
    dmin = (-lo.min(axis=2) / 63.0).astype(f16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.rint(np.where(df > 0, scale / np.where(df > 0, df, 1), 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.where(dmf > 0, -lo / np.where(dmf > 0, dmf, 1), 0)), 0, 63).astype(np.uint8)
    step, bias = (df * sc)[..., None], (dmf * mn)[..., None]
    q = np.clip(np.rint(np.where(step > 0, (sub + bias) / np.where(step > 0, step, 1), 0)), 0, 15).astype(np.uint8)
    q = q.reshape(rows, -1, 4, 2, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, -1, 128)
    packed = np.zeros((rows, cols // 256, 12), dtype=np.uint8)  # inverse of get_scale_min_k4
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    out = np.concatenate(
        [
            d[..., None].view(np.uint8).reshape(rows, -1, 2),
            dmin[..., None].view(np.uint8).reshape(rows, -1, 2),
            packed,
            qs,
        ],
        axis=2,
    )
    return out.reshape(rows, -1).astype(np.uint8)


def retyped_gguf(
    src: Path,
    dst: Path,
    pick: Callable[[str, np.ndarray[Any, np.dtype[np.float32]]], gguf.GGMLQuantizationType],
    file_type: gguf.LlamaFileType | None = None,
) -> Path:
    """`src` rewritten to `dst` with every matrix dequantized (gguf-py) and stored in the GGML type `pick(name,
    values)` chooses (F16, F32, Q4_0 ..., K-quants by :func:`quantize_k`); 1-D tensors (norms, biases) in F32,
    as llama.cpp's converter keeps them. Every metadata field is copied (architecture, hyperparameters,
    tokenizer, chat template), `general.file_type` replaced by `file_type` when given."""
    reader = gguf.GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if name == "general.file_type" and file_type is not None:
            writer.add_key_value(name, int(file_type), kind)
        elif kind == gguf.GGUFValueType.ARRAY:
            item = field.types[1]
            if item == gguf.GGUFValueType.STRING:
                value: Any = [str(bytes(field.parts[i]), "utf-8") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, value, kind, sub_type=item)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, str(bytes(field.parts[field.data[0]]), "utf-8"), kind)
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    if file_type is not None and "general.file_type" not in reader.fields:
        writer.add_file_type(int(file_type))
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        qtype = Q.F32 if values.ndim == 1 else pick(t.name, values)
        if qtype == Q.F32:
            writer.add_tensor(t.name, values)
        elif qtype == Q.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        elif qtype in K_BLOCKS:
            writer.add_tensor(t.name, quantize_k(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def f16_gguf(src: Path, dst: Path) -> Path:
    """An F16 GGUF of the GGUF `src` (llama.cpp's `--outtype f16` layout: matrices F16, 1-D tensors F32),
    its values gguf-py's dequantization of `src`'s blocks: the same model, unquantized, every metadata field
    kept (bench/spec_vs_llama_server.py's draft-model target, drafted for by `src` itself)."""
    return retyped_gguf(src, dst, lambda _name, _values: Q.F16, gguf.LlamaFileType.MOSTLY_F16)


def k_mix_gguf(src: Path, dst: Path) -> Path:
    """A llama.cpp-style Q4_K_M type mix of the llama GGUF `src`, requantized from its values with
    :func:`quantize_k` and gguf-py: llama.cpp's per-tensor choice (llama_tensor_get_type for
    LLAMA_FTYPE_MOSTLY_Q4_K_M: attn_v / ffn_down Q6_K in the use_more_bits layers, else Q4_K; the
    output / tied embedding Q6_K), with its fallback for rows that are not whole 256-value blocks
    (Q4_K -> Q5_0, Q6_K -> Q8_0: SmolLM2's 576-wide rows)."""
    reader = gguf.GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    n_layers = int(reader.fields[f"{arch}.block_count"].parts[-1][0])

    def more_bits(i: int) -> bool:
        return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2

    def pick(name: str, values: np.ndarray[Any, np.dtype[np.float32]]) -> gguf.GGMLQuantizationType:
        parts = name.split(".")
        more = len(parts) == 4 and parts[2] in ("attn_v", "ffn_down") and more_bits(int(parts[1]))
        qtype = Q.Q6_K if more or name in ("token_embd.weight", "output.weight") else Q.Q4_K
        if values.shape[1] % 256:
            qtype = Q.Q8_0 if qtype == Q.Q6_K else Q.Q5_0
        return qtype

    return retyped_gguf(src, dst, pick)


def real_blocks_gguf(src: Path, dst: Path, *, dim: int = 1024, ffn: int = 2048) -> Path:
    """A one-layer llama GGUF whose matrices are rows of real Q4_K / Q6_K blocks taken from the K-quant
    GGUF `src` (any architecture: rows are independent runs of blocks, so rows of its tensors of the
    right width are stacked into each matrix): real scale and min distributions, not random bytes.
    Needs Q4_K tensors `dim` wide and Q6_K ones `ffn` wide (Gemma 3 270M Q4_K_M: 1024 and 2048)."""
    pool: dict[tuple[gguf.GGMLQuantizationType, int], list[np.ndarray[Any, np.dtype[np.uint8]]]] = {}
    for t in gguf.GGUFReader(src).tensors:
        if t.tensor_type in (Q.Q4_K, Q.Q6_K):
            rows = np.asarray(t.data, dtype=np.uint8).reshape(int(t.shape[1]), -1)
            pool.setdefault((t.tensor_type, int(t.shape[0])), []).append(rows)
    stacks = {key: np.concatenate(parts) for key, parts in pool.items()}
    vocab = tiny_vocab("bpe")
    n_heads, n_kv = 8, 2
    writer = gguf.GGUFWriter(dst, "llama")
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(dim // n_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    used = {key: 0 for key in stacks}

    def add(name: str, qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> None:
        key = (qtype, cols)
        start = used[key] % max(1, stacks[key].shape[0] - rows)  # each matrix its own rows where there are enough
        writer.add_tensor(name, stacks[key][start : start + rows], raw_dtype=qtype)
        used[key] += rows

    kv_dim = n_kv * dim // n_heads
    add("token_embd.weight", Q.Q4_K, len(vocab.tokens), dim)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(dim, np.float32))
    add("blk.0.attn_q.weight", Q.Q4_K, dim, dim)
    add("blk.0.attn_k.weight", Q.Q4_K, kv_dim, dim)
    add("blk.0.attn_v.weight", Q.Q4_K, kv_dim, dim)
    add("blk.0.attn_output.weight", Q.Q4_K, dim, dim)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(dim, np.float32))
    add("blk.0.ffn_gate.weight", Q.Q4_K, ffn, dim)
    add("blk.0.ffn_up.weight", Q.Q4_K, ffn, dim)
    add("blk.0.ffn_down.weight", Q.Q6_K, dim, ffn)
    writer.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
