"""Teacher-forced scoring equals transformers' logits and leaves the engine's pages free."""

from __future__ import annotations

from pathlib import Path

import torch

from densa.engine.llm_engine import LLMEngine
from densa.offline.scoring import iter_logits, token_logprobs
from densa.setup.args import EngineArgs

from ..model.helpers import hf_logits

TOKENS = [1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77, 10, 11, 12, 13, 14, 900, 901, 5]


def test_chunked_scores_match_transformers(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_args(
        EngineArgs(model=str(tiny_model_dir), num_kv_pages=16, page_size=4, max_model_len=64)
    )
    ours = torch.cat(list(iter_logits(engine, TOKENS, chunk_size=5)))
    torch.testing.assert_close(ours, hf_logits(tiny_model_dir, TOKENS), atol=2e-4, rtol=1e-4)
    logprobs = token_logprobs(engine, TOKENS, chunk_size=7)
    expected = (
        torch.log_softmax(ours[:-1], -1).gather(1, torch.tensor(TOKENS[1:])[:, None]).squeeze(1)
    )
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=1e-4)
    engine.check_invariants()  # scoring returned every page
