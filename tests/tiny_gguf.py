"""Small GGUFs of each architecture the engine runs (llama, qwen2, qwen3, gemma3), written with the
`gguf` package under llama.cpp's key and tensor names: the converter's and the model cache's test input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from aiobasert.tiny import CHATML_TEMPLATE, llama3_rope_factors, tiny_vocab

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
) -> Path:
    """A small GGUF of `arch` with a mix of F32, F16 and Q8_0 tensors and the tiny BPE vocabulary (with the
    pre-tokenizer name `pre`), or with the GGUF `tokenizer.*` fields given (another GGUF's vocabulary).

    qwen2 adds q/k/v biases; qwen3 and gemma3 a wider head (attention.key_length) and q/k norms;
    gemma3 the post-attention / post-FFN norms and a sliding window (every 6th layer global, as
    llama.cpp reads gemma3). `rope_freqs` adds Llama 3's per-frequency divisors. Any other arch
    gets the llama tensors (for refusals). `head_dim` overrides the head size (key_length)."""
    vocab = tiny_vocab("bpe")
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"]) if tokenizer else len(vocab.tokens)
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(path, arch)
    head_dim = head_dim or (WIDE_HEAD if arch in ("qwen3", "gemma3") else HEAD_DIM)
    writer.add_block_count(n_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(DIM)
    extra_kv = extra_kv or {}
    if f"{arch}.feed_forward_length" not in extra_kv:  # GGUFWriter refuses duplicate keys
        writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != HEAD_DIM:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
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

    def add(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType = Q.F32, center: float = 0.0) -> None:
        if name in drop:
            return
        values = (center + rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(np.float32)
        if qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif qtype == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (n_vocab, DIM), Q.Q8_0)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, 50000.0, original_context_length=256))
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (DIM,))
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, DIM), Q.Q8_0)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, DIM), Q.F16)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, DIM))
        add(f"blk.{i}.attn_output.weight", (DIM, HEADS * head_dim), Q.Q8_0)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", (HEADS * head_dim,))
            add(f"blk.{i}.attn_k.bias", (KV_HEADS * head_dim,))
            add(f"blk.{i}.attn_v.bias", (KV_HEADS * head_dim,))
        if arch in ("qwen3", "gemma3"):  # norm weights near 1 (gemma's GGUF holds 1 + w)
            add(f"blk.{i}.attn_q_norm.weight", (head_dim,), center=1.0)
            add(f"blk.{i}.attn_k_norm.weight", (head_dim,), center=1.0)
        if arch == "gemma3":
            add(f"blk.{i}.post_attention_norm.weight", (DIM,), center=1.0)
            add(f"blk.{i}.post_ffw_norm.weight", (DIM,), center=1.0)
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


#: One GGUF per architecture feature the engine runs (write_gguf keyword arguments).
ARCH_GGUFS: dict[str, dict[str, Any]] = {
    "llama3_rope_freqs": dict(rope_freqs=True),
    "llama_linear": dict(extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
    "qwen2_yarn": dict(arch="qwen2", extra_kv={"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                                               "qwen2.rope.scaling.original_context_length": 64}),
    "llama_wide_head": dict(head_dim=WIDE_HEAD),  # Mistral Nemo's kind: key_length x heads != embedding_length
    "qwen3": dict(arch="qwen3"),
    "gemma3": dict(arch="gemma3", n_layers=6),
}
