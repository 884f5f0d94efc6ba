"""The engine: one loop of schedule -> execute -> update, plus request bookkeeping around it.

Synchronous and single-threaded by design; `AsyncEngine` runs it on a background thread.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import psutil
import torch

from densa.cache.integrity import IntegrityStats
from densa.cache.kv_manager import KVCacheManager
from densa.config import CacheConfig, EngineConfig
from densa.engine.args import EngineArgs, default_model_path
from densa.engine.detokenizer import Detokenizer
from densa.engine.output import RequestOutput
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention import AttentionBackend
from densa.model.interface import CausalLM
from densa.model.linear import resident_weight_bytes
from densa.model.loader import load_model, resolve_model_dir
from densa.model.tokenizer import Tokenizer
from densa.quant import fp8_kv
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.scheduler import Scheduler
from densa.utils.logging import get_logger
from densa.utils.sizes import format_bytes
from densa.worker.integrity import IntegrityChecker, NoopIntegrityChecker, TagTableChecker
from densa.worker.kv_cache import allocate_kv_caches, num_pages_for_budget, page_bytes
from densa.worker.model_runner import ModelRunner
from densa.worker.sampler import TokenLogprobs

logger = get_logger(__name__)


class PromptTooLong(ValueError):
    """The prompt leaves no room for output in the model's context (context_length_exceeded)."""


@dataclass
class _Tracked:
    """Engine-side state of one request: its scheduler record plus text and timing."""

    request: Request
    detokenizer: Detokenizer
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    first_token_time: float | None = None


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        runner: ModelRunner,
        arch: ArchConfig,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.arch = arch
        self.kv_manager = KVCacheManager(
            config.cache.num_pages, config.cache.page_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.integrity_stats = IntegrityStats()
        self._tracked: dict[str, _Tracked] = {}
        self._finished_outputs: list[RequestOutput] = []
        self._ids = itertools.count()

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        model_path = args.model or default_model_path()
        model_dir = resolve_model_dir(model_path)
        arch = ArchConfig.from_dir(model_dir)
        device = torch.device(args.device)
        max_len = args.resolved_max_model_len(arch)
        kv_dtype, kv_scales = args.resolved_kv_cache_dtype(), args.resolved_kv_scales()
        static_scales = load_static_kv_scales(args, arch, device)  # fails fast, before loading
        tokenizer = Tokenizer(model_dir, arch.eos_token_ids)
        model = load_model(model_dir, arch, args.dtype, max_len, device, args.weight_format)
        decode_model = load_decode_model(args, arch, max_len, device)
        num_pages = _resolve_num_pages(args, arch, kv_dtype, max_len, device)
        config = args.resolve(arch, model_path, num_pages)
        kv_caches = allocate_kv_caches(
            arch, num_pages, args.page_size, kv_dtype, device, kv_scales, static_scales
        )
        backend = select_backend(args.attention_backend, device)
        runner = ModelRunner(
            model,
            kv_caches,
            args.page_size,
            backend,
            tokenizer.eos_token_ids,
            device,
            make_integrity_checker(config.cache, device),
            args.seed,
            decode_model=decode_model,
        )
        logger.info(
            "KV cache: %d pages x %d tokens (%s, %s), attention backend %s",
            num_pages, args.page_size, _describe_kv(kv_dtype, static_scales),
            format_bytes(num_pages * page_bytes(arch, args.page_size, kv_dtype, kv_scales)),
            backend.name,
        )  # fmt: skip
        return cls(config, tokenizer, runner, arch)

    # ---- requests ------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_scope: str = "",
        session_id: str | None = None,
    ) -> str:
        """Queue a request. Raises ValueError (nothing changed) if it can never run."""
        self.validate_request(prompt_token_ids, params)
        request = Request(
            request_id=request_id or self.new_request_id(),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            cache_scope=cache_scope,
            session_id=session_id,
        )
        self.scheduler.add_request(request)
        self._tracked[request.request_id] = _Tracked(
            request=request,
            detokenizer=Detokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            ),
        )
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def land_kv_pages(
        self, request_id: str, page_ids: list[int], expected_tags: list[int], payload: torch.Tensor
    ) -> bool:
        """Write copied K/V pages for a request (a transfer landing). A writer that no longer owns
        a destination page is refused: nothing is written and the issuing request is aborted."""
        violation = None
        if self.config.cache.kv_integrity:
            request = self.scheduler.requests.get(request_id)
            violation = self.kv_manager.check_writer(request_id, request, page_ids, expected_tags)
        if violation is None:
            # Releases since the last step have not reached the device tag table yet: sync first.
            self.runner.integrity.apply_tag_updates(self.kv_manager.pool.drain_tag_updates())
            violation = self.runner.write_kv_pages(request_id, page_ids, expected_tags, payload)
        if violation is None:
            return True
        self.integrity_stats.record(violation)
        self._finish(request_id, RequestStatus.FINISHED_ERROR, violation.message)
        return False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._finished_outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    def check_invariants(self) -> None:
        """Assert the page pool matches the requests' page tables (tests run this every step)."""
        owners = {rid: req.page_ids for rid, req in self.scheduler.requests.items()}
        self.kv_manager.pool.check_consistency(owners)
        if not self.scheduler.has_unfinished:
            assert self.kv_manager.num_free_pages == self.kv_manager.num_pages, (
                "idle but pages in use"
            )

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with an error (after an unexpected engine failure); frees all pages."""
        for request_id in list(self.scheduler.requests):
            self._finish(request_id, RequestStatus.FINISHED_ERROR, error)
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run. Pure: safe to call from any thread."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.arch.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        max_len = self.config.scheduler.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise PromptTooLong(
                f"the prompt has {len(prompt_token_ids)} tokens but this model's context is "
                f"{max_len} tokens (prompt + at least one output token); shorten the prompt"
            )
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad_stop[:5]}")

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return outputs for every request that progressed or ended."""
        outputs, self._finished_outputs = self._finished_outputs, []
        sched_out = self.scheduler.schedule()
        for request_id in sched_out.finished_request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is not None:  # ended by the scheduler itself (e.g. outgrew the KV cache)
                outputs.append(self._output(tracked))
        runner_out = self.runner.execute(sched_out)
        for request_id, violation in runner_out.failed.items():
            self.integrity_stats.record(violation)
            self._finish(request_id, RequestStatus.FINISHED_ERROR, violation.message)
        updated = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids)
        now = time.monotonic()
        for request in updated:
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                continue
            self._absorb_token(tracked, runner_out.logprobs.get(request.request_id), now)
            outputs.append(self._output(tracked))
        outputs.extend(self._finished_outputs)
        self._finished_outputs = []
        self._record_release_violations()
        return outputs

    def _record_release_violations(self) -> None:
        for violation in self.scheduler.release_violations:
            self.integrity_stats.record(violation)
        self.scheduler.release_violations.clear()

    def _absorb_token(self, tracked: _Tracked, logprobs: TokenLogprobs | None, now: float) -> None:
        request = tracked.request
        token_id = request.output_token_ids[-1]
        tracked.first_token_time = tracked.first_token_time or now
        tracked.pending_token_ids.append(token_id)
        if logprobs is not None:
            tracked.pending_logprobs.append(logprobs)
        tracked.detokenizer.add_token(token_id)
        if not request.is_finished and tracked.detokenizer.check_stop():
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        request = self.scheduler.finish_request(request_id, status, error)
        tracked = self._tracked.get(request_id)
        if request is None or tracked is None:
            return
        self._finished_outputs.append(self._output(tracked))

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        finished = request.is_finished
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=tracked.pending_token_ids,
            new_text=tracked.detokenizer.take_delta(finished),
            new_logprobs=tracked.pending_logprobs,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            error=request.error,
            error_code=_error_code(request.error),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
        )
        tracked.pending_token_ids, tracked.pending_logprobs = [], []
        if finished:
            output.text = tracked.detokenizer.text
            output.token_ids = list(request.output_token_ids)
            del self._tracked[request.request_id]
        return output


def _error_code(error: str | None) -> str | None:
    if error is None:
        return None
    return error.split(":", 1)[0] if ":" in error else "engine_error"


def make_integrity_checker(cache: CacheConfig, device: torch.device) -> IntegrityChecker:
    if not cache.kv_integrity:
        return NoopIntegrityChecker()
    # A fresh pool's tags are page ids (generation 0); the pool reports every change after that.
    return TagTableChecker(list(range(cache.num_pages)), cache.page_size, device)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    from densa.model.attention import CpuAttentionBackend, TorchAttentionBackend

    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchAttentionBackend()
    if name in ("auto", "cpu"):
        if device.type != "cpu":
            raise ValueError("the 'cpu' attention backend runs on the CPU only; use 'torch'")
        return CpuAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}")


def load_decode_model(
    args: EngineArgs, arch: ArchConfig, max_len: int, device: torch.device
) -> CausalLM | None:
    """The decode-phase weight set (phase-aware formats), or None when decode shares `model`'s.

    It must be the same model (same shapes): its layers write into and read from the same KV
    cache as the prefill weights'. Costs its resident weight bytes on top of the prefill set's.
    """
    if args.decode_model is None:
        return None
    decode_dir = resolve_model_dir(args.decode_model)
    decode_arch = ArchConfig.from_dir(decode_dir)
    if not same_shapes(arch, decode_arch):
        raise ModelLoadError(
            f"--decode-model {args.decode_model} is not the same model as --model "
            "(its layer shapes differ); it must be a checkpoint of the same weights"
        )
    model = load_model(decode_dir, decode_arch, args.dtype, max_len, device, "auto")
    logger.info(
        "phase-aware weights: decode runs through %s (%s more resident weight memory)",
        decode_dir.name, format_bytes(resident_weight_bytes(model)),
    )  # fmt: skip
    return model


def same_shapes(a: ArchConfig, b: ArchConfig) -> bool:
    """Whether two checkpoints can share one KV cache and one tokenizer."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings")  # fmt: skip
    return all(getattr(a, key) == getattr(b, key) for key in keys)


def load_static_kv_scales(
    args: EngineArgs, arch: ArchConfig, device: torch.device
) -> fp8_kv.KVScales | None:
    """Check an FP8 KV cache can run here; the static scales it uses (None: not needed).

    Raises ModelLoadError naming the alternative when this build cannot run FP8, and when the
    scales file does not fit the model. Options that do not fit together raise ValueError.
    """
    if args.resolved_kv_cache_dtype() != fp8_kv.KV_DTYPE:
        return None
    problem = fp8_kv.fp8_support_error(device)
    if problem is not None:
        raise ModelLoadError(problem)
    scales = args.resolved_kv_scales()
    if args.kv_scales_file is not None and scales != "static":
        raise ValueError("a KV scales file holds static per-layer scales: use --kv-scales static")
    if scales != "static":
        return None
    if args.kv_scales_file is None:
        return fp8_kv.KVScales.ones(arch.num_layers)
    try:
        return fp8_kv.KVScales.load(args.kv_scales_file, arch.num_layers)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _describe_kv(kv_dtype: str, static_scales: fp8_kv.KVScales | None) -> str:
    if kv_dtype != fp8_kv.KV_DTYPE:
        return kv_dtype
    if static_scales is None:
        return f"{kv_dtype}, dynamic scales"
    return f"{kv_dtype}, static scales: {static_scales.source}"


def _kv_budget_bytes(
    args: EngineArgs, arch: ArchConfig, kv_dtype: str, device: torch.device
) -> int:
    if args.num_kv_pages is not None:
        return args.num_kv_pages * page_bytes(
            arch, args.page_size, kv_dtype, args.resolved_kv_scales()
        )
    budget = args.kv_budget()
    if isinstance(budget, int):
        return budget
    # A fraction of what is free now that the weights are loaded.
    if device.type == "cpu":
        free = psutil.virtual_memory().available
    else:
        free = torch.cuda.mem_get_info(device)[0]
    return int(free * budget)


def _resolve_num_pages(
    args: EngineArgs, arch: ArchConfig, kv_dtype: str, max_len: int, device: torch.device
) -> int:
    budget = _kv_budget_bytes(args, arch, kv_dtype, device)
    num_pages = num_pages_for_budget(
        arch, args.page_size, kv_dtype, budget, args.resolved_kv_scales()
    )
    needed = -(-max_len // args.page_size)
    if num_pages < needed:
        raise ModelLoadError(
            f"the KV cache budget ({format_bytes(budget)}) holds {num_pages} pages but one "
            f"{max_len}-token request needs {needed}; "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    return num_pages
