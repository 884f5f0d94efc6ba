"""L1: frozen, typed configuration, built and validated once (EngineArgs.resolve), never mutated.

Each component receives only its own sub-config: the scheduler gets `SchedulerConfig`, the KV
manager `CacheConfig`, the model runner `ModelConfig` + `CacheConfig` + `DeviceConfig`, the
engine core's KV agents `DisaggConfig`, the KV tiers `TiersConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from densa.utils.sizes import parse_memory

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# "auto" resolves per checkpoint: bfloat16 for one stored in bfloat16, else float32.
DTYPE_CHOICES = ("auto", *COMPUTE_DTYPES)
# auto: densa's Numba kernels on the CPU, its Triton kernels on a GPU (torch's without Triton).
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# "auto" resolves to the compute dtype. fp8_e4m3 and int8 are the compressed formats (about half
# BF16's bytes per token; docs/kv-cache.md compares their quality).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8")
# FP8 KV scales: one per (token, kv head) chosen at write time, or one per layer from a
# calibration file. "auto" = static when a scales file is given, else DEFAULT_KV_SCALES.
# Why dynamic is the default: docs/kv-cache.md (quality and capacity of both, measured).
KV_SCALE_POLICIES = ("auto", "dynamic", "static")
DEFAULT_KV_SCALES = "dynamic"
# "auto" = whatever the checkpoint stores (its metadata says so); the others convert at load time.
# w4a8 / w8a8: packed into the CPU kernels' formats at load time (densa/model/packed_linear.py).
WEIGHT_FORMATS = ("auto", "dense", "int4", "fp8", "mxfp4", "nvfp4", "mxfp4a8", "nvfp4a8", "w4a8",
                  "w8a8", "w8")  # fmt: skip
# The output head: as loaded, or packed for the CPU kernels. "auto" keeps a GGUF's Q8_0 head
# as w8 (its own bits, float activations: no added error) where the kernels are built.
HEAD_FORMATS = ("auto", "dense", "w8a8", "w8")
# What `auto` resolves a GGUF file's linear layers and untied head to where the C++ kernels run
# its block types: the file's own blocks (densa.model.gguf_loading). Not a user-facing choice.
WEIGHTS_FROM_BLOCKS = HEAD_FROM_BLOCKS = "blocks"
# The default KV budget (densa/setup/kv_sizing.py): pages for max_num_seqs requests at the full
# max_model_len (so the scheduler never has to preempt at the default settings), but never more
# than AUTO_KV_MAX_FRACTION of the memory free once the weights are loaded.
AUTO_KV_MEMORY = "auto"
AUTO_KV_MAX_FRACTION = 0.5
# Prefill/decode disaggregation (docs/disaggregation.md).
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face directory or a .gguf file
    served_model_name: str  # the id clients send as "model"
    dtype: str = (
        "float32"  # compute dtype; fp32 is the CPU default (bf16 degrades this model's answers)
    )
    max_model_len: int = 2048  # prompt + output tokens per request; <= the model's context length
    weight_format: str = "auto"
    head_format: str = "dense"
    decode_model: str | None = None  # phase-aware: decode runs through this checkpoint's weights
    # phase-aware from one checkpoint: decode runs through a second copy in this weight format
    decode_weight_format: str | None = None
    seed: int = 0  # default sampling seed source for requests that do not pass one

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
        if self.weight_format not in (*WEIGHT_FORMATS, WEIGHTS_FROM_BLOCKS):
            raise ValueError(
                f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}"
            )
        if self.head_format not in (*HEAD_FORMATS, HEAD_FROM_BLOCKS):
            raise ValueError(f"head_format must be one of {HEAD_FORMATS}, got {self.head_format!r}")
        if self.decode_weight_format not in (None, *WEIGHT_FORMATS):
            raise ValueError(f"decode_weight_format must be one of {WEIGHT_FORMATS}")
        if self.decode_weight_format is not None and self.decode_model is not None:
            raise ValueError("give --decode-model or --decode-weight-format, not both")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page; small pages waste less, large pages index less
    num_pages: int = (
        0  # resolved from the memory budget before freezing; 0 only in unresolved configs
    )
    kv_cache_dtype: str = "float32"  # resolved ("auto" -> compute dtype)
    kv_scales: str = DEFAULT_KV_SCALES  # resolved; only read for fp8 caches
    kv_scales_file: str | None = None  # static per-layer scales (JSON); None = 1.0 everywhere
    # DSA index keys' dtype, when not the pages' own (None): resolved, never "auto"
    index_kv_dtype: str | None = None
    enable_prefix_caching: bool = True
    kv_integrity: bool = True  # page generation tags checked before every read and write
    # What num_pages is sized from (densa/setup/kv_sizing.py): "auto", bytes ("2GiB") or a share
    # of free memory ("0.3", "30%"); or an exact page count, which overrides it.
    memory: str = AUTO_KV_MEMORY
    exact_num_pages: int | None = None

    def budget(self) -> float | int | None:
        """Bytes (int), a share of free memory (float), or None for the automatic size."""
        return None if self.memory == AUTO_KV_MEMORY else parse_memory(self.memory)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.num_pages < 0:
            raise ValueError("num_pages must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES or self.kv_cache_dtype == "auto":
            raise ValueError(f"kv_cache_dtype must be resolved to one of {KV_CACHE_DTYPES[1:]}")
        if self.kv_scales not in KV_SCALE_POLICIES[1:]:
            raise ValueError(f"kv_scales must be resolved to one of {KV_SCALE_POLICIES[1:]}")
        if self.index_kv_dtype is not None and self.index_kv_dtype not in KV_CACHE_DTYPES[1:]:
            raise ValueError(f"index_kv_dtype must be one of {KV_CACHE_DTYPES[1:]}")
        if self.kv_scales_file is not None and self.kv_scales != "static":
            raise ValueError(
                "a KV scales file holds static per-layer scales: use it with --kv-scales static"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # requests in flight per step
    # Tokens computed per step (prefill chunks + one per decode). Bounds step latency, so decode
    # requests are never stalled behind a whole long prompt.
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    max_waiting_requests: int = (
        1024  # beyond this, new requests are refused (429), never queued forever
    )
    # The model's end-of-sequence tokens (the tokenizer's): the engine's one source of them.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


SPECULATIVE_METHODS = ("ngram", "draft", "mtp", "ngram+draft")
DRAFT_METHODS = ("draft", "ngram+draft")  # the methods that run --speculative-model
# Speculation stops when more requests than this decode in one step. Verifying k proposals adds
# k rows to a request's decode row; at batch 1 the step streams every weight for one row, so the
# extra rows are nearly free, but as the batch grows the projections turn compute-bound and every
# rejected row costs as much as a real one: on the 2-core dev CPU a step of 4 rows already cost
# twice one of 2 (docs/speculative.md, "When it turns off", has the figures).
DEFAULT_SPECULATIVE_MAX_BATCH = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative.md): a proposer guesses up to num_tokens tokens per
    decoding request; the target verifies them in its own decode step."""

    method: str = "ngram"  # ngram | draft | mtp | ngram+draft (prompt lookup, else the draft)
    model: str | None = None  # the draft model (DRAFT_METHODS): a path or a catalog name
    num_tokens: int = 4  # most tokens proposed per request and step (k)
    max_batch: int = DEFAULT_SPECULATIVE_MAX_BATCH  # decode requests above which it pauses
    # What proposing one token costs, relative to one target decode step: None = estimated
    # (0 for ngram; a draft's or MTP layer's streamed weight bytes over the target's). Set it
    # where the estimate is off for a machine (measured with densa_bench/speculative/step_split).
    proposer_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.method in DRAFT_METHODS and not self.model:
            raise ValueError(f"speculative method {self.method} needs --speculative-model")
        if self.num_tokens < 1:
            raise ValueError("--num-speculative-tokens must be >= 1")
        if self.max_batch < 1:
            raise ValueError("--speculative-max-batch must be >= 1")
        if self.proposer_cost is not None and not 0 <= self.proposer_cost < 100:
            raise ValueError("--speculative-proposer-cost must be in [0, 100)")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the engine runs, and how its steps execute there."""

    device: str = "cpu"  # where weights, KV pages and the tag table live: cpu, cuda or cuda:N
    attention_backend: str = "auto"  # see ATTENTION_BACKENDS
    # On a GPU, replay all-decode steps of up to 64 requests from CUDA graphs (Triton backend).
    cuda_graphs: bool = True
    # Decode-only steps through the fused C++ step (densa/model/fused_decode.py) where it runs.
    fused_decode: bool = True
    # Every row attends as a decode row does, so tokens and logprobs are bit-identical whatever
    # the batch, the chunking and the prefix-cache state (docs/architecture.md, "Deterministic
    # mode"). Needs the fused C++ step; prompts cost a decode-style attention per row.
    deterministic: bool = False


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (docs/disaggregation.md): both = one server does all;
    prefill = also serves remote prefills to decode workers on kv_listen; decode = runs requests
    that name a prefill worker (header x-densa-prefill) with K/V copied from it."""

    role: str = "both"
    kv_listen: str = "tcp://127.0.0.1:0"  # where a prefill worker accepts decode workers
    kv_transfer_timeout: float = 30.0  # seconds any KV transfer state may last
    # The internal plane's credential (docs/security.md): a file holding the cluster secret
    # (else DENSA_CLUSTER_SECRET). It authenticates the KV link and the router's placements.
    cluster_secret_file: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.kv_transfer_timeout > 0:
            raise ValueError("--kv-transfer-timeout must be > 0 seconds")


@dataclass(frozen=True)
class TiersConfig:
    """KV tiers below the device pool, in order (docs/kv-cache.md): "disk:PATH:SIZE",
    "shared:redis://HOST:PORT[/DB]" (needs the cluster secret). Empty: the device pool only."""

    specs: tuple[str, ...] = ()
    # The MAC key of every tier where there is a secret (else each tier keys itself).
    cluster_secret_file: str | None = None  # else DENSA_CLUSTER_SECRET
    # The shared store's password (else DENSA_KV_TIER_PASSWORD), never an option's value.
    store_password_file: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    device: DeviceConfig = field(default_factory=DeviceConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    # Start without checking that weights + KV + activations fit (densa/setup/memory_plan.py).
    skip_memory_check: bool = False

    def sized(self, num_pages: int, eos_token_ids: tuple[int, ...]) -> EngineConfig:
        """This config once the KV cache is sized and the tokenizer loaded (a new object)."""
        return replace(
            self,
            cache=replace(self.cache, num_pages=num_pages),
            scheduler=replace(self.scheduler, eos_token_ids=eos_token_ids),
        )
