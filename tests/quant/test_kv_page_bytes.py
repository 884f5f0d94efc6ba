"""Page bytes from one KVFormat: exact counts for a dense, a latent (MLA) and a sparse (DSA)
layout in every format (the values the dtype-name arithmetic gave before the format was the
only argument), and the format's wire form and capabilities."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from densa.config import CacheConfig
from densa.disagg.handshake import expected_page_bytes
from densa.disagg.messages import PageFormat
from densa.formats.kv_format import DYNAMIC, NO_SCALES, ROW, STATIC, KVFormat
from densa.model.arch import ArchConfig
from densa.model.kv_pages import page_bytes

CONFIGS = Path(__file__).parents[1] / "fixtures" / "configs"
PAGE_SIZE = 16
# SmolLM2-135M's KV shape: 30 layers x K and V x 3 KV heads x head_dim 64.
DENSE = ArchConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=576, intermediate_size=16,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True,
)  # fmt: skip
FORMATS = {
    "float32": KVFormat.of("float32"),
    "bfloat16": KVFormat.of("bfloat16"),
    "float16": KVFormat.of("float16"),
    "fp8-dynamic": KVFormat.of("fp8_e4m3", DYNAMIC),
    "fp8-static": KVFormat.of("fp8_e4m3", STATIC),
    "int8": KVFormat.of("int8"),
}
# 16-token pages. Dense: 2 x 30 x 3 rows of 64 values a token (+1 byte a row for FP8 dynamic,
# +2 for INT8). Kimi K2 (latent): 61 rows of 576. GLM-5.2 (sparse): 78 latent rows of 576 and
# 21 index keys of 128 values (one block scale each when quantized, static latents or not).
PAGE_BYTES = {
    "dense": {"float32": 737280, "bfloat16": 368640, "float16": 368640,
              "fp8-dynamic": 187200, "fp8-static": 184320, "int8": 190080},
    "latent": {"float32": 2248704, "bfloat16": 1124352, "float16": 1124352,
               "fp8-dynamic": 563152, "fp8-static": 562176, "int8": 564128},
    "sparse": {"float32": 3047424, "bfloat16": 1523712, "float16": 1523712,
               "fp8-dynamic": 763440, "fp8-static": 762192, "int8": 765024},
}  # fmt: skip


def _arch(layout: str) -> ArchConfig:
    if layout == "dense":
        return DENSE
    return ArchConfig.from_dir(CONFIGS / ("kimi-k2-instruct" if layout == "latent" else "glm-5.2"))


@pytest.mark.parametrize("layout", sorted(PAGE_BYTES))
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_page_bytes_of_each_layout_and_format(layout: str, name: str) -> None:
    assert page_bytes(_arch(layout), PAGE_SIZE, FORMATS[name]) == PAGE_BYTES[layout][name]


def test_index_keys_in_a_dtype_of_their_own_are_sized_so() -> None:
    glm = _arch("sparse")
    fp8_keys = KVFormat.of("bfloat16", index_dtype="fp8_e4m3")
    assert page_bytes(glm, PAGE_SIZE, fp8_keys) == 16 * (78 * 576 * 2 + 21 * 129) == 1481040
    bf16_keys = KVFormat.of("fp8_e4m3", STATIC, index_dtype="bfloat16")
    assert page_bytes(glm, PAGE_SIZE, bf16_keys) == 16 * (78 * 576 + 21 * 256) == 804864
    # The index dtype changes nothing where no layer keeps index keys.
    assert page_bytes(DENSE, PAGE_SIZE, fp8_keys) == PAGE_BYTES["dense"]["bfloat16"]


def test_the_format_of_a_cache_config() -> None:
    cache = CacheConfig(kv_cache_dtype="fp8_e4m3", kv_scales="static",
                        kv_scales_file="scales.json", index_kv_dtype="bfloat16")  # fmt: skip
    assert KVFormat.of_cache(cache) == KVFormat("fp8_e4m3", STATIC, "scales.json", "bfloat16")
    assert KVFormat.of_cache(CacheConfig(kv_cache_dtype="int8")) == KVFormat("int8", ROW)
    plain = KVFormat.of_cache(CacheConfig(kv_cache_dtype="bfloat16", kv_scales="dynamic"))
    assert plain == KVFormat("bfloat16", NO_SCALES)


def test_wire_form_round_trips_without_what_does_not_travel() -> None:
    fmt = KVFormat.of("fp8_e4m3", STATIC, "scales.json", index_dtype="bfloat16")
    assert fmt.wire_form == ("fp8_e4m3", STATIC)
    assert fmt.on_wire == KVFormat.from_wire(*fmt.wire_form) == KVFormat("fp8_e4m3", STATIC)
    for served in KVFormat.served():
        assert KVFormat.from_wire(*served.wire_form) == served
    with pytest.raises(ValueError):
        KVFormat.from_wire("fp4", NO_SCALES)
    with pytest.raises(ValueError):
        KVFormat.from_wire("bfloat16", DYNAMIC)


def test_scale_capabilities_and_index_keys() -> None:
    has = {name: (f.has_row_scales, f.has_layer_scales) for name, f in FORMATS.items()}
    assert has == {"float32": (False, False), "bfloat16": (False, False),
                   "float16": (False, False), "fp8-dynamic": (True, False),
                   "fp8-static": (False, True), "int8": (True, False)}  # fmt: skip
    # Index keys: the pages' dtype, never static scales; or a dtype of their own.
    assert FORMATS["fp8-static"].index_keys() == KVFormat("fp8_e4m3", DYNAMIC)
    assert FORMATS["int8"].index_keys() == KVFormat("int8", ROW)
    assert KVFormat.of("int8", index_dtype="float32").index_keys() == KVFormat("float32")
    with pytest.raises(ValueError, match="index key dtype"):
        KVFormat("bfloat16", index_dtype="fp4")


@pytest.mark.parametrize("layout", sorted(PAGE_BYTES))
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_handshake_sizes_a_peers_pages_as_page_bytes(layout: str, name: str) -> None:
    # A peer announces its signature (a dict) and its format's wire form; what it must announce
    # is what page_bytes gives that model, by the same arithmetic (KVGeometry.page_bytes).
    arch, fmt = _arch(layout), FORMATS[name]
    page = PageFormat(*fmt.wire_form, PAGE_SIZE, 0)
    signature = msgspec.to_builtins(arch.signature())  # as the wire carries it
    assert expected_page_bytes(signature, page) == page_bytes(arch, PAGE_SIZE, fmt)
    assert expected_page_bytes(signature, page) == PAGE_BYTES[layout][name]
