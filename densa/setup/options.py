"""The engine's command-line options (`densa serve`, `densa generate`, bench, eval), one short
function per group; the defaults come from EngineArgs, the choices from densa.config."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from densa.config import (
    ATTENTION_BACKENDS,
    AUTO_KV_MAX_FRACTION,
    DEFAULT_KV_SCALES,
    DTYPE_CHOICES,
    HEAD_FORMATS,
    KV_CACHE_DTYPES,
    KV_SCALE_POLICIES,
    ROLES,
    SPECULATIVE_METHODS,
    WEIGHT_FORMATS,
)
from densa.model.catalog import CATALOG

if TYPE_CHECKING:
    from densa.setup.args import EngineArgs


def add_engine_options(parser: argparse.ArgumentParser, d: EngineArgs) -> None:
    """Every EngineArgs field as an option of one "engine" group, defaults from `d`."""
    g = parser.add_argument_group("engine")
    _model_options(g, d)
    _kv_cache_options(g, d)
    _scheduling_options(g, d)
    _weight_options(g, d)
    _device_options(g, d)
    _disagg_options(g, d)
    _tier_options(g)
    _memory_check_option(g, d)
    _speculative_options(g, d)


def _model_options(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """The model, its name for clients, its compute dtype and context."""
    g.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or a named model ("
        + ", ".join(model.name for model in CATALOG)
        + "; scripts/setup.sh models) (default: bundled SmolLM2-135M)",
    )
    g.add_argument(
        "--served-model-name", default=None, nargs="+", metavar="NAME",
        help="model id clients use (default: file name); `densa serve` also accepts the "
        "names after the first as aliases",
    )  # fmt: skip
    g.add_argument("--dtype", default=d.dtype, choices=list(DTYPE_CHOICES))
    g.add_argument(
        "--max-model-len", type=int, default=None, help="tokens per request (prompt + output)"
    )


def _kv_cache_options(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """The KV cache: its size, format and page checks."""
    g.add_argument(
        "--kv-cache-memory",
        default=d.kv_cache_memory,
        help="KV cache size: bytes like '2GiB', a share of the memory free after loading "
        "like '0.3' or '30%%', or auto (default): room for --max-num-seqs requests of "
        f"--max-model-len tokens, at most {AUTO_KV_MAX_FRACTION * 100:.0f}%% of free memory",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=list(KV_CACHE_DTYPES),
    )
    g.add_argument(
        "--index-kv-dtype",
        default=d.index_kv_dtype,
        choices=list(KV_CACHE_DTYPES),
        help="sparse attention (DeepSeek-V3.2, GLM-5): the index keys' dtype; auto (default): "
        "the pages' (FP8 pages hold FP8 keys with a scale per 128 values)",
    )
    g.add_argument(
        "--kv-scales",
        default=d.kv_scales,
        choices=list(KV_SCALE_POLICIES),
        help="FP8 KV scales: per token and head (dynamic) or per layer from --kv-scales-file "
        f"(static; 1.0 without a file). auto: static if a file is given, else "
        f"{DEFAULT_KV_SCALES}",
    )
    g.add_argument(
        "--kv-scales-file",
        default=None,
        help="JSON file of static per-layer FP8 KV scales, made by `densa calibrate-kv`",
    )
    g.add_argument(
        "--num-kv-pages",
        type=int,
        default=None,
        help="exact number of KV pages (overrides --kv-cache-memory)",
    )
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
    )
    g.add_argument(
        "--kv-integrity",
        choices=["on", "off"],
        default="on" if d.kv_integrity else "off",
        help="check KV page generation tags before every read and write",
    )


def _scheduling_options(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """How much work one step takes, and how much may wait."""
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="requests in flight per step"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens per step",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="queue bound (then 429)",
    )


def _weight_options(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """The formats the weights execute in, per phase."""
    g.add_argument(
        "--weight-format",
        default=d.weight_format,
        choices=list(WEIGHT_FORMATS),
        help="linear weights: as stored (auto: a GGUF's Q4_1 layers as w4a8, a densa "
        "checkpoint's own format, else dense), dequantized (dense), or quantized at load "
        "time by round-to-nearest (int4 g128 symmetric, fp8 128x128 blocks; w4a8 / w8a8 / "
        "w8: 4-/8-bit groups of 32 on densa's CPU kernels, see docs/weights.md)",
    )
    g.add_argument(
        "--head-format",
        default=d.head_format,
        choices=list(HEAD_FORMATS),
        help="the output head (also when tied to the embedding): dense, w8a8 (int8 "
        "activations), w8 (float activations), or auto: a GGUF's Q8_0 head as w8",
    )
    g.add_argument(
        "--decode-weight-format",
        default=None,
        choices=list(WEIGHT_FORMATS),
        help="phase-aware from one checkpoint: decode steps run through a second copy of "
        "--model in this format (e.g. w4a8), prefill through --weight-format",
    )
    g.add_argument(
        "--decode-model",
        default=None,
        help="a checkpoint of the same model (e.g. INT4 from densa quantize) that decode "
        "steps run through; prefill keeps --model's weights; one shared KV cache",
    )


def _device_options(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """Where the engine runs and how its steps execute there."""
    g.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=list(ATTENTION_BACKENDS),
        help="auto: Numba kernels on the CPU, Triton kernels on a GPU",
    )
    g.add_argument(
        "--device",
        default=d.device,
        help="where weights, KV pages and the tag table live: cpu, cuda or cuda:N",
    )
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=d.cuda_graphs,
        help="on a GPU, replay decode steps from CUDA graphs (batch sizes up to 64)",
    )
    g.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=d.fused_decode,
        help="run decode-only steps through the fused C++ step where it runs (float32 "
        "compute, dense / w4a8 / w8a8 weights, CPU; otherwise the eager model)",
    )
    g.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=d.deterministic,
        help="bit-identical tokens and logprobs whatever the batch, the prompt's chunks and the "
        "prefix-cache state: every prompt row attends as a decode row does (CPU, float32, a "
        "model the fused C++ step runs; prompts cost more: docs/architecture.md)",
    )
    g.add_argument("--seed", type=int, default=d.seed)


def _disagg_options(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """Prefill/decode disaggregation and the internal plane's credential."""
    g.add_argument(
        "--role", default=d.role, choices=list(ROLES),
        help="both: prefill and decode here (default); prefill: also run prompts for decode "
        "workers and hand them the KV pages; decode: take requests whose x-densa-prefill "
        "header names a prefill worker, and decode them with its pages",
    )  # fmt: skip
    g.add_argument(
        "--kv-listen", default=d.kv_listen,
        help="prefill role: the ZeroMQ address decode workers connect to (port 0: any free)",
    )  # fmt: skip
    g.add_argument(
        "--kv-transfer-timeout", type=float, default=d.kv_transfer_timeout,
        help="seconds a KV transfer may stay in any one state (then it fails, pages freed)",
    )  # fmt: skip
    g.add_argument(
        "--cluster-secret-file", default=d.cluster_secret_file, metavar="FILE",
        help="the cluster secret shared by the router and the workers (else the environment "
        "variable DENSA_CLUSTER_SECRET): authenticates the KV link and the router's signed "
        "placements; --role prefill and --role decode need it",
    )  # fmt: skip


def _tier_options(g: argparse._ArgumentGroup) -> None:
    """KV tiers below the device pool."""
    g.add_argument(
        "--kv-tier", dest="kv_tiers", action="append", default=None, metavar="TIER",
        help="keep full prefix pages below the device too, repeatable, in tier order: "
        "host:SIZE (this process's memory, below a GPU's pool, e.g. host:32GiB), "
        "disk:PATH:SIZE (files under PATH, at most SIZE, e.g. disk:/var/densa-kv:20GiB) or "
        "shared:redis://HOST:PORT[/DB] (a Redis server all workers reach; needs the cluster "
        "secret). Every block read back is verified; a failing one is a miss",
    )  # fmt: skip
    g.add_argument(
        "--kv-tier-password-file", default=None, metavar="FILE",
        help="a file holding the shared tier's Redis password (else the environment variable "
        "DENSA_KV_TIER_PASSWORD); keeps it out of the URL, which `ps` shows to every user",
    )  # fmt: skip


def _memory_check_option(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """The memory check before loading."""
    g.add_argument(
        "--skip-memory-check", action="store_true", default=d.skip_memory_check,
        help="start even if the weights, KV cache and activations look larger than the "
        "available memory (also DENSA_SKIP_MEMORY_CHECK=1)",
    )  # fmt: skip


def _speculative_options(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """Speculative decoding (docs/speculative.md)."""
    g.add_argument(
        "--speculative-method", default=None, choices=list(SPECULATIVE_METHODS),
        help="speculative decoding (docs/speculative.md): ngram = prompt lookup, draft = a "
        "small model of the same tokenizer (--speculative-model), mtp = the checkpoint's "
        "multi-token-prediction layer, ngram+draft = prompt lookup, the draft model where it "
        "finds nothing; greedy and sampled outputs keep their distribution",
    )  # fmt: skip
    g.add_argument(
        "--speculative-model", default=None, metavar="PATH_OR_NAME",
        help="the draft model for speculative decoding (implies --speculative-method draft)",
    )  # fmt: skip
    g.add_argument(
        "--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
        help="most tokens proposed per request and step (each request adapts below it)",
    )  # fmt: skip
    g.add_argument(
        "--speculative-max-batch", type=int, default=d.speculative_max_batch,
        help="speculation pauses while more requests than this decode in a step",
    )  # fmt: skip
    g.add_argument(
        "--speculative-proposer-cost", type=float, default=d.speculative_proposer_cost,
        metavar="FRACTION",
        help="what proposing one token costs, as a fraction of one target decode step (default: "
        "estimated: 0 for ngram, the draft's streamed weight bytes over the target's); each "
        "request's k maximises expected tokens per unit of cost",
    )  # fmt: skip
