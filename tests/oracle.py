"""Numpy reference forward for llama bundles: the oracle engine logits are tested against.

`NumpyLlama` runs the forward of docs/BUNDLE.md over a `.base` file;
`gguf_oracle` runs the same forward over a GGUF's dequantized weights read
straight from the GGUF (its own name mapping and config parsing, not the
converter's), so agreement with it checks the converter and the engine
independently. Everything is computed in float64 over float32 weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from aiobasert.bundle import read_bundle

Weights = Callable[[str], npt.NDArray[np.float32]]


@dataclass(frozen=True)
class OracleConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tied: bool


def _rmsnorm(x: npt.NDArray[np.float64], weight: npt.NDArray[np.float32], eps: float) -> npt.NDArray[np.float64]:
    normed: npt.NDArray[np.float64] = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight
    return normed


def _rope(x: npt.NDArray[np.float64], theta: float) -> npt.NDArray[np.float64]:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head; x is (n, heads, head_dim)."""
    n, _, head_dim = x.shape
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (head_dim/2,)
    angles = np.arange(n, dtype=np.float64)[:, None] * freqs[None, :]  # (n, head_dim/2)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _q8_rows(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """x as the engine's integer kernels see a matmul input: float32, per block of 32 rounded to
    q * d with d = amax / 127, q = round-half-even(x * (1 / d)) in [-127, 127] (native/src/quant.h)."""
    n, width = x.shape
    v = x.astype(np.float32).reshape(n, width // 32, 32)
    d = (np.abs(v).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((v * inv).astype(np.float32)), -127, 127)
    out: npt.NDArray[np.float64] = (q.astype(np.float64) * d.astype(np.float64)).reshape(n, width)
    return out


class LlamaForward:
    """The llama forward of docs/BUNDLE.md over weights in canonical names. With q8_inputs, every
    matmul input is first rounded as the engine's integer kernels round it (for quantized bundles)."""

    def __init__(self, config: OracleConfig, weights: Weights, *, q8_inputs: bool = False) -> None:
        self.config = config
        self._weight = weights
        self._in = _q8_rows if q8_inputs else (lambda x: x)

    def logits(self, tokens: Sequence[int]) -> npt.NDArray[np.float64]:
        """Logits (len(tokens), vocab) for tokens at positions 0..n-1."""
        cfg, w = self.config, self._weight
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"tokens must be a non-empty list of ids in [0, {cfg.vocab_size})")
        n, hd = ids.size, cfg.head_dim
        group = cfg.n_heads // cfg.n_kv_heads
        causal = np.triu(np.full((n, n), -np.inf), k=1)
        h = w("embed_tokens.weight")[ids].astype(np.float64)
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            x = self._in(_rmsnorm(h, w(p + "input_norm.weight"), cfg.rms_norm_eps))
            q = (x @ w(p + "self_attn.q_proj.weight").T).reshape(n, cfg.n_heads, hd)
            k = (x @ w(p + "self_attn.k_proj.weight").T).reshape(n, cfg.n_kv_heads, hd)
            v = (x @ w(p + "self_attn.v_proj.weight").T).reshape(n, cfg.n_kv_heads, hd)
            q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head h reads kv head h // group
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, cfg.n_heads * hd)
            h = h + self._in(attn) @ w(p + "self_attn.o_proj.weight").T
            x = self._in(_rmsnorm(h, w(p + "post_attn_norm.weight"), cfg.rms_norm_eps))
            gate = x @ w(p + "mlp.gate_proj.weight").T
            up = x @ w(p + "mlp.up_proj.weight").T
            h = h + self._in(gate / (1.0 + np.exp(-gate)) * up) @ w(p + "mlp.down_proj.weight").T
        x = self._in(_rmsnorm(h, w("final_norm.weight"), cfg.rms_norm_eps))
        head = w("embed_tokens.weight" if cfg.tied else "lm_head.weight")
        logits: npt.NDArray[np.float64] = x @ head.T
        return logits

    def greedy(self, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation (argmax, lowest id on ties), recomputing the full prefix per step."""
        out = list(tokens)
        for _ in range(max_new_tokens):
            out.append(int(np.argmax(self.logits(out)[-1])))
        return out[len(tokens) :]


class NumpyLlama(LlamaForward):
    """The reference forward over a `.base` bundle (weights widened to float32, cached)."""

    def __init__(self, bundle_path: str | Path, *, q8_inputs: bool = False) -> None:
        self.bundle = read_bundle(bundle_path)
        c = self.bundle.config
        config = OracleConfig(
            dim=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"],
            n_kv_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"],
            vocab_size=c["vocab_size"],
            rope_theta=float(c["rope_theta"]),
            rms_norm_eps=float(c["rms_norm_eps"]),
            tied=bool(c["tie_word_embeddings"]),
        )
        super().__init__(config, functools.cache(self.bundle.tensor), q8_inputs=q8_inputs)


# GGUF tensor names -> canonical bundle names, written out independently of aiobasert.convert.
_GGUF_GLOBAL = {"token_embd": "embed_tokens", "output_norm": "final_norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attn_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _canonical(gguf_name: str) -> str:
    stem = gguf_name.removesuffix(".weight")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"layers.{layer}.{_GGUF_LAYER[part]}.weight"
    return f"{_GGUF_GLOBAL[stem]}.weight"


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise KeyError(f"GGUF has no {key!r}")
    return field.parts[field.data[0]].tolist()[0]


def gguf_oracle(gguf_path: str | Path) -> LlamaForward:
    """The reference forward over a llama GGUF's dequantized weights (no bundle involved)."""
    reader = gguf.GGUFReader(gguf_path)
    by_name = {_canonical(t.name): t for t in reader.tensors}

    @functools.cache
    def weight(name: str) -> npt.NDArray[np.float32]:
        t = by_name[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims fastest-first; numpy's row-major shape is the reverse.
        return values.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))

    dim = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    config = OracleConfig(
        dim=dim,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=dim // n_heads,
        vocab_size=int(by_name["embed_tokens.weight"].shape[1]),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tied="lm_head.weight" not in by_name,
    )
    return LlamaForward(config, weight)
