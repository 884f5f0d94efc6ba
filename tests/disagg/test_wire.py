"""Pages on the wire, for every KV format densa serves and every pair of them: each format travels
as its own bytes (never float32), the frames are what its KVFormat says, and landing stores
exactly what a slow reference (the torch quantizers, not the store path) computes from the
source's real values, or copies the bytes where the formats are the same."""

from __future__ import annotations

import itertools

import pytest
import torch

from densa.disagg.messages import WireLayout
from densa.disagg.wire import WireError, check_frames, pack_pages, unpack
from densa.formats import fp8_kv, int8_kv
from densa.formats.kv_format import DYNAMIC, ROW, STATIC, KVFormat
from densa.kernels.reference.paged_attention import dequantize_pages
from densa.model.attention import LayerKVCache
from densa.worker import kv_io

NUM_PAGES, HEADS, PAGE, DIM, LAYERS = 6, 2, 4, 8, 2
SRC, DST = [1, 4], [5, 0]  # source page ids, destination page ids
STATIC_SCALE = 0.5

# Every format an engine serves (KVFormat.served), static FP8 with a scale file's 0.5.
FORMATS = {
    "float32": KVFormat("float32"),
    "bfloat16": KVFormat("bfloat16"),
    "float16": KVFormat("float16"),
    "fp8-dynamic": KVFormat("fp8_e4m3", DYNAMIC),
    "fp8-static": KVFormat("fp8_e4m3", STATIC),
    "int8": KVFormat("int8", ROW),
}


def test_the_formats_here_are_every_format_densa_serves() -> None:
    served = {(f.name, f.scales) for f in KVFormat.served()}
    assert served == {(f.name, f.scales) for f in FORMATS.values()}


def caches(fmt: str, static: float = STATIC_SCALE) -> list[LayerKVCache]:
    kv_format = FORMATS[fmt]
    shape = (NUM_PAGES, HEADS, PAGE, DIM)
    out = []
    for _ in range(LAYERS):
        k, v = (torch.zeros(shape, dtype=kv_format.storage_dtype) for _ in range(2))
        scales: tuple[torch.Tensor | None, ...] = (None, None)
        if kv_format.row_scale_dtype is not None:
            scales = tuple(torch.zeros(shape[:-1], dtype=kv_format.row_scale_dtype) for _ in "kv")
        elif kv_format.scales == STATIC:
            scales = (torch.tensor(static), torch.tensor(static))
        out.append(LayerKVCache(k, v, scales[0], scales[1], kv_format))
    return out


def parts(cache: LayerKVCache) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return [(cache.k, cache.k_scale), (cache.v, cache.v_scale)]


def fill(layers: list[LayerKVCache], seed: int = 0) -> None:
    """Store random values into every page as a prefill would (rows of very different sizes,
    so per-row scales matter)."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.arange(NUM_PAGES)
    for cache in layers:
        for values, scale in parts(cache):
            row_size = torch.exp2(torch.randint(-4, 5, (NUM_PAGES, HEADS, PAGE, 1), generator=gen))
            real = torch.randn(NUM_PAGES, HEADS, PAGE, DIM, generator=gen) * row_size
            kv_io.store_pages(cache.kv_format, values, scale, index, real)


def real(values: torch.Tensor, scale: torch.Tensor | None, pages: list[int]) -> torch.Tensor:
    """The reference reader: stored values x their scale, whatever the format."""
    return dequantize_pages(values, torch.tensor(pages), scale)


def quantized(kv_format: KVFormat, x: torch.Tensor, scale: torch.Tensor | None) -> tuple:
    """The reference store: what `kv_format` holds for real values x [..., D]."""
    if kv_format.scales == DYNAMIC:
        return fp8_kv.quantize_fp8_exponent(x)
    if kv_format.scales == STATIC:
        assert scale is not None
        return fp8_kv.quantize_fp8_static(x, scale), scale
    if kv_format.scales == ROW:
        return int8_kv.quantize_rows(x)
    return x.to(kv_format.storage_dtype), None


def move(src: list[LayerKVCache], dst: list[LayerKVCache]) -> int:
    packed = pack_pages(src, SRC)
    check_frames(packed.layout, packed.frames, len(SRC))
    kv_io.land(dst, DST, unpack(packed.layout, packed.frames))
    return packed.num_bytes


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_travels_as_its_own_bytes(fmt: str) -> None:
    src, dst = caches(fmt), caches(fmt)
    fill(src)
    num_bytes = move(src, dst)
    kv_format = FORMATS[fmt]
    rows = LAYERS * 2 * len(SRC) * HEADS * PAGE
    assert num_bytes == rows * (DIM * kv_format.value_bytes() + kv_format.scale_bytes_per_row())
    for s, d in zip(src, dst, strict=True):
        for (s_values, s_scale), (d_values, d_scale) in zip(parts(s), parts(d), strict=True):
            assert same_bits(s_values[SRC], d_values[DST])
            if kv_format.row_scale_dtype is not None:
                assert same_bits(s_scale[SRC], d_scale[DST])  # type: ignore[index]
            untouched = [p for p in range(NUM_PAGES) if p not in DST]
            assert not d_values[untouched].float().any()  # nothing else written


@pytest.mark.parametrize(("source", "dest"), [pair for pair in itertools.permutations(FORMATS, 2)])
def test_every_pair_of_formats_lands_what_the_reference_stores(source: str, dest: str) -> None:
    src, dst = caches(source), caches(dest)
    fill(src)
    move(src, dst)
    for s, d in zip(src, dst, strict=True):
        for (s_values, s_scale), (d_values, d_scale) in zip(parts(s), parts(d), strict=True):
            want_values, want_scale = quantized(
                FORMATS[dest], real(s_values, s_scale, SRC), d_scale
            )
            assert same_bits(d_values[DST], want_values)
            if FORMATS[dest].row_scale_dtype is not None:
                assert same_bits(d_scale[DST], want_scale)  # type: ignore[index]
            untouched = [p for p in range(NUM_PAGES) if p not in DST]
            assert not d_values[untouched].float().any()


@pytest.mark.parametrize("dest", list(FORMATS))
def test_landed_real_values_are_the_sources_within_the_destinations_rounding(dest: str) -> None:
    src, dst = caches("float32"), caches(dest)
    fill(src)
    move(src, dst)
    # The largest relative error of one stored value in each format (of its row's max for INT8).
    tolerance = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11, "fp8-dynamic": 2**-4,
                 "fp8-static": 2**-4, "int8": 1 / 254}[dest]  # fmt: skip
    for s, d in zip(src, dst, strict=True):
        for (s_values, s_scale), (d_values, d_scale) in zip(parts(s), parts(d), strict=True):
            want, got = real(s_values, s_scale, SRC), real(d_values, d_scale, DST)
            scale = want.abs().amax(-1, keepdim=True) if dest == "int8" else want.abs()
            # FP8's subnormals step by 2**-9 of the scale (a static 0.5; a dynamic row's max/224)
            floor = torch.zeros(())
            if dest == "fp8-static":
                floor = torch.tensor(STATIC_SCALE * 2**-10)
            elif dest == "fp8-dynamic":
                floor = want.abs().amax(-1, keepdim=True) / 224 * 2**-10
            assert torch.all((got - want).abs() <= scale * tolerance + floor)


def test_fp8_static_pages_copy_bytes_only_when_the_scales_are_equal() -> None:
    src = caches("fp8-static", static=0.5)
    fill(src)
    same, other = caches("fp8-static", static=0.5), caches("fp8-static", static=0.25)
    move(src, same)
    move(src, other)
    for s, a, b in zip(src, same, other, strict=True):
        assert same_bits(s.k[SRC], a.k[DST])
        want, _ = quantized(FORMATS["fp8-static"], real(s.k, s.k_scale, SRC), b.k_scale)
        assert same_bits(b.k[DST], want)


def test_the_format_comes_from_the_cache_not_its_tensors() -> None:
    """INT8 pages carry fp16 row scales; read off the tensors, nothing could tell them from a
    made-up format. The layout names the format the caches carry."""
    packed = pack_pages(caches("int8"), SRC)
    assert (packed.layout.kv_dtype, packed.layout.kv_scales) == ("int8", "row")
    assert len(packed.frames) == 2
    assert packed.frames[1].nbytes == LAYERS * 2 * len(SRC) * HEADS * PAGE * 2


@pytest.mark.parametrize("damage", ["truncate", "layout", "format", "scales", "static"])
def test_damaged_frames_are_refused_before_landing(damage: str) -> None:
    src = caches("int8")
    fill(src)
    packed = pack_pages(src, SRC)
    frames = [memoryview(bytes(f)) for f in packed.frames]
    layout, num_pages = packed.layout, len(SRC)
    if damage == "truncate":
        frames[0] = frames[0][: frames[0].nbytes // 2]
    elif damage == "layout":
        num_pages = 3
    elif damage == "format":  # a format densa does not serve
        layout = WireLayout("int4", "row", layout.shape, [])
    elif damage == "scales":  # INT8 announced without its row scales
        layout = WireLayout("int8", "none", layout.shape, [])
        frames = frames[:1]
    else:  # static scales where the format has none
        layout = WireLayout("int8", "row", layout.shape, [[1.0, 1.0]] * LAYERS)
    with pytest.raises(WireError):
        check_frames(layout, frames, num_pages)


def test_pages_of_another_shape_are_refused_before_anything_is_written() -> None:
    src = caches("bfloat16")
    fill(src)
    packed = pack_pages(src, SRC)
    layout = packed.layout
    wrong = WireLayout(layout.kv_dtype, layout.kv_scales, [LAYERS, 2, 2, HEADS, PAGE * 2, DIM // 2])
    check_frames(wrong, packed.frames, len(SRC))  # the bytes add up...
    dst = caches("bfloat16")
    with pytest.raises(kv_io.LandingError):  # ...but not to this model's pages
        kv_io.land(dst, DST, unpack(wrong, packed.frames))
    assert not any(c.k.float().any() or c.v.float().any() for c in dst)
