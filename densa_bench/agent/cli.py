"""`densa bench agent`: the command line, the engines it compares, and turning options into a run.
Building the parser imports no torch."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from densa_bench.peers.cli import find_llama_server
from densa_bench.peers.servers import PeerSpec

ENGINES = ("densa", "densa-deterministic", "densa-disk", "densa-nocache", "llama.cpp")


@dataclass(frozen=True)
class AgentContext:
    gguf: Path
    hf_dir: Path
    llama_server: Path | None
    threads: int
    num_sessions: int
    context_len: int  # tokens one session needs at its last turn (prompt + answer)
    kv_sessions: float  # sessions' whole contexts the KV memory holds

    @property
    def model_id(self) -> str:
        return self.gguf.stem

    @property
    def llama_kv_tokens(self) -> int:
        return int(self.kv_sessions * self.context_len)

    @property
    def kv_bytes(self) -> int:
        """llama-server's f16 K and V for its -c tokens: densa's pages get the same bytes."""
        config = json.loads((self.hf_dir / "config.json").read_text())
        kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return config["num_hidden_layers"] * kv_heads * head_dim * 2 * 2 * self.llama_kv_tokens


def add_agent_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "agent",
        help="coding-agent sessions replayed against densa and llama-server",
        description="N coding-agent sessions (committed synthetic traces: a shared ~2.5k-token "
        "system prompt with tool definitions, 10-12 turns, each a forced tool call and a "
        "500-2,000-token tool result) replayed at once, greedy, on a fresh server per engine "
        "and replay: tool-call validity, timeouts, turn TTFT, output tok/s, prefix hits and "
        "replay-to-replay consistency.",
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--engines", nargs="+", default=["densa", "densa-deterministic", "llama.cpp"],
                   choices=ENGINES)  # fmt: skip
    g.add_argument("--num-sessions", type=int, default=4)
    g.add_argument(
        "--kv-sessions",
        type=float,
        default=0.0,
        help="whole session contexts the KV memory holds (default: every session)",
    )
    g.add_argument("--replays", type=int, default=2, help="runs per engine (consistency)")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens a turn may answer")
    g.add_argument("--turn-timeout", type=float, default=300.0, help="seconds per turn")
    g.add_argument("--threads", type=int, default=None, help="per server (default: all CPUs)")
    g.add_argument("--model", default="qwen2.5-coder-1.5b", help="a .gguf file or catalog name")
    g.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's server binary")
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/agent"))
    parser.set_defaults(handler=_agent)


def _agent(ns: argparse.Namespace) -> int:
    from densa.model.catalog import resolve_model_arg
    from densa.model.loader import resolve_model_dir
    from densa.text.tokenizer import Tokenizer
    from densa.utils.cpu import usable_cpus
    from densa_bench.agent.report import build_report
    from densa_bench.agent.runner import AgentRun, EngineConfig, run_all
    from densa_bench.agent.traces import TOOLS, load_traces

    try:
        traces = load_traces(ns.num_sessions)
        gguf = Path(resolve_model_arg(ns.model))
        hf_dir = resolve_model_dir(str(gguf))
    except (ValueError, OSError) as exc:
        print(f"densa bench agent: {exc}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_dir(hf_dir)
    longest = max(len(tokenizer.encode_chat(t.messages(len(t.turns) - 1), TOOLS)) for t in traces)
    ctx = AgentContext(
        gguf, hf_dir, find_llama_server(ns.llama_server), ns.threads or usable_cpus(),
        ns.num_sessions, -(-(longest + ns.max_tokens + 64) // 256) * 256,
        ns.kv_sessions or ns.num_sessions,
    )  # fmt: skip
    configs = [EngineConfig(name, _BUILDERS[name](ctx)) for name in ns.engines]
    settings = {
        "num_sessions": ns.num_sessions, "kv_sessions": ctx.kv_sessions, "replays": ns.replays,
        "max_tokens": ns.max_tokens, "turn_timeout_s": ns.turn_timeout, "threads": ctx.threads,
        "model": str(gguf), "context_len": ctx.context_len, "longest_prompt": longest,
        "kv_bytes": ctx.kv_bytes, "engines": {c.name: " ".join(c.build(Path("DIR")).argv)
                                              for c in configs},
        "turns": [len(t.turns) for t in traces],
    }  # fmt: skip

    def save(runs: list[AgentRun]) -> None:  # after each run: a cut-short run keeps them
        build_report(runs, settings).write(ns.out)

    runs = run_all(configs, traces, ns.replays, ns.max_tokens, ns.turn_timeout,
                   ns.out / "logs", on_run=save)  # fmt: skip
    report = build_report(runs, settings)
    paths = report.write(ns.out)
    for table in report.tables:
        print(table.to_markdown() + "\n")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


# ---- the engines -----------------------------------------------------------------------------
SpecBuilder = Callable[[Path], PeerSpec]  # a run's scratch directory -> the server to start


def _densa(*extra: str, disk_tier: bool = False) -> Callable[[AgentContext], SpecBuilder]:
    """densa as scripts/serve.sh runs it (INT8 pages), in the KV bytes llama-server has."""

    def for_context(ctx: AgentContext) -> SpecBuilder:
        def build(scratch: Path) -> PeerSpec:
            kv_mib = -(-ctx.kv_bytes // 2**20)
            argv = [sys.executable, "-m", "densa.cli", "serve", "--port", "{port}",
                    "--model", str(ctx.gguf), "--served-model-name", ctx.model_id,
                    "--kv-cache-dtype", "int8", "--max-num-seqs", str(ctx.num_sessions),
                    "--max-model-len", str(ctx.context_len), "--kv-cache-memory", f"{kv_mib}MiB",
                    *extra]  # fmt: skip
            if disk_tier:
                argv += ["--kv-tier", f"disk:{scratch / 'kv-tier'}:16GiB"]
            return PeerSpec(name="", engine="densa", argv=tuple(argv), model=ctx.model_id,
                            env={"OMP_NUM_THREADS": str(ctx.threads)})  # fmt: skip

        return build

    return for_context


def _llama_cpp(ctx: AgentContext) -> SpecBuilder:
    """llama-server with a slot per session and its prompt cache (defaults: cache_prompt on,
    --cache-ram 8 GiB of host memory for slots' saved prompts)."""

    def build(scratch: Path) -> PeerSpec:
        if ctx.llama_server is None or not ctx.llama_server.exists():
            raise FileNotFoundError(
                "llama-server not found: build it with `scripts/setup.sh peers`"
            )
        argv = [str(ctx.llama_server), "-m", str(ctx.gguf), "--host", "127.0.0.1",
                "--port", "{port}", "-t", str(ctx.threads), "-tb", str(ctx.threads),
                "-np", str(ctx.num_sessions), "-c", str(ctx.llama_kv_tokens), "--jinja",
                "--alias", ctx.model_id, "--no-webui"]  # fmt: skip
        # Slots share one pool when it cannot give each session its whole context.
        argv.append("-kvu" if ctx.kv_sessions < ctx.num_sessions else "-no-kvu")
        return PeerSpec(name="", engine="llama.cpp", argv=tuple(argv), model=ctx.model_id,
                        ready_path="/health")  # fmt: skip

    return build


_BUILDERS: dict[str, Callable[[AgentContext], SpecBuilder]] = {
    "densa": _densa(),
    "densa-deterministic": _densa("--deterministic"),
    "densa-disk": _densa(disk_tier=True),
    "densa-nocache": _densa("--no-enable-prefix-caching"),
    "llama.cpp": _llama_cpp,
}
