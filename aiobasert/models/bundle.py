"""Reader and writer for the `.base` model bundle subset of docs/BUNDLE.md.

Layout: ``b"BASE"``, format version (u32 LE), header length (u64 LE), the
canonical JSON header, zero padding to the next 64 KiB file offset, then the
tensor blob. Tensor offsets are relative to the blob start and aligned by
compute region (``accelerator``/``cpu`` 64 B, ``gpu`` 16 KiB by default).

The writer streams: :class:`BundleWriter` lays out every tensor from its
shape and dtype up front, writes the header, then takes the arrays one at a
time, so a converter never holds more than one dequantized tensor in memory.
Files are written to a temporary name in the target directory and renamed
into place, so readers never see a partial bundle.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from ..errors import BundleError

__all__ = [
    "BASERT_VERSION",
    "BLOB_ALIGNMENT",
    "FORMAT_VERSION",
    "MAGIC",
    "TIED_EMBEDDINGS_FLAG",
    "Bundle",
    "BundleError",
    "BundleWriter",
    "Progress",
    "QuantizedTensor",
    "TensorEntry",
    "TensorInfo",
    "bf16_to_f32",
    "canonical_json",
    "f32_to_bf16",
    "llama_header",
    "read_bundle",
    "write_bundle",
]

MAGIC: Final = b"BASE"
FORMAT_VERSION: Final = 1
#: The BaseRT release whose bundle format this module writes (header field `baserT_version`).
BASERT_VERSION: Final = "0.4.6"
BLOB_ALIGNMENT: Final = 1 << 16
_PREFIX = struct.Struct("<4sIQ")
_COPY_CHUNK = 1 << 24

DType = Literal["f32", "f16", "bf16"]
Region = Literal["accelerator", "gpu", "cpu"]

_ITEMSIZE: Final[dict[str, int]] = {"f32": 4, "f16": 2, "bf16": 2}
# Group-wise quantized dtypes (CANONICAL_QUANT_SPEC.md): bits per value. Their
# tensors carry scale (and, asymmetric, bias) regions beside the packed values.
_QUANT_BITS: Final[dict[str, int]] = {"base_q8": 8, "base_q5": 5, "base_q4": 4}
#: Packing of each quantized dtype this module writes and reads (target_backend cpu_avx2):
#: row-major; q8 one byte per value; q4 per group of G values G/2 bytes, byte j holding value j
#: in its low nibble and value j + G/2 in its high nibble (GGML's Q4_1 order); q5 (GGML's Q5_0 / Q5_1 /
#: Q5_K blocks, an aiobasert extension) per group G/8 bytes of fifth bits (bit j % 8 of byte j / 8 is
#: value j's), then the G/2 bytes of nibbles as q4.
QUANT_LAYOUT: Final[dict[str, str]] = {
    "base_q8": "rowmajor",
    "base_q5": "rowmajor_qh_nibble_halves",
    "base_q4": "rowmajor_nibble_halves",
}
#: GGML K-quant super-blocks stored as the GGUF has them (an aiobasert extension): row-major rows of
#: blocks of 256 values, bytes per block as ggml-common.h's block_q4_K / block_q5_K / block_q6_K; the
#: engine decodes them at load (exactly: K-quant sub-block scales are f16 x small integers).
GGML_BLOCKS: Final[dict[str, tuple[str, int]]] = {
    "ggml_q4_k": ("Q4_K", 144),
    "ggml_q5_k": ("Q5_K", 176),
    "ggml_q6_k": ("Q6_K", 210),
}
_QUANT_REGION_ALIGN: Final = 64
_SCALE_SIZE: Final = {"f16": 2, "f32": 4}  # the scale dtypes the writer lays out
# Storage dtype of each bundle dtype (bf16 has no numpy dtype: raw uint16 bits).
_STORAGE: Final[dict[str, np.dtype[Any]]] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
}
DEFAULT_ALIGNMENT: Final[dict[str, int]] = {"accel_align_log2": 6, "gpu_page_log2": 14, "cpu_align_log2": 6}
_REGION_ALIGN_KEY: Final[dict[str, str]] = {
    "accelerator": "accel_align_log2",
    "gpu": "gpu_page_log2",
    "cpu": "cpu_align_log2",
}

#: Progress callback: (bytes done, bytes total).
Progress = Callable[[int, int], object]


class TensorInfo(msgspec.Struct, frozen=True):
    """One entry of the header's `tensors` list (unknown extra fields are ignored).

    `ggml_q4_k` / `ggml_q5_k` / `ggml_q6_k` tensors are GGML K-quant blocks as in a GGUF
    (:data:`GGML_BLOCKS`), `length` bytes with no further fields.

    Quantized tensors (`base_q8`, `base_q5`, `base_q4`) add the spec's group fields: `offset`
    / `length` then locate the packed values, `scale_offset` / `scale_length` the
    f16 or bf16 scales (one per group, row-major), and asymmetric ones
    `bias_offset` / `bias_length` (value = q * scale + bias; symmetric: value =
    (q - 2^(bits-1)) * scale). The fields are absent (None) for f32/f16/bf16."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    compute_region: str = "gpu"
    group_size: int | None = None
    scale_dtype: str | None = None
    symmetric: bool | None = None
    layout: str | None = None
    scale_offset: int | None = None
    scale_length: int | None = None
    bias_offset: int | None = None
    bias_length: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


TIED_EMBEDDINGS_FLAG: Final = 0x400  # HeaderFlags bit 10


def llama_header(
    *,
    arch: str = "llama",
    dtype: str,
    source: Mapping[str, str],
    config: Mapping[str, Any],
    tokenizer: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The header of a bundle of `arch` (llama, qwen2, qwen3, gemma3, phi3: docs/models.md): the fixed
    fields around a model's own config, tokenizer (GGUF-style fields) and metadata, as
    docs/BUNDLE.md lays out."""
    tied = bool(config.get("tie_word_embeddings"))
    return {
        "schema": 1,
        "arch": arch,
        "quant_scheme": dtype,
        "min_hw": "cpu",
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "baserT_version": BASERT_VERSION,
        "source": dict(source),
        "alignment": dict(DEFAULT_ALIGNMENT),
        "flags": f"0x{TIED_EMBEDDINGS_FLAG if tied else 0:08x}",
        "config": dict(config),
        "tokenizer": dict(tokenizer),
        "metadata": dict(metadata or {}),
    }


def canonical_json(obj: Any) -> bytes:
    """The header encoding the format requires: sorted keys, no spaces, UTF-8."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def f32_to_bf16(values: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Round float32 values to bfloat16 bits (round to nearest even; NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return out.astype(np.uint16)


def bf16_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _region_alignment(alignment: Mapping[str, Any], region: str) -> int:
    key = _REGION_ALIGN_KEY.get(region)
    if key is None:
        raise ValueError(f"unknown compute_region {region!r} (expected one of {sorted(_REGION_ALIGN_KEY)})")
    log2 = alignment.get(key, DEFAULT_ALIGNMENT[key])
    if not isinstance(log2, int) or isinstance(log2, bool) or not 0 <= log2 <= 16:
        raise ValueError(f"alignment.{key} must be an integer in 0..16, got {log2!r}")
    return 1 << log2


def _dtype_of(array: np.ndarray[Any, Any]) -> str:
    if array.dtype == np.float32:
        return "f32"
    if array.dtype == np.float16:
        return "f16"
    raise ValueError(
        f"cannot infer a bundle dtype from numpy {array.dtype}: pass float32, float16, or uint16 bits with dtype 'bf16'"
    )


class TensorEntry(msgspec.Struct, frozen=True):
    """What the writer needs to lay a tensor out before seeing its data
    (quantized dtypes: also the group size and whether it is symmetric)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    compute_region: str = "gpu"
    group_size: int = 32
    symmetric: bool = False
    scale_dtype: str = "f16"  # or "f32": scales a GGUF K-quant makes (d * sub-block scale) that f16 cannot hold


class QuantizedTensor(msgspec.Struct, frozen=True):
    """The data of a `base_q8` / `base_q4` tensor for :meth:`BundleWriter.write`.

    `packed`: uint8, the values packed as :data:`QUANT_LAYOUT` says; `scales` and
    `biases` (None when symmetric): one per group, row-major, float16 (float32 for an
    entry whose scale_dtype is "f32")."""

    packed: npt.NDArray[np.uint8]
    scales: npt.NDArray[np.float16] | npt.NDArray[np.float32]
    biases: npt.NDArray[np.float16] | npt.NDArray[np.float32] | None = None


def _quant_lengths(dtype: str, shape: tuple[int, ...], group_size: int) -> tuple[int, int]:
    """(packed bytes, groups) of a quantized tensor; ValueError when the shape does not split into groups."""
    if len(shape) != 2 or shape[1] % group_size or group_size not in (32, 64, 128):
        raise ValueError(
            f"a {dtype} tensor needs a 2-D shape whose rows split into groups of 32, 64 or 128 "
            f"(shape {list(shape)}, group_size {group_size})"
        )
    n = math.prod(shape)
    return n * _QUANT_BITS[dtype] // 8, n // group_size


def _ggml_length(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a GGML-block tensor; ValueError unless its rows are whole 256-value super-blocks."""
    if len(shape) != 2 or shape[1] % 256 or shape[1] == 0:
        raise ValueError(f"a {dtype} tensor needs a 2-D shape whose rows are multiples of 256 (shape {list(shape)})")
    return shape[0] * shape[1] // 256 * GGML_BLOCKS[dtype][1]


def _info_dict(info: TensorInfo) -> dict[str, Any]:
    """A header entry: the quantization fields appear only on quantized tensors."""
    return {k: v for k, v in msgspec.structs.asdict(info).items() if v is not None}


def _layout(entries: Sequence[TensorEntry], alignment: Mapping[str, Any]) -> list[TensorInfo]:
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    cursor = 0
    for entry in entries:
        if entry.name in seen:
            raise ValueError(f"duplicate tensor name {entry.name!r}")
        seen.add(entry.name)
        if entry.dtype not in _ITEMSIZE and entry.dtype not in _QUANT_BITS and entry.dtype not in GGML_BLOCKS:
            raise ValueError(f"tensor {entry.name!r}: unsupported dtype {entry.dtype!r}")
        if any(dim < 0 for dim in entry.shape):
            raise ValueError(f"tensor {entry.name!r}: negative dimension in shape {entry.shape}")
        offset = _align_up(cursor, _region_alignment(alignment, entry.compute_region))
        if entry.dtype in _QUANT_BITS:
            try:
                length, groups = _quant_lengths(entry.dtype, entry.shape, entry.group_size)
            except ValueError as exc:
                raise ValueError(f"tensor {entry.name!r}: {exc}") from None
            if entry.scale_dtype not in _SCALE_SIZE:
                raise ValueError(f"tensor {entry.name!r}: scale_dtype {entry.scale_dtype!r} (f16 or f32)")
            region = _SCALE_SIZE[entry.scale_dtype] * groups
            scale_offset = _align_up(offset + length, _QUANT_REGION_ALIGN)
            bias_offset = None if entry.symmetric else _align_up(scale_offset + region, _QUANT_REGION_ALIGN)
            infos.append(
                TensorInfo(
                    entry.name,
                    entry.dtype,
                    tuple(entry.shape),
                    offset,
                    length,
                    entry.compute_region,
                    group_size=entry.group_size,
                    scale_dtype=entry.scale_dtype,
                    symmetric=entry.symmetric,
                    layout=QUANT_LAYOUT[entry.dtype],
                    scale_offset=scale_offset,
                    scale_length=region,
                    bias_offset=bias_offset,
                    bias_length=None if bias_offset is None else region,
                )
            )
            cursor = (scale_offset if bias_offset is None else bias_offset) + region
            continue
        if entry.dtype in GGML_BLOCKS:
            try:
                length = _ggml_length(entry.dtype, entry.shape)
            except ValueError as exc:
                raise ValueError(f"tensor {entry.name!r}: {exc}") from None
        else:
            length = math.prod(entry.shape) * _ITEMSIZE[entry.dtype]
        infos.append(TensorInfo(entry.name, entry.dtype, tuple(entry.shape), offset, length, entry.compute_region))
        cursor = offset + length
    return infos


class BundleWriter:
    """Streams a bundle to disk: header first, then tensors in layout order.

    Use as a context manager; the file appears at `path` only when the block
    exits normally after every tensor was written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        header: Mapping[str, Any],
        entries: Sequence[TensorEntry],
        *,
        progress: Progress | None = None,
    ) -> None:
        if "tensors" in header:
            raise ValueError("header must not contain 'tensors': the writer lays them out")
        self.path = Path(path)
        full_header = dict(header)
        full_header.setdefault("alignment", dict(DEFAULT_ALIGNMENT))
        self.infos = _layout(entries, full_header["alignment"])
        full_header["tensors"] = [_info_dict(info) for info in self.infos]
        self.header = full_header
        header_bytes = canonical_json(full_header)
        self._blob_start = _align_up(_PREFIX.size + len(header_bytes), BLOB_ALIGNMENT)
        self._next = 0
        self._written = 0
        self._total = sum(info.length + (info.scale_length or 0) + (info.bias_length or 0) for info in self.infos)
        self._progress = progress

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        try:
            self._file.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)))
            self._file.write(header_bytes)
            self._pad_to(self._blob_start)
        except BaseException:
            self._abort()
            raise

    def _pad_to(self, absolute_offset: int) -> None:
        gap = absolute_offset - self._file.tell()
        if gap < 0:
            raise AssertionError("bundle layout went backwards")
        self._file.write(bytes(gap))

    def write(self, name: str, array: npt.ArrayLike | QuantizedTensor) -> None:
        """Write the next tensor; `name`, shape and dtype must match its layout entry
        (a `base_q8` / `base_q4` entry takes a :class:`QuantizedTensor`)."""
        if self._next >= len(self.infos):
            raise ValueError(f"tensor {name!r}: every laid-out tensor was already written")
        info = self.infos[self._next]
        if name != info.name:
            raise ValueError(f"tensor {name!r} written out of order: expected {info.name!r}")
        if info.dtype in _QUANT_BITS:
            self._write_quantized(info, array)
            return
        if isinstance(array, QuantizedTensor):
            raise ValueError(f"tensor {name!r}: a {info.dtype} tensor is written as an array, not a QuantizedTensor")
        data = np.asarray(array)
        if info.dtype in GGML_BLOCKS:  # the GGUF's block bytes, any shape
            if data.dtype != np.uint8 or data.size != info.length:
                raise ValueError(f"tensor {name!r}: a {info.dtype} tensor is {info.length} bytes of uint8")
            data = data.reshape(info.shape[0], -1)
            storage = np.dtype(np.uint8)
        else:
            storage = _STORAGE[info.dtype]
        if data.dtype.kind != storage.kind or data.dtype.itemsize != storage.itemsize:
            raise ValueError(f"tensor {name!r}: array dtype {data.dtype} does not store bundle dtype {info.dtype}")
        if tuple(data.shape) != info.shape and info.dtype not in GGML_BLOCKS:
            raise ValueError(f"tensor {name!r}: array shape {data.shape} != laid-out shape {info.shape}")
        data = np.ascontiguousarray(data, dtype=storage)  # also fixes byte order
        self._pad_to(self._blob_start + info.offset)
        flat = data.reshape(-1).view(np.uint8)
        for start in range(0, flat.size, _COPY_CHUNK):
            self._file.write(flat[start : start + _COPY_CHUNK].data)
        self._next += 1
        self._written += info.length
        if self._progress is not None:
            self._progress(self._written, self._total)

    def _write_quantized(self, info: TensorInfo, data: object) -> None:
        if not isinstance(data, QuantizedTensor):
            raise ValueError(f"tensor {info.name!r}: a {info.dtype} tensor is written as a QuantizedTensor")
        region = info.scale_length or 0
        scale_type = np.float32 if info.scale_dtype == "f32" else np.float16
        parts: list[tuple[int | None, npt.NDArray[Any] | None, int, str]] = [
            (info.offset, data.packed, info.length, "packed"),
            (info.scale_offset, data.scales, region, "scales"),
            (info.bias_offset, data.biases, region if info.bias_offset is not None else 0, "biases"),
        ]
        for offset, part, length, what in parts:
            if offset is None:
                if part is not None:
                    raise ValueError(f"tensor {info.name!r}: a symmetric tensor has no biases")
                continue
            if part is None:
                raise ValueError(f"tensor {info.name!r}: {what} missing")
            want = np.uint8 if what == "packed" else scale_type
            flat = np.ascontiguousarray(part, dtype=np.dtype(want).newbyteorder("<")).reshape(-1).view(np.uint8)
            if np.asarray(part).dtype != want or flat.size != length:
                raise ValueError(f"tensor {info.name!r}: {what} must be {length} bytes of {np.dtype(want)}")
            self._pad_to(self._blob_start + offset)
            self._file.write(flat.data)
        self._next += 1
        self._written += info.length + (region if info.bias_offset is None else 2 * region)
        if self._progress is not None:
            self._progress(self._written, self._total)

    def close(self) -> None:
        """Finish the file and move it into place."""
        if self._next != len(self.infos):
            missing = ", ".join(info.name for info in self.infos[self._next :][:5])
            self._abort()
            raise ValueError(f"bundle closed before every tensor was written (next missing: {missing})")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.chmod(self._tmp, 0o644)
            os.replace(self._tmp, self.path)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()


def write_bundle(
    path: str | os.PathLike[str],
    header: Mapping[str, Any],
    tensors: Iterable[tuple[str, npt.ArrayLike, str] | tuple[str, npt.ArrayLike, str, str]],
    *,
    progress: Progress | None = None,
) -> None:
    """Write a bundle from in-memory arrays.

    Each tensor is ``(name, array, compute_region)``; the dtype follows the
    array (float32 -> "f32", float16 -> "f16"). bfloat16 has no numpy dtype:
    pass its uint16 bits as ``(name, bits, compute_region, "bf16")``.
    `header` is everything but `tensors`; `alignment` defaults to the spec's.
    """
    arrays: list[np.ndarray[Any, Any]] = []
    entries: list[TensorEntry] = []
    for item in tensors:
        name, array, region = item[0], np.asarray(item[1]), item[2]
        dtype = item[3] if len(item) == 4 else _dtype_of(array)
        arrays.append(array)
        entries.append(TensorEntry(name, tuple(array.shape), dtype, region))
    with BundleWriter(path, header, entries, progress=progress) as writer:
        for entry, array in zip(entries, arrays, strict=True):
            writer.write(entry.name, array)


class Bundle:
    """A `.base` file opened read-only; tensors are views over one memory map."""

    def __init__(self, path: Path, header: dict[str, Any], infos: dict[str, TensorInfo], blob_start: int) -> None:
        self.path = path
        self.header = header
        self.tensors = infos
        self.blob_start = blob_start
        self._map: np.memmap[Any, np.dtype[np.uint8]] | None = None

    @property
    def config(self) -> dict[str, Any]:
        config = self.header.get("config")
        return config if isinstance(config, dict) else {}

    @property
    def tokenizer(self) -> dict[str, Any]:
        tokenizer = self.header.get("tokenizer")
        return tokenizer if isinstance(tokenizer, dict) else {}

    def _memmap(self) -> np.memmap[Any, np.dtype[np.uint8]]:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def raw(self, name: str) -> npt.NDArray[Any]:
        """The stored data, read-only: float32, float16, or uint16 bits for bf16 (a quantized
        tensor's packed bytes, uint8)."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        start = self.blob_start + info.offset
        data = np.asarray(self._memmap()[start : start + info.length])
        if info.dtype in _QUANT_BITS or info.dtype in GGML_BLOCKS:
            return data
        return data.view(_STORAGE[info.dtype]).reshape(info.shape)

    def _region_f32(self, offset: int, length: int, scale_dtype: str) -> npt.NDArray[np.float32]:
        start = self.blob_start + offset
        raw = np.asarray(self._memmap()[start : start + length])
        if scale_dtype == "bf16":
            return bf16_to_f32(raw.view("<u2"))
        if scale_dtype == "f32":
            return raw.view("<f4").astype(np.float32)
        return raw.view("<f2").astype(np.float32)

    def _dequantize(self, info: TensorInfo) -> npt.NDArray[np.float32]:
        out_dim, in_dim = info.shape
        gs = info.group_size or 32
        packed = self.raw(info.name).reshape(out_dim, in_dim // gs, -1)
        if info.dtype == "base_q8":
            q = packed.astype(np.float32)
        else:  # low nibbles are the group's first half, high nibbles its second half
            nibbles = packed[:, :, gs // 8 :] if info.dtype == "base_q5" else packed
            u = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)
            if info.dtype == "base_q5":
                u |= np.unpackbits(packed[:, :, : gs // 8], axis=2, bitorder="little") << 4
            q = u.astype(np.float32)
        scales = self._region_f32(info.scale_offset or 0, info.scale_length or 0, info.scale_dtype or "f16")
        scales = scales.reshape(out_dim, in_dim // gs, 1)
        if info.symmetric:
            values = (q - float(1 << (_QUANT_BITS[info.dtype] - 1))) * scales
        else:
            biases = self._region_f32(info.bias_offset or 0, info.bias_length or 0, info.scale_dtype or "f16")
            values = q * scales + biases.reshape(out_dim, in_dim // gs, 1)
        return values.reshape(out_dim, in_dim).astype(np.float32)

    def tensor(self, name: str) -> npt.NDArray[np.float32]:
        """The tensor as read-only float32 (a zero-copy view when stored as f32; quantized
        tensors dequantized in f32: q * scale + bias, or (q - 2^(bits-1)) * scale)."""
        info = self.tensors.get(name)
        if info is not None and info.dtype in _QUANT_BITS:
            out = self._dequantize(info)
            out.flags.writeable = False
            return out
        if info is not None and info.dtype in GGML_BLOCKS:
            import gguf  # gguf-py's reference dequantization, only when such a tensor is read

            kind = gguf.GGMLQuantizationType[GGML_BLOCKS[info.dtype][0]]
            out = np.asarray(gguf.quants.dequantize(self.raw(name).reshape(info.shape[0], -1), kind), np.float32)
            out.flags.writeable = False
            return out
        data = self.raw(name)
        dtype = self.tensors[name].dtype
        if dtype == "f32":
            return data
        out = bf16_to_f32(data) if dtype == "bf16" else data.astype(np.float32)
        out.flags.writeable = False
        return out

    def close(self) -> None:
        """Drop this object's memory map (views handed out keep theirs alive)."""
        self._map = None

    def __enter__(self) -> Bundle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _check_quantized(path: Path, info: TensorInfo, blob_size: int) -> None:
    where = f"tensor {info.name!r}"
    try:
        length, groups = _quant_lengths(info.dtype, info.shape, info.group_size or 0)
    except ValueError as exc:
        raise BundleError(path, f"{where}: {exc}") from None
    if info.layout != QUANT_LAYOUT[info.dtype]:
        raise BundleError(path, f"{where}: layout {info.layout!r} is not supported ({QUANT_LAYOUT[info.dtype]!r})")
    if info.scale_dtype not in ("f16", "bf16", "f32"):
        raise BundleError(path, f"{where}: scale_dtype {info.scale_dtype!r} is not supported (f16, bf16, f32)")
    if info.length != length:
        raise BundleError(path, f"{where}: length {info.length} != {length} packed bytes")
    regions = [("scale", info.scale_offset, info.scale_length)]
    if not info.symmetric:
        regions.append(("bias", info.bias_offset, info.bias_length))
    region = (4 if info.scale_dtype == "f32" else 2) * groups
    for what, offset, size in regions:
        if offset is None or size != region or offset < 0 or offset + size > blob_size:
            raise BundleError(path, f"{where}: the {what} region is missing, of the wrong size or outside the blob")


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Open and validate a bundle; raises :class:`BundleError` naming the file and the problem."""
    path = Path(path)
    with open(path, "rb") as file:
        file_size = os.fstat(file.fileno()).st_size
        prefix = file.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            if prefix and not MAGIC.startswith(prefix[:4]):
                raise BundleError(path, f"bad magic {prefix[:4]!r} (not a .base bundle)")
            raise BundleError(path, f"truncated: {file_size} bytes, shorter than the {_PREFIX.size}-byte prefix")
        magic, version, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise BundleError(path, f"bad magic {magic!r} (not a .base bundle)")
        if version != FORMAT_VERSION:
            raise BundleError(path, f"unsupported format version {version} (this reader knows {FORMAT_VERSION})")
        if header_len > file_size - _PREFIX.size:
            raise BundleError(
                path, f"truncated: header length {header_len} exceeds the {file_size - _PREFIX.size} bytes left"
            )
        header_bytes = file.read(header_len)
    try:
        header = msgspec.json.decode(header_bytes)
    except msgspec.DecodeError as exc:
        raise BundleError(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BundleError(path, f"header must be a JSON object, got {type(header).__name__}")
    try:
        tensor_list = msgspec.convert(header.get("tensors"), list[TensorInfo])
    except msgspec.ValidationError as exc:
        raise BundleError(path, f"bad tensor table: {exc}") from None
    alignment = header.get("alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, dict):
        raise BundleError(path, "header 'alignment' must be an object")

    blob_start = _align_up(_PREFIX.size + header_len, BLOB_ALIGNMENT)
    blob_size = file_size - blob_start
    infos: dict[str, TensorInfo] = {}
    for info in tensor_list:
        where = f"tensor {info.name!r}"
        if info.name in infos:
            raise BundleError(path, f"duplicate {where}")
        if info.dtype not in _ITEMSIZE and info.dtype not in _QUANT_BITS and info.dtype not in GGML_BLOCKS:
            raise BundleError(path, f"{where}: unsupported dtype {info.dtype!r}")
        if any(dim < 0 for dim in info.shape):
            raise BundleError(path, f"{where}: negative dimension in shape {list(info.shape)}")
        if info.dtype in _QUANT_BITS:
            _check_quantized(path, info, blob_size)
        elif info.dtype in GGML_BLOCKS:
            try:
                length = _ggml_length(info.dtype, info.shape)
            except ValueError as exc:
                raise BundleError(path, f"{where}: {exc}") from None
            if info.length != length:
                raise BundleError(path, f"{where}: length {info.length} != {length} bytes of {info.dtype} blocks")
        elif info.length != info.numel * _ITEMSIZE[info.dtype]:
            raise BundleError(
                path, f"{where}: length {info.length} != {info.numel} x {_ITEMSIZE[info.dtype]} bytes ({info.dtype})"
            )
        try:
            align = _region_alignment(alignment, info.compute_region)
        except ValueError as exc:
            raise BundleError(path, f"{where}: {exc}") from None
        if info.offset < 0 or info.offset % align:
            raise BundleError(path, f"{where}: offset {info.offset} is not {align}-byte aligned")
        if info.offset + info.length > blob_size:
            raise BundleError(
                path,
                f"truncated or corrupt: {where} spans blob bytes {info.offset}..{info.offset + info.length} "
                f"but the blob holds {max(blob_size, 0)}",
            )
        infos[info.name] = info
    return Bundle(path, header, infos, blob_start)
