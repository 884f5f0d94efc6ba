"""The draft-model proposer: its proposals are exactly the draft's own greedy continuation, through
catch-up after acceptance, truncation after rejection and batching; its pages are freed; a draft of
another tokenizer is refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from densa.cache.integrity import IntegrityViolation, ViolationKind
from densa.engine.llm import LLM
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention_backends import select_backend
from densa.model.kv_pages import allocate_kv_caches
from densa.model.loader import resolve_model_dir
from densa.sampling_params import SamplingParams
from densa.spec.draft import DraftModelProposer, DraftSpec, load_draft_proposer
from densa.spec.lookup_first import LookupFirstProposer
from densa.spec.ngram import NgramProposer
from densa.spec.proposer import SpecInput
from densa.text.tokenizer import Tokenizer
from tests.conftest import make_tiny_llama

PAGE_SIZE = 4  # small pages: a proposal round crosses page boundaries
MAX_LEN = 256
CPU = torch.device("cpu")
K = 4


def _proposer(draft: str | Path, target: str | Path, num_pages: int = 64) -> DraftModelProposer:
    target_dir = resolve_model_dir(str(target))
    arch = ArchConfig.from_dir(target_dir)
    spec = DraftSpec(str(draft), PAGE_SIZE, num_pages, MAX_LEN)
    return load_draft_proposer(
        spec, arch, Tokenizer.from_dir(target_dir), select_backend("auto", CPU), CPU
    )


def _greedy(llm: LLM, prompt: list[int], num_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return llm.generate([prompt], params)[0].token_ids


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), smollm2_dir, seed=3)


@pytest.fixture(scope="module")
def tiny_llm(tiny_draft_dir: Path) -> LLM:
    return LLM(str(tiny_draft_dir), num_kv_pages=256, page_size=PAGE_SIZE, max_model_len=MAX_LEN)


PROMPTS = ([5, 17, 230, 1234, 9, 88, 4021], [301, 302, 7, 7, 7, 12, 4000, 51, 6, 9, 10])


def test_proposals_are_the_drafts_greedy_continuation_across_rounds(
    tiny_draft_dir: Path, tiny_model_dir: Path, tiny_llm: LLM
) -> None:
    """Two requests batched; round 2 after full acceptance (+ bonus), round 3 after a rejection."""
    proposer = _proposer(tiny_draft_dir, tiny_model_dir)
    refs = [_greedy(tiny_llm, prompt, 2 * K + 1) for prompt in PROMPTS]
    inputs = [SpecInput(f"r{i}", prompt, K) for i, prompt in enumerate(PROMPTS)]
    assert proposer.propose(inputs) == [ref[:K] for ref in refs]
    # r0 accepted everything and the target added the draft's own next token as its bonus;
    # r1 accepted one token, then the target chose another token than the draft's.
    rejected = (refs[1][1] + 1) % 49152
    histories = [list(PROMPTS[0]) + refs[0][: K + 1], [*PROMPTS[1], refs[1][0], rejected]]
    got = proposer.propose([SpecInput(f"r{i}", h, K) for i, h in enumerate(histories)])
    assert got[0] == refs[0][K + 1 : 2 * K + 1]
    assert got[1] == _greedy(tiny_llm, histories[1], K)
    for i, history in enumerate(histories):  # the pages hold the history and proposals[:-1]
        seq = proposer.sequences[f"r{i}"]
        assert seq.token_ids == history + got[i][:-1]
        assert len(seq.page_ids) == -(-(len(history) + K - 1) // PAGE_SIZE)


def test_truncation_frees_the_rejected_pages_and_release_frees_all(
    tiny_draft_dir: Path, tiny_model_dir: Path, tiny_llm: LLM
) -> None:
    proposer = _proposer(tiny_draft_dir, tiny_model_dir, num_pages=16)
    prompt = list(range(100, 109))  # 9 tokens: positions 0..11 cached after k = 4 -> 3 pages
    first = proposer.propose([SpecInput("a", prompt, K)])[0]
    pages = list(proposer.sequences["a"].page_ids)
    assert pages == [0, 1, 2] and proposer.pool.num_free_pages == 13
    # The target rejected the very first proposal: 10 tokens, k = 1 needs positions 0..9 only.
    history = [*prompt, (first[0] + 1) % 49152]
    assert proposer.propose([SpecInput("a", history, 1)]) == [_greedy(tiny_llm, history, 1)]
    assert proposer.sequences["a"].page_ids == [0, 1, 2]
    assert proposer.sequences["a"].token_ids == history
    # A shorter history than the pages hold (the engine rolled back further): pages beyond it go.
    proposer.propose([SpecInput("a", prompt[:3], 1)])
    assert proposer.sequences["a"].page_ids == [0]
    assert proposer.pool.is_free(1) and proposer.pool.is_free(2)
    proposer.release("a")
    assert "a" not in proposer.sequences
    assert proposer.pool.num_free_pages == 16
    proposer.pool.check_consistency({})
    proposer.release("a")  # releasing twice (finished, then aborted) is harmless


def test_draft_pages_carry_tags_bumped_on_rollback_and_release(
    tiny_draft_dir: Path, tiny_model_dir: Path
) -> None:
    """The draft's pool tags pages as the target's does: tag = generation * 16 + page id, bumped
    when a page is allocated and when it is freed (rollback or release)."""
    proposer = _proposer(tiny_draft_dir, tiny_model_dir, num_pages=16)
    prompt = list(range(100, 109))
    proposer.propose([SpecInput("a", prompt, K)])
    seq = proposer.sequences["a"]
    assert (seq.page_ids, seq.page_tags) == ([0, 1, 2], [16, 17, 18])
    proposer.propose([SpecInput("a", prompt[:3], 1)])  # rolled back to 3 tokens: one page
    assert (seq.page_ids, seq.page_tags) == ([0], [16])
    assert proposer.pool.tags([1, 2]) == [33, 34]
    proposer.release("a")
    assert proposer.pool.tags([0, 1, 2]) == [32, 33, 34]
    assert proposer.take_violations() == []


def test_the_drafts_pool_queues_no_tag_updates_nobody_reads(
    tiny_draft_dir: Path, tiny_model_dir: Path
) -> None:
    """Only the target pool's tag changes are mirrored (the scheduler drains them into each
    step); the draft's pool must not queue its own, or a long-running server keeps an entry for
    every draft page ever allocated or freed."""
    proposer = _proposer(tiny_draft_dir, tiny_model_dir, num_pages=16)
    prompt = list(range(100, 109))
    for _ in range(3):  # allocate, roll back, release
        proposer.propose([SpecInput("a", prompt, K)])
        proposer.propose([SpecInput("a", prompt[:3], 1)])
        proposer.release("a")
    assert proposer.pool.num_free_pages == 16
    assert proposer.pool.drain_tag_updates() == []


def test_a_draft_page_freed_behind_its_request_ends_only_its_speculation(
    tiny_draft_dir: Path, tiny_model_dir: Path, tiny_llm: LLM
) -> None:
    proposer = _proposer(tiny_draft_dir, tiny_model_dir, num_pages=16)
    a, b = list(range(100, 109)), list(range(200, 209))
    proposer.propose([SpecInput("a", a, K)])
    assert proposer.sequences["a"].page_tags == [16, 17, 18]
    # A bookkeeping bug frees a's page 1 behind its back, and b is given it (tag 17 -> 33 -> 49).
    proposer.pool.free([1])
    proposer.pool.move_to_front(1)
    proposer.propose([SpecInput("b", b, K)])
    assert proposer.sequences["b"].page_ids == [1, 3, 4]
    assert proposer.sequences["b"].page_tags == [49, 19, 20]
    got = proposer.propose([SpecInput("a", a, K), SpecInput("b", b, K)])
    # a reads nothing and proposes nothing; b, whose pages are its own, proposes as ever.
    assert got == [[], _greedy(tiny_llm, b, K)]
    assert proposer.take_violations() == [
        IntegrityViolation("a", ViolationKind.STALE_READ, 1, expected_tag=17, found_tag=49)
    ]
    assert proposer.take_violations() == []
    # a's state is gone: its own pages freed (tags bumped), b's page 1 untouched.
    assert "a" not in proposer.sequences
    assert proposer.pool.tags([0, 1, 2]) == [32, 49, 34]
    proposer.pool.check_consistency({"b": proposer.sequences["b"].page_ids})
    # Next step a rebuilds its draft K/V from its token ids.
    assert proposer.propose([SpecInput("a", a, K)]) == [_greedy(tiny_llm, a, K)]


def test_lookup_first_asks_the_draft_only_where_prompt_lookup_finds_nothing(
    tiny_draft_dir: Path, tiny_model_dir: Path, tiny_llm: LLM
) -> None:
    draft = _proposer(tiny_draft_dir, tiny_model_dir, num_pages=16)
    proposer = LookupFirstProposer(NgramProposer(), draft)
    copying = [5, 6, 7, 8, 5, 6, 7]  # its tail 5 6 7 occurred before, followed by 8 5 6 7
    fresh = list(PROMPTS[0])  # no repeated tail
    got = proposer.propose([SpecInput("copy", copying, K), SpecInput("fresh", fresh, K)])
    assert got == [[8, 5, 6, 7], _greedy(tiny_llm, fresh, K)]
    assert list(draft.sequences) == ["fresh"]  # the draft never saw the copying request
    assert (proposer.num_lookup_answers, proposer.num_draft_answers) == (1, 1)
    assert proposer.cost_per_token == draft.cost_per_token
    proposer.release("fresh")
    assert draft.pool.num_free_pages == 16


def test_a_full_pool_proposes_nothing_and_holds_no_pages(
    tiny_draft_dir: Path, tiny_model_dir: Path
) -> None:
    proposer = _proposer(tiny_draft_dir, tiny_model_dir, num_pages=3)
    fits, too_long = list(range(10, 18)), list(range(20, 40))
    got = proposer.propose([SpecInput("fits", fits, K), SpecInput("long", too_long, K)])
    assert len(got[0]) == K and got[1] == []
    assert "long" not in proposer.sequences
    proposer.pool.check_consistency({"fits": proposer.sequences["fits"].page_ids})


def test_the_bundled_smollm2_as_draft_proposes_its_greedy_continuation(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), num_kv_pages=128, page_size=PAGE_SIZE, max_model_len=MAX_LEN)
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    ref = _greedy(llm, prompt, 2 * K + 1)
    # The same weights drive the draft (loading the 135M twice would double the test's time);
    # the draft runs them over pages of its own.
    arch = llm.engine.arch
    proposer = DraftModelProposer(
        llm.engine.runner.model, allocate_kv_caches(arch, 32, PAGE_SIZE, KVFormat.of("float32"), CPU),
        PAGE_SIZE, select_backend("auto", CPU), CPU, 32, MAX_LEN, arch.vocab_size,
    )  # fmt: skip
    assert proposer.propose([SpecInput("s", prompt, K)]) == [ref[:K]]
    assert proposer.propose([SpecInput("s", prompt + ref[: K + 1], K)]) == [ref[K + 1 :]]


def test_a_draft_of_another_tokenizer_is_refused(
    tmp_path: Path, tiny_model_dir: Path, smollm2_dir: Path
) -> None:
    other = make_tiny_llama(tmp_path / "other", smollm2_dir, seed=4)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: p for p, i in vocab.items()}
    vocab[by_id[1000]], vocab[by_id[1001]] = 1001, 1000  # two ids swap their text
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    expected = f"token 1000 is {by_id[1001]!r} in the draft and {by_id[1000]!r} in the target"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        _proposer(other, tiny_model_dir)
    shutil.rmtree(other)
