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
    pre: str = "smollm",
    tokenizer: dict[str, Any] | None = None,
) -> Path:
    """A small llama GGUF with a mix of F32, F16 and Q8_0 tensors and the tiny BPE vocabulary (with the
    pre-tokenizer name `pre`), or with the GGUF `tokenizer.*` fields given (another GGUF's vocabulary)."""
    vocab = tiny_vocab("bpe")
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"]) if tokenizer else len(vocab.tokens)
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(DIM)
    extra_kv = extra_kv or {}
    if "llama.feed_forward_length" not in extra_kv:  # GGUFWriter refuses duplicate keys
        writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(HEAD_DIM)
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

    def add(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType = Q.F32) -> None:
        if name in drop:
            return
        values = (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(np.float32)
        if qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif qtype == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (n_vocab, DIM), Q.Q8_0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (DIM,))
        add(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, DIM), Q.Q8_0)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, DIM), Q.F16)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, DIM))
        add(f"blk.{i}.attn_output.weight", (DIM, HEADS * HEAD_DIM), Q.Q8_0)
        add(f"blk.{i}.ffn_norm.weight", (DIM,))
        add(f"blk.{i}.ffn_gate.weight", (FFN, DIM), Q.F16)
        add(f"blk.{i}.ffn_up.weight", (FFN, DIM), Q.Q8_0)
        add(f"blk.{i}.ffn_down.weight", (DIM, FFN))
    add("output_norm.weight", (DIM,))
    if not tied:
        add("output.weight", (n_vocab, DIM), Q.F16)
    for name in extra_tensors:
        add(name, (DIM,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
