"""What the engine process keeps in memory besides weights and KV pages (issue 21 point 1).

The HTTP front tokenizes and detokenizes; the engine only needs what its tokenizer said at load
(EOS ids, vocabulary size) and the files it hands to fronts. Holding the Rust tokenizer there
cost ~135 MB of the 1.5B's engine process (a 150k-token vocabulary)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from densa.engine.llm_engine import LLMEngine
from densa.ipc.messages import TokenizerFiles
from densa.kernels.cpu import native
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs
from densa.text.tokenizer import TOKENIZER_FILE, Tokenizer, compact_merges, read_tokenizer_files

TEXT = "The capital of France is Paris. <|im_end|> naïve café 東京"


def test_a_released_tokenizer_rebuilds_to_the_same_ids_and_text(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    ids = tokenizer.encode(TEXT)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    eos, vocab = tokenizer.eos_token_ids, tokenizer.vocab_size
    tokenizer.release()
    assert not tokenizer.is_loaded
    assert (tokenizer.eos_token_ids, tokenizer.vocab_size) == (eos, vocab)  # read at load, kept
    assert tokenizer.encode(TEXT) == ids
    assert tokenizer.is_loaded
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_a_read_tokenizer_has_string_merges_and_the_same_ids_and_text(smollm2_dir: Path) -> None:
    as_shipped = (smollm2_dir / TOKENIZER_FILE).read_text(encoding="utf-8")
    assert isinstance(json.loads(as_shipped)["model"]["merges"][0], list)  # ["a", "b"] pairs
    files = read_tokenizer_files(smollm2_dir)
    merges = json.loads(files.tokenizer_json)["model"]["merges"]
    assert merges[:2] == ["Ġ t", "Ġ a"]
    read, shipped = Tokenizer(files), Tokenizer(TokenizerFiles(as_shipped, files.config_json))
    text = TEXT + " def f(x):\n\treturn x ** 2  # ✓ 🙂" * 3
    ids = read.encode(text)
    assert ids == shipped.encode(text)
    assert read.decode(ids, skip_special_tokens=False) == shipped.decode(
        ids, skip_special_tokens=False
    )
    assert read.vocab_size == shipped.vocab_size


def test_merges_with_a_space_in_a_piece_stay_pairs() -> None:
    spaced = json.dumps({"model": {"type": "BPE", "merges": [["a", "b"], ["a b", "c"]]}})
    assert compact_merges(spaced) == spaced
    assert compact_merges("not json") == "not json"


def test_an_engine_serves_without_holding_its_rust_tokenizer(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_args(EngineArgs(model=str(tiny_model_dir), num_kv_pages=16,
                                            max_model_len=64))  # fmt: skip
    assert not engine.tokenizer.is_loaded
    assert engine.config.scheduler.eos_token_ids == engine.tokenizer.eos_token_ids != ()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request([1, 2, 3, 4, 5], params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 4  # a prefill with the first token, then three decode steps
    assert not engine.tokenizer.is_loaded  # serving token ids never rebuilt it


# Loads the bundled GGUF as scripts/serve.sh serves it (w4a8 layers, w8 head: C++ kernels; INT8
# KV: torch stores; the fused C++ decode step), prefills and samples, in a fresh interpreter.
_SERVE_WITHOUT_NUMBA = """
import json, sys
from densa.engine.llm_engine import LLMEngine
from densa.sampling_params import SamplingParams
from densa.setup.args import EngineArgs, default_model_path
engine = LLMEngine.from_args(EngineArgs(model=str(default_model_path()), kv_cache_dtype="int8",
                                        kv_cache_memory="8MiB", max_model_len=64))
engine.add_request(list(range(1, 20)), SamplingParams(temperature=0.8, seed=3, max_tokens=3,
                                                      ignore_eos=True))
while engine.has_unfinished_requests():
    engine.step()
print(json.dumps({"fused": engine.runner.model.fused_decode.enabled,
                  "numba": "numba" in sys.modules}))
"""


@pytest.mark.skipif(not native.is_available(), reason="no C++ kernels here")
def test_serving_a_gguf_through_the_cpp_kernels_never_imports_numba() -> None:
    # Numba (with llvmlite) is ~55 MiB of the engine's RSS; no kernel of this path is Numba's.
    out = subprocess.run([sys.executable, "-c", _SERVE_WITHOUT_NUMBA], check=True,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"fused": True, "numba": False}
