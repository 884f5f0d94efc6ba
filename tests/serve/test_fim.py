"""Fill-in-the-middle on the real Qwen2.5-Coder-0.5B: `suffix` on /v1/completions and llama.cpp's
/infill build their prompts from the model's FIM tokens, in llama.cpp's layout (openai/fim.py),
and the model fills the gap; a model whose tokenizer has no FIM tokens (SmolLM2-135M's) gets a
400 naming the field."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from densa.engine.client import EngineClient
from densa.ipc.messages import AddRequest, RequestDelta
from densa.model.loader import resolve_model_dir
from densa.openai import fim
from densa.text.tokenizer import Tokenizer

from .support import MODEL_NAME, RunningServer, engine_client, running_server

MODEL = "qwen2.5-coder-0.5b"
# Qwen2.5-Coder's FIM tokens.
PRE, MID, SUF, PAD, REPO, SEP, END = 151659, 151660, 151661, 151662, 151663, 151664, 151643
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\n\nprint(add(2, 3))\n"
EXTRA = [{"filename": "util.py", "text": "def double(x):\n    return x * 2\n"}]


class PromptRecorder(EngineClient):
    """An EngineClient that keeps the prompt tokens of every request it sends to the engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    async def generate(self, request: AddRequest) -> AsyncGenerator[RequestDelta, None]:
        self.prompts.append(list(request.prompt_token_ids))
        async for delta in super().generate(request):
            yield delta


@pytest.fixture(scope="module")
def qwen_dir(real_model: Callable[[str], Path]) -> Path:
    return resolve_model_dir(str(real_model(MODEL)))


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> Iterator[RunningServer]:
    with running_server(engine_client(qwen_dir, PromptRecorder, max_model_len=1024)) as running:
        yield running


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=120)


# ---- the prompts ----------------------------------------------------------------------------
def test_the_fim_tokens_are_found_by_their_spelling(qwen_tokenizer: Tokenizer) -> None:
    tokens = fim.fim_tokens(qwen_tokenizer)
    assert (tokens.prefix, tokens.suffix, tokens.middle) == (PRE, SUF, MID)
    assert (tokens.repo, tokens.file_sep, tokens.pad, tokens.end) == (REPO, SEP, PAD, END)
    assert set(tokens.stop_token_ids) == {PAD, REPO, SEP, END}


def test_a_completion_suffix_is_qwens_file_level_form(qwen_tokenizer: Tokenizer) -> None:
    tok = qwen_tokenizer
    prompt = fim.completion_prompt(tok, PREFIX, SUFFIX).token_ids
    plain = [PRE, *tok.encode(PREFIX, False), SUF, *tok.encode(SUFFIX, False), MID]
    assert prompt == plain
    # What Qwen's own recipe encodes: the markers spelled in the text.
    assert prompt == tok.encode(f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")


def test_infill_is_llama_cpps_repo_level_layout(qwen_tokenizer: Tokenizer) -> None:
    tok = qwen_tokenizer
    extra = [fim.ExtraChunk(c["text"], c["filename"]) for c in EXTRA]
    prompt = fim.infill_prompt(tok, PREFIX, SUFFIX, extra, prompt="    ").token_ids

    def text(s: str) -> list[int]:
        return tok.encode(s, False)

    assert prompt == [REPO, *text("myproject\n"), SEP, *text("util.py\n"), *text(EXTRA[0]["text"]),
                      SEP, *text("filename\n"), PRE, *text(PREFIX), *text("    "), SUF,
                      *text(SUFFIX), MID]  # fmt: skip


def test_code_that_spells_a_marker_stays_text(qwen_tokenizer: Tokenizer) -> None:
    tricky = 'MARK = "<|fim_suffix|>"  # <|file_sep|>\n'
    prompt = fim.completion_prompt(qwen_tokenizer, tricky, SUFFIX).token_ids
    assert prompt.count(SUF) == 1 and SEP not in prompt
    assert qwen_tokenizer.decode(prompt, False).startswith(f"<|fim_prefix|>{tricky}<|fim_suffix|>")
    extra = [fim.ExtraChunk(tricky, "<|repo_name|>.py")]
    infill = fim.infill_prompt(qwen_tokenizer, tricky, tricky, extra).token_ids
    assert [infill.count(t) for t in (REPO, SEP, PRE, SUF, MID)] == [1, 2, 1, 1, 1]


def test_extra_context_is_cut_from_its_start_to_fit(qwen_tokenizer: Tokenizer) -> None:
    chunks = [fim.ExtraChunk(f"x{i} = {i}\n" * 20, f"f{i}.py") for i in range(4)]
    whole = fim.infill_prompt(qwen_tokenizer, PREFIX, SUFFIX, chunks)
    cut = fim.infill_prompt(qwen_tokenizer, PREFIX, SUFFIX, chunks, max_prompt_tokens=100)
    assert whole.num_extra_dropped == 0 and len(cut.token_ids) == 100
    assert cut.num_extra_dropped == len(whole.token_ids) - 100
    assert cut.token_ids == whole.token_ids[cut.num_extra_dropped :]  # the newest context kept


def test_a_model_without_fim_tokens_is_refused(smollm2_dir: Path) -> None:
    with pytest.raises(fim.FimUnsupported, match="cannot fill in the middle"):
        fim.fim_tokens(Tokenizer.from_dir(smollm2_dir))


# ---- over HTTP, on the real model -----------------------------------------------------------
def test_a_completion_with_a_suffix_fills_the_gap(
    qwen: RunningServer, qwen_tokenizer: Tokenizer
) -> None:
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 16, "temperature": 0}
    response = _post(qwen, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (
        qwen.engine.prompts[-1] == fim.completion_prompt(qwen_tokenizer, PREFIX, SUFFIX).token_ids
    )
    # The instruct 0.5B fills the line, then may go on a line or two (editors keep the first).
    assert choice["text"].split("\n")[0] == "a + b", choice
    assert choice["finish_reason"] == "stop"  # ended by a FIM end token, not the length


def test_a_suffix_with_the_clients_whole_stop_token_ids_bound_is_served(
    qwen: RunningServer,
) -> None:
    """16 stop_token_ids (the API's bound) plus the FIM separators the server adds: served, not a
    500 from the engine's own bound (the server's ids do not count against the client's)."""
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4, "temperature": 0,
            "stop_token_ids": list(range(1000, 1016))}  # fmt: skip
    response = _post(qwen, "/v1/completions", body)
    assert response.status_code == 200, response.text


def test_infill_fills_the_gap_in_llama_cpps_shape(
    qwen: RunningServer, qwen_tokenizer: Tokenizer
) -> None:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
            "n_predict": 16, "temperature": 0, "cache_prompt": True}  # fmt: skip
    response = _post(qwen, "/infill", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    extra = [fim.ExtraChunk(c["text"], c["filename"]) for c in EXTRA]
    expected = fim.infill_prompt(qwen_tokenizer, PREFIX, SUFFIX, extra).token_ids
    assert qwen.engine.prompts[-1] == expected
    # The instruct 0.5B writes the line, then (repo-level) often talks about the code.
    assert answer["content"].split("\n")[0] == "a + b", answer
    assert answer["stop"] is True and answer["model"] == MODEL_NAME
    num_predicted = answer["tokens_predicted"]
    assert answer["stop_type"] == ("limit" if num_predicted == 16 else "eos"), answer
    assert answer["tokens_evaluated"] == len(expected) and answer["truncated"] is False
    assert answer["tokens_cached"] == 0 and 3 <= num_predicted <= 16

    stream = {**body, "stream": True}
    with httpx.stream("POST", qwen.base_url + "/infill", json=stream, timeout=120) as events:
        data = [line[6:] for line in events.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == answer["content"]
    assert chunks[-1]["tokens_cached"] > 0  # the same prompt again: its full pages were cached


def test_n_predict_0_only_warms_the_cache(qwen: RunningServer) -> None:
    body = {"input_prefix": "import os\n\n" + PREFIX, "input_suffix": SUFFIX, "n_predict": 0}
    warm = _post(qwen, "/infill", body).json()
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "limit")
    assert warm["tokens_cached"] == 0
    again = _post(qwen, "/infill", {**body, "n_predict": 4, "temperature": 0}).json()
    # Every full page of the prompt but one token (which is always computed) was cached.
    assert again["tokens_cached"] == (warm["tokens_evaluated"] - 1) // 16 * 16 > 0
    assert again["tokens_predicted"] > 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX}, "suffix"),
        ("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX}, "input_prefix"),
    ],
)
def test_fim_on_a_model_without_fim_tokens_is_a_400(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    response = _post(server, path, body)  # the tiny model: SmolLM2-135M's tokenizer
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_value"
    assert error["param"] == param
    assert "<|fim_prefix|>" in error["message"] and "Qwen2.5-Coder" in error["message"]
    server.wait_idle()


@pytest.mark.parametrize(
    "body",
    [
        {"input_suffix": ""},  # no input_prefix
        {"input_prefix": "", "input_suffix": "", "input_extra": {}},
        {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]},  # no text
    ],
)
def test_infill_refuses_what_llama_cpp_refuses(server: RunningServer, body: dict[str, Any]) -> None:
    response = _post(server, "/infill", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] in ("invalid_value", "missing_required_parameter")
