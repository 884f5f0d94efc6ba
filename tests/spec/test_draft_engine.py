"""A draft model wired through the engine builder: greedy output is the target's own, a draft of
the target itself is accepted (almost) always, and the draft's KV pages come out of the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.engine.llm import LLM
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.kv_pages import page_bytes
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs, default_model_path
from densa.setup.kv_sizing import draft_kv_page_bytes, resolve_num_pages
from densa.spec.draft import DraftModelProposer
from densa.spec.lookup_first import LookupFirstProposer
from tests.conftest import make_tiny_llama

PAGE_SIZE = 8
CPU = torch.device("cpu")
FP32 = KVFormat.of("float32")
ENGINE = dict(num_kv_pages=128, page_size=PAGE_SIZE, max_model_len=512)
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "1, 2, 3, 4, 5, 6,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-other-draft"), smollm2_dir, seed=7)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir: Path) -> list[list[int]]:
    llm = LLM(str(tiny_model_dir), **ENGINE)
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def test_a_draft_of_the_target_itself_is_accepted_and_changes_nothing(
    tiny_model_dir: Path, plain_outputs: list[list[int]]
) -> None:
    llm = LLM(str(tiny_model_dir), speculative_model=str(tiny_model_dir), **ENGINE)
    speculator = llm.engine.speculator
    assert speculator is not None and isinstance(speculator.proposer, DraftModelProposer)
    # A draft as big as its target costs a whole step per guess: never worth it, so the
    # speculator would not propose at all. Priced as free, it proposes every step.
    assert speculator.proposer.cost_per_token == pytest.approx(1.0)
    speculator.proposer.cost_per_token = 0.0
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == plain_outputs
    assert speculator.num_proposed_tokens >= 3 * 24 // 2  # it speculated most of the way
    assert speculator.num_accepted_tokens >= 0.95 * speculator.num_proposed_tokens
    # Every finished request's draft pages are back in the draft's pool.
    assert speculator.proposer.sequences == {}
    assert speculator.proposer.pool.num_free_pages == ENGINE["num_kv_pages"]


def test_another_draft_keeps_greedy_output_exact(
    tiny_model_dir: Path, other_draft_dir: Path, plain_outputs: list[list[int]]
) -> None:
    llm = LLM(str(tiny_model_dir), speculative_model=str(other_draft_dir), **ENGINE)
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == plain_outputs
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.num_proposed_tokens > 0


def test_lookup_first_with_a_draft_keeps_greedy_output_exact(
    tiny_model_dir: Path, other_draft_dir: Path, plain_outputs: list[list[int]]
) -> None:
    llm = LLM(
        str(tiny_model_dir), speculative_method="ngram+draft",
        speculative_model=str(other_draft_dir), **ENGINE,
    )  # fmt: skip
    speculator = llm.engine.speculator
    assert speculator is not None and isinstance(speculator.proposer, LookupFirstProposer)
    speculator.proposer.cost_per_token = 0.0  # priced as free: it proposes every step
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == plain_outputs
    assert speculator.num_proposed_tokens > 0
    assert speculator.proposer.num_draft_answers > 0
    assert speculator.proposer.draft.sequences == {}  # released with their requests


def test_the_draft_kv_shares_the_budget(tiny_model_dir: Path, other_draft_dir: Path) -> None:
    """A byte budget buys pages of (target + draft) bytes, as many for each; an exact page count
    is the target's."""
    arch = ArchConfig.from_dir(tiny_model_dir)
    args = EngineArgs(
        model=str(tiny_model_dir), speculative_model=str(other_draft_dir),
        kv_cache_memory="1MiB", page_size=PAGE_SIZE, dtype="float32", max_model_len=64,
    )  # fmt: skip
    per_page = page_bytes(arch, PAGE_SIZE, args.kv_format())
    draft_per_page = page_bytes(ArchConfig.from_dir(other_draft_dir), PAGE_SIZE, FP32)
    config, kv_format = args.resolve(arch, str(tiny_model_dir)), args.kv_format()
    draft_page = draft_kv_page_bytes(config.speculative, PAGE_SIZE, kv_format)
    assert draft_page == draft_per_page
    num_pages, _ = resolve_num_pages(
        config.cache, config.scheduler, arch, kv_format, CPU, draft_page
    )
    assert num_pages == (1 << 20) // (per_page + draft_per_page)
    plain, _ = resolve_num_pages(config.cache, config.scheduler, arch, kv_format, CPU)
    assert plain == (1 << 20) // per_page


def test_a_gguf_draft_runs_from_its_blocks_as_the_target_does() -> None:
    """The draft's formats are resolved as the target's: a GGUF draft passed on with "auto"
    was dequantized to dense float weights (4x the file, each draft pass ~3x slower)."""
    gguf = default_model_path()
    llm = LLM(gguf, speculative_model=gguf, num_kv_pages=16, page_size=PAGE_SIZE,
              max_model_len=128)  # fmt: skip
    speculator = llm.engine.speculator
    assert speculator is not None and isinstance(speculator.proposer, DraftModelProposer)
    draft_format = speculator.proposer.model.weight_format
    assert draft_format == llm.engine.weight_format
    assert "dense" not in draft_format
