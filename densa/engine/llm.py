"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

The engine runs in this process, stepped directly; its token deltas become text exactly as in the
server (text/output.TextStream: incremental detokenization, stop strings)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from densa.engine.llm_engine import LLMEngine
from densa.ipc.messages import TokenLogprobs
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.text.output import RequestOutput, TextStream

Prompt = str | list[int]


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None
    # SamplingParams.prompt_logprobs: prompt tokens 1 .. P - 1 (token 0 has none).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    """Batch generation in-process. Keyword arguments are `EngineArgs` fields."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        on_finished: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text, or token ids); results come back in prompt order.
        `on_finished(1)` is called as each request finishes (a caller's own progress bar)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompt_list))
        token_lists = [self._tokens(p) for p in prompt_list]
        streams = {}
        for tokens, sp in zip(token_lists, params_list, strict=True):
            request_id = self.engine.add_request(tokens, sp)
            streams[request_id] = TextStream(self.tokenizer, request_id, tokens, sp)
        request_ids = list(streams)
        finals = self._run_to_completion(streams, use_tqdm, on_finished)
        return [
            self._result(finals[rid], tokens)
            for rid, tokens in zip(request_ids, token_lists, strict=True)
        ]

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        """One conversation (a list of messages) or several; the chat template is applied."""
        batch = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        prompts: list[Prompt] = [self.tokenizer.encode_chat(list(c)) for c in cast(list, batch)]
        return self.generate(prompts, params)

    def _tokens(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _run_to_completion(
        self,
        streams: dict[str, TextStream],
        use_tqdm: bool,
        on_finished: Callable[[int], None] | None = None,
    ) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in streams}
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in streams}
        progress = _progress(len(streams), use_tqdm)
        while len(finals) < len(streams):
            for delta in self.engine.step():
                out = streams[delta.request_id].process(delta)
                if out is None:
                    continue  # late tokens of a request a stop string ended
                logprobs[out.request_id].extend(out.new_logprobs)
                prompt_logprobs[out.request_id].extend(out.prompt_logprobs)
                if streams[delta.request_id].stopped and not delta.finished:
                    self.engine.abort_request(delta.request_id)
                if out.finished:
                    out.new_logprobs = logprobs[out.request_id]
                    out.prompt_logprobs = prompt_logprobs[out.request_id]
                    finals[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
                    if on_finished is not None:
                        on_finished(1)
        if progress is not None:
            progress.close()
        return finals

    @staticmethod
    def _result(out: RequestOutput, prompt_tokens: list[int]) -> GenerationResult:
        return GenerationResult(
            request_id=out.request_id,
            prompt_token_ids=prompt_tokens,
            text=out.text or "",
            token_ids=out.token_ids or [],
            finish_reason=out.finish_reason,
            num_cached_tokens=out.num_cached_tokens,
            logprobs=out.new_logprobs,
            error=out.error,
            prompt_logprobs=out.prompt_logprobs,
        )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} SamplingParams for {count} prompts")
    return list(params)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
