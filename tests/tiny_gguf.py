"""A small llama GGUF written with the `gguf` package: the converter's and the model cache's test input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from aiobasert.tiny import CHATML_TEMPLATE, tiny_vocab

Q = gguf.GGMLQuantizationType
DIM, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = DIM // HEADS


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tied: bool = False,
    extra_kv: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    extra_tensors: tuple[str, ...] = (),
    matrices: gguf.GGMLQuantizationType | None = None,
    dim: int = DIM,
    ffn: int = FFN,
    seed: int = 3,
) -> Path:
    """A small llama GGUF with a mix of F32, F16 and Q8_0 tensors and the tiny BPE vocabulary; with
    `matrices`, every matrix in that GGML type (K-quants: rows of a multiple of 256 values, `dim` / `ffn`)."""
    vocab = tiny_vocab("bpe")
    n_vocab = len(vocab.tokens)
    rng = np.random.default_rng(seed)
    head_dim = dim // HEADS
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(dim)
    extra_kv = extra_kv or {}
    if "llama.feed_forward_length" not in extra_kv:  # GGUFWriter refuses duplicate keys
        writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
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

    def add(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType = Q.F32) -> None:
        if name in drop:
            return
        if matrices is not None and len(shape) == 2:
            qtype = matrices
        if qtype in K_BLOCKS:
            writer.add_tensor(name, k_quant_blocks(rng, qtype, shape), raw_dtype=qtype)
            return
        values = (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(np.float32)
        if qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif qtype == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (n_vocab, dim), Q.Q8_0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (dim,))
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, dim), Q.Q8_0)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, dim), Q.F16)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, dim))
        add(f"blk.{i}.attn_output.weight", (dim, HEADS * head_dim), Q.Q8_0)
        add(f"blk.{i}.ffn_norm.weight", (dim,))
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


# GGML's K-quant super-blocks (ggml-common.h): 256 values each; bytes per block, and where the f16 d sits.
K_BLOCKS = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def k_quant_blocks(rng: np.random.Generator, qtype: gguf.GGMLQuantizationType,
                   shape: tuple[int, ...]) -> np.ndarray[Any, np.dtype[np.uint8]]:
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
