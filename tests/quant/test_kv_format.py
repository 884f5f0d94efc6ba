"""KVFormat: made once from the options, carried by every cache, asked by every store."""

from __future__ import annotations

import pytest
import torch

from densa.formats import int8_kv
from densa.formats.kv_format import DYNAMIC, NO_SCALES, ROW, STATIC, KVFormat
from densa.kernels.cpu.kv_store import store_fp8, store_kv
from densa.model.attention import LayerKVCache
from densa.model.kv_pages import allocate_kv_caches


def test_formats_from_options_and_their_costs() -> None:
    assert KVFormat.of("bfloat16", "dynamic") == KVFormat("bfloat16", NO_SCALES)
    fp8 = KVFormat.of("fp8_e4m3", "dynamic")
    assert (fp8.scales, fp8.is_quantized, fp8.scale_bytes_per_row()) == (DYNAMIC, True, 1)
    static = KVFormat.of("fp8_e4m3", "static", "scales.json")
    assert static.describe() == "fp8_e4m3, static scales: scales.json"
    assert static.scale_bytes_per_row() == 0
    int8 = KVFormat.of("int8", "dynamic")  # the FP8 policy does not apply to INT8
    assert (int8.scales, int8.scale_bytes_per_row(), int8.storage_dtype) == (ROW, 2, torch.int8)
    with pytest.raises(ValueError, match="cannot have"):
        KVFormat("bfloat16", DYNAMIC)
    with pytest.raises(ValueError, match="must be one of"):
        KVFormat("fp4")


def test_hand_made_pages_get_their_format_read_off_once() -> None:
    pages = torch.zeros(2, 1, 4, 8, dtype=torch.float8_e4m3fn)
    static = LayerKVCache(pages, pages.clone(), torch.tensor(1.0), torch.tensor(1.0))
    assert static.kv_format.scales == STATIC
    exps = torch.zeros(2, 1, 4, dtype=torch.int8)
    assert LayerKVCache(pages, pages.clone(), exps, exps.clone()).kv_format.scales == DYNAMIC


def test_store_writes_what_each_format_promises() -> None:
    rows = torch.randn(3, 1, 8) * 10
    slot_pages, offsets = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 3])
    fp8 = torch.zeros(2, 1, 4, 8, dtype=torch.float8_e4m3fn)
    fp8_exps = torch.zeros(2, 1, 4, dtype=torch.int8)
    store_kv(KVFormat.of("fp8_e4m3", "dynamic"), fp8, fp8_exps, slot_pages, offsets, rows)
    expected, expected_exps = torch.zeros_like(fp8), torch.zeros_like(fp8_exps)
    store_fp8(expected, expected_exps, slot_pages, offsets, rows)
    assert torch.equal(fp8.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(fp8_exps, expected_exps)
    codes = torch.zeros(2, 1, 4, 8, dtype=torch.int8)
    scales = torch.zeros(2, 1, 4, dtype=torch.float16)
    store_kv(KVFormat.of("int8", "dynamic"), codes, scales, slot_pages, offsets, rows)
    want_codes, want_scales = int8_kv.quantize_rows(rows)
    assert torch.equal(codes[slot_pages, :, offsets], want_codes)
    assert torch.equal(scales[slot_pages, :, offsets], want_scales)
    plain = torch.zeros(2, 1, 4, 8, dtype=torch.bfloat16)
    store_kv(KVFormat.of("bfloat16", "dynamic"), plain, None, slot_pages, offsets, rows)
    assert torch.equal(plain[slot_pages, :, offsets], rows.to(torch.bfloat16))


def test_the_allocator_hands_every_layer_the_engine_format(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from densa.model.arch import ArchConfig

    arch = ArchConfig.from_dir(tiny_model_dir)
    caches = allocate_kv_caches(arch, 4, 4, KVFormat.of("int8"), torch.device("cpu"))
    assert {c.kv_format for c in caches} == {KVFormat("int8", ROW)}
