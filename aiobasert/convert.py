"""Convert a llama-family GGUF (e.g. SmolLM2-135M-Instruct Q4_1) into a `.base` bundle.

Quantized GGUF tensors are dequantized with the `gguf` package and stored as
f16 (or f32); norms stay f32. q/k projection rows keep the GGUF order, which
llama.cpp permuted at HF->GGUF conversion time so that RoPE rotates adjacent
pairs, exactly what docs/BUNDLE.md's forward does.

Usage: ``python -m aiobasert.convert SRC.gguf OUT.base [--dtype f16|f32]``
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import gguf
import numpy as np
import numpy.typing as npt
from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]  # no stubs in tqdm itself

from .bundle import BundleWriter, Progress, TensorEntry, llama_header
from .errors import AioBaseRTError

__all__ = ["ConversionError", "convert_gguf", "main"]

_GGUF_MAGIC: Final = b"GGUF"

# GGUF tensor name stems -> canonical bundle names (base-convert's llama mapping).
_GLOBAL_NAMES: Final = {"token_embd": "embed_tokens", "output_norm": "final_norm", "output": "lm_head"}
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
}


class ConversionError(AioBaseRTError, ValueError):
    """The source cannot be converted; the message names the file and the reason."""


class _Llama:
    """The llama hyperparameters the bundle needs, read from `llama.*` keys."""

    def __init__(self, meta: dict[str, Any], n_tokens: int, fail: Callable[[str], ConversionError]) -> None:
        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"llama.{key}", default)
            if value is None:
                raise fail(f"missing GGUF key 'llama.{key}'")
            return value

        def integer(key: str, default: int | None = None) -> int:
            value = get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise fail(f"'llama.{key}' must be a positive integer, got {value!r}")
            return value

        self.n_layers = integer("block_count")
        self.dim = integer("embedding_length")
        self.ffn_dim = integer("feed_forward_length")
        self.n_heads = integer("attention.head_count")
        self.n_kv_heads = integer("attention.head_count_kv", self.n_heads)
        self.context_length = integer("context_length")
        self.vocab_size = integer("vocab_size", n_tokens)
        self.head_dim = integer("rope.dimension_count", self.dim // self.n_heads)
        self.rope_theta = float(get("rope.freq_base", 10000.0))
        self.rms_norm_eps = float(get("attention.layer_norm_rms_epsilon"))

        if self.n_heads % self.n_kv_heads:
            raise fail(f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}")
        if self.head_dim % 2:
            raise fail(f"odd head size {self.head_dim} cannot be rotated in pairs")
        for key in ("attention.key_length", "attention.value_length"):
            if meta.get(f"llama.{key}", self.head_dim) != self.head_dim:
                raise fail(f"unsupported: llama.{key} {meta[f'llama.{key}']} != rotary head size {self.head_dim}")
        if self.n_heads * self.head_dim != self.dim:
            raise fail(
                f"unsupported: rope.dimension_count {self.head_dim} x {self.n_heads} heads != "
                f"embedding_length {self.dim} (partial rotary or a non-standard head size)"
            )
        scaling = meta.get("llama.rope.scaling.type", "none")
        factor = meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear", 1.0))
        if scaling != "none" or float(factor) != 1.0:
            raise fail(f"unsupported RoPE scaling (type {scaling!r}, factor {factor}): the engine runs plain RoPE")
        if meta.get("llama.expert_count", 0):
            raise fail(f"unsupported: mixture of experts (llama.expert_count {meta['llama.expert_count']})")


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _canonical_name(gguf_name: str) -> str | None:
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix != "weight":
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def _expected_shapes(cfg: _Llama, tied: bool) -> dict[str, tuple[int, ...]]:
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, cfg.dim)}
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
    shapes["final_norm.weight"] = (cfg.dim,)
    if not tied:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def _tqdm_progress(desc: str, total: int) -> tuple[Progress, Callable[[], None]]:
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    return update, bar.close


def convert_gguf(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: Literal["f16", "f32"] = "f16",
    progress: bool | Progress = True,
) -> Path:
    """Convert the llama GGUF `src` into the bundle `dst` (written atomically); returns `dst`.

    `progress`: True shows a tqdm bar on stderr, False nothing; a callable is
    called with (bytes written, bytes total) after each tensor.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be 'f16' or 'f32', got {dtype!r}")

    def fail(reason: str) -> ConversionError:
        return ConversionError(f"{src}: {reason}")

    with open(src, "rb") as file:
        magic = file.read(4)
    if magic != _GGUF_MAGIC:
        raise fail(f"not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(src)
        meta = {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    except (ValueError, IndexError, UnicodeDecodeError) as exc:  # what GGUFReader raises on a damaged file
        raise fail(f"unreadable GGUF: {exc}") from None

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise fail(f"unsupported architecture {arch!r}: only 'llama' models can be converted")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise fail("no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise fail(f"unsupported tokenizer model {meta.get('tokenizer.ggml.model')!r}: needs byte-level BPE 'gpt2'")
    cfg = _Llama(meta, len(tokens), fail)
    if len(tokens) != cfg.vocab_size:
        raise fail(f"llama.vocab_size {cfg.vocab_size} != {len(tokens)} tokens in the vocabulary")

    sources: dict[str, gguf.ReaderTensor] = {}
    for tensor in reader.tensors:
        name = _canonical_name(tensor.name)
        if name is None:
            raise fail(f"unsupported tensor {tensor.name!r} (not part of a plain llama model)")
        sources[name] = tensor
    tied = "lm_head.weight" not in sources
    expected = _expected_shapes(cfg, tied)
    if missing := [name for name in expected if name not in sources]:
        raise fail(f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra := [name for name in sources if name not in expected]:
        raise fail(f"tensors beyond the {cfg.n_layers} configured layers: {', '.join(extra[:5])}")
    entries: list[TensorEntry] = []
    for name, shape in expected.items():
        # GGUF lists dimensions fastest-varying first: [in, out] is numpy (out, in).
        gguf_shape = tuple(int(d) for d in reversed(sources[name].shape.tolist()))
        if gguf_shape != shape:
            raise fail(f"tensor {sources[name].name!r} has shape {list(gguf_shape)}, expected {list(shape)}")
        if len(shape) == 1:
            entries.append(TensorEntry(name, shape, "f32", "gpu"))
        else:
            region = "gpu" if name in ("embed_tokens.weight", "lm_head.weight") else "accelerator"
            entries.append(TensorEntry(name, shape, dtype, region))

    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if not isinstance(bos, int) or not isinstance(eos, int):
        raise fail("the vocabulary needs tokenizer.ggml.bos_token_id and tokenizer.ggml.eos_token_id")
    stop_ids = sorted(
        {meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta} - {eos}
    )
    tokenizer = {"tokenizer_type": "gguf"} | {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    chat_template = meta.get("tokenizer.chat_template")
    header = llama_header(
        dtype=dtype,
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
        },
        tokenizer=tokenizer,
        metadata={} if chat_template is None else {"tokenizer.chat_template": chat_template},
    )

    close_bar: Callable[[], None] | None = None
    callback: Progress | None
    if progress is True:
        total = sum(math.prod(e.shape) * (4 if e.dtype == "f32" else 2) for e in entries)
        callback, close_bar = _tqdm_progress(f"converting {src.name}", total)
    else:
        callback = progress or None
    try:
        with BundleWriter(dst, header, entries, progress=callback) as writer:
            for entry in entries:
                writer.write(entry.name, _dequantize(sources[entry.name], entry, fail))
    finally:
        if close_bar is not None:
            close_bar()
    return dst


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
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiobasert.convert", description="Convert a llama GGUF model into a BaseRT .base bundle."
    )
    parser.add_argument("src", type=Path, help="input .gguf file")
    parser.add_argument("dst", type=Path, help="output .base file")
    parser.add_argument("--dtype", choices=("f16", "f32"), default="f16", help="storage type of the matrices")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        out = convert_gguf(args.src, args.dst, dtype=args.dtype, progress=not args.quiet)
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
