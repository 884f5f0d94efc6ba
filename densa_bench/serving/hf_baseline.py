"""The Hugging Face transformers peer: `model.generate` over a static batch, fp32, greedy.

TTFT comes from a streamer inside the timed `generate` call itself: transformers hands the streamer
the prompt first, then each step's new tokens (one per sequence), so the second `put` marks the end
of prefill. Static batching means every request in the batch gets its tokens at the same moments.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from densa_bench.common.timing import RequestTiming


class _ArrivalStreamer(BaseStreamer):
    """Records when each decoding step's tokens reach the caller (the prompt's `put` is skipped)."""

    def __init__(self) -> None:
        self.arrival_s: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._seen_prompt:  # the first call carries the prompt, not generated tokens
            self._seen_prompt = True
            return
        self.arrival_s.append(now)

    def end(self) -> None:
        pass


class HFGenerate:
    """transformers `generate` as a ServingEngine: one wave = one static batch."""

    name = "hf"

    def __init__(self, model_dir: Path) -> None:
        from densa.model.gguf import ensure_dense_copy

        # A converted GGUF directory holds no weights of its own: transformers reads a float32
        # copy written on first use (densa serves from the GGUF file itself).
        weights_dir = ensure_dense_copy(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=torch.float32)
        self.model.eval()

    def run_wave(self, prompts: list[list[int]], output_len: int) -> list[RequestTiming]:
        _check_equal_lengths(prompts)
        input_ids = torch.tensor(prompts, dtype=torch.long)  # [batch, prompt_len]
        streamer = _ArrivalStreamer()
        submit_s = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(  # type: ignore[misc]  # transformers mistypes generate's self
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,  # EOS is masked: every request makes output_len tokens
                pad_token_id=0,  # never used (equal lengths), but silences the missing-pad warning
                streamer=streamer,
            )
        return [RequestTiming(submit_s, list(streamer.arrival_s)) for _ in prompts]

    def wave_stats(self) -> dict[str, int]:
        return {}


def _check_equal_lengths(prompts: list[list[int]]) -> None:
    # Equal lengths keep the batch free of padding, so HF does exactly the work densa does.
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(
            f"the HF baseline needs equal-length prompts, got lengths {sorted(lengths)}"
        )
