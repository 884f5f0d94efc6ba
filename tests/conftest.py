"""Shared fixtures: the real SmolLM2-135M (converted once from the bundled GGUF), the catalog's
real models (`real_model`) and tiny random models.

Tiny models use SmolLM2's tokenizer (so text round-trips) with random weights from a fixed seed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter. Triton fixes the mode when it is
# first imported, so the switch is set before any test can import it (tests/gpu, tests/quant).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from densa.model.catalog import (
    SETUP_COMMAND,
    default_cache_dir,
    find_model,
    missing_packages,
    resolve_model,
)
from densa.model.loader import resolve_model_dir
from densa.setup.args import default_model_path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


_SUITE_CACHE: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """The suite converts hundreds of GGUF files it writes (a config and tokenizer each) and
    servers it starts convert them again: all of that goes to a cache of its own, removed at
    the end, not into the user's ~/.cache/densa. Installed models (`scripts/setup.sh models`)
    are linked in. DENSA_CACHE_DIR set by the caller is kept."""
    global _SUITE_CACHE
    if "DENSA_CACHE_DIR" in os.environ:
        return
    models = default_cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    _SUITE_CACHE = Path(tempfile.mkdtemp(prefix="densa-suite-cache-"))
    (_SUITE_CACHE / "models").symlink_to(models, target_is_directory=True)
    os.environ["DENSA_CACHE_DIR"] = str(_SUITE_CACHE)  # servers the tests start inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SUITE_CACHE is not None:
        os.environ.pop("DENSA_CACHE_DIR", None)
        shutil.rmtree(_SUITE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model_dir(default_model_path())


@pytest.fixture(scope="session")
def real_model() -> Callable[[str], Path]:
    """`real_model("qwen2.5-coder-0.5b")`: a catalog model's assembled GGUF (densa/model/catalog.py),
    or a skip that names the setup step when its packages are not installed. CI installs the 0.5B
    (`scripts/setup.sh models-small`); `scripts/setup.sh models` adds the 1.5B."""

    def get(name: str) -> Path:
        model = find_model(name)
        assert model is not None, f"{name!r} is not in densa/model/catalog.py"
        missing = missing_packages(model)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            pytest.skip(f"{SETUP_COMMAND} not run: package {missing[0]} missing{more}")
        return resolve_model(name)

    return get


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests that use a real model carry the marker, so `-m "not real_model"` leaves them out.
    for item in items:
        if "real_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)


def make_tiny_llama(
    out_dir: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    **overrides: object,
) -> Path:
    """Save a random-weight Llama (HF format, float32) that shares SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, object] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    # Larger-than-default weights make the logits less flat, so greedy ties are rare.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.08)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture
def forced_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Force the native kernels' code path (`request.param`, e.g. "avx2") for one test:
    parametrize with indirect=True."""
    from densa.kernels.cpu import native

    monkeypatch.setenv(native.ISA_ENV, request.param)
    native.isa.cache_clear()
    yield request.param
    monkeypatch.delenv(native.ISA_ENV)
    native.isa.cache_clear()
