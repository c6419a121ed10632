"""The .base writer and reader: layout of docs/BUNDLE.md, round trips, and rejection of bad files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiobasert.models.bundle import (
    BLOB_ALIGNMENT,
    BundleError,
    BundleWriter,
    TensorEntry,
    bf16_to_f32,
    canonical_json,
    f32_to_bf16,
    read_bundle,
    write_bundle,
)

HEADER: dict[str, Any] = {"schema": 1, "arch": "llama", "config": {"hidden_size": 4}, "note": "héllo ✓"}


def _sample_tensors() -> list[Any]:
    rng = np.random.default_rng(1)
    return [
        ("a.f32", rng.standard_normal((3, 5), dtype=np.float32), "accelerator"),
        ("b.norm", np.arange(7, dtype=np.float32), "gpu"),
        ("c.f16", rng.standard_normal((4, 6)).astype(np.float16), "accelerator"),
        ("d.bf16", f32_to_bf16(rng.standard_normal((2, 3), dtype=np.float32)), "cpu", "bf16"),
        ("e.empty", np.zeros((0, 4), dtype=np.float32), "gpu"),
        ("f.scalarish", np.array([1.5], dtype=np.float16), "gpu"),
    ]


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "sample.base"
    write_bundle(path, HEADER, _sample_tensors())
    return path


def _header_of(path: Path) -> tuple[bytes, dict[str, Any]]:
    raw = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", raw, 8)
    header_bytes = raw[16 : 16 + header_len]
    return header_bytes, json.loads(header_bytes)


def test_layout_follows_the_spec(sample: Path) -> None:
    raw = sample.read_bytes()
    assert raw[:4] == b"BASE"
    assert struct.unpack_from("<I", raw, 4) == (1,)
    header_bytes, header = _header_of(sample)
    assert header_bytes == canonical_json(header)  # sorted keys, compact, UTF-8 (not \u escapes)
    assert "héllo ✓".encode() in header_bytes
    blob = -(-(16 + len(header_bytes)) // BLOB_ALIGNMENT) * BLOB_ALIGNMENT
    assert raw[16 + len(header_bytes) : blob] == bytes(blob - 16 - len(header_bytes))
    assert header["alignment"] == {"accel_align_log2": 6, "cpu_align_log2": 6, "gpu_page_log2": 14}
    align = {"accelerator": 64, "gpu": 16384, "cpu": 64}
    end = 0
    for entry, (name, array, region, *_) in zip(header["tensors"], _sample_tensors(), strict=True):
        assert entry["name"] == name and entry["compute_region"] == region
        assert entry["shape"] == list(array.shape)
        assert entry["length"] == array.nbytes
        assert entry["offset"] % align[region] == 0 and entry["offset"] >= end
        assert raw[blob + end : blob + entry["offset"]] == bytes(entry["offset"] - end)  # zero padding
        assert raw[blob + entry["offset"] : blob + entry["offset"] + entry["length"]] == array.tobytes()
        end = entry["offset"] + entry["length"]
    assert [e["dtype"] for e in header["tensors"]] == ["f32", "f32", "f16", "bf16", "f32", "f16"]
    assert len(raw) == blob + end


def test_round_trip(sample: Path) -> None:
    bundle = read_bundle(sample)
    assert {k: v for k, v in bundle.header.items() if k not in ("tensors", "alignment")} == HEADER
    assert bundle.config == {"hidden_size": 4}
    for name, array, _region, *dtype in _sample_tensors():
        got = bundle.tensor(name)
        assert got.dtype == np.float32 and got.shape == array.shape
        assert not got.flags.writeable
        expected = bf16_to_f32(array) if dtype == ["bf16"] else array.astype(np.float32)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(bundle.raw(name), array)
    with pytest.raises(KeyError, match="nope"):
        bundle.tensor("nope")


def test_f32_tensors_are_views_over_the_file(sample: Path) -> None:
    view = read_bundle(sample).tensor("a.f32")
    assert not view.flags.owndata
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 1.0


def test_bf16_rounding() -> None:
    values = np.array([1.0, -2.5, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.0e38, np.inf, np.nan], dtype=np.float32)
    back = bf16_to_f32(f32_to_bf16(values))
    np.testing.assert_array_equal(back[:2], values[:2])
    assert back[2] == 1.0  # tie rounds to even
    assert back[3] == 1.0 + 4 * 2**-8  # tie rounds to even (up)
    assert back[5] == np.inf and np.isnan(back[6])


def test_write_is_atomic_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "m.base"
    write_bundle(path, HEADER, _sample_tensors())
    before = path.read_bytes()
    bad = [*_sample_tensors(), ("g.int", np.arange(3, dtype=np.int64), "gpu")]
    with pytest.raises(ValueError, match="int64"):
        write_bundle(path, HEADER, bad)
    assert path.read_bytes() == before
    with (
        pytest.raises(ValueError, match="before every tensor"),
        BundleWriter(path, HEADER, [TensorEntry("x", (2,), "f32"), TensorEntry("y", (2,), "f32")]) as writer,
    ):
        writer.write("x", np.zeros(2, dtype=np.float32))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.base"]  # no temporary files left


def test_writer_rejects_mismatches(tmp_path: Path) -> None:
    entries = [TensorEntry("x", (2, 2), "f16", "accelerator")]
    cases: list[tuple[str, np.ndarray[Any, Any], str]] = [
        ("y", np.zeros((2, 2), np.float16), "out of order"),
        ("x", np.zeros((2, 2), np.float32), "does not store"),
        ("x", np.zeros((4,), np.float16), "shape"),
    ]
    for name, array, match in cases:
        with pytest.raises(ValueError, match=match), BundleWriter(tmp_path / "w.base", {}, entries) as writer:
            writer.write(name, array)
    with pytest.raises(ValueError, match="duplicate"):
        write_bundle(tmp_path / "w.base", {}, [("x", np.zeros(1, np.float32), "gpu")] * 2)
    with pytest.raises(ValueError, match="compute_region"):
        write_bundle(tmp_path / "w.base", {}, [("x", np.zeros(1, np.float32), "tpu")])
    with pytest.raises(ValueError, match="tensors"):
        write_bundle(tmp_path / "w.base", {"tensors": []}, [])
    assert not list(tmp_path.iterdir())


def test_progress_reports_bytes(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    write_bundle(
        tmp_path / "p.base", HEADER, _sample_tensors(), progress=lambda done, total: calls.append((done, total))
    )
    total = sum(t[1].nbytes for t in _sample_tensors())
    assert calls[-1] == (total, total)
    assert len(calls) == len(_sample_tensors())
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def _rewrite_header(path: Path, header: Any) -> None:
    """Replace the header in place, keeping the blob where it is (header must fit the padding)."""
    raw = bytearray(path.read_bytes())
    new = canonical_json(header)
    (old_len,) = struct.unpack_from("<Q", raw, 8)
    assert len(new) + 16 <= -(-(16 + old_len) // BLOB_ALIGNMENT) * BLOB_ALIGNMENT
    struct.pack_into("<Q", raw, 8, len(new))
    raw[16 : 16 + max(len(new), old_len)] = new.ljust(max(len(new), old_len), b"\0")
    path.write_bytes(bytes(raw))


def _expect_rejected(path: Path, match: str) -> None:
    with pytest.raises(BundleError, match=match) as info:
        read_bundle(path)
    assert str(path) in str(info.value)


def test_rejects_bad_prefix(sample: Path) -> None:
    raw = sample.read_bytes()
    sample.write_bytes(b"GGUF" + raw[4:])
    _expect_rejected(sample, "bad magic")
    sample.write_bytes(raw[:4] + struct.pack("<I", 2) + raw[8:])
    _expect_rejected(sample, "format version 2")
    sample.write_bytes(raw[:10])
    _expect_rejected(sample, "truncated")
    sample.write_bytes(b"")
    _expect_rejected(sample, "truncated")
    sample.write_bytes(raw[:8] + struct.pack("<Q", len(raw)) + raw[16:])
    _expect_rejected(sample, "header length")


def test_rejects_truncated_blob(sample: Path) -> None:
    raw = sample.read_bytes()
    sample.write_bytes(raw[:-1])
    _expect_rejected(sample, "truncated or corrupt: tensor 'f.scalarish'")
    _, header = _header_of(sample)
    sample.write_bytes(raw[: 16 + len(canonical_json(header))])  # header only, no blob at all
    _expect_rejected(sample, "truncated or corrupt: tensor 'a.f32'")


def test_rejects_bad_json(sample: Path) -> None:
    raw = bytearray(sample.read_bytes())
    raw[16] = ord("[")
    sample.write_bytes(bytes(raw))
    _expect_rejected(sample, "not valid JSON")
    _rewrite_header(sample, [])
    _expect_rejected(sample, "must be a JSON object")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "q4_0", "unsupported dtype 'q4_0'"),
        ("length", 3, "length 3"),
        ("offset", 8, "not 64-byte aligned"),
        ("offset", 1 << 40, "truncated or corrupt"),
        ("shape", [3, -5], "negative dimension"),
        ("compute_region", "tpu", "unknown compute_region"),
        ("shape", "3x5", "bad tensor table"),
    ],
)
def test_rejects_bad_tensor_entries(sample: Path, field: str, value: Any, match: str) -> None:
    _, header = _header_of(sample)
    header["tensors"][0][field] = value
    _rewrite_header(sample, header)
    _expect_rejected(sample, match)


def test_rejects_duplicate_tensor(sample: Path) -> None:
    _, header = _header_of(sample)
    header["tensors"].append(header["tensors"][0])
    _rewrite_header(sample, header)
    _expect_rejected(sample, "duplicate tensor 'a.f32'")
