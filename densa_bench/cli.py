"""The `densa bench` command and its benchmarks. Building the parser imports no torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from densa.engine.args import EngineArgs
from densa_bench.peers.cli import add_peers_parser
from densa_bench.speculative.cli import add_speculative_parser

T = TypeVar("T")

BENCH_KV_CACHE_MEMORY = "2GiB"  # fixed, not a fraction of free memory: runs stay comparable


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Add `densa bench` with one sub-command per benchmark to the `densa` sub-commands."""
    parser = commands.add_parser(
        "bench",
        help="measure densa (and its peers) on this machine",
        description="Benchmarks: results go to docs/benchmarks/<name>/ as JSON, Markdown and PNG.",
    )
    benchmarks = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    _add_serving(benchmarks)
    _add_integrity(benchmarks)
    _add_load(benchmarks)
    _add_prefix(benchmarks)
    _add_tiers(benchmarks)
    _add_kv_sweep(benchmarks)
    _add_weights(benchmarks)
    _add_moe(benchmarks)
    _add_hostile(benchmarks)
    add_peers_parser(benchmarks)
    add_speculative_parser(benchmarks)
    _add_structured(benchmarks)
    _add_router(benchmarks)
    _add_step_bytes(benchmarks)
    _add_disagg(benchmarks)
    parser.set_defaults(handler=lambda ns: _print_help(parser))


def _wave_args(
    parser: argparse.ArgumentParser,
    concurrency: list[int],
    *,
    prompt_len: int,
    output_len: int,
    repeats: int,
    name: str,
) -> argparse._ArgumentGroup:
    """The options every wave benchmark shares; returns the group for benchmark-specific ones."""
    g = parser.add_argument_group("benchmark")
    g.add_argument("--concurrency", type=int, nargs="+", default=concurrency, help="requests/wave")
    g.add_argument("--prompt-len", type=int, default=prompt_len, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=output_len, help="output tokens (EOS ignored)")
    g.add_argument("--repeats", type=int, default=repeats, help="timed waves per variant and level")
    g.add_argument("--warmup", type=int, default=1, help="untimed waves per variant first")
    g.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--out", type=Path, default=Path(f"docs/benchmarks/{name}"), help="folder")
    return g


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _add_serving(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "serving",
        help="throughput and latency vs concurrency, densa vs transformers generate",
        description="Waves of concurrent requests (random prompts, fixed output length), densa "
        "vs Hugging Face transformers `generate` on the same weights, interleaved.",
    )
    g = _wave_args(parser, [1, 8, 32], prompt_len=256, output_len=128, repeats=3, name="serving")
    g.add_argument("--skip-hf", action="store_true", help="measure densa only")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_serving, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _add_integrity(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "integrity",
        help="cost of KV integrity checks: on vs off, interleaved",
        description="Long-prompt, long-output waves with --kv-integrity on and off, interleaved, "
        "plus a direct timing of the batched check on the same step shapes.",
    )
    _wave_args(parser, [1, 2, 4, 8], prompt_len=2048, output_len=256, repeats=3, name="integrity")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_integrity, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _add_disagg(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "disagg",
        help="co-located vs 1 prefill + 1 decode worker while long prompts keep arriving",
        description="Short requests decode while long prompts arrive: one co-located engine "
        "(2 threads) vs a prefill and a decode worker (1 core each), same formats and the "
        "reference split (prefill BF16 KV, decode INT4 + FP8 KV), interleaved.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--num-decoders", type=int, default=16, help="short requests decoding")
    g.add_argument("--decoder-prompt-len", type=int, default=64)
    g.add_argument("--decoder-output-len", type=int, default=96)
    g.add_argument("--num-long", type=int, default=3, help="long prompts arriving meanwhile")
    g.add_argument("--long-prompt-len", type=int, default=2048)
    g.add_argument("--long-output-len", type=int, default=8)
    g.add_argument("--long-interval", type=float, default=1.5, help="seconds between long ones")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per variant")
    g.add_argument("--prompt-seed", type=int, default=0)
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/disagg"), help="folder")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_disagg, kv_cache_memory="1GiB")


def _disagg(ns: argparse.Namespace) -> int:
    from densa_bench.disagg.runner import DisaggSettings, run_disagg

    settings = _settings(
        "disagg",
        lambda: DisaggSettings(
            num_decoders=ns.num_decoders,
            decoder_prompt_len=ns.decoder_prompt_len,
            decoder_output_len=ns.decoder_output_len,
            num_long=ns.num_long,
            long_prompt_len=ns.long_prompt_len,
            long_output_len=ns.long_output_len,
            long_interval_s=ns.long_interval,
            repeats=ns.repeats,
            prompt_seed=ns.prompt_seed,
        ),
    )
    if settings is None:
        return 2
    return _write(run_disagg(settings, EngineArgs.from_cli(ns)), ns.out)


def _add_kv_sweep(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "kv-sweep",
        help="BF16 vs FP8 KV cache under one fixed KV budget, concurrency 1..64",
        description="Waves of long requests at each concurrency, one engine per KV dtype with "
        "the same KV memory in bytes, interleaved: throughput, admission, preemptions, latency.",
    )
    g = _wave_args(
        parser, [1, 8, 16, 32, 64], prompt_len=1024, output_len=128, repeats=2, name="kv_sweep"
    )
    g.add_argument(
        "--budget-requests",
        type=float,
        default=16.5,
        help="KV budget in BF16 requests of prompt+output tokens (16.5: BF16 fits 16, FP8 32)",
    )
    g.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "fp8_e4m3"])
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_kv_sweep)


def _kv_sweep(ns: argparse.Namespace) -> int:
    from densa_bench.kv_sweep.runner import KVSweepSettings, run_kv_sweep

    settings = _settings(
        "kv-sweep",
        lambda: KVSweepSettings(
            concurrency=tuple(ns.concurrency),
            prompt_len=ns.prompt_len,
            output_len=ns.output_len,
            budget_requests=ns.budget_requests,
            kv_dtypes=tuple(ns.kv_dtypes),
            repeats=ns.repeats,
            warmup=ns.warmup,
            prompt_seed=ns.prompt_seed,
        ),
    )
    if settings is None:
        return 2
    return _write(run_kv_sweep(settings, EngineArgs.from_cli(ns)), ns.out)


def _integrity(ns: argparse.Namespace) -> int:
    from densa_bench.integrity.runner import IntegritySettings, run_integrity

    settings = IntegritySettings(
        concurrency=tuple(ns.concurrency),
        prompt_len=ns.prompt_len,
        output_len=ns.output_len,
        repeats=ns.repeats,
        warmup=ns.warmup,
        prompt_seed=ns.prompt_seed,
    )
    if _settings("integrity", settings.serving) is None:  # validates the shared fields
        return 2
    report = run_integrity(settings, EngineArgs.from_cli(ns))
    return _write(report, ns.out)


def _settings(command: str, build: Callable[[], T]) -> T | None:
    """`build()`, or None after printing why its values are invalid (the caller exits 2)."""
    try:
        return build()
    except ValueError as exc:
        print(f"densa bench {command}: {exc}", file=sys.stderr)
        return None


def _write(report: Any, out: Path) -> int:
    paths = report.write(out)
    for table in report.tables:
        print(table.to_markdown() + "\n")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _serving(ns: argparse.Namespace) -> int:
    from densa_bench.serving.runner import ServingSettings, run_serving

    settings = _settings(
        "serving",
        lambda: ServingSettings(
            concurrency=tuple(ns.concurrency),
            prompt_len=ns.prompt_len,
            output_len=ns.output_len,
            repeats=ns.repeats,
            warmup=ns.warmup,
            prompt_seed=ns.prompt_seed,
            include_hf=not ns.skip_hf,
        ),
    )
    if settings is None:
        return 2
    return _write(run_serving(settings, EngineArgs.from_cli(ns)), ns.out)


def _add_hostile(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "hostile",
        help="a normal request's latency while oversized prompts keep arriving",
        description="Quiet and hostile phases, interleaved: a client sends short chat requests "
        "one after another while (in hostile phases) other processes keep sending prompts far "
        "too long for the context. Reports the latency ratio and what the hostile ones got.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--hostile-clients", type=int, default=8)
    g.add_argument("--hostile-bytes", type=int, default=4_000_000, help="text per hostile prompt")
    g.add_argument("--requests-per-phase", type=int, default=8)
    g.add_argument("--repeats", type=int, default=3, help="quiet + hostile phase pairs")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/hostile"))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_hostile, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _hostile(ns: argparse.Namespace) -> int:
    from densa_bench.hostile.runner import HostileSettings, run_hostile_bench

    settings = _settings(
        "hostile",
        lambda: HostileSettings(
            num_hostile=ns.hostile_clients,
            hostile_bytes=ns.hostile_bytes,
            requests_per_phase=ns.requests_per_phase,
            repeats=ns.repeats,
        ),
    )
    if settings is None:
        return 2
    report = run_hostile_bench(settings, EngineArgs.from_cli(ns))
    return _write(report, ns.out)


def _add_load(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "load",
        help="many concurrent streaming clients, some leaving early: nothing lost, nothing leaked",
        description="N streaming clients at once on loopback (mixed prompt lengths, some "
        "disconnecting, some cancelled); checks every request ended cleanly, every KV page is "
        "free afterwards and /metrics agrees with the clients. Exit status 1 if not.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--clients", type=int, default=64)
    g.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 128, 512, 1024])
    g.add_argument("--shared-prefix-len", type=int, default=48, help="half the clients share it")
    g.add_argument("--max-tokens", type=int, default=32, help="for clients that read it all")
    g.add_argument("--long-max-tokens", type=int, default=256, help="for clients that leave")
    g.add_argument("--disconnect-fraction", type=float, default=0.15)
    g.add_argument("--cancel-fraction", type=float, default=0.15)
    g.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole run")
    g.add_argument("--plan-seed", type=int, default=0, help="seed of prompts and behaviours")
    g.add_argument("--url", default=None, help="a running server (default: start one here)")
    g.add_argument("--served-model", default=None, help="with --url (default: ask the server)")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/load"))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_load, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _load(ns: argparse.Namespace) -> int:
    from densa_bench.load.report import run_load_bench
    from densa_bench.load.runner import LoadSettings

    settings = _settings(
        "load",
        lambda: LoadSettings(
            num_clients=ns.clients,
            prompt_lens=tuple(ns.prompt_lens),
            shared_prefix_len=ns.shared_prefix_len,
            max_tokens=ns.max_tokens,
            long_max_tokens=ns.long_max_tokens,
            disconnect_fraction=ns.disconnect_fraction,
            cancel_fraction=ns.cancel_fraction,
            time_limit_s=ns.time_limit,
            seed=ns.plan_seed,
        ),
    )
    if settings is None:
        return 2
    report, problems = run_load_bench(settings, EngineArgs.from_cli(ns), ns.url, ns.served_model)
    _write(report, ns.out)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _add_prefix(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "prefix",
        help="TTFT with a cached prefix vs cold, and per turn of a multi-turn chat",
        description="Time to first token for requests sharing a cached prefix vs never-seen ones "
        "of the same length, and per turn of a chat with and without prefix reuse, interleaved.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--prefix-lens", type=int, nargs="+", default=[256, 512, 1024])
    g.add_argument("--suffix-len", type=int, default=32, help="new tokens after the prefix")
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--turns", type=int, default=8, help="turns per conversation")
    g.add_argument("--system-len", type=int, default=256, help="tokens of the first turn")
    g.add_argument("--user-len", type=int, default=64, help="tokens each user message adds")
    g.add_argument("--answer-len", type=int, default=32, help="tokens each answer adds")
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--prompt-seed", type=int, default=0)
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/prefix"))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_prefix, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _add_tiers(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "tiers",
        help="KV tiers (off / disk / shared Redis) under agent sessions, one and two workers",
        description="Agent-like sessions (long tool-schema system prompts, growing history) "
        "that the device pool cannot all keep: hit rate vs the ceiling, returning-turn TTFT and "
        "throughput with the KV tiers off, on a local disk and in a shared redis-server.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--num-sessions", type=int, default=8)
    g.add_argument("--num-turns", type=int, default=3)
    g.add_argument("--system-tokens", type=int, default=2048, help="tool schemas per session")
    g.add_argument("--user-tokens", type=int, default=48, help="tokens each user message adds")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens each answer adds")
    g.add_argument("--pool-share", type=float, default=0.25,
                   help="share of the live sessions' contexts the device pool holds")  # fmt: skip
    g.add_argument("--workers", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    g.add_argument("--variants", nargs="+", default=["off", "disk", "shared"],
                   choices=["off", "disk", "shared"])  # fmt: skip
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/tiers"))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_tiers)


def _tiers(ns: argparse.Namespace) -> int:
    from densa_bench.tiers.runner import TiersSettings, run_tiers

    settings = _settings(
        "tiers",
        lambda: TiersSettings(
            num_sessions=ns.num_sessions,
            num_turns=ns.num_turns,
            system_tokens=ns.system_tokens,
            user_tokens=ns.user_tokens,
            max_tokens=ns.max_tokens,
            pool_share=ns.pool_share,
            workers=tuple(ns.workers),
            variants=tuple(ns.variants),
        ),
    )
    if settings is None:
        return 2

    def save(report: Any) -> None:  # after each configuration: a cut-short run keeps them
        report.write(ns.out)

    return _write(run_tiers(settings, EngineArgs.from_cli(ns), on_config=save), ns.out)


def _prefix(ns: argparse.Namespace) -> int:
    from densa_bench.prefix.runner import PrefixSettings, run_prefix

    settings = _settings(
        "prefix",
        lambda: PrefixSettings(
            prefix_lens=tuple(ns.prefix_lens),
            suffix_len=ns.suffix_len,
            repeats=ns.repeats,
            turns=ns.turns,
            system_len=ns.system_len,
            user_len=ns.user_len,
            answer_len=ns.answer_len,
            warmup=ns.warmup,
            seed=ns.prompt_seed,
        ),
    )
    if settings is None:
        return 2
    engine_args = EngineArgs.from_cli(ns)
    if not engine_args.enable_prefix_caching:
        print("densa bench prefix: it measures the prefix cache; drop --no-enable-prefix-caching")
        return 2
    return _write(run_prefix(settings, engine_args), ns.out)


def _add_weights(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "weights",
        help="BF16 vs FP8 vs INT4 weights: sizes, prefill tok/s, decode tok/s by concurrency",
        description="Converts --model to each weight format once (cached in --work-dir), loads "
        "one engine per format, and measures prefill and decode throughput interleaved.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument(
        "--formats",
        nargs="+",
        default=["bf16", "fp8", "int4", "bf16+int4"],
        help="bf16, fp8, int4, and bf16+int4 (phase-aware: bf16 prefill, int4 decode)",
    )
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    g.add_argument("--prefill-len", type=int, default=1024, help="prompt tokens, prefill test")
    g.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, decode waves")
    g.add_argument("--output-len", type=int, default=64, help="output tokens, decode waves")
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--int4-group-size", type=int, default=128, choices=[32, 64, 128])
    g.add_argument("--int4-symmetric", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--work-dir", type=Path, default=None, help="where converted checkpoints go")
    g.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--prompt-seed", type=int, default=0)
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/weights"))
    EngineArgs.add_cli_args(parser)
    # One engine per format in one process: a fixed 1 GiB KV each (c=64 x 128 tokens ~ 0.4 GiB).
    parser.set_defaults(handler=_weights, kv_cache_memory="1GiB", max_num_batched_tokens=1024)


def _weights(ns: argparse.Namespace) -> int:
    from densa_bench.weights.runner import WeightsSettings, run_weights

    settings = _settings(
        "weights",
        lambda: WeightsSettings(
            formats=tuple(ns.formats),
            concurrency=tuple(ns.concurrency),
            prefill_len=ns.prefill_len,
            prompt_len=ns.prompt_len,
            output_len=ns.output_len,
            repeats=ns.repeats,
            int4_group_size=ns.int4_group_size,
            int4_symmetric=ns.int4_symmetric,
            profile=ns.profile,
            prompt_seed=ns.prompt_seed,
            **({"work_dir": ns.work_dir} if ns.work_dir is not None else {}),
        ),
    )
    if settings is None:
        return 2
    return _write(run_weights(settings, EngineArgs.from_cli(ns)), ns.out)


def _add_moe(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "moe",
        help="BF16 vs INT4 experts on a random ~1B-parameter MoE made locally",
        description="Writes a random Qwen3-MoE-shaped checkpoint (once, in --work-dir), then "
        "runs the weights benchmark on it: sizes, prefill tok/s, decode tok/s by concurrency.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--formats", nargs="+", default=["bf16", "int4"], help="as in bench weights")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    g.add_argument("--prefill-len", type=int, default=512, help="prompt tokens, prefill test")
    g.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, decode waves")
    g.add_argument("--output-len", type=int, default=32, help="output tokens, decode waves")
    g.add_argument("--repeats", type=int, default=3)
    m = parser.add_argument_group("the random model (Qwen3-MoE shape)")
    m.add_argument("--num-layers", type=int, default=12)
    m.add_argument("--hidden-size", type=int, default=1024, help="a multiple of 256")
    m.add_argument("--num-experts", type=int, default=64)
    m.add_argument("--top-k", type=int, default=8, help="experts per token")
    m.add_argument("--expert-intermediate-size", type=int, default=384)
    g.add_argument("--work-dir", type=Path, default=None, help="model and checkpoints (cached)")
    g.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/moe"))
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_moe, kv_cache_memory="1GiB", max_num_batched_tokens=1024)


def _moe(ns: argparse.Namespace) -> int:
    from densa_bench.moe.runner import MoeShape, run_moe
    from densa_bench.weights.runner import WeightsSettings

    def build() -> tuple[MoeShape, WeightsSettings]:
        shape = MoeShape(
            hidden_size=ns.hidden_size, num_layers=ns.num_layers, num_experts=ns.num_experts,
            top_k=ns.top_k, expert_intermediate_size=ns.expert_intermediate_size,
        )  # fmt: skip
        settings = WeightsSettings(
            formats=tuple(ns.formats), concurrency=tuple(ns.concurrency),
            prefill_len=ns.prefill_len, prompt_len=ns.prompt_len, output_len=ns.output_len,
            repeats=ns.repeats, profile=ns.profile,
            **({"work_dir": ns.work_dir} if ns.work_dir is not None else {}),
        )  # fmt: skip
        return shape, settings

    built = _settings("moe", build)
    if built is None:
        return 2
    return _write(run_moe(*built, EngineArgs.from_cli(ns)), ns.out)


def _add_structured(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "structured",
        help="cost of grammar-constrained decoding (JSON schemas) per decode step",
        description="Waves of JSON-schema-constrained chat requests: token-bitmask fill and "
        "apply time as a share of the decode step, interleaved with unconstrained waves; "
        "grammar compile times cold and cached.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests/wave")
    g.add_argument("--max-tokens", type=int, default=160, help="cap on each answer")
    g.add_argument("--repeats", type=int, default=3, help="timed waves per variant and level")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/structured"), help="folder")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_structured, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _structured(ns: argparse.Namespace) -> int:
    from densa_bench.structured.runner import StructuredSettings, run_structured

    settings = _settings(
        "structured",
        lambda: StructuredSettings(
            concurrency=tuple(ns.concurrency), max_tokens=ns.max_tokens, repeats=ns.repeats
        ),
    )
    if settings is None:
        return 2
    return _write(run_structured(settings, EngineArgs.from_cli(ns)), ns.out)


def _add_router(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "router",
        help="routing policies over 3 local workers: prefix hit rate, TTFT, router latency",
        description="Three `densa serve` workers (1 thread each) behind `densa router` with each "
        "policy in turn (round-robin, least-load, prefix, densa), interleaved: multi-tenant "
        "multi-turn chat with shared system prompts and sessions.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--tenant-sessions", type=int, nargs="+", default=[6, 2, 1],
                   help="sessions per tenant (one number per tenant)")  # fmt: skip
    g.add_argument("--turns", type=int, default=6, help="turns per session")
    g.add_argument("--system-words", type=int, default=100, help="words per system prompt")
    g.add_argument("--user-words", type=int, default=60, help="words per user message")
    g.add_argument("--max-tokens", type=int, default=24, help="output tokens per turn")
    g.add_argument("--stagger", type=float, default=1.0, help="seconds between session starts")
    g.add_argument("--repeats", type=int, default=2, help="runs per policy (interleaved)")
    g.add_argument("--latency-probes", type=int, default=40, help="direct/routed request pairs")
    g.add_argument("--model", default=None, help="the workers' model (default: the bundled one)")
    g.add_argument("--kv-cache-memory", default="512MiB", help="KV budget per worker")
    g.add_argument("--work-dir", type=Path, default=Path("/tmp/densa-bench-router"),
                   help="worker and router logs")  # fmt: skip
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/router"), help="folder")
    parser.set_defaults(handler=_router)


def _router(ns: argparse.Namespace) -> int:
    from densa_bench.router.runner import RouterBenchSettings, run_router_bench

    settings = _settings(
        "router",
        lambda: RouterBenchSettings(
            tenant_sessions=tuple(ns.tenant_sessions), turns=ns.turns,
            system_words=ns.system_words, user_words=ns.user_words, max_tokens=ns.max_tokens,
            stagger_s=ns.stagger,
            repeats=ns.repeats, latency_probes=ns.latency_probes,
            kv_cache_memory=ns.kv_cache_memory, model=ns.model,
        ),
    )  # fmt: skip
    if settings is None:
        return 2
    return _write(run_router_bench(settings, ns.work_dir), ns.out)


def _add_step_bytes(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "step-bytes",
        help="bytes per step of the scheduler -> runner contract: deltas vs whole snapshots",
        description="One run of --concurrency requests; every step's SchedulerOutput encoded "
        "with msgpack, next to the whole per-request snapshot the previous contract sent.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--concurrency", type=int, default=32, help="requests in the run")
    g.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/step_bytes"), help="folder")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=_step_bytes, kv_cache_memory=BENCH_KV_CACHE_MEMORY)


def _step_bytes(ns: argparse.Namespace) -> int:
    from densa_bench.step_bytes.runner import StepBytesSettings, run_step_bytes

    settings = _settings(
        "step-bytes",
        lambda: StepBytesSettings(
            concurrency=ns.concurrency, prompt_len=ns.prompt_len, output_len=ns.output_len
        ),
    )
    if settings is None:
        return 2
    return _write(run_step_bytes(settings, EngineArgs.from_cli(ns)), ns.out)
