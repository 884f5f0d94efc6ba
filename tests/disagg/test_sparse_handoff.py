"""Sparse attention across a prefill/decode split: GLM-5's index keys travel in the same pages
as its latents (frames of their own layout), land in the decode pool's reserved pages, and the
decode engine generates what one engine does; pages without them are refused."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from densa.disagg import wire
from densa.disagg.landing_checks import check_layout
from densa.sampling_params import SamplingParams
from tests.tiny_families import save_tiny

from .support import colocated_tokens, make_pair

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(44)]  # past the 16 tokens the indexer keeps
SMALL = {"num_kv_pages": 16, "max_model_len": 128}


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return save_tiny("glm_moe_dsa", tmp_path_factory.mktemp("glm"), smollm2_dir)


def _index_keys(engine: object, page_ids: list[int]) -> list[torch.Tensor]:
    caches = engine.runner.kv_caches  # type: ignore[attr-defined]
    return [c.index.keys[page_ids].float() for c in caches if c.index is not None]


def test_index_keys_cross_the_split_and_decode_as_one_engine(glm: Path) -> None:
    expected = colocated_tokens(glm, [PROMPT], GREEDY, **SMALL)[0]
    pair = make_pair(glm, SMALL, SMALL)
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    assert pair.tokens("r") == expected
    transfer = next(iter(pair.d_agent.transfers.values()))
    pages = transfer.reservation.dest_page_ids
    assert len(pages) == 3  # the prompt's full pages of 16 tokens
    landed = _index_keys(pair.decode, pages)
    assert len(landed) == 2 and all(bool(keys.abs().sum() > 0) for keys in landed)
    pair.assert_all_free()


def test_pages_without_their_index_keys_are_refused(glm: Path) -> None:
    pair = make_pair(glm, SMALL, SMALL)
    packed = wire.pack_pages(pair.prefill.runner.kv_caches, [0, 1])
    assert packed.layout.index is not None and len(packed.frames) == 2
    model = pair.d_agent.model
    check_layout(model, packed.layout)  # as sent: accepted
    stripped = msgspec.structs.replace(packed.layout, index=None)
    with pytest.raises(wire.WireError, match="without the index keys"):
        check_layout(model, stripped)
    wrong = msgspec.structs.replace(packed.layout.index, shape=[2, 1, 2, 1, 16, 8])
    with pytest.raises(wire.WireError, match="index keys of shape"):
        check_layout(model, msgspec.structs.replace(packed.layout, index=wrong))
