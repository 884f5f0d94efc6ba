"""`densa bench peers`: the command line, and turning its options into a run. Building the parser
imports no torch."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILT_LLAMA_SERVER = REPO_ROOT / ".peers" / "bin" / "llama-server"  # scripts/setup.sh peers


def add_peers_parser(benchmarks: argparse._SubParsersAction) -> None:
    from densa_bench.peers.specs import DEFAULT_PEERS, PEERS

    parser = benchmarks.add_parser(
        "peers",
        help="densa's server vs llama.cpp's llama-server vs transformers serve, side by side",
        description="Starts each peer's own OpenAI-compatible server on the same model, sends "
        "the same streamed requests through one openai-client load generator, interleaved, and "
        "reports throughput, TTFT / TPOT / ITL, peak RSS and the ratios the CPU goals name.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--peers", nargs="+", default=list(DEFAULT_PEERS), choices=list(PEERS))
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    g.add_argument("--prompt-len", type=int, nargs="+", default=[300],
                   help="prompt tokens per request; several lengths run interleaved")  # fmt: skip
    g.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    g.add_argument("--repeats", type=int, default=2)
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--wave-timeout", type=float, default=1800.0,
                   help="seconds a wave may take (a 32k prefill takes minutes here)")  # fmt: skip
    g.add_argument("--prompt-seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="per server (default: all CPUs)")
    g.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2)")
    g.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's server binary")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/peers"))
    parser.set_defaults(handler=_peers)


def find_llama_server(given: Path | None) -> Path | None:
    if given is not None:
        return given
    if BUILT_LLAMA_SERVER.exists():
        return BUILT_LLAMA_SERVER
    found = shutil.which("llama-server")
    return Path(found) if found else None


def _peers(ns: argparse.Namespace) -> int:
    from densa.model.catalog import resolve_model_arg
    from densa.model.loader import resolve_model_dir
    from densa.quant.calibration_data import lambada_passages
    from densa.setup.args import default_model_path
    from densa.text.tokenizer import Tokenizer
    from densa.utils.cpu import usable_cpus
    from densa_bench.peers.report import build_report
    from densa_bench.peers.runner import PeersSettings, PromptMaker, report_settings, run_peers
    from densa_bench.peers.specs import PeerContext, build_specs

    try:
        lengths = tuple(ns.prompt_len)
        settings = PeersSettings(
            concurrency=tuple(ns.concurrency), prompt_len=lengths[0],
            prompt_lens=lengths if len(lengths) > 1 else (),
            output_len=ns.output_len, repeats=ns.repeats, warmup=ns.warmup,
            prompt_seed=ns.prompt_seed, threads=ns.threads or usable_cpus(),
            wave_timeout_s=ns.wave_timeout,
        )  # fmt: skip
        gguf = Path(resolve_model_arg(ns.model) if ns.model else default_model_path())
        hf_dir = resolve_model_dir(str(gguf))
        ctx = PeerContext(
            gguf=gguf, hf_dir=hf_dir,
            llama_server=find_llama_server(ns.llama_server), threads=settings.threads,
            max_concurrency=max(settings.concurrency),
            context_len=max(settings.lengths) + settings.output_len + 64,
            output_len=settings.output_len,
        )  # fmt: skip
        specs = build_specs(ns.peers, ctx)
    except (ValueError, OSError) as exc:
        print(f"densa bench peers: {exc}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_dir(hf_dir)
    prompts = PromptMaker(
        lambada_passages(),
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        tokenizer.decode,
        settings,
    )
    waves, peers = run_peers(specs, settings, prompts, ns.out / "logs")
    extra = {"model": str(gguf), "prompts": "LAMBADA passages, distinct per request and wave"}
    report = build_report(waves, peers, report_settings(settings, extra))
    paths = report.write(ns.out)
    for table in report.tables:
        print(table.to_markdown() + "\n")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
