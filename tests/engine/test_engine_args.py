"""The engine's options have one set of defaults (EngineArgs) and one set of choices (densa.config):
the command line shows exactly those, and parses back into the same EngineArgs."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from densa.config import ATTENTION_BACKENDS, DTYPE_CHOICES, KV_CACHE_DTYPES, WEIGHT_FORMATS
from densa.setup.args import EngineArgs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def test_an_empty_command_line_is_the_dataclass_defaults() -> None:
    assert EngineArgs.from_cli(_parser().parse_args([])) == EngineArgs()


def test_every_field_is_an_option_and_the_choices_are_the_configs() -> None:
    parser = _parser()
    options = {a.dest: a for a in parser._actions}
    assert {f.name for f in fields(EngineArgs)} <= set(options)
    assert options["dtype"].choices == list(DTYPE_CHOICES)
    assert options["kv_cache_dtype"].choices == list(KV_CACHE_DTYPES)
    assert options["weight_format"].choices == list(WEIGHT_FORMATS)
    assert options["attention_backend"].choices == list(ATTENTION_BACKENDS)


def test_options_parse_into_their_fields() -> None:
    argv = ["--kv-cache-dtype", "fp8_e4m3", "--page-size", "8", "--kv-integrity", "off",
            "--no-enable-prefix-caching", "--max-num-seqs", "4"]  # fmt: skip
    args = EngineArgs.from_cli(_parser().parse_args(argv))
    assert (args.kv_cache_dtype, args.page_size, args.kv_integrity) == ("fp8_e4m3", 8, False)
    assert (args.enable_prefix_caching, args.max_num_seqs) == (False, 4)


def test_kv_tiers_are_repeatable_in_order_and_checked() -> None:
    argv = ["--kv-tier", "disk:/var/kv:2GiB", "--kv-tier", "shared:redis://10.0.0.5:6379/1"]
    args = EngineArgs.from_cli(_parser().parse_args(argv))
    assert args.kv_tiers == ("disk:/var/kv:2GiB", "shared:redis://10.0.0.5:6379/1")
    for bad in ("disk:/var/kv", "shared:10.0.0.5:6379", "ram:1GiB"):
        with pytest.raises(ValueError, match="--kv-tier"):
            EngineArgs(kv_tiers=(bad,)).check()
