"""Pages on the wire: each format travels as its own bytes (never float32), and landing converts
exactly as a prefill store into the destination format would."""

from __future__ import annotations

import pytest
import torch

from densa.disagg.wire import WireError, check_frames, land_pages, pack_pages
from densa.kernels.fp8_store import store_fp8
from densa.kernels.paged_attention_ref import dequantize_pages
from densa.model.attention import LayerKVCache
from densa.quant import fp8_kv

NUM_PAGES, HEADS, PAGE, DIM, LAYERS = 6, 2, 4, 8, 2


def caches(dtype: str, scales: str = "none", static: float = 0.5) -> list[LayerKVCache]:
    out = []
    for _ in range(LAYERS):
        shape = (NUM_PAGES, HEADS, PAGE, DIM)
        if dtype != "fp8_e4m3":
            torch_dtype = getattr(torch, dtype)
            out.append(
                LayerKVCache(
                    k=torch.zeros(shape, dtype=torch_dtype), v=torch.zeros(shape, dtype=torch_dtype)
                )
            )
            continue
        k, v = (
            torch.zeros(shape, dtype=fp8_kv.FP8_DTYPE),
            torch.zeros(shape, dtype=fp8_kv.FP8_DTYPE),
        )
        cache = LayerKVCache(k=k, v=v)
        if scales == "dynamic":
            cache.k_scale = torch.zeros(shape[:-1], dtype=torch.int8)
            cache.v_scale = torch.zeros(shape[:-1], dtype=torch.int8)
        else:
            cache.k_scale, cache.v_scale = torch.tensor(static), torch.tensor(static)
        out.append(cache)
    return out


def fill(layers: list[LayerKVCache], seed: int = 0) -> list[torch.Tensor]:
    """Store random values into every page as a prefill would; returns them [L][2][pages...]."""
    gen = torch.Generator().manual_seed(seed)
    values = []
    for cache in layers:
        for tensor, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
            real = torch.randn(NUM_PAGES, HEADS, PAGE, DIM, generator=gen) * 3
            store(tensor, scale, list(range(NUM_PAGES)), real)
            values.append(real)
    return values


def store(
    cache: torch.Tensor, scale: torch.Tensor | None, pages: list[int], real: torch.Tensor
) -> None:
    if cache.dtype != fp8_kv.FP8_DTYPE:
        cache[pages] = real.to(cache.dtype)
        return
    index = torch.tensor(pages)
    rows = real.transpose(1, 2).reshape(len(pages) * PAGE, HEADS, DIM)  # [n*P, H, D]
    slots = index.repeat_interleave(PAGE), torch.arange(PAGE).repeat(len(pages))
    store_fp8(cache, scale, slots[0], slots[1], rows.contiguous())


def real(cache: LayerKVCache, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(pages)
    return dequantize_pages(cache.k, index, cache.k_scale), dequantize_pages(
        cache.v, index, cache.v_scale
    )


SRC, DST = [1, 4], [5, 0]  # source page ids, destination page ids


def move(src: list[LayerKVCache], dst: list[LayerKVCache]) -> int:
    packed = pack_pages(src, SRC)
    check_frames(packed.layout, packed.frames, len(SRC))
    land_pages(dst, DST, packed.layout, packed.frames)
    return packed.num_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_dtype_moves_bytes_exactly_in_the_sources_width(dtype: str) -> None:
    src, dst = caches(dtype), caches(dtype)
    fill(src)
    num_bytes = move(src, dst)
    itemsize = 4 if dtype == "float32" else 2
    assert num_bytes == LAYERS * 2 * len(SRC) * HEADS * PAGE * DIM * itemsize
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s.k[SRC], d.k[DST]) and torch.equal(s.v[SRC], d.v[DST])
        assert not d.k[[1, 2, 3, 4]].any()  # nothing else written


def test_fp8_to_fp8_dynamic_moves_e4m3_bytes_and_exponents_only() -> None:
    src, dst = caches("fp8_e4m3", "dynamic"), caches("fp8_e4m3", "dynamic")
    fill(src)
    num_bytes = move(src, dst)
    num_values = LAYERS * 2 * len(SRC) * HEADS * PAGE * DIM
    assert num_bytes == num_values + num_values // DIM  # 1 byte a value + 1 exponent a row
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s.k[SRC].view(torch.uint8), d.k[DST].view(torch.uint8))
        assert torch.equal(s.k_scale[SRC], d.k_scale[DST])
        assert torch.equal(s.v_scale[SRC], d.v_scale[DST])


@pytest.mark.parametrize("source", ["float32", "bfloat16"])
def test_high_precision_to_fp8_quantizes_with_fresh_scales_as_a_prefill_store_would(
    source: str,
) -> None:
    src, dst = caches(source), caches("fp8_e4m3", "dynamic")
    fill(src)
    move(src, dst)
    want = caches("fp8_e4m3", "dynamic")
    for layer, cache in enumerate(src):
        for tensor, target, scale in (
            (cache.k, want[layer].k, want[layer].k_scale),
            (cache.v, want[layer].v, want[layer].v_scale),
        ):
            store(target, scale, DST, tensor[SRC].float())
    for w, d in zip(want, dst, strict=True):
        assert torch.equal(w.k.view(torch.uint8), d.k.view(torch.uint8))
        assert torch.equal(w.k_scale, d.k_scale) and torch.equal(w.v_scale, d.v_scale)


def test_fp8_to_bfloat16_lands_the_real_values() -> None:
    src, dst = caches("fp8_e4m3", "dynamic"), caches("bfloat16")
    fill(src)
    move(src, dst)
    for s, d in zip(src, dst, strict=True):
        k, v = real(s, SRC)
        assert torch.equal(d.k[DST], k.to(torch.bfloat16)) and torch.equal(
            d.v[DST], v.to(torch.bfloat16)
        )


def test_fp8_static_scales_copy_bytes_when_equal_and_requantize_when_not() -> None:
    src = caches("fp8_e4m3", "static", static=0.5)
    fill(src)
    same, other = (
        caches("fp8_e4m3", "static", static=0.5),
        caches("fp8_e4m3", "static", static=0.25),
    )
    move(src, same)
    move(src, other)
    for s, a, b in zip(src, same, other, strict=True):
        assert torch.equal(s.k[SRC].view(torch.uint8), a.k[DST].view(torch.uint8))
        k_src, _ = real(s, SRC)
        k_other, _ = real(b, DST)
        # e4m3 * 0.25 holds every e4m3 * 0.5 value below its max: the real values survive
        assert torch.allclose(k_other, k_src.clamp(-448 * 0.25, 448 * 0.25), rtol=0.07)


@pytest.mark.parametrize("damage", ["truncate", "flip", "layout"])
def test_damaged_frames_are_refused_before_landing(damage: str) -> None:
    src = caches("fp8_e4m3", "dynamic")
    fill(src)
    packed = pack_pages(src, SRC)
    frames = [memoryview(bytes(f)) for f in packed.frames]
    num_pages = len(SRC)
    if damage == "truncate":
        frames[0] = frames[0][: frames[0].nbytes // 2]
    elif damage == "flip":
        raw = bytearray(frames[1])
        raw[3] ^= 0x10
        frames[1] = memoryview(bytes(raw))
    else:
        num_pages = 3
    with pytest.raises(WireError):
        check_frames(packed.layout, frames, num_pages)
