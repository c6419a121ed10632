"""Numpy reference forward for the engine's architectures: the oracle engine logits are tested against.

`NumpyLlama` runs the forward of docs/BUNDLE.md over a `.base` file of any
architecture the engine runs (llama, qwen2, qwen3, gemma3: docs/models.md),
written from llama.cpp's graphs for them (src/models/*.cpp), not from the engine;
`gguf_oracle` runs the same forward over a GGUF's dequantized weights read
straight from the GGUF (its own name mapping and config parsing, not the
converter's), so agreement with it checks the converter and the engine
independently. Everything is computed in float64 over float32 weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from aiobasert.models.bundle import read_bundle

Weights = Callable[[str], npt.NDArray[np.float32]]


@dataclass(frozen=True)
class Rope:
    """One RoPE table's parameters, as ggml's rope_yarn reads them."""

    theta: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    orig_ctx: int = 0
    freq_factors: tuple[float, ...] | None = None


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
    arch: str = "llama"
    rope: Rope | None = None  # full-attention layers; None: plain Rope(rope_theta)
    local_rope: Rope | None = None  # sliding-window layers
    sliding: tuple[bool, ...] = ()  # per layer; () = none
    sliding_window: int = 0
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    final_softcap: float = 0.0


# What each architecture's graph does (llama.cpp: src/models/llama.cpp, qwen2.cpp, qwen3.cpp, gemma3.cpp,
# phi3.cpp: llama's layers once its fused matrices are split, see gguf_oracle).
NEOX_ROPE = {"qwen2", "qwen3", "gemma3", "phi3"}  # LLAMA_ROPE_TYPE_NEOX: pairs (i, i + head_dim/2)
QKV_BIAS = {"qwen2"}
QK_NORM = {"qwen3", "gemma3"}
GEMMA = {"gemma3"}  # GeGLU (tanh gelu), post-attention / post-FFN norms, embedding * sqrt(dim)


def _rmsnorm(x: npt.NDArray[np.float64], weight: npt.NDArray[np.float32], eps: float) -> npt.NDArray[np.float64]:
    normed: npt.NDArray[np.float64] = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight
    return normed


def _rope_angles(rope: Rope, n: int, head_dim: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """cos / sin (n, head_dim/2) as ggml's rope_yarn makes them (magnitude scale included)."""
    pair = np.arange(head_dim // 2, dtype=np.float64)
    extrap = np.arange(n, dtype=np.float64)[:, None] * rope.theta ** (-2.0 * pair / head_dim)[None, :]
    if rope.freq_factors is not None:
        extrap = extrap / np.asarray(rope.freq_factors, dtype=np.float64)[None, :]
    theta, mscale = rope.freq_scale * extrap, rope.attn_factor
    if rope.ext_factor:

        def corr(n_rot: float) -> float:
            return head_dim * math.log(rope.orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(rope.theta))

        low = max(0.0, math.floor(corr(rope.beta_fast)))
        high = min(head_dim - 1.0, math.ceil(corr(rope.beta_slow)))
        ramp = 1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp[None, :] * rope.ext_factor
        theta = theta * (1 - mix) + extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / rope.freq_scale)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def _rope(x: npt.NDArray[np.float64], rope: Rope, neox: bool) -> npt.NDArray[np.float64]:
    """Rotate pair i of each head: (x[2i], x[2i+1]), or NeoX (x[i], x[i + head_dim/2]); x is (n, heads, head_dim)."""
    n, _, head_dim = x.shape
    cos, sin = (a[:, None, :] for a in _rope_angles(rope, n, head_dim))
    half = head_dim // 2
    first, second = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])
    out = np.empty_like(x)
    if neox:
        out[..., :half], out[..., half:] = first * cos - second * sin, first * sin + second * cos
    else:
        out[..., 0::2], out[..., 1::2] = first * cos - second * sin, first * sin + second * cos
    return out


def _gelu_tanh(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    out: npt.NDArray[np.float64] = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
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
        return self._head(self._hidden(tokens))

    def next_logits(self, tokens: Sequence[int]) -> npt.NDArray[np.float64]:
        """The logits (vocab,) after the last of tokens: logits(tokens)[-1], the output head applied to
        that row alone (for a 262k vocabulary, most of a short prompt's forward is the head)."""
        return self._head(self._hidden(tokens)[-1:])[0]

    def _head(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        cfg, w = self.config, self._weight
        head = w("embed_tokens.weight" if cfg.tied else "lm_head.weight")
        logits: npt.NDArray[np.float64] = x @ head.T
        if cfg.final_softcap:
            logits = cfg.final_softcap * np.tanh(logits / cfg.final_softcap)
        return logits

    def _hidden(self, tokens: Sequence[int]) -> npt.NDArray[np.float64]:
        """The final norm's output (len(tokens), dim), the head's input."""
        cfg, w = self.config, self._weight
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"tokens must be a non-empty list of ids in [0, {cfg.vocab_size})")
        n, hd = ids.size, cfg.head_dim
        group = cfg.n_heads // cfg.n_kv_heads
        neox, gemma = cfg.arch in NEOX_ROPE, cfg.arch in GEMMA
        eps = cfg.rms_norm_eps
        pos = np.arange(n)
        causal = np.triu(np.full((n, n), -np.inf), k=1)
        # sliding-window layers: key t is visible to query p when p - t < window
        window = np.where(pos[:, None] - pos[None, :] >= cfg.sliding_window, -np.inf, 0.0) + causal
        scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(hd)
        h = w("embed_tokens.weight")[ids].astype(np.float64)
        if gemma:
            h = h * np.float64(np.float32(math.sqrt(cfg.dim)))
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            sliding = bool(cfg.sliding) and cfg.sliding[layer]
            rope = (cfg.local_rope if sliding else cfg.rope) or Rope(cfg.rope_theta)
            x = self._in(_rmsnorm(h, w(p + "input_norm.weight"), eps))
            q, k, v = (x @ w(p + f"self_attn.{t}_proj.weight").T for t in "qkv")
            if cfg.arch in QKV_BIAS:
                q, k, v = (y + w(p + f"self_attn.{t}_proj.bias") for y, t in zip((q, k, v), "qkv", strict=True))
            q, k, v = q.reshape(n, cfg.n_heads, hd), k.reshape(n, cfg.n_kv_heads, hd), v.reshape(n, cfg.n_kv_heads, hd)
            if cfg.arch in QK_NORM:
                q = _rmsnorm(q, w(p + "self_attn.q_norm.weight"), eps)
                k = _rmsnorm(k, w(p + "self_attn.k_norm.weight"), eps)
            q, k = _rope(q, rope, neox), _rope(k, rope, neox)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head h reads kv head h // group
            scores = np.einsum("qhd,khd->hqk", q, k) * scale + (window if sliding else causal)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, cfg.n_heads * hd)
            out = self._in(attn) @ w(p + "self_attn.o_proj.weight").T
            if gemma:
                out = _rmsnorm(out, w(p + "self_attn.out_norm.weight"), eps)
            h = h + out
            x = self._in(_rmsnorm(h, w(p + "post_attn_norm.weight"), eps))
            gate = x @ w(p + "mlp.gate_proj.weight").T
            up = x @ w(p + "mlp.up_proj.weight").T
            act = _gelu_tanh(gate) if gemma else gate / (1.0 + np.exp(-gate))
            out = self._in(act * up) @ w(p + "mlp.down_proj.weight").T
            if gemma:
                out = _rmsnorm(out, w(p + "mlp.out_norm.weight"), eps)
            h = h + out
        return self._in(_rmsnorm(h, w("final_norm.weight"), eps))

    def greedy(self, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation (argmax, lowest id on ties), recomputing the full prefix per step."""
        out = list(tokens)
        for _ in range(max_new_tokens):
            out.append(int(np.argmax(self.logits(out)[-1])))
        return out[len(tokens) :]


class NumpyLlama(LlamaForward):
    """The reference forward over a `.base` bundle (weights widened to float32, cached)."""

    def __init__(self, bundle_path: str | Path, *, q8_inputs: bool = False, context: int | None = None) -> None:
        self.bundle = read_bundle(bundle_path)
        config = bundle_oracle_config(self.bundle.header["arch"], self.bundle.config, self.bundle.tensor, context)
        super().__init__(config, functools.cache(self.bundle.tensor), q8_inputs=q8_inputs)


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    """`n` token ids drawn from [3, vocab) with `seed` (0-2: the tiny vocabularies' special tokens)."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=n)]


def f16_close(engine: npt.NDArray[Any], ref: npt.NDArray[np.float64]) -> float:
    """Worst error of the engine's (f16) logits against the oracle's, in units of the tolerance: f16
    rounding of each value + 1e-4 of the row scale (below 1: close)."""
    tol = np.abs(ref) * 2.0**-11 + 1e-4 * np.abs(ref).max()
    return float((np.abs(engine.astype(np.float64) - ref) / tol).max())


def llama3_divisors(
    head_dim: int, theta: float, factor: float, low: float, high: float, orig_ctx: int
) -> npt.NDArray[np.float64]:
    """Llama 3.1's `llama3` RoPE scaling as per-frequency divisors (HF's _compute_llama3_parameters)."""
    wavelen = 2 * math.pi / theta ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)
    smooth = (orig_ctx / wavelen - low) / (high - low)
    blend = 1.0 / ((1 - smooth) / factor + smooth)
    out: npt.NDArray[np.float64] = np.where(
        wavelen < orig_ctx / high, 1.0, np.where(wavelen > orig_ctx / low, factor, blend)
    )
    return out


def bundle_oracle_config(arch: str, c: dict[str, Any], tensor: Weights, context: int | None = None) -> OracleConfig:
    """The oracle's description of a bundle's model: its config keys read as docs/models.md says. `context`:
    the engine's context per sequence (LongRoPE's choice of factors), default max_position_embeddings."""
    n_layers = c["num_hidden_layers"]
    rope = Rope(float(c["rope_theta"]))
    scaling = c.get("rope_scaling") or {}
    kind = scaling.get("rope_type", "none")
    if kind in ("linear", "yarn"):
        rope = Rope(
            rope.theta,
            freq_scale=1.0 / float(np.float32(scaling["factor"])),
            ext_factor=float(scaling.get("ext_factor", 1.0 if kind == "yarn" else 0.0)),
            attn_factor=float(scaling.get("attn_factor", 1.0)),
            beta_fast=float(scaling.get("beta_fast", 32.0)),
            beta_slow=float(scaling.get("beta_slow", 1.0)),
            orig_ctx=int(scaling.get("original_max_position_embeddings", 0)),
        )
    try:
        factors = tensor("rope_freqs.weight")
    except KeyError:
        factors = None
    if factors is None and kind == "llama3":  # HF's config form: the same divisors, computed
        factors = llama3_divisors(
            c["head_dim"],
            rope.theta,
            float(np.float32(scaling["factor"])),
            float(np.float32(scaling.get("low_freq_factor", 1.0))),
            float(np.float32(scaling.get("high_freq_factor", 4.0))),
            int(scaling["original_max_position_embeddings"]),
        )
    if kind == "longrope":
        longer = (context or c["max_position_embeddings"]) > int(scaling["original_max_position_embeddings"])
        factors = tensor("rope_factors_long.weight" if longer else "rope_factors_short.weight")
        rope = dataclasses.replace(rope, attn_factor=float(np.float32(scaling.get("attn_factor", 1.0))))
    if factors is not None:
        rope = dataclasses.replace(rope, freq_factors=tuple(float(f) for f in factors))
    sliding: tuple[bool, ...] = ()
    if c.get("layer_types") is not None:
        sliding = tuple(t == "sliding_attention" for t in c["layer_types"])
    elif c.get("sliding_window") is not None:
        pattern = int(c.get("sliding_window_pattern", 6))
        sliding = tuple(i % pattern < pattern - 1 for i in range(n_layers))
    scalar = c.get("query_pre_attn_scalar")
    return OracleConfig(
        dim=c["hidden_size"],
        n_layers=n_layers,
        n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        vocab_size=c["vocab_size"],
        rope_theta=float(c["rope_theta"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        tied=bool(c["tie_word_embeddings"]),
        arch=arch,
        rope=rope,
        local_rope=Rope(float(c.get("rope_local_base_freq", 10000.0))) if sliding else None,
        sliding=sliding,
        sliding_window=int(c.get("sliding_window") or 0),
        attn_scale=None if scalar is None else 1.0 / math.sqrt(float(np.float32(scalar))),
        final_softcap=float(c.get("final_logit_softcapping") or 0.0),
    )


# GGUF tensor names -> canonical bundle names, written out independently of aiobasert.models.convert.
_GGUF_GLOBAL = {
    "token_embd": "embed_tokens",
    "output_norm": "final_norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
    "rope_factors_long": "rope_factors_long",
    "rope_factors_short": "rope_factors_short",
}
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "self_attn.out_norm",
    "post_ffw_norm": "mlp.out_norm",
}


def _canonical(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"layers.{layer}.{_GGUF_LAYER[part]}.{suffix}"
    return f"{_GGUF_GLOBAL[stem]}.weight"


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is not None:
            return default
        raise KeyError(f"GGUF has no {key!r}")
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]].tolist()[0]


def gguf_oracle(gguf_path: str | Path | gguf.GGUFReader, context: int | None = None) -> LlamaForward:
    """The reference forward over a GGUF's dequantized weights (no bundle involved), its
    hyperparameters read as llama.cpp's llama-model.cpp reads them. `context`: llama.cpp's n_ctx_seq
    (which LongRoPE factors), default the trained context. A GGUFReader already open may be passed
    (gguf-py reads a 262k-entry vocabulary in ~14 s)."""
    reader = gguf_path if isinstance(gguf_path, gguf.GGUFReader) else gguf.GGUFReader(gguf_path)
    arch = str(_field(reader, "general.architecture"))
    fused = {
        t.name: t for t in reader.tensors if arch == "phi3" and t.name.endswith((".attn_qkv.weight", ".ffn_up.weight"))
    }
    by_name = {_canonical(t.name): t for t in reader.tensors if t.name not in fused}

    def values_of(t: gguf.ReaderTensor) -> npt.NDArray[np.float32]:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims fastest-first; numpy's row-major shape is the reverse.
        return values.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))

    @functools.cache
    def weight(name: str) -> npt.NDArray[np.float32]:
        if name in by_name:
            return values_of(by_name[name])
        # phi3 (llama.cpp's build_qkv views and ggml_swiglu): attn_qkv's rows are q (n_head * head),
        # k, v (n_head_kv * head each); ffn_up's first half is the gate, its second the up projection.
        _, layer, part, what, _ = name.split(".")
        if part == "mlp":
            both = values_of(fused[f"blk.{layer}.ffn_up.weight"])
            half = both.shape[0] // 2
            return both[:half] if what == "gate_proj" else both[half:]
        qkv = values_of(fused[f"blk.{layer}.attn_qkv.weight"])
        q_rows, kv_rows = n_heads * head_dim, int(_field(reader, f"{arch}.attention.head_count_kv")) * head_dim
        start = {"q_proj": 0, "k_proj": q_rows, "v_proj": q_rows + kv_rows}[what]
        return qkv[start : start + (q_rows if what == "q_proj" else kv_rows)]

    dim = int(_field(reader, f"{arch}.embedding_length"))
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    n_layers = int(_field(reader, f"{arch}.block_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", dim // n_heads))
    theta = float(_field(reader, f"{arch}.rope.freq_base"))
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    rope = Rope(theta)
    if kind in ("linear", "yarn"):
        rope = Rope(
            theta,
            freq_scale=1.0 / factor,
            ext_factor=1.0 if kind == "yarn" else 0.0,
            orig_ctx=int(_field(reader, f"{arch}.rope.scaling.original_context_length", 0)),
        )
    if "rope_freqs.weight" in by_name:
        rope = dataclasses.replace(rope, freq_factors=tuple(float(f) for f in weight("rope_freqs.weight")))
    elif "rope_factors_long.weight" in by_name:  # llama_model::get_rope_factors; attn_factor: llama-context.cpp
        trained = int(_field(reader, f"{arch}.context_length"))
        longer = (context or trained) > int(_field(reader, f"{arch}.rope.scaling.original_context_length", trained))
        factors = weight("rope_factors_long.weight" if longer else "rope_factors_short.weight")
        rope = dataclasses.replace(
            rope,
            freq_factors=tuple(float(f) for f in factors),
            attn_factor=float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
        )
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0)) if arch == "gemma3" else 0
    sliding = tuple(i % 6 < 5 for i in range(n_layers)) if window else ()  # gemma3: set_swa_pattern(6)
    config = OracleConfig(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv")),
        head_dim=head_dim,
        vocab_size=int(by_name["embed_tokens.weight"].shape[1]),
        rope_theta=theta,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tied="lm_head.weight" not in by_name,
        arch=arch,
        rope=rope,
        local_rope=Rope(10000.0) if window else None,
        sliding=sliding,
        sliding_window=window,
        attn_scale=1.0 / math.sqrt(dim // n_heads if arch == "gemma3" and n_layers == 62 else head_dim),
        final_softcap=float(_field(reader, f"{arch}.final_logit_softcapping", 0.0)) if arch == "gemma3" else 0.0,
    )
    return LlamaForward(config, weight)
