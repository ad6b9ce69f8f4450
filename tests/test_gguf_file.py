"""Our GGUF reader gives what ``gguf``'s ``GGUFReader`` gives (metadata of every value type, plain and quantized
tensors), on a small file written by ``gguf``'s own ``GGUFWriter``; damaged files are refused naming the file. The
real models' files are read by every model test (whose greedy tokens and logits are checked)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kv_cache_manager_v2.models.gguf_file import read_gguf_file

try:
    import gguf
except ImportError:
    if os.environ.get("CI"):  # CI installs the models extra: a missing one must fail, not skip
        raise
    pytest.skip("needs the models extra (gguf)", allow_module_level=True)


def write_sample(path: Path) -> None:
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -7)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1.0 / 3.0)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strings", ["a", "", "ünï", "z" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((4, 2, 8)).astype(np.float16))
    q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("quant.q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_metadata_and_tensors_equal_gguf_readers(tmp_path: Path) -> None:
    path = tmp_path / "sample.gguf"
    write_sample(path)
    metadata, tensors = read_gguf_file(path)
    reader = gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert metadata == expected
    assert {key: type(value) for key, value in metadata.items()} == {key: type(v) for key, v in expected.items()}
    assert metadata["t.strings"] == ["a", "", "ünï", "z" * 300] and metadata["t.bool"] is True
    assert [t.name for t in tensors] == [t.name for t in reader.tensors] == ["plain.f32", "plain.f16", "quant.q8_0"]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)
    from gguf.quants import dequantize

    assert np.array_equal(dequantize(tensors[2].data, tensors[2].tensor_type), dequantize(reader.tensors[2].data, reader.tensors[2].tensor_type))


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "sample.gguf"
    write_sample(path)
    whole = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ValueError, match=f"{bad}: not a GGUF file"):
        read_gguf_file(bad)
    for cut in (12, 40, len(whole) - 150):  # the header, the metadata, the last tensors' data
        bad.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"{bad}: truncated GGUF"):
            read_gguf_file(bad)
    bad.write_bytes(whole[:4] + (7).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="GGUF version 7 is not supported"):
        read_gguf_file(bad)
