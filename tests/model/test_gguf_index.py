"""The tensor-index reader finds the same tensors as the `gguf` package's reader, at the same
offsets, after metadata arrays of every kind (strings, numbers, nested), in either byte order,
without parsing the arrays' values."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from densa.model.gguf_index import TensorIndexReader


def _write(path: Path, endianess: gguf.GGUFEndian) -> None:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" * (1 + i % 7) for i in range(300)])  # strings of many sizes
    writer.add_token_types([i % 5 for i in range(300)])  # int32 array
    writer.add_token_merges(["a b", "ab c", ""])  # an empty string too
    writer.add_array("test.nested", [[1, 2, 3], [4], [5, 6]])
    writer.add_array("test.floats", [0.5, 1.5])
    writer.add_uint32("test.after_arrays", 7)
    writer.add_string("test.text", "after the arrays")
    rng = np.random.default_rng(0)
    for i, shape in enumerate([(4, 32), (3, 64), (1, 32)]):
        tensor = rng.standard_normal(shape).astype(np.float32)
        if endianess == gguf.GGUFEndian.BIG:
            tensor = tensor.byteswap()
        writer.add_tensor(f"blk.{i}.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_same_tensors_as_the_full_reader(tmp_path: Path, endianess: gguf.GGUFEndian) -> None:
    path = tmp_path / "m.gguf"
    _write(path, endianess)
    full, lean = gguf.GGUFReader(str(path)), TensorIndexReader(str(path))

    assert lean.data_offset == full.data_offset
    assert [t.name for t in lean.tensors] == ["blk.0.weight", "blk.1.weight", "blk.2.weight"]
    for mine, theirs in zip(lean.tensors, full.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data_offset) == (
            theirs.name,
            theirs.tensor_type,
            theirs.data_offset,
        )
        np.testing.assert_array_equal(mine.data, theirs.data)
    assert list(lean.fields) == list(full.fields)
    for key in ("general.architecture", "test.after_arrays", "test.text"):
        assert lean.fields[key].contents() == full.fields[key].contents()
    assert full.fields["tokenizer.ggml.tokens"].contents()[299] == "tok299" * (1 + 299 % 7)
    assert lean.fields["tokenizer.ggml.tokens"].contents() == []  # skipped, not parsed
