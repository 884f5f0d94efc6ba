"""Hugging Face transformers as the reference implementation, and a tie-aware greedy comparison."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams

from ..outputs import Collector

# Logit gap below which two tokens count as tied: fp32 summation-order differences between two
# correct implementations reach ~1e-4 on logits of magnitude ~10-40.
TIE_TOLERANCE = 2e-3


@dataclass
class ReferenceGeneration:
    token_ids: list[int]
    scores: list[torch.Tensor]  # the logits HF chose each token from


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[ReferenceGeneration]:
    """Greedy generations from transformers in fp32, one prompt at a time (no padding effects)."""
    from transformers import AutoModelForCausalLM

    from densa.model.gguf import ensure_dense_copy

    weights_dir = ensure_dense_copy(model_dir)  # transformers reads a float32 copy of a GGUF
    model = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=None,  # compare full lengths
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            results.append(ReferenceGeneration(tokens, [s[0] for s in out.scores]))
    return results


def first_divergence(ours: list[int], ref: ReferenceGeneration) -> int | None:
    """Index of the first differing token, or None if identical. Fails unless it is a near-tie."""
    assert len(ours) == len(ref.token_ids), (len(ours), len(ref.token_ids))
    for idx, (mine, theirs) in enumerate(zip(ours, ref.token_ids, strict=True)):
        if mine != theirs:
            scores = ref.scores[idx]
            gap = float(scores[theirs] - scores[mine])
            assert gap < TIE_TOLERANCE, (
                f"token {idx}: densa chose {mine}, HF chose {theirs}; HF's logit gap {gap:.4g} is not a tie"
            )
            return idx
    return None


def run_with_invariants(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """Run requests to completion, checking the page pool after every step; tokens in prompt order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
    collector = Collector()
    while engine.has_unfinished_requests():
        for final in collector.add(engine.step()):
            assert final.error is None, final.error
        engine.check_invariants()
    engine.check_invariants()
    return [collector.finals[i].token_ids for i in ids]
