"""LinearFormat, what `--weight-format` selects, answers what its callers ask: whether it
quantizes at load (and into what), which packed CPU format it makes, whether the checkpoint's
quantized layers load dense first, what a draft runs in; and it reads as the option's string.
HeadFormat, what `--head-format` selects, the same for the output head."""

from __future__ import annotations

import json

import pytest

from densa.config import HEAD_FORMATS, HEAD_FROM_BLOCKS, WEIGHT_FORMATS, WEIGHTS_FROM_BLOCKS
from densa.model.packed_linear import PACKED_FORMATS
from densa.model.runtime_weights import runtime_format
from densa.quant.linear_format import HeadFormat, LinearFormat
from densa.quant.weight_format import CheckpointFormat, WeightFormat

F = LinearFormat


def test_it_is_parsed_from_the_options_strings_and_reads_as_them() -> None:
    assert F.offered() == WEIGHT_FORMATS  # --help lists the same choices, in the same order
    assert F.of("w4a8") is F.W4A8 and F.of(F.W4A8) is F.W4A8
    assert F.of(WEIGHTS_FROM_BLOCKS) is F.BLOCKS  # what `auto` resolves a GGUF file to
    # Logs, fingerprints and the config print the option value, as the strings did.
    assert f"{F.INT4}" == str(F.INT4) == "int4" == F.INT4
    assert json.dumps({"weight_format": F.NVFP4A8}) == '{"weight_format": "nvfp4a8"}'
    with pytest.raises(ValueError, match="weight format must be one of"):
        F.of("q4")


def test_which_choices_quantize_at_load_and_into_what() -> None:
    on_the_fly = {f.value: f.on_the_fly for f in F if f.on_the_fly is not None}
    assert on_the_fly == {
        "int4": WeightFormat("int4", group_size=128, symmetric=True),
        "fp8": WeightFormat("fp8", block_size=128),
        "mxfp4": WeightFormat("mxfp4"),
        "nvfp4": WeightFormat("nvfp4"),
        "mxfp4a8": WeightFormat("mxfp4", activations="int8"),
        "nvfp4a8": WeightFormat("nvfp4", activations="int8"),
    }


def test_packed_formats_and_what_loads_dense_first() -> None:
    assert tuple(f.packed for f in F if f.packed is not None) == PACKED_FORMATS
    assert {f.value for f in F if f.loads_dense_first} == {"dense", "w4a8", "w8a8", "w8", "blocks"}
    assert [f for f in F if f.is_auto] == [F.AUTO]
    assert [f for f in F if f.is_gguf_blocks] == [F.BLOCKS]


def test_a_draft_runs_the_targets_packed_format_else_its_own() -> None:
    drafts = {f.value: f.for_draft().value for f in F}
    assert drafts == {"auto": "auto", "dense": "auto", "int4": "auto", "fp8": "auto",
                      "mxfp4": "auto", "nvfp4": "auto", "mxfp4a8": "auto", "nvfp4a8": "auto",
                      "w4a8": "w4a8", "w8a8": "w8a8", "w8": "w8", "blocks": "auto"}  # fmt: skip


def test_the_runtime_format_of_each_choice_over_what_a_checkpoint_stores() -> None:
    int4 = CheckpointFormat(WeightFormat("int4", group_size=64))
    mxfp4 = CheckpointFormat(WeightFormat("mxfp4"))
    for fmt in (F.DENSE, F.W4A8, F.W8A8, F.W8, F.BLOCKS):  # the rest loads dense
        assert runtime_format(int4, fmt) is None and runtime_format(None, fmt) is None
    assert runtime_format(None, F.AUTO) is None
    assert runtime_format(int4, F.AUTO) == int4.format
    assert runtime_format(mxfp4, F.AUTO) == WeightFormat("mxfp4", activations="int8")
    assert runtime_format(None, F.FP8) == WeightFormat("fp8", block_size=128)
    assert runtime_format(int4, F.INT4) == int4.format  # as stored, not re-quantized
    assert runtime_format(mxfp4, F.MXFP4) == WeightFormat("mxfp4")
    with pytest.raises(RuntimeError, match=r"stores int4 g64 .* weights, not fp8"):
        runtime_format(int4, F.FP8)
    with pytest.raises(RuntimeError, match="not nvfp4a8"):
        runtime_format(mxfp4, F.NVFP4A8)


def test_the_head_format_is_parsed_from_the_options_strings_and_reads_as_them() -> None:
    H = HeadFormat
    assert H.offered() == HEAD_FORMATS  # --help lists the same choices, in the same order
    assert H.of("w8") is H.W8 and H.of(H.W8) is H.W8 and H.of(HEAD_FROM_BLOCKS) is H.BLOCKS
    assert f"{H.W8A8}" == "w8a8" == H.W8A8
    with pytest.raises(ValueError, match="head format must be one of"):
        H.of("w4a8")  # a linear format, not a head one


def test_what_each_head_format_packs_and_is() -> None:
    H = HeadFormat
    assert {h.value: h.packed for h in H} == {
        "auto": None, "dense": None, "w8a8": "w8a8", "w8": "w8", "blocks": None
    }  # fmt: skip
    assert all(h.packed in PACKED_FORMATS for h in H if h.packed is not None)
    assert [h for h in H if h.is_dense] == [H.DENSE]
    assert [h for h in H if h.is_auto] == [H.AUTO]
    assert [h for h in H if h.is_gguf_blocks] == [H.BLOCKS]
