"""Convert a GGUF of an architecture the engine runs (llama, qwen2, qwen3, gemma3, phi3; e.g.
SmolLM2-135M-Instruct Q4_1) into a `.base` bundle.

``--dtype auto`` (the command's default) keeps each matrix as the GGUF stores it:
Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks as base_q8 / base_q4 / base_q5 groups,
Q4_K / Q5_K / Q6_K blocks byte for byte (ggml_q*_k), all carried with no added
error; float matrices as f16. ``f16`` / ``f32`` dequantize every matrix with the
`gguf` package; ``q8`` / ``q4`` store them group-wise quantized (groups of 32),
carrying the blocks the target width holds exactly and quantizing the rest from
their f32 values. Norms stay f32. docs/models.md has the table per GGML type; the
quantized-output section below has the details. q/k projection rows keep the GGUF
order, which llama.cpp permuted at HF->GGUF conversion time so that RoPE rotates
adjacent pairs, exactly what docs/BUNDLE.md's forward does, and Gemma's norm weights
carry the 1 llama.cpp added: the engine's description of each architecture
(docs/models.md) reads them so. Phi-3's fused projections (attn_qkv, ffn_up holding
gate and up) are split into the canonical q/k/v and gate/up matrices by rows, each
part in the GGUF's own type (rows are independent: no value changes).

Usage: ``python -m aiobasert.models.convert SRC.gguf OUT.base [--dtype auto|f16|f32|q8|q4]``
"""

from __future__ import annotations

import argparse
import hashlib
import math
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import gguf
import numpy as np
import numpy.typing as npt
from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]  # no stubs in tqdm itself

from ..errors import ConversionError
from ._gguf_tokenizer import bundle_tokenizer, tokenizer_refusal
from ._options import DTYPES, Dtype, add_arguments
from ._progress import ticking
from .bundle import GGML_BLOCKS, BundleWriter, Progress, QuantizedTensor, TensorEntry, llama_header

__all__ = ["DTYPES", "ConversionError", "Dtype", "convert_gguf", "main"]


_GGUF_MAGIC: Final = b"GGUF"

# GGUF tensor name stems -> canonical bundle names (base-convert's llama mapping, and the
# other architectures' extra tensors under names of their own).
_GLOBAL_NAMES: Final = {
    "token_embd": "embed_tokens",
    "output_norm": "final_norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
    "rope_factors_long": "rope_factors_long",
    "rope_factors_short": "rope_factors_short",
}
_LAYER_NAMES: Final = {
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

# The architectures the engine runs and the per-layer tensors each adds to llama's
# (native/src/loader.c's table says the same from the engine's side).
_ARCH_LAYER_EXTRAS: Final[dict[str, tuple[str, ...]]] = {
    "llama": (),
    "qwen2": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "qwen3": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    "gemma3": (
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "self_attn.out_norm.weight",
        "mlp.out_norm.weight",
    ),
    "phi3": (),
}

# Fused GGUF matrices: per architecture, stem -> the canonical matrices its row blocks hold, in order
# (llama.cpp: create_tensor_qkv's {n_embd, n_embd_q + 2 n_embd_gqa}; phi3's ffn_up is {n_embd, 2 n_ff},
# split by ggml_swiglu: the first half is the gate, SiLU'd, times the second).
_FUSED: Final[dict[str, dict[str, tuple[str, ...]]]] = {
    "phi3": {
        "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),
    },
}


class _Hparams:
    """The hyperparameters the bundle needs, read from the `{arch}.*` keys as llama.cpp reads them."""

    def __init__(
        self,
        arch: str,
        meta: dict[str, Any],
        n_tokens: int,
        n_tensors: int,
        fail: Callable[[str], ConversionError],
        *,
        longrope: bool = False,
    ) -> None:
        self.arch = arch

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise fail(f"missing GGUF key '{arch}.{key}'")
            return value

        def integer(key: str, default: int | None = None) -> int:
            value = get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise fail(f"'{arch}.{key}' must be a positive integer, got {value!r}")
            return value

        def number(key: str, default: float | None = None) -> float:
            return _finite_number(f"{arch}.{key}", get(key, default), fail)

        self.n_layers = integer("block_count")
        # Sized by the file before anything is sized by it: every layer has at least llama's 9 tensors
        # (6 where q/k/v and gate/up may come fused).
        if self.n_layers * (6 if arch in _FUSED else 9) + 2 > n_tensors:
            raise fail(f"'{arch}.block_count' {self.n_layers} needs more tensors than the file's {n_tensors}")
        self.dim = integer("embedding_length")
        self.ffn_dim = integer("feed_forward_length")
        self.n_heads = integer("attention.head_count")
        self.n_kv_heads = integer("attention.head_count_kv", self.n_heads)
        self.context_length = integer("context_length")
        self.vocab_size = integer("vocab_size", n_tokens)
        # llama.cpp: n_embd_head_k = key_length, else n_embd / n_head; n_rot defaults to it.
        self.head_dim = integer("attention.key_length", self.dim // self.n_heads)
        rot = integer("rope.dimension_count", self.head_dim)
        self.rope_theta = number("rope.freq_base", 10000.0)
        self.rms_norm_eps = number("attention.layer_norm_rms_epsilon")

        if self.n_heads % self.n_kv_heads:
            raise fail(f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}")
        if self.head_dim % 2:
            raise fail(f"odd head size {self.head_dim} cannot be rotated in pairs")
        if integer("attention.value_length", self.head_dim) != self.head_dim:
            raise fail(
                f"unsupported: {arch}.attention.value_length {meta[f'{arch}.attention.value_length']} != "
                f"key_length {self.head_dim}"
            )
        if rot != self.head_dim:
            raise fail(
                f"unsupported: partial rotary ({arch}.rope.dimension_count {rot} of a {self.head_dim}-wide head)"
            )
        if meta.get(f"{arch}.expert_count", 0):
            raise fail(f"unsupported: mixture of experts ({arch}.expert_count {meta[f'{arch}.expert_count']})")
        self.extra: dict[str, Any] = {}
        self._rope_scaling(get, fail)
        if arch == "gemma3":
            self._gemma3(meta, fail)
        elif arch == "phi3":
            # llama.cpp reads phi3.attention.sliding_window and then disables it (phi3.cpp: "Phi SWA is
            # currently disabled"): every layer attends to the whole context, here too.
            self._longrope(longrope, number, fail)
        elif meta.get(f"{arch}.attention.sliding_window"):
            raise fail(f"unsupported: sliding-window attention in a {arch} model")

    def _rope_scaling(self, get: Callable[[str, Any], Any], fail: Callable[[str], ConversionError]) -> None:
        def number(key: str, default: float) -> float:
            return _finite_number(f"{self.arch}.{key}", get(key, default), fail)

        scaling = get("rope.scaling.type", "none")
        factor = _finite_number(
            f"{self.arch}.rope.scaling.factor", get("rope.scaling.factor", get("rope.scale_linear", 1.0)), fail
        )
        if scaling == "none" and factor == 1.0:
            return
        if scaling == "none":  # a bare factor: llama.cpp treats it as linear
            scaling = "linear"
        if scaling not in ("linear", "yarn"):
            raise fail(f"unsupported RoPE scaling type {scaling!r} (the engine runs linear and yarn)")
        if not factor > 0:
            raise fail(f"RoPE scaling factor {factor} must be positive")
        rope: dict[str, Any] = {"rope_type": scaling, "factor": factor}
        if scaling == "yarn":
            if number("rope.scaling.yarn_log_multiplier", 0.0):
                raise fail("unsupported: YaRN with a log multiplier (DeepSeek-style mscale)")
            rope["original_max_position_embeddings"] = _positive_int(
                f"{self.arch}.rope.scaling.original_context_length",
                get("rope.scaling.original_context_length", self.context_length),
                fail,
            )
            for key, ours in (
                ("yarn_beta_fast", "beta_fast"),
                ("yarn_beta_slow", "beta_slow"),
                ("yarn_ext_factor", "ext_factor"),
                ("attn_factor", "attn_factor"),
            ):
                value = number(f"rope.scaling.{key}", -1.0)
                if value >= 0:  # llama.cpp: negative or absent = its default
                    rope[ours] = value
        self.extra["rope_scaling"] = rope

    def _longrope(
        self, longrope: bool, number: Callable[[str, float], float], fail: Callable[[str], ConversionError]
    ) -> None:
        # Phi-3's 128k variants (llama.cpp: llama_model::get_rope_factors, llama-context.cpp): each frequency is
        # divided by rope_factors_long when the context per sequence is longer than
        # rope.scaling.original_context_length, else by rope_factors_short, and q / k turn scaled by
        # rope.scaling.attn_factor (which llama.cpp's converter writes only beside those tensors).
        attn_factor = number("rope.scaling.attn_factor", 1.0)
        if not longrope:
            if attn_factor != 1.0:
                raise fail("unsupported: phi3.rope.scaling.attn_factor without LongRoPE's factor tensors")
            return
        if "rope_scaling" in self.extra:
            raise fail("unsupported: LongRoPE factor tensors beside another RoPE scaling type")
        orig = number("rope.scaling.original_context_length", float(self.context_length))
        if orig != int(orig) or orig < 1:
            raise fail(f"phi3.rope.scaling.original_context_length must be a positive integer, got {orig}")
        self.extra["rope_scaling"] = {
            "rope_type": "longrope",
            "original_max_position_embeddings": int(orig),
            "attn_factor": attn_factor,
        }

    def _gemma3(self, meta: dict[str, Any], fail: Callable[[str], ConversionError]) -> None:
        # llama.cpp's gemma3 rules (llama-model.cpp): every 6th layer full attention, the others a
        # sliding window with RoPE base 10000 and no scaling; attention scale 1/sqrt(key_length),
        # except the 62-layer 27B's 1/sqrt(n_embd / n_head).
        window = meta.get("gemma3.attention.sliding_window", 0)
        if window:
            self.extra |= {
                "sliding_window": _positive_int("gemma3.attention.sliding_window", window, fail),
                "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(self.n_layers)],
                "rope_local_base_freq": 10000.0,
            }
        scalar = self.dim // self.n_heads if self.n_layers == 62 else self.head_dim
        self.extra["query_pre_attn_scalar"] = float(scalar)
        cap = meta.get("gemma3.final_logit_softcapping", 0.0)
        if cap:
            self.extra["final_logit_softcapping"] = _finite_number("gemma3.final_logit_softcapping", cap, fail)


def _finite_number(key: str, value: Any, fail: Callable[[str], ConversionError]) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise fail(f"'{key}' must be a finite number, got {value!r}")
    return float(value)


def _positive_int(key: str, value: Any, fail: Callable[[str], ConversionError]) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise fail(f"'{key}' must be a positive integer, got {value!r}")
    return value


# What each other architecture needs beyond the forwards the reference engine runs, so a
# refusal names it.
_MISSING_FEATURES: Final = {
    "qwen2moe": "mixture-of-experts feed-forward layers and q/k/v biases",
    "qwen3moe": "mixture-of-experts feed-forward layers and q/k RMSNorm",
    "gemma": "GeGLU feed-forward, (1 + w) RMSNorm and scaled embeddings",
    "gemma2": "GeGLU feed-forward, sandwich norms, logit soft-capping and sliding-window attention",
    "phi2": "LayerNorm with biases, a GELU MLP and a parallel attention/MLP block",
    "gpt2": "LayerNorm with biases, learned position embeddings and a GELU MLP",
    "gptneox": "LayerNorm with biases, partial rotary embeddings and a parallel attention/MLP block",
    "falcon": "LayerNorm, multi-query fused QKV and a parallel attention/MLP block",
    "starcoder2": "LayerNorm with biases and a GELU MLP",
    "mamba": "state-space (Mamba) layers instead of attention",
    "rwkv6": "RWKV time-mixing layers instead of attention",
    "bert": "a bidirectional encoder (not a causal language model)",
    "nomic-bert": "a bidirectional encoder (not a causal language model)",
    "t5": "an encoder-decoder model",
    "deepseek2": "multi-head latent attention and mixture-of-experts layers",
    "mixtral": "mixture-of-experts feed-forward layers",
}


def _unsupported_architecture(arch: object) -> str:
    missing = _MISSING_FEATURES.get(arch) if isinstance(arch, str) else None
    what = f"it needs {missing}" if missing else "its layers are none of these layouts"
    return (
        f"unsupported architecture {arch!r}: the reference engine runs 'llama' (Llama 1-3, SmolLM2, "
        "Mistral-style: RMSNorm, RoPE, SwiGLU, grouped-query attention), 'qwen2', 'qwen3', 'gemma3' and 'phi3' "
        "models; "
        f"{what}, which the reference engine does not implement"
    )


def _can_dequantize(kind: gguf.GGMLQuantizationType) -> bool:
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    # gguf-py keeps its numpy dequantizers in a private table; without it, let _dequantize try.
    traits = getattr(gguf.quants, "_type_traits", None)
    return traits is None or kind in traits


_VT = gguf.GGUFValueType
_U64: Final = struct.Struct("<Q")
_ARRAY_HEAD: Final = struct.Struct("<IQ")
_SCALARS: Final[dict[int, struct.Struct]] = {
    _VT.UINT8: struct.Struct("<B"), _VT.INT8: struct.Struct("<b"), _VT.UINT16: struct.Struct("<H"),
    _VT.INT16: struct.Struct("<h"), _VT.UINT32: struct.Struct("<I"), _VT.INT32: struct.Struct("<i"),
    _VT.FLOAT32: struct.Struct("<f"), _VT.BOOL: struct.Struct("<?"), _VT.UINT64: struct.Struct("<Q"),
    _VT.INT64: struct.Struct("<q"), _VT.FLOAT64: struct.Struct("<d"),
}  # fmt: skip
_ARRAY_ITEMS: Final[dict[int, np.dtype[Any]]] = {
    _VT.UINT8: np.dtype("<u1"), _VT.INT8: np.dtype("<i1"), _VT.UINT16: np.dtype("<u2"), _VT.INT16: np.dtype("<i2"),
    _VT.UINT32: np.dtype("<u4"), _VT.INT32: np.dtype("<i4"), _VT.FLOAT32: np.dtype("<f4"), _VT.BOOL: np.dtype("?"),
    _VT.UINT64: np.dtype("<u8"), _VT.INT64: np.dtype("<i8"), _VT.FLOAT64: np.dtype("<f8"),
}  # fmt: skip


def _f32(value: float) -> float:
    """Shortest decimal that round-trips the float32 (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _parse_metadata(buf: memoryview, offs: int, count: int) -> tuple[dict[str, Any], dict[str, int], int]:
    """The key/value section of a little-endian GGUF: (values, value types, offset after it)."""
    unpack_u64 = _U64.unpack_from
    n_buf = len(buf)

    def string(o: int) -> tuple[str, int]:
        (n,) = unpack_u64(buf, o)
        if n > n_buf - o - 8:
            raise ValueError(f"a string of {n} bytes at offset {o} runs past the end of the file")
        return str(buf[o + 8 : o + 8 + n], "utf-8"), o + 8 + n

    def value(kind: int, o: int) -> tuple[Any, int]:
        if kind == _VT.STRING:
            return string(o)
        if kind == _VT.ARRAY:
            item, n = _ARRAY_HEAD.unpack_from(buf, o)
            o += _ARRAY_HEAD.size
            if n > n_buf - o:  # every item takes at least a byte: a count the file cannot hold
                raise ValueError(f"an array of {n} items at offset {o} runs past the end of the file")
            if item == _VT.STRING:
                items = []
                for _ in range(n):  # the hot loop: a 49k-token vocabulary and its merges
                    (size,) = unpack_u64(buf, o)
                    items.append(str(buf[o + 8 : o + 8 + size], "utf-8"))
                    o += 8 + size
                return items, o
            if item not in _ARRAY_ITEMS:
                raise ValueError(f"unsupported GGUF array item type {item}")
            array = np.frombuffer(buf, dtype=_ARRAY_ITEMS[item], count=n, offset=o)
            values = array.tolist()
            return ([_f32(v) for v in values] if item == _VT.FLOAT32 else values), o + array.nbytes
        if kind not in _SCALARS:
            raise ValueError(f"unsupported GGUF value type {kind}")
        (scalar,) = _SCALARS[kind].unpack_from(buf, o)
        return (_f32(scalar) if kind == _VT.FLOAT32 else scalar), o + _SCALARS[kind].size

    meta: dict[str, Any] = {}
    kinds: dict[str, int] = {}
    if count > (n_buf - offs) // 13:  # a key/value takes at least 8 + 4 + 1 bytes
        raise ValueError(f"{count} metadata entries cannot fit in the file")
    for _ in range(count):
        key, offs = string(offs)
        (kind,) = _SCALARS[_VT.UINT32].unpack_from(buf, offs)
        meta[key], offs = value(kind, offs + 4)
        kinds[key] = kind
    return meta, kinds, offs


def _truncated(size: int, needed: int | None = None) -> ValueError:
    if needed is None:
        return ValueError(f"truncated: the file ends ({size:,} bytes) inside its metadata (an interrupted download?)")
    return ValueError(f"truncated: the file is {size:,} bytes but its contents run to byte {needed:,} "
                      "(an interrupted download?)")  # fmt: skip


class _Reader(gguf.GGUFReader):
    """gguf-py's reader with a fast metadata pass.

    gguf-py builds numpy views for every element of every array (about 5 s for
    SmolLM2's 49k-token vocabulary and merges, most of a first run's conversion);
    this parses the key/value section with `struct` in one pass (a tenth of a
    second) and keeps gguf-py for the tensor table. Byte-swapped files take
    gguf-py's own path."""

    metadata: dict[str, Any] | None = None

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: Any = None) -> Any:
        # Every read of gguf-py's goes through here: a cut-off file is named as such, not as numpy's complaint.
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _truncated(len(self.data), end)
        return super()._get(offset, dtype, count, override_order)

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            return int(super()._build_fields(offs, count))
        try:
            self.metadata, kinds, end = _parse_metadata(self.data.data, int(offs), int(count))
        except struct.error:  # unpack_from past the end
            raise _truncated(len(self.data)) from None
        if "general.alignment" in self.metadata:  # the one key gguf-py's reader itself consults
            if kinds["general.alignment"] != _VT.UINT32:  # as gguf-py requires (and a negative one must not wrap)
                raise ValueError("general.alignment is not a uint32")
            kind = gguf.GGUFValueType(kinds["general.alignment"])
            part = np.array([self.metadata["general.alignment"]], dtype=np.uint64).astype(np.uint32)
            self.fields["general.alignment"] = gguf.ReaderField(offs, "general.alignment", [part], [0], [kind])
        return end

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[gguf.ReaderField]]:
        # A tensor's entry takes at least 8 + 4 + 4 + 8 bytes: bound the count by the file before gguf-py loops.
        if int(count) > (len(self.data) - int(offs)) // 24:
            raise ValueError(f"{int(count)} tensors cannot fit in the file")
        offs, fields = super()._build_tensor_info(offs, count)
        return int(offs), list(fields)


def _read_gguf(src: Path) -> tuple[gguf.GGUFReader, dict[str, Any]]:
    reader = _Reader(src)
    if reader.metadata is not None:
        return reader, reader.metadata
    return reader, {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _field_value(field: gguf.ReaderField) -> Any:
    """A GGUF metadata value as plain Python (works across gguf-py versions)."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise ValueError(f"nested array in GGUF key {field.name!r}")
        item = field.types[1]
        if item == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [_plain_scalar(field.parts[i], item) for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return _plain_scalar(field.parts[field.data[0]], kind)


def _plain_scalar(part: npt.NDArray[Any], kind: gguf.GGUFValueType) -> Any:
    value = part.tolist()[0]
    if kind == gguf.GGUFValueType.FLOAT32:
        # Shortest decimal that round-trips the float32 (1e-05, not 9.9999997e-06).
        return float(str(np.float32(value)))
    return value


def _json_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a metadata value (strict JSON has neither)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_json_finite(v) for v in value)
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _canonical_name(gguf_name: str) -> str | None:
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _split_fused(
    cfg: _Hparams, tensor: gguf.ReaderTensor, fail: Callable[[str], ConversionError]
) -> dict[str, gguf.ReaderTensor]:
    """A fused matrix of `cfg.arch` as its canonical parts (row blocks, each in the GGUF's own type and
    bytes: a row of any GGML type is whole blocks, so the split is exact); {} when `tensor` is not one."""
    stem, _, suffix = tensor.name.rpartition(".")
    parts = stem.split(".")
    fused = _FUSED.get(cfg.arch, {})
    if suffix != "weight" or len(parts) != 3 or parts[0] != "blk" or parts[2] not in fused:
        return {}
    if not (parts[1].isascii() and parts[1].isdigit()):
        return {}
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    widths = (q_dim, kv_dim, kv_dim) if parts[2] == "attn_qkv" else (cfg.ffn_dim, cfg.ffn_dim)
    shape = [int(d) for d in tensor.shape.tolist()]  # GGUF order: [in, out]
    if len(shape) != 2 or shape[1] != sum(widths) or len(tensor.data) != shape[1]:
        raise fail(f"tensor {tensor.name!r} has shape {shape[::-1]}, expected [{sum(widths)}, {cfg.dim}]")
    out: dict[str, gguf.ReaderTensor] = {}
    start = 0
    for canonical, width in zip(fused[parts[2]], widths, strict=True):
        rows = tensor.data[start : start + width]  # [out, in] values, or [out, row bytes] of blocks
        out[f"layers.{int(parts[1])}.{canonical}.weight"] = tensor._replace(
            name=f"{tensor.name}[{start}:{start + width}]",
            shape=np.array([shape[0], width], dtype=np.uint64),
            n_elements=shape[0] * width,
            n_bytes=int(rows.nbytes),
            data=rows,
        )
        start += width
    return out


def _expected_shapes(cfg: _Hparams, tied: bool, rope_freqs: bool, longrope: bool) -> dict[str, tuple[int, ...]]:
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, cfg.dim)}
    if rope_freqs:
        shapes["rope_freqs.weight"] = (cfg.head_dim // 2,)
    if longrope:
        shapes["rope_factors_long.weight"] = shapes["rope_factors_short.weight"] = (cfg.head_dim // 2,)
    extra_shapes = {
        "self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,), "self_attn.v_proj.bias": (kv_dim,),
        "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,),
        "self_attn.out_norm.weight": (cfg.dim,), "mlp.out_norm.weight": (cfg.dim,),
    }  # fmt: skip
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_norm.weight": (cfg.dim,),
            p + "self_attn.q_proj.weight": (q_dim, cfg.dim),
            p + "self_attn.k_proj.weight": (kv_dim, cfg.dim),
            p + "self_attn.v_proj.weight": (kv_dim, cfg.dim),
            p + "self_attn.o_proj.weight": (cfg.dim, q_dim),
            p + "post_attn_norm.weight": (cfg.dim,),
            p + "mlp.gate_proj.weight": (cfg.ffn_dim, cfg.dim),
            p + "mlp.up_proj.weight": (cfg.ffn_dim, cfg.dim),
            p + "mlp.down_proj.weight": (cfg.dim, cfg.ffn_dim),
        }
        shapes |= {p + name: extra_shapes[name] for name in _ARCH_LAYER_EXTRAS[cfg.arch]}
    shapes["final_norm.weight"] = (cfg.dim,)
    if not tied:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def _tqdm_progress(desc: str, total: int) -> tuple[Progress, Callable[[], None]]:
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)

    def update(done: int, total: int) -> None:
        bar.total = total  # the writer's own count (quantized and GGML-block tensors are not 2 bytes a value)
        bar.update(done - bar.n)

    return update, bar.close


def convert_gguf(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: Dtype = "f16",
    progress: bool | Progress = True,
) -> Path:
    """Convert the GGUF `src` (llama, qwen2, qwen3, gemma3 or phi3) into the bundle `dst` (written atomically);
    returns `dst`.

    `dtype`: how the matrices are stored: f16 / f32, q8 / q4 (group-wise quantized), or auto (each as
    the GGUF has it; GGML blocks the engine's integer kernels can hold are carried exactly). The
    ``aiobasert convert`` command defaults to auto.

    `progress`: True shows a tqdm bar on stderr, False nothing; a callable is
    called with (bytes written, bytes total) after each tensor.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")

    def fail(reason: str) -> ConversionError:
        return ConversionError(f"{src}: {reason}")

    # Every stage refuses what it reads before the next one starts: nothing is written for a bad file.
    reader, meta = _open_gguf(src, fail, show=progress is True)
    cfg, longrope = _model_hparams(reader, meta, fail)
    sources = _source_tensors(cfg, reader, fail)
    tied = "lm_head.weight" not in sources
    entries = _bundle_entries(cfg, sources, dtype, tied=tied, longrope=longrope, fail=fail)
    header = _bundle_header(src, cfg, meta, dtype, entries, tied=tied, fail=fail)
    _write_bundle(dst, header, entries, sources, progress, f"converting {src.name}", fail)
    return dst


def _open_gguf(
    src: Path, fail: Callable[[str], ConversionError], *, show: bool
) -> tuple[gguf.GGUFReader, dict[str, Any]]:
    """The GGUF's reader and metadata; a file that is not one, or is damaged, refused."""
    with open(src, "rb") as file:
        magic = file.read(4)
    if magic != _GGUF_MAGIC:
        raise fail(f"not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    try:
        # Quick for the demo model; a big vocabulary or a slow disk gets an elapsed-time line.
        with ticking(f"reading {src.name}", enabled=show):
            return _read_gguf(src)
    except (ValueError, IndexError, UnicodeDecodeError, struct.error) as exc:  # a damaged file
        raise fail(f"unreadable GGUF: {exc}") from None


def _model_hparams(
    reader: gguf.GGUFReader, meta: dict[str, Any], fail: Callable[[str], ConversionError]
) -> tuple[_Hparams, bool]:
    """The architecture's hyperparameters and whether it has LongRoPE factor tensors; an architecture or
    a tokenizer the engine does not run refused before any tensor is read."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in _ARCH_LAYER_EXTRAS:
        raise fail(_unsupported_architecture(arch))
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise fail("no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if not all(isinstance(t, str) for t in tokens):
        raise fail("tokenizer.ggml.tokens must be an array of strings")
    if refusal := tokenizer_refusal(meta):  # before any tensor is read
        raise fail(refusal)
    longrope = arch == "phi3" and any(t.name.startswith("rope_factors_") for t in reader.tensors)
    cfg = _Hparams(arch, meta, len(tokens), len(reader.tensors), fail, longrope=longrope)
    if len(tokens) != cfg.vocab_size:
        raise fail(f"{arch}.vocab_size {cfg.vocab_size} != {len(tokens)} tokens in the vocabulary")
    return cfg, longrope


def _source_tensors(
    cfg: _Hparams, reader: gguf.GGUFReader, fail: Callable[[str], ConversionError]
) -> dict[str, gguf.ReaderTensor]:
    """Each canonical bundle tensor name and the GGUF tensor (or fused tensor's rows) holding it."""
    sources: dict[str, gguf.ReaderTensor] = {}
    for tensor in reader.tensors:
        if not _can_dequantize(tensor.tensor_type):  # refuse now, not after converting half the file
            raise fail(f"tensor {tensor.name!r}: cannot dequantize GGML type {tensor.tensor_type.name}")
        parts = _split_fused(cfg, tensor, fail)
        if not parts:
            name = _canonical_name(tensor.name)
            if name is None:
                raise fail(f"unsupported tensor {tensor.name!r} (not part of a {cfg.arch} model the engine runs)")
            parts = {name: tensor}
        if twice := sorted(parts.keys() & sources.keys()):  # e.g. attn_qkv beside attn_q
            raise fail(f"tensor {tensor.name!r} holds {twice[0]!r}, which another tensor already holds")
        sources |= parts
    return sources


def _bundle_entries(
    cfg: _Hparams,
    sources: dict[str, gguf.ReaderTensor],
    dtype: Dtype,
    *,
    tied: bool,
    longrope: bool,
    fail: Callable[[str], ConversionError],
) -> list[TensorEntry]:
    """The bundle's tensor table: every tensor the architecture has, at its expected shape, none other."""
    # llama.cpp reads rope_freqs for llama only; elsewhere it is a tensor the model does not have.
    expected = _expected_shapes(cfg, tied, cfg.arch == "llama" and "rope_freqs.weight" in sources, longrope)
    _check_tensor_names(cfg, sources, expected, fail)
    return [_bundle_entry(name, shape, sources[name], dtype, fail) for name, shape in expected.items()]


def _check_tensor_names(
    cfg: _Hparams,
    sources: dict[str, gguf.ReaderTensor],
    expected: dict[str, tuple[int, ...]],
    fail: Callable[[str], ConversionError],
) -> None:
    if missing := [name for name in expected if name not in sources]:
        raise fail(f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra := [name for name in sources if name not in expected]:
        where = [n for n in extra if not (n.startswith("layers.") and int(n.split(".")[1]) >= cfg.n_layers)]
        if where:
            raise fail(f"unsupported tensor(s) for a {cfg.arch} model: {', '.join(where[:5])}")
        raise fail(f"tensors beyond the {cfg.n_layers} configured layers: {', '.join(extra[:5])}")


def _bundle_entry(
    name: str, shape: tuple[int, ...], source: gguf.ReaderTensor, dtype: Dtype, fail: Callable[[str], ConversionError]
) -> TensorEntry:
    """One tensor's entry: norms f32, matrices in `dtype` (quantized ones as `_quantized_entry` decides)."""
    # GGUF lists dimensions fastest-varying first: [in, out] is numpy (out, in).
    gguf_shape = tuple(int(d) for d in reversed(source.shape.tolist()))
    if gguf_shape != shape:
        raise fail(f"tensor {source.name!r} has shape {list(gguf_shape)}, expected {list(shape)}")
    if len(shape) == 1:
        return TensorEntry(name, shape, "f32", "gpu")
    region = "gpu" if name in ("embed_tokens.weight", "lm_head.weight") else "accelerator"
    if dtype in ("auto", "q8", "q4"):
        return _quantized_entry(name, shape, region, dtype, source)
    return TensorEntry(name, shape, dtype, region)


def _special_ids(
    meta: dict[str, Any], vocab_size: int, fail: Callable[[str], ConversionError]
) -> tuple[int, int, list[int]]:
    """The vocabulary's bos and eos ids and its other stop ids (end of turn / message)."""

    def token_id(key: str) -> int:
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
            raise fail(f"{key} must be a token id below the vocabulary size {vocab_size}, got {value!r}")
        return value

    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key not in meta:
            raise fail("the vocabulary needs tokenizer.ggml.bos_token_id and tokenizer.ggml.eos_token_id")
    bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
    stop_ids = sorted(
        {token_id(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta} - {eos}
    )
    return bos, eos, stop_ids


def _bundle_header(
    src: Path,
    cfg: _Hparams,
    meta: dict[str, Any],
    dtype: Dtype,
    entries: Sequence[TensorEntry],
    *,
    tied: bool,
    fail: Callable[[str], ConversionError],
) -> dict[str, Any]:
    """The bundle's header: the config, the tokenizer and chat template, the source's identity."""
    bos, eos, stop_ids = _special_ids(meta, cfg.vocab_size, fail)
    tokenizer = bundle_tokenizer(meta)
    chat_template = meta.get("tokenizer.chat_template")
    # The header is strict JSON: a NaN / Inf anywhere in what it copies from the GGUF is a malformed file.
    for key, value in tokenizer.items():
        if not _json_finite(value):
            raise fail(f"{key} holds a NaN or infinite number")
    if chat_template is not None and not isinstance(chat_template, str):
        raise fail(f"tokenizer.chat_template must be a string, got {type(chat_template).__name__}")
    header = llama_header(
        arch=cfg.arch,
        dtype=_QUANT_DTYPE.get(dtype, dtype),  # "auto": the mix the GGUF has
        source={"format": "gguf", "sha256": _sha256(src), "filename": src.name},
        config={
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_dim,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.context_length,
            "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": tied,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "eos_token_ids": stop_ids,
        }
        | cfg.extra,
        tokenizer=tokenizer,
        metadata={} if chat_template is None else {"tokenizer.chat_template": chat_template},
    )
    if any(e.dtype in _QUANTIZED or e.dtype in GGML_BLOCKS for e in entries):
        header["target_backend"] = "cpu_avx2"
    return header


def _write_bundle(
    dst: Path,
    header: dict[str, Any],
    entries: Sequence[TensorEntry],
    sources: dict[str, gguf.ReaderTensor],
    progress: bool | Progress,
    desc: str,
    fail: Callable[[str], ConversionError],
) -> None:
    """Each entry's values in its bundle dtype (quantized groups, K-quant blocks as they are, or floats),
    written atomically to `dst` with the progress asked for."""
    close_bar: Callable[[], None] | None = None
    callback: Progress | None
    if progress is True:
        total = sum(math.prod(e.shape) * (4 if e.dtype == "f32" else 2) for e in entries)
        callback, close_bar = _tqdm_progress(desc, total)
    else:
        callback = progress or None
    try:
        with BundleWriter(dst, header, entries, progress=callback) as writer:
            for entry in entries:
                if entry.dtype in _QUANTIZED:
                    writer.write(entry.name, _quantize(sources[entry.name], entry, fail))
                elif entry.dtype in GGML_BLOCKS:
                    writer.write(entry.name, _k_blocks(sources[entry.name], fail))
                else:
                    writer.write(entry.name, _dequantize(sources[entry.name], entry, fail))
    finally:
        if close_bar is not None:
            close_bar()


def _k_blocks(tensor: gguf.ReaderTensor, fail: Callable[[str], ConversionError]) -> npt.NDArray[np.uint8]:
    """A K-quant tensor's blocks as they are, refused when a super-block's f16 d or dmin is NaN / Inf (all its
    256 values non-finite), as the engine refuses it at load."""
    blocks = np.asarray(tensor.data, dtype=np.uint8)
    size = gguf.GGML_QUANT_SIZES[tensor.tensor_type][1]
    flat = blocks.reshape(-1, size)
    fields = (("d", 208),) if tensor.tensor_type == _Q.Q6_K else (("d", 0), ("dmin", 2))
    for field, at in fields:
        bad = np.flatnonzero(~np.isfinite(_f16_field(flat, at)))
        if bad.size:
            raise fail(f"tensor {tensor.name!r}: super-block {int(bad[0])} has a non-finite {field}")
    return blocks


def _dequantize(
    tensor: gguf.ReaderTensor, entry: TensorEntry, fail: Callable[[str], ConversionError]
) -> npt.NDArray[Any]:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise fail(f"tensor {tensor.name!r}: cannot dequantize GGML type {tensor.tensor_type.name}") from None
    values = np.asarray(values, dtype=np.float32)
    if values.shape != entry.shape:  # dequantize yields numpy order (out, in): no reshaping needed
        raise fail(f"tensor {tensor.name!r} dequantized to shape {list(values.shape)}, expected {list(entry.shape)}")
    out = values.astype(np.float16) if entry.dtype == "f16" else values
    if not np.isfinite(out).all():
        raise fail(f"tensor {tensor.name!r}: non-finite values after conversion to {entry.dtype}")
    if tensor.name.startswith(("rope_freqs", "rope_factors_")) and not (out > 0).all():
        # RoPE frequency divisors: the engine refuses a zero or negative one (its angles would be NaN)
        raise fail(f"tensor {tensor.name!r}: RoPE frequency divisors must be positive")
    return out


# ---- quantized output (--dtype auto | q8 | q4) -------------------------------------------------
# CANONICAL_QUANT_SPEC.md's base_q8 / base_q4 (and aiobasert's base_q5) with group_size 32, the packing
# aiobasert.models.bundle.QUANT_LAYOUT names: value = scale * u + bias per group of 32 (symmetric: scale *
# (u - 2^(bits-1))). Many GGML block types are exactly that with integer u, so they are carried over
# block for block, with no added error (_carried below): Q8_0 (symmetric q8), Q4_0 (symmetric q4),
# Q4_1, Q5_0 (symmetric q5), Q5_1, and the K-quants whose sub-blocks are 32 values, Q4_K / Q5_K (scale
# = d * sc, bias = -dmin * m, sc and m 6-bit: an f16 times an integer below 64, exact in f32 though
# rarely in f16, so such tensors get f32 scales unless every one converts to f16 exactly).
#
# `auto` keeps each tensor as the GGUF has it, in the GGUF's own size: the 32-value block types in
# their own width, K-quant blocks (Q4_K / Q5_K / Q6_K) byte for byte as ggml_q*_k tensors that the
# engine decodes at load (Q6_K's 16-value sub-blocks with int8 scales have no 32-group form: the
# engine has a q6 kernel kind for them), f32 / f16 / bf16 matrices as f16, other blocks (Q2_K, Q3_K,
# IQ*) quantized to q8 from their f32 values. `q8` carries every 32-group type into base_q8; `q4`
# carries the 4-bit ones into base_q4, keeps Q8_0 at q8 (never lower its precision) and quantizes the
# rest to q4 (asymmetric, the spec's default).

_QUANT_DTYPE: Final = {"q8": "base_q8", "q4": "base_q4"}
_QUANT_GROUP: Final = 32
_QUANTIZED: Final = frozenset({"base_q8", "base_q5", "base_q4"})  # the bundle dtypes written as QuantizedTensor
_Q: Final = gguf.GGMLQuantizationType
_FOUR_BIT: Final = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q4_K})
_FIVE_BIT: Final = frozenset({_Q.Q5_0, _Q.Q5_1, _Q.Q5_K})
_CARRIED: Final = _FOUR_BIT | _FIVE_BIT | {_Q.Q8_0}
# Blocks whose bias is -2^(bits-1) * scale: stored symmetric (no bias region) in their own width.
_SYMMETRIC: Final = {_Q.Q8_0: "base_q8", _Q.Q5_0: "base_q5", _Q.Q4_0: "base_q4"}
_FLOAT: Final = frozenset({_Q.F32, _Q.F16, _Q.BF16})
# K-quant blocks `auto` stores as the GGUF has them (bundle dtypes ggml_q4_k / ggml_q5_k / ggml_q6_k,
# the GGUF's size): the engine repacks them at load into K panels that keep GGML's super-block scales
# (native/src/quant.h), Q6_K's two 16-value halves per block of 32 each with its int8 scale.
_K_BLOCKS: Final = {kind: dtype for dtype, (kind, _) in GGML_BLOCKS.items()}


def _quantized_entry(
    name: str, shape: tuple[int, ...], region: str, dtype: str, tensor: gguf.ReaderTensor
) -> TensorEntry:
    kind = tensor.tensor_type
    if dtype == "auto" and kind in _FLOAT:
        return TensorEntry(name, shape, "f16", region)
    if dtype == "auto" and kind.name in _K_BLOCKS:
        return TensorEntry(name, shape, _K_BLOCKS[kind.name], region)
    if dtype == "q4":
        target = "base_q8" if kind == _Q.Q8_0 else "base_q4"
    elif dtype == "auto":
        target = "base_q4" if kind in _FOUR_BIT else "base_q5" if kind in _FIVE_BIT else "base_q8"
    else:
        target = "base_q8"
    symmetric = _SYMMETRIC.get(kind) == target
    scale_dtype = "f16"
    if _is_carried(kind, target):
        _, scale, bias = _carried(tensor, shape)
        if not _f16_exact(scale) or (not symmetric and bias is not None and not _f16_exact(bias)):
            scale_dtype = "f32"
    return TensorEntry(
        name, shape, target, region, group_size=_QUANT_GROUP, symmetric=symmetric, scale_dtype=scale_dtype
    )


def _is_carried(kind: gguf.GGMLQuantizationType, target: str) -> bool:
    return kind in _CARRIED and (target == "base_q8" or kind in (_FOUR_BIT if target == "base_q4" else _FIVE_BIT))


def _f16_exact(values: npt.NDArray[np.float32]) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


_Carried = tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32], npt.NDArray[np.float32] | None]


def _f16_field(blocks: npt.NDArray[np.uint8], at: int) -> npt.NDArray[np.float32]:
    return blocks[..., at : at + 2].copy().view("<f2")[..., 0].astype(np.float32)


def _k_scales(packed: npt.NDArray[np.uint8]) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The 8 sub-block scales and mins of Q4_K / Q5_K, 6 bits each in 12 bytes (ggml's get_scale_min_k4)."""
    s = packed.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _carried(tensor: gguf.ReaderTensor, shape: tuple[int, ...]) -> _Carried:
    """A tensor of a carried GGML type as (u [out, in], scale [out, in/32], bias [out, in/32] or None for
    symmetric q8) with value = scale * u + bias, exactly as ggml (and gguf-py) dequantize it."""
    out_dim, in_dim = shape
    kind = tensor.tensor_type
    size = gguf.GGML_QUANT_SIZES[kind][1]
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out_dim, -1, size)
    if kind in (_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1):
        d = _f16_field(raw, 0)
        offset = 4 if kind in (_Q.Q4_1, _Q.Q5_1) else 2
        five = kind in (_Q.Q5_0, _Q.Q5_1)
        qs = raw[..., offset + 4 * five :]
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # value j in the low nibble, j + 16 in the high one
        if five:  # bit j of the little-endian qh word is value j's fifth bit
            qh = raw[..., offset : offset + 4].copy().view("<u4")
            u |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        bias = _f16_field(raw, 2) if offset == 4 else -(8.0 if not five else 16.0) * d
        return u.reshape(out_dim, in_dim), d, bias.astype(np.float32)
    if kind == _Q.Q8_0:
        u = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return u.reshape(out_dim, in_dim), _f16_field(raw, 0), None
    # Q4_K / Q5_K: super-blocks of 256 = 4 chunks of 64, each two 32-value sub-blocks (low, high nibbles)
    d, dmin = _f16_field(raw, 0)[..., None], _f16_field(raw, 2)[..., None]
    sc, mn = _k_scales(raw[..., 4:16])
    qs = raw[..., -128:].reshape(out_dim, -1, 4, 1, 32)
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=3)  # [row, super-block, chunk, sub-block, value]
    if kind == _Q.Q5_K:
        qh = raw[..., 16:48].reshape(out_dim, -1, 1, 1, 32)
        bit = np.arange(8, dtype=np.uint8).reshape(1, 1, 4, 2, 1)  # sub-block 2i + j takes bit 2i + j
        u |= ((qh >> bit) & 1) << 4
    scale, bias = d * sc, -(dmin * mn)  # f16 x 6-bit integer: exact in f32
    return (
        u.reshape(out_dim, in_dim),
        scale.reshape(out_dim, -1).astype(np.float32),
        bias.reshape(out_dim, -1).astype(np.float32),
    )


def _quantize(tensor: gguf.ReaderTensor, entry: TensorEntry, fail: Callable[[str], ConversionError]) -> QuantizedTensor:
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught just below, as an error
        q = _quantize_groups_of(tensor, entry, fail)
    # A NaN / Inf scale or bias (copied from the GGUF, or an f16 overflow of a huge finite range) would make the
    # whole group non-finite: the engine refuses such a bundle, so refuse it here, naming the tensor.
    for what, part in (("scale", q.scales), ("bias", q.biases)):
        if part is not None and not np.isfinite(part).all():
            raise fail(f"tensor {tensor.name!r}: a non-finite group {what} when quantized to {entry.dtype}")
    return q


def _quantize_groups_of(
    tensor: gguf.ReaderTensor, entry: TensorEntry, fail: Callable[[str], ConversionError]
) -> QuantizedTensor:
    if not _is_carried(tensor.tensor_type, entry.dtype):
        values = _dequantize(tensor, TensorEntry(entry.name, entry.shape, "f32"), fail)
        return quantize_groups(values, entry.dtype, symmetric=entry.symmetric)
    u, scale, bias = _carried(tensor, entry.shape)
    if entry.symmetric:
        bias = None  # the bias is -2^(bits-1) * scale, implied
    if entry.dtype in ("base_q4", "base_q5"):
        g = u.reshape(entry.shape[0], -1, _QUANT_GROUP)
        half = _QUANT_GROUP // 2
        u = ((g[:, :, :half] & 0x0F) | ((g[:, :, half:] & 0x0F) << 4)).astype(np.uint8)
        if entry.dtype == "base_q5":  # each group's fifth bits first, bit v % 8 of byte v / 8
            u = np.concatenate([np.packbits(g >> 4, axis=2, bitorder="little"), u], axis=2)
    packed = np.ascontiguousarray(u).reshape(-1)
    if entry.scale_dtype == "f32":
        return QuantizedTensor(packed, scale.reshape(-1), None if bias is None else bias.reshape(-1))
    return QuantizedTensor(
        packed, scale.astype(np.float16).reshape(-1), None if bias is None else bias.astype(np.float16).reshape(-1)
    )


def quantize_groups(
    values: npt.NDArray[np.float32], dtype: str, *, symmetric: bool = False, group_size: int = _QUANT_GROUP
) -> QuantizedTensor:
    """Round-to-nearest group quantization of a [out, in] f32 matrix: symmetric base_q8 as GGML's Q8_0
    (scale = amax / 127, stored q + 128), asymmetric as GGML's Q4_1 (scale = (max - min) / (2^bits - 1),
    bias = min). The f16-rounded scale and bias are the ones the values are quantized against."""
    if symmetric and dtype != "base_q8":
        raise ValueError("symmetric quantization is implemented for base_q8 only")
    out_dim, in_dim = values.shape
    g = np.asarray(values, dtype=np.float32).reshape(out_dim, in_dim // group_size, group_size)
    if symmetric:
        scale = (np.abs(g).max(axis=2) / 127.0).astype(np.float16)
        s = scale.astype(np.float32)[:, :, None]
        q = np.where(s > 0, np.rint(g / np.where(s > 0, s, 1.0)), 0.0)
        packed = (np.clip(q, -127, 127) + 128).astype(np.uint8)
        return QuantizedTensor(packed.reshape(-1), scale.reshape(-1))
    top = 255 if dtype == "base_q8" else 15
    lo, hi = g.min(axis=2), g.max(axis=2)
    scale = ((hi - lo) / top).astype(np.float16)
    bias = lo.astype(np.float16)
    s, b = scale.astype(np.float32)[:, :, None], bias.astype(np.float32)[:, :, None]
    q = np.clip(np.where(s > 0, np.rint((g - b) / np.where(s > 0, s, 1.0)), 0.0), 0, top).astype(np.uint8)
    if dtype == "base_q8":
        return QuantizedTensor(q.reshape(-1), scale.reshape(-1), bias.reshape(-1))
    half = group_size // 2
    packed = q[:, :, :half] | (q[:, :, half:] << 4)
    return QuantizedTensor(packed.reshape(-1), scale.reshape(-1), bias.reshape(-1))


def run(args: argparse.Namespace) -> int:
    """Convert as `args` (from :func:`add_arguments`) say; 1 with the reason on stderr when refused."""
    started = time.perf_counter()
    try:
        out = convert_gguf(args.src, args.dst, dtype=args.dtype, progress=not args.quiet)
    except (OSError, ValueError) as exc:
        print(f"aiobasert convert: error: {exc}", file=sys.stderr)
        return 1
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiobasert.models.convert",
        description="Convert a GGUF model (llama, qwen2, qwen3, gemma3, phi3) into a BaseRT .base bundle.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
