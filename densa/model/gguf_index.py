"""A GGUF reader for loading weights: the tensor index and scalar metadata, without parsing the
metadata's arrays.

The `gguf` package's reader builds one numpy view per array element while it walks the header
to find the tensor index. A 150k-token vocabulary's tokens, merges and token types are ~600k
elements: ~11 s and ~500 MB of Python objects before the first tensor can be read, paid by the
memory check and again by the loader on every start. Loading needs only the tensor index and
`general.architecture` (the tokenizer and config were converted once, into the model's cache
directory), so arrays are skipped here: their bytes are walked to find where the next field
starts, and their values are left out of `fields` (their parts hold only item type and length).
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import numpy as np
from gguf import GGUFReader, GGUFValueType


class TensorIndexReader(GGUFReader):
    """GGUFReader whose array fields keep only their item type and length (`contents()` of one
    is an empty list); scalars, strings and the tensors read as the package reads them."""

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        size = 12 + self._array_bytes(orig_offs + 12, int(item_type[0]), int(length[0]))
        return size, [item_type, length], [], [GGUFValueType.ARRAY]

    def _array_bytes(self, offset: int, item_type: int, length: int) -> int:
        """Bytes of `length` items of `item_type` stored from `offset`."""
        kind = GGUFValueType(item_type)
        scalar = self.gguf_scalar_to_np.get(kind)
        if scalar is not None:
            return length * np.dtype(scalar).itemsize
        start = offset
        if kind == GGUFValueType.STRING:
            raw = self.data.data  # a memoryview of the mapped file
            order = self._byte_order()
            for _ in range(length):  # each string: a u64 byte count, then the bytes
                offset += 8 + int.from_bytes(raw[offset : offset + 8], order)
            return offset - start
        if kind == GGUFValueType.ARRAY:  # nested: each item is (item type, length, items)
            for _ in range(length):
                inner_type = int(self._get(offset, np.uint32)[0])
                inner_length = int(self._get(offset + 4, np.uint64)[0])
                offset += 12 + self._array_bytes(offset + 12, inner_type, inner_length)
            return offset - start
        raise ValueError(f"unknown GGUF array item type {item_type}")

    def _byte_order(self) -> Literal["little", "big"]:
        """The file's byte order ('S': swapped from this host's)."""
        host = sys.byteorder
        if self.byte_order != "S":
            return host
        return "big" if host == "little" else "little"
