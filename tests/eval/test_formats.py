"""Format specs: `[label:]key=value,...` over EngineArgs fields, converted to the field types."""

from __future__ import annotations

import dataclasses

import pytest

from densa.setup.args import EngineArgs
from densa_bench.eval.formats import parse_format, split_options

BASE = EngineArgs(kv_cache_memory="512MiB")


def test_a_spec_replaces_fields_and_is_its_own_label() -> None:
    fmt = parse_format("kv_cache_dtype=fp8_e4m3", BASE)
    assert fmt.label == "kv_cache_dtype=fp8_e4m3"
    assert fmt.overrides == {"kv_cache_dtype": "fp8_e4m3"}
    assert fmt.args == dataclasses.replace(BASE, kv_cache_dtype="fp8_e4m3")


def test_values_take_the_field_types_and_a_label_may_lead() -> None:
    fmt = parse_format(
        "int4: model=/ckpt/a:b, num_kv_pages=8, kv_integrity=off, max_model_len=none", BASE
    )
    assert fmt.label == "int4"
    assert fmt.overrides == {
        "model": "/ckpt/a:b",  # a ':' after the first '=' belongs to the value
        "num_kv_pages": 8,
        "kv_integrity": False,
        "max_model_len": None,
    }


def test_an_empty_spec_is_the_base() -> None:
    fmt = parse_format("", BASE)
    assert (fmt.label, fmt.args, fmt.overrides) == ("base", BASE, {})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "kv_dtype=fp8_e4m3",
            "unknown format option 'kv_dtype'; EngineArgs fields are: .*kv_cache_dtype",
        ),
        ("page_size=big", r"page_size='big': expected int"),
        ("page_size=none", r"page_size='none': expected int"),
        ("num_kv_pages=x", r"expected int or none"),
        ("kv_integrity=maybe", r"expected bool"),
        ("kv_cache_dtype", "is not key=value"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_format(spec, BASE)


def test_split_options_separates_shared_from_differing() -> None:
    ref = parse_format("", BASE)
    test = parse_format("fp8:kv_cache_dtype=fp8_e4m3,page_size=32", BASE)
    common, differing = split_options([ref, test])
    assert common["kv_cache_memory"] == "512MiB" and "kv_cache_dtype" not in common
    assert differing == [
        {"kv_cache_dtype": "auto", "page_size": 16},
        {"kv_cache_dtype": "fp8_e4m3", "page_size": 32},
    ]
