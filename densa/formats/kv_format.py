"""KVFormat: how KV pages store their values, decided once and carried by every cache.

The engine builds one KVFormat from its frozen cache config (`KVFormat.of_cache`) before
anything is sized or allocated, and passes that value down: sizing and allocation
(densa.model.kv_pages.page_bytes, allocate_kv_caches), the memory plan, each layer's cache, the
P/D wire and the KV tiers. Whoever stores into pages, reads them, sizes them or describes them
asks the format (its methods and capabilities), instead of comparing dtype names or guessing
from a tensor's dtype or its scale tensor's rank.

    name       storage                   scales                     bytes per value row of D
    float32    float32                   none                       4 D
    bfloat16   bfloat16                  none                       2 D
    float16    float16                   none                       2 D
    fp8_e4m3   float8_e4m3fn             dynamic: int8 exponent     D + 1
                                         static: one float / layer  D
    int8       int8 codes                one fp16 scale per row     D + 2

Sparse attention's index keys live in the same pages in a format of their own (`index_keys`):
the pages' dtype unless `index_dtype` names another.

On the P/D wire and in tier blocks a format travels as its `wire_form`, (name, scales), and comes
back through `from_wire`; the index dtype and the static scales' source do not travel.

A format is also the codec of its pages: the kernels' `store_kv(kv_format, ...)` encodes real
values as it says (as a prefill does), `dequantize` decodes stored pages back to real values.
Copies between workers (densa/worker/kv_io.py) use exactly these two, so a new format is one
entry here, not a case in every reader. This module holds the formulas only and imports no
kernel: the kernels import it (densa/formats sits below densa/kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from densa.config import CacheConfig
from densa.formats import fp8_kv, int8_kv

_STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    fp8_kv.KV_DTYPE: fp8_kv.FP8_DTYPE,
    int8_kv.KV_DTYPE: int8_kv.CODE_DTYPE,
}
NO_SCALES, DYNAMIC, STATIC, ROW = "none", "dynamic", "static", "row"
# Per-row scale tensors, as stored next to the values ([pages, heads, page_size], one per row).
_ROW_SCALE_DTYPES = {DYNAMIC: fp8_kv.EXPONENT_SCALE_DTYPE, ROW: int8_kv.SCALE_DTYPE}
KV_FORMAT_NAMES = tuple(_STORAGE)


@dataclass(frozen=True)
class KVFormat:
    name: str  # a KV cache dtype name (densa.config.KV_CACHE_DTYPES, resolved)
    scales: str = NO_SCALES  # none | dynamic | static (FP8) | row (INT8)
    static_source: str | None = None  # where static FP8 scales came from (a file), for people
    # DSA index keys' dtype when not the pages' own (None); read only by sparse-attention models.
    index_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.name not in _STORAGE:
            raise ValueError(f"KV cache dtype must be one of {tuple(_STORAGE)}, got {self.name!r}")
        allowed = {fp8_kv.KV_DTYPE: (DYNAMIC, STATIC), int8_kv.KV_DTYPE: (ROW,)}
        if self.scales not in allowed.get(self.name, (NO_SCALES,)):
            raise ValueError(f"{self.name} pages cannot have {self.scales!r} scales")
        if self.index_dtype is not None and self.index_dtype not in _STORAGE:
            raise ValueError(f"index key dtype must be one of {tuple(_STORAGE)}")

    @classmethod
    def of(
        cls,
        name: str,
        fp8_scales: str = DYNAMIC,
        static_source: str | None = None,
        index_dtype: str | None = None,
    ) -> KVFormat:
        """The format of a resolved KV dtype; `fp8_scales` (dynamic | static) applies to FP8."""
        if name == fp8_kv.KV_DTYPE:
            source = static_source if fp8_scales == STATIC else None
            return cls(name, fp8_scales, source, index_dtype)
        return cls(name, ROW if name == int8_kv.KV_DTYPE else NO_SCALES, None, index_dtype)

    @classmethod
    def of_cache(cls, cache: CacheConfig) -> KVFormat:
        """The engine's one KV format, from its frozen (resolved) cache config."""
        return cls.of(cache.kv_cache_dtype, cache.kv_scales, cache.kv_scales_file,
                      cache.index_kv_dtype)  # fmt: skip

    @classmethod
    def from_wire(cls, name: str, scales: str) -> KVFormat:
        """The format a peer's pages or a tier block announce (`wire_form`); ValueError for
        one densa does not serve."""
        return cls(name, scales)

    @property
    def wire_form(self) -> tuple[str, str]:
        """(name, scales): how the format travels on the P/D wire and in tier blocks."""
        return self.name, self.scales

    @property
    def on_wire(self) -> KVFormat:
        """This format as a peer learns it from `wire_form` (no index dtype, no static source):
        the page a handshake announces is sized in it."""
        return KVFormat.from_wire(*self.wire_form)

    def index_keys(self) -> KVFormat:
        """How DSA index keys are stored beside these pages: in `index_dtype`, else the pages'
        dtype; quantized keys with one scale per block of index values (FP8: a power-of-two
        exponent, the ue8m0 block scale DeepSeek-V3.2 keeps as a float32; INT8: an fp16),
        never static scales (no calibration measures index keys)."""
        return KVFormat.of(self.index_dtype or self.name, DYNAMIC)

    @classmethod
    def of_tensors(cls, values: torch.Tensor, scale: torch.Tensor | None) -> KVFormat:
        """The format of pages made by hand (tests, kernel benchmarks), read off the tensors.
        The one place a format is inferred; the engine always builds its format from options."""
        name = next(n for n, dtype in _STORAGE.items() if dtype == values.dtype)
        if name == fp8_kv.KV_DTYPE:
            return cls(name, STATIC if scale is None or scale.dim() == 0 else DYNAMIC)
        return cls.of(name, DYNAMIC)

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE[self.name]

    @property
    def is_quantized(self) -> bool:
        """Values are stored scaled (FP8, INT8): a prefill chunk attends to its own new K/V as
        computed, not as stored (docs/kv-cache.md)."""
        return self.scales != NO_SCALES

    @property
    def is_fp8(self) -> bool:
        return self.name == fp8_kv.KV_DTYPE

    @property
    def fp8_policy(self) -> str:
        """The FP8 scale policy (dynamic | static) the sizing functions take; dynamic otherwise,
        where it is not read."""
        return self.scales if self.is_fp8 else DYNAMIC

    @property
    def has_row_scales(self) -> bool:
        """One scale per stored [head_dim] row, next to the values (FP8 dynamic, INT8)."""
        return self.scales in _ROW_SCALE_DTYPES

    @property
    def has_layer_scales(self) -> bool:
        """One scale per layer and part (static FP8), fixed at allocation."""
        return self.scales == STATIC

    @property
    def row_scale_dtype(self) -> torch.dtype | None:
        """The dtype of the per-row scales stored next to the values (None: no per-row scales;
        static FP8 keeps one float per layer and part instead)."""
        return _ROW_SCALE_DTYPES.get(self.scales)

    @classmethod
    def served(cls) -> list[KVFormat]:
        """Every KV format an engine can serve (each FP8 scale policy counts as its own)."""
        formats: list[KVFormat] = []
        for name in KV_FORMAT_NAMES:
            policies = (DYNAMIC, STATIC) if name == fp8_kv.KV_DTYPE else (DYNAMIC,)
            formats.extend(cls.of(name, policy) for policy in policies)
        return formats

    def scale_bytes_per_row(self) -> int:
        """Bytes of scale each [head_dim] row of a token adds."""
        return {NO_SCALES: 0, STATIC: 0, DYNAMIC: 1, ROW: int8_kv.SCALE_BYTES}[self.scales]

    def value_bytes(self) -> int:
        return self.storage_dtype.itemsize

    def describe(self) -> str:
        if self.scales == DYNAMIC:
            return f"{self.name}, dynamic scales"
        if self.scales == STATIC:
            return f"{self.name}, static scales: {self.static_source or 'none given (1.0)'}"
        return self.name

    def dequantize(self, values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Stored pages [..., D] of this format -> their real values (float32), the inverse of
        `store_kv` up to its rounding. `scale`: the per-row scales [...] (FP8 dynamic: int8
        power-of-two exponents; INT8: fp16), the 0-dim static FP8 scale, or None (no scales)."""
        real = values.to(torch.float32)
        if self.scales == NO_SCALES:
            return real
        if scale is None:
            if self.scales != STATIC:
                raise ValueError(f"{self.describe()} pages need their scales")
            return real  # static FP8 without a scale file stores with 1.0
        if self.scales == STATIC:
            return real * scale.to(torch.float32)
        if self.scales == DYNAMIC:
            return real * torch.exp2(scale.to(torch.float32)).unsqueeze(-1)
        return int8_kv.dequantize_rows(values, scale)


def is_layer_scale(scale: torch.Tensor, kv_format: KVFormat | None) -> bool:
    """Whether `scale` is one scale for the whole layer, as the pages' format says; pages made by
    hand without one (tests, kernel benchmarks, which also scale other dtypes) say it by shape."""
    return kv_format.has_layer_scales if kv_format is not None else scale.dim() == 0
