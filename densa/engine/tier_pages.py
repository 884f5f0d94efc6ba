"""One page's bytes as a KV tier stores them: its slice of a PackedPages (kv_io's packing:
values [L, parts, n, H, P, D] then row scales [L, parts, n, H, P]) of every (layer, part) row,
in order:

    payload(page i) = values[0, 0, i] | values[0, 1, i] | ... | values[L-1, parts-1, i]
                      | scales[0, 0, i] | ... | scales[L-1, parts-1, i]
                      | the same of its index keys (sparse attention: PackedPages.index)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from densa.formats.kv_format import KVFormat
from densa.sched.output import PackedPages


@dataclass(frozen=True)
class PageLayout:
    """How one page's bytes sit in a PackedPages of n pages (see the module docstring)."""

    num_rows: int  # layers x parts
    value_bytes: int  # one page's values in one (layer, part) row
    scale_bytes: int  # one page's row scales in one (layer, part) row (0: none)
    template: PackedPages  # a 0-page pack: the format, scales and shape to rebuild
    index: PageLayout | None = None  # sparse attention's index keys, after the pages' own bytes

    @property
    def own_bytes(self) -> int:
        return self.num_rows * (self.value_bytes + self.scale_bytes)

    @property
    def payload_bytes(self) -> int:
        return self.own_bytes + (0 if self.index is None else self.index.payload_bytes)

    def split(self, pages: PackedPages) -> list[bytes]:
        own = self._split_own(pages)
        if self.index is None or pages.index is None:
            return own
        return [a + b for a, b in zip(own, self.index.split(pages.index), strict=True)]

    def _split_own(self, pages: PackedPages) -> list[bytes]:
        n = pages.shape[2]
        values, scales = memoryview(pages.values), pages.row_scales
        payloads = []
        for i in range(n):
            parts = [values[(r * n + i) * self.value_bytes :][: self.value_bytes]
                     for r in range(self.num_rows)]  # fmt: skip
            if scales is not None:
                parts += [scales[(r * n + i) * self.scale_bytes :][: self.scale_bytes]
                          for r in range(self.num_rows)]  # fmt: skip
            payloads.append(b"".join(parts))
        return payloads

    def join(self, payloads: Sequence[memoryview]) -> PackedPages:
        rows = range(self.num_rows)
        values = b"".join(p[r * self.value_bytes :][: self.value_bytes] for r in rows
                          for p in payloads)  # fmt: skip
        scales = None
        if self.scale_bytes:
            base = self.num_rows * self.value_bytes
            scales = memoryview(b"".join(p[base + r * self.scale_bytes :][: self.scale_bytes]
                                         for r in rows for p in payloads))  # fmt: skip
        shape = list(self.template.shape)
        shape[2] = len(payloads)
        index = None
        if self.index is not None:
            index = self.index.join([p[self.own_bytes :] for p in payloads])
        return PackedPages(self.template.kv_dtype, self.template.kv_scales, tuple(shape),
                           memoryview(values), scales, self.template.static_scales,
                           index)  # fmt: skip

    @classmethod
    def of(cls, template: PackedPages) -> PageLayout:
        num_layers, num_parts, _, heads, page_size, head_dim = template.shape
        kv_format = KVFormat.from_wire(template.kv_dtype, template.kv_scales)
        itemsize = kv_format.storage_dtype.itemsize
        scale_dtype = kv_format.row_scale_dtype
        scale_itemsize = 0 if scale_dtype is None else scale_dtype.itemsize
        index = None if template.index is None else cls.of(template.index)
        return cls(num_layers * num_parts, heads * page_size * head_dim * itemsize,
                   heads * page_size * scale_itemsize, template, index)  # fmt: skip
