"""`densa capacity` (what a KV budget holds per KV dtype) and `densa calibrate-kv` (static FP8
KV scales from real text). Building the parsers imports no torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from densa.model.arch import ArchConfig
    from densa.model.kv_pages import KVCapacity
    from densa.text.tokenizer import Tokenizer

# (KV dtype, FP8 scale policy) rows of `densa capacity`, BF16 first: the ratio column divides by
# it. Plain pairs (KVFormat.of builds each), so building the parsers imports no torch.
CAPACITY_FORMATS = [
    ("bfloat16", "dynamic"),
    ("float32", "dynamic"),
    ("float16", "dynamic"),
    ("fp8_e4m3", "dynamic"),
    ("fp8_e4m3", "static"),
    ("int8", "dynamic"),
]
DEFAULT_SCALES_FILE = "kv_scales.json"
GPUS_BY_NAME = ("h100", "h200")  # densa.offline.deployment.GPUS (no torch import here)


def add_kv_parsers(commands: argparse._SubParsersAction) -> None:
    _add_capacity(commands)
    _add_calibrate(commands)


# ---- densa capacity ----------------------------------------------------------------------------
def _add_capacity(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "capacity",
        help="KV cache capacity per KV dtype: bytes per token, resident tokens, requests",
        description="How many tokens and requests a KV cache budget holds in each KV dtype "
        "(exact arithmetic over the model's shape; nothing is loaded but its config).",
    )
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled)")
    parser.add_argument("--kv-cache-memory", default="4GiB", help="the budget, e.g. '4GiB'")
    parser.add_argument(
        "--context-len", type=int, default=2048, help="tokens per request (prompt + output)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    deployment = parser.add_argument_group(
        "a deployment (--gpu): weights per GPU in bf16 / fp8 / int4 and the KV tokens the rest "
        "holds per KV dtype, from a config.json alone (densa.offline.deployment)"
    )
    deployment.add_argument(
        "--config", default=None, help="a config.json (or its directory); no weights needed"
    )
    deployment.add_argument("--gpu", default=None, choices=sorted(GPUS_BY_NAME))
    deployment.add_argument("--gpu-memory", default=None, help="instead of --gpu's, e.g. 141GB")
    deployment.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    deployment.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU used"
    )
    deployment.add_argument(
        "--reserve", default="4GiB", help="per GPU, kept for activations and CUDA graphs"
    )
    parser.set_defaults(handler=_capacity)


def _capacity(ns: argparse.Namespace) -> int:
    from densa.formats.kv_format import KVFormat
    from densa.model.arch import ArchConfig
    from densa.model.kv_pages import kv_capacity
    from densa.model.loader import resolve_model_dir
    from densa.setup.args import default_model_path
    from densa.utils.sizes import parse_memory

    if ns.gpu is not None or ns.gpu_memory is not None:
        return _deployment(ns)
    budget = parse_memory(ns.kv_cache_memory)
    if not isinstance(budget, int):
        print("densa capacity: give --kv-cache-memory in bytes, e.g. '4GiB'", file=sys.stderr)
        return 2
    if ns.context_len < 1 or ns.page_size < 1:
        print("densa capacity: --context-len and --page-size must be >= 1", file=sys.stderr)
        return 2
    arch = ArchConfig.from_dir(resolve_model_dir(ns.model or default_model_path()))
    formats = [KVFormat.of(name, policy) for name, policy in CAPACITY_FORMATS]
    rows = [kv_capacity(arch, budget, ns.page_size, kv_format) for kv_format in formats]
    print(format_capacity(arch, rows, budget, ns.context_len))
    return 0


def _deployment(ns: argparse.Namespace) -> int:
    import json

    from densa.model.arch import ArchConfig
    from densa.offline import deployment
    from densa.utils.sizes import parse_memory

    if ns.config is None:
        print("densa capacity: --gpu needs --config (a config.json)", file=sys.stderr)
        return 2
    path = Path(ns.config)
    path = path / "config.json" if path.is_dir() else path
    gpu_bytes = parse_memory(ns.gpu_memory) if ns.gpu_memory else deployment.GPUS[ns.gpu]
    reserve = parse_memory(ns.reserve)
    if not isinstance(gpu_bytes, int) or not isinstance(reserve, int) or ns.tp < 1:
        print("densa capacity: give --gpu-memory / --reserve in bytes and --tp >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    cfg = json.loads(path.read_text())
    arch = ArchConfig.from_hf_dict(cfg)
    counts = deployment.count_parameters(cfg, arch)
    sizes = deployment.weight_sizes(counts, ns.tp)
    util = ns.gpu_memory_utilization
    rows = deployment.kv_rows(arch, sizes, gpu_bytes, util, reserve, ns.tp)
    gpu = ns.gpu or "GPU"
    print(deployment.format_deployment(path.parent.name, arch, counts, sizes, rows, gpu,
                                       gpu_bytes, util, reserve, ns.tp))  # fmt: skip
    return 0


def format_capacity(arch: ArchConfig, rows: list[KVCapacity], budget: int, context_len: int) -> str:
    """The `densa capacity` report: a header naming the shape and budget, then a Markdown table
    (rows[0] is the BF16 baseline of the last column)."""
    from densa.utils.sizes import format_bytes

    lines = [
        f"KV budget {format_bytes(budget)} ({budget} bytes), page {rows[0].page_size} tokens; "
        f"{_describe_kv_shape(arch)}",
        "",
        f"| KV dtype | scales | bytes/token | of which scales | pages | resident tokens "
        f"| requests @ {context_len} tokens | tokens vs bfloat16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.kv_dtype} | {row.kv_scales or '-'} | {row.bytes_per_token} "
            f"| {row.scale_bytes_per_token} | {row.num_pages} | {row.resident_tokens} "
            f"| {row.max_requests(context_len)} "
            f"| {row.resident_tokens / max(rows[0].resident_tokens, 1):.3f}x |"
        )
    return "\n".join(lines)


def _describe_kv_shape(arch: ArchConfig) -> str:
    if arch.mla is not None:  # one latent row per token and layer (densa.model.kv_layout)
        m = arch.mla
        return (
            f"{arch.num_layers} layers x MLA latent {m.latent_dim} values "
            f"(kv_lora_rank {m.kv_lora_rank} + rope {m.rope_head_dim}), no separate V"
            f"{'' if arch.dsa is None else ', + ' + arch.dsa.describe()}"
        )
    return f"{arch.num_layers} layers x {arch.num_kv_heads} KV heads x head_dim {arch.head_dim}"


# ---- densa calibrate-kv ------------------------------------------------------------------------
def _add_calibrate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "calibrate-kv",
        help="calibrate static per-layer FP8 KV scales over real text",
        description="Run real text through the model (high-precision KV cache), record each "
        "layer's max |K| and |V|, and save per-layer FP8 scales as JSON for "
        "`--kv-cache-dtype fp8_e4m3 --kv-scales static --kv-scales-file FILE`.",
    )
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--text",
        type=Path,
        default=None,
        help="a plain-text file to calibrate on (default: LAMBADA passages from the END of the "
        "set, disjoint from the start that `densa eval distribution` scores)",
    )
    parser.add_argument("--num-tokens", type=int, default=16384, help="tokens to run")
    parser.add_argument("--segment-len", type=int, default=1024, help="tokens per text")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_SCALES_FILE))
    parser.set_defaults(handler=_calibrate)


def _calibrate(ns: argparse.Namespace) -> int:
    from densa.engine.llm_engine import LLMEngine
    from densa.offline.kv_calibration import calibrate_kv_scales
    from densa.setup.args import EngineArgs
    from densa.utils.progress import progress

    if ns.num_tokens < 2 or ns.segment_len < 2:
        print("densa calibrate-kv: --num-tokens and --segment-len must be >= 2", file=sys.stderr)
        return 2
    args = EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        kv_cache_dtype="auto",  # observe K/V unquantized
        kv_cache_memory="512MiB",
        max_model_len=max(ns.segment_len, 2),
        enable_prefix_caching=False,
    )
    engine = LLMEngine.from_args(args)
    try:
        texts, description = _calibration_texts(engine.tokenizer, ns)
    except (OSError, ValueError) as exc:
        print(f"densa calibrate-kv: {exc}", file=sys.stderr)
        return 2
    with progress(sum(map(len, texts)), "calibrate-kv", "tok") as bar:
        scales = calibrate_kv_scales(engine, texts, description, on_text=bar.update)
    scales.save(ns.out)
    print(f"K scales per layer: {', '.join(f'{s:g}' for s in scales.k)}")
    print(f"V scales per layer: {', '.join(f'{s:g}' for s in scales.v)}")
    print(
        f"wrote {ns.out}; use it with --kv-cache-dtype fp8_e4m3 --kv-scales-file {ns.out} "
        "(implies --kv-scales static)"
    )
    return 0


def _calibration_texts(tokenizer: Tokenizer, ns: argparse.Namespace) -> tuple[list[list[int]], str]:
    """`--num-tokens` tokens cut into `--segment-len` texts, and a description of the source."""
    if ns.text is not None:
        stream = tokenizer.encode(ns.text.read_text(), add_special_tokens=False)
        description = str(ns.text)
    else:
        from densa.quant.calibration_data import TEXT_SOURCE, lambada_passages

        stream = []
        for passage in reversed(lambada_passages()):
            stream += tokenizer.encode(passage + "\n\n", add_special_tokens=False)
            if len(stream) >= ns.num_tokens:
                break
        description = f"{TEXT_SOURCE}, passages from the end of the set backwards"
    stream = stream[: ns.num_tokens]
    if len(stream) < 2:
        raise ValueError("the calibration text is empty")
    step = ns.segment_len
    return [stream[i : i + step] for i in range(0, len(stream), step)], description
