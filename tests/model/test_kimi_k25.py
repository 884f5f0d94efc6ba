"""Kimi K2.5+ (`kimi_k25`): the DeepSeek-V3 text model of a multimodal checkpoint loads from its
config's text_config and serves transformers' greedy tokens (its Kimi_K25ForConditionalGeneration,
fp32), from transformers' tensor names and from Moonshot's; the vision tower is not loaded, and a
chat request with an image part is refused with a message that says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from densa.engine.llm_engine import LLMEngine
from densa.model.arch import ArchConfig
from densa.openai.protocol import ChatCompletionRequest
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from tests.engine.reference import run_with_invariants
from tests.tiny_families import save_tiny

PROMPTS = [[1, 520, 9531, 198, 27, 1256, 42, 8000, 3, 77], [5, 17, 230, 1234, 9, 88, 4021]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return save_tiny("kimi_k25", tmp_path_factory.mktemp("kimi_k25"), smollm2_dir)


def _hf_greedy(model_dir: Path) -> list[list[int]]:
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    model = Kimi_K25ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        return [
            model.eval()
            .generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ]
            .tolist()
            for p in PROMPTS
        ]


def _densa_greedy(model_dir: Path) -> list[list[int]]:
    args = EngineArgs(model=str(model_dir), max_model_len=64, num_kv_pages=32, page_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return run_with_invariants(LLMEngine.from_args(args), PROMPTS, params)


def _moonshot_names(src: Path, out: Path) -> Path:
    """The same checkpoint under the names Moonshot's releases use (language_model.model.
    layers.*, language_model.lm_head, the vision tower under vision_tower.*)."""
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {name.replace("language_model.model.blocks.", "language_model.model.layers."): t
               for name, t in tensors.items()}  # fmt: skip
    save_file({k: v.contiguous() for k, v in renamed.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"architectures": [
        "KimiK25ForConditionalGeneration"]}))  # fmt: skip
    return out


def test_the_text_model_serves_transformers_greedy(kimi: Path, tmp_path: Path) -> None:
    arch = ArchConfig.from_dir(kimi)
    assert arch.architecture == "Kimi_K25ForConditionalGeneration"
    assert arch.mla is not None and arch.moe is not None and not arch.tie_word_embeddings
    names = load_file(str(kimi / "model.safetensors")).keys()
    assert any(n.startswith("vision_tower.") for n in names)  # there, and not loaded
    expected = _hf_greedy(kimi)
    assert _densa_greedy(kimi) == expected
    assert _densa_greedy(_moonshot_names(kimi, tmp_path / "moonshot")) == expected


def test_an_image_content_part_is_refused_by_name() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": "kimi", "messages": [{"role": "user", "content": [image]}]}
    with pytest.raises(ValidationError, match="image content parts are not supported"):
        ChatCompletionRequest.model_validate(body)
