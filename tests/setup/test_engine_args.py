"""The engine's options have one set of defaults (EngineArgs) and one set of choices (densa.config):
the command line shows exactly those, and parses back into the same EngineArgs."""

from __future__ import annotations

import argparse
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from densa.config import (
    ATTENTION_BACKENDS,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    WEIGHT_FORMATS,
    CacheConfig,
    DeviceConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TiersConfig,
)
from densa.model.arch import ArchConfig
from densa.setup.args import EngineArgs
from densa.setup.options import ENGINE, option_of, parsed_values

SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "speculative": SpeculativeConfig, "device": DeviceConfig, "disagg": DisaggConfig,
            "tiers": TiersConfig, ENGINE: EngineConfig}  # fmt: skip
# Config fields no option sets: filled in once the KV cache is sized and the tokenizer loaded.
SIZED_LATER = {("cache", "num_pages"), ("scheduler", "eos_token_ids")}


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


def test_the_frozen_config_carries_every_part_its_own_options(tiny_model_dir: Path) -> None:
    """Disaggregation, tiers and the device reach the engine through EngineConfig (they once
    bypassed it); the KV size is resolved later (EngineConfig.sized), nothing else changes."""
    args = EngineArgs(
        model=str(tiny_model_dir), dtype="float32", role="prefill", kv_transfer_timeout=5.0,
        cluster_secret_file="/etc/densa/secret", kv_tiers=("disk:/var/kv:2GiB",),
        num_kv_pages=64, cuda_graphs=False,
    )  # fmt: skip
    config = args.resolve(ArchConfig.from_dir(tiny_model_dir), str(tiny_model_dir))
    assert config.disagg == DisaggConfig("prefill", args.kv_listen, 5.0, "/etc/densa/secret")
    assert config.tiers == TiersConfig(("disk:/var/kv:2GiB",), "/etc/densa/secret")
    assert config.device == DeviceConfig("cpu", "auto", cuda_graphs=False)
    assert (config.cache.num_pages, config.cache.exact_num_pages) == (0, 64)
    sized = config.sized(64, (2,))
    assert (sized.cache.num_pages, sized.scheduler.eos_token_ids) == (64, (2,))
    assert sized.model == config.model and sized.disagg == config.disagg
    with pytest.raises(ValueError, match="--role must be one of"):
        EngineArgs(role="router").check()


def test_the_proposer_cost_option_replaces_the_estimate() -> None:
    from densa.config import SpeculativeConfig
    from densa.setup.proposers import build_proposer

    argv = ["--speculative-method", "ngram", "--speculative-proposer-cost", "0.25"]
    config = EngineArgs.from_cli(_parser().parse_args(argv)).speculative_config()
    assert config is not None and config.proposer_cost == 0.25
    proposer = build_proposer(config, None)  # type: ignore[arg-type]  # ngram needs no target
    assert proposer is not None and proposer.cost_per_token == 0.25
    estimated = build_proposer(SpeculativeConfig(), None)  # type: ignore[arg-type]
    assert estimated is not None and estimated.cost_per_token == 0.0  # ngram's own estimate
    with pytest.raises(ValueError, match="proposer-cost"):
        SpeculativeConfig(proposer_cost=-1.0)


def test_every_field_is_one_option_and_every_config_field_comes_from_one() -> None:
    """One declaration per option: each EngineArgs field is exactly one command-line option and
    lands in config fields that exist; every config field is some option's (or sized later)."""
    actions = [a for a in _parser()._actions if a.option_strings != ["-h", "--help"]]
    assert sorted(a.dest for a in actions) == sorted(f.name for f in fields(EngineArgs))
    landed: list[tuple[str, str]] = []
    for f in fields(EngineArgs):
        for section, config_class in SECTIONS.items():
            names = option_of(f).config_names(f.name, section)
            landed += [(section, name) for name in names]
            unknown = set(names) - {c.name for c in fields(config_class)}
            assert not unknown, f"EngineArgs.{f.name} lands in no field {unknown} of {section}"
        assert option_of(f).to, f"EngineArgs.{f.name} lands nowhere in the config"
    wanted = {
        (section, c.name)
        for section, config_class in SECTIONS.items()
        for c in fields(config_class)
        if not (config_class is EngineConfig and c.name in SECTIONS)
    }
    assert len(landed) == len(set(landed)), "two options set one config field"
    assert set(landed) | SIZED_LATER == wanted


def test_the_parser_defaults_are_the_dataclass_defaults() -> None:
    assert parsed_values(EngineArgs, _parser().parse_args([])) == asdict(EngineArgs())


def test_help_lists_every_option() -> None:
    text = _parser().format_help()
    flags = [a.option_strings for a in _parser()._actions]
    assert len(flags) == len(fields(EngineArgs)) + 1  # and -h / --help
    for strings in flags:
        for flag in strings:
            assert flag in text
    assert "--kv-tier TIER" in text and "--no-cuda-graphs" in text
    assert "--kv-integrity {on,off}" in text and "--served-model-name NAME [NAME ...]" in text


def test_a_command_line_reaches_the_frozen_config(tiny_model_dir: Path) -> None:
    argv = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "alias",
            "--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory", "1GiB",
            "--num-kv-pages", "40", "--kv-cache-dtype", "int8", "--kv-integrity", "off",
            "--no-enable-prefix-caching", "--max-num-seqs", "3", "--seed", "7",
            "--no-fused-decode", "--role", "prefill", "--cluster-secret-file", "/s",
            "--kv-tier", "disk:/var/kv:1GiB", "--kv-tier", "host:1GiB",
            "--kv-tier-password-file", "/p", "--skip-memory-check",
            "--speculative-method", "ngram", "--num-speculative-tokens", "2"]  # fmt: skip
    args = EngineArgs.from_cli(_parser().parse_args(argv))
    config = args.resolve(ArchConfig.from_dir(tiny_model_dir), str(tiny_model_dir))
    model, cache, scheduler = config.model, config.cache, config.scheduler
    assert (model.served_model_name, model.dtype, model.seed) == ("tiny", "float32", 7)
    assert model.max_model_len == scheduler.max_model_len == 64
    assert (cache.memory, cache.exact_num_pages, cache.kv_cache_dtype) == ("1GiB", 40, "int8")
    assert (cache.kv_integrity, cache.enable_prefix_caching) == (False, False)
    assert (scheduler.max_num_seqs, config.device.fused_decode) == (3, False)
    assert config.disagg == DisaggConfig("prefill", cluster_secret_file="/s")
    assert config.tiers == TiersConfig(("disk:/var/kv:1GiB", "host:1GiB"), "/s", "/p")
    assert config.speculative == SpeculativeConfig("ngram", num_tokens=2)
    assert config.skip_memory_check
