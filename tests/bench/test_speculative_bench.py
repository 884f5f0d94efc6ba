"""`densa bench speculative`: its prompts, the servers it starts, the run and the report (fake
peers for the mechanics), and one real `densa serve` on the bundled SmolLM2 speculating with
itself as its draft."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from densa.model.loader import resolve_model_dir
from densa.setup.args import default_model_path
from densa_bench.peers.servers import PeerSpec
from densa_bench.peers.specs import PeerContext
from densa_bench.speculative.report import build_report
from densa_bench.speculative.runner import (
    CHAT_ASK,
    CODE_EDIT_ASK,
    SOURCE_ROOT,
    SpecBenchSettings,
    SpecPrompts,
    build_variants,
    run_speculative,
)

FAKE = str(Path(__file__).with_name("fake_openai_server.py"))
PASSAGES = ["the cat sat on the mat and looked at the door", "a storm came over the hills"]


def _prompts(settings: SpecBenchSettings) -> SpecPrompts:
    """Words as tokens; the chat template shown as a tag around the user's text."""
    return SpecPrompts(
        lambda text: f"<user>{text}</user>", lambda text: text.split(), PASSAGES, settings
    )


def test_prompts_hold_a_source_file_or_a_passage_and_repeat_per_key() -> None:
    settings = SpecBenchSettings(prompt_len=40)
    maker = _prompts(settings)
    code = maker.prompts("code-edit", 3, "c3-r0")
    assert code == maker.prompts("code-edit", 3, "c3-r0")  # every variant gets the same
    assert code != maker.prompts("code-edit", 3, "c3-r1")
    for prompt in code:
        body = prompt.removeprefix("<user>```python\n").removesuffix(
            f"\n```\n\n{CODE_EDIT_ASK}</user>"
        )
        assert len(body.split()) >= 40  # cut at the first line past prompt_len tokens
        assert any(body in path.read_text() for path in maker.sources)  # a real excerpt
    chat = maker.prompts("chat", 2, "c2-r0")
    assert all(p.endswith(f"{CHAT_ASK}</user>") and "the" in p for p in chat)
    assert all(p.is_relative_to(SOURCE_ROOT) for p in maker.sources)


def test_each_method_starts_its_server_with_its_options(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))  # fmt: skip
    server = tmp_path / "llama-server"
    server.write_text("")
    ctx = PeerContext(
        gguf=tmp_path / "target.gguf", hf_dir=tmp_path / "hf", llama_server=server, threads=2,
        max_concurrency=4, context_len=256, output_len=8,
    )  # fmt: skip
    draft = tmp_path / "draft.gguf"
    settings = SpecBenchSettings(num_speculative_tokens=3)
    with pytest.MonkeyPatch.context() as patch:  # the file's own types label densa's rows
        patch.setattr(PeerContext, "stored_types", lambda self: {"linear": "Q4_K", "head": "Q6_K"})
        specs = {s.name: s for s in build_variants(settings, ctx, draft)}
    assert list(specs) == ["densa off", "densa ngram", "densa draft", "llama.cpp draft"]
    assert "--speculative-method" not in specs["densa off"].argv
    ngram, drafted, llama = (
        specs["densa ngram"].argv,
        specs["densa draft"].argv,
        specs["llama.cpp draft"].argv,
    )
    assert ngram[-4:] == ("--speculative-method", "ngram", "--num-speculative-tokens", "3")
    assert drafted[-4:] == ("--speculative-model", str(draft), "--num-speculative-tokens", "3")
    assert llama[0] == str(server)
    assert llama[-8:] == ("-md", str(draft), "--spec-type", "draft-simple",
                          "--spec-draft-n-max", "3", "-td", "2")  # fmt: skip
    assert all("--kv-cache-dtype" in specs[n].argv for n in ("densa off", "densa draft"))


def _fake(name: str, engine: str, *options: str) -> PeerSpec:
    return PeerSpec(
        name=name, engine=engine, argv=(sys.executable, FAKE, "--port", "{port}", *options),
        model="fake", extra_body={"ignore_eos": True}, ready_path="/health", start_timeout_s=60,
    )  # fmt: skip


def test_fake_variants_run_interleaved_and_report_acceptance(tmp_path: Path) -> None:
    settings = SpecBenchSettings(
        concurrency=(1, 2), prompt_len=16, output_len=6, warmup=0, workloads=("code-edit",)
    )
    specs = [
        _fake("densa off", "densa", "--token-delay", "0.02"),
        _fake("densa draft", "densa", "--token-delay", "0.005", "--tokens-per-event", "3"),
        _fake("llama.cpp draft", "llama.cpp", "--token-delay", "0.01", "--draft-timings", "8,6"),
    ]
    seen: list[int] = []
    waves, variants = run_speculative(
        specs, settings, _prompts(settings), tmp_path / "logs", lambda w, _: seen.append(len(w))
    )
    assert seen == list(range(1, 7))  # a report can be written after every wave
    order = [(w.workload, w.peer_wave.wave.engine, w.peer_wave.wave.concurrency) for w in waves]
    assert order == [("code-edit", s.name, c) for c in (1, 2) for s in specs]
    report = build_report(waves, variants, {"what": "test"})
    report.write(tmp_path / "out")
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {(r["variant"], r["concurrency"]): r for r in data["summary"] if r["kind"] == "variant"}
    assert rows[("densa draft", 1)]["tokens_per_event"] == 3.0
    assert rows[("densa off", 2)]["tokens_per_event"] == 1.0
    assert rows[("llama.cpp draft", 2)]["draft_acceptance"] == 0.75
    assert rows[("densa draft", 1)]["draft_acceptance"] is None
    goals = {g["goal"]: g for g in data["summary"] if g["kind"] == "goal"}
    speedup = goals["c=1 code-edit TPOT: densa draft vs off"]
    assert speedup["ratio"] > 1.5 and speedup["met"] == (speedup["ratio"] >= 2.0)
    assert goals["largest c code-edit tok/s: densa draft vs off"]["concurrency"] == 2
    assert (tmp_path / "out" / "code_edit_tpot_s.png").exists()
    assert "| densa draft | 1 |" in (tmp_path / "out" / "README.md").read_text()


def test_no_wave_starts_once_the_time_budget_is_spent(tmp_path: Path) -> None:
    settings = SpecBenchSettings(
        concurrency=(1,), prompt_len=16, output_len=4, warmup=0, workloads=("chat",),
        time_budget_s=0.0,
    )  # fmt: skip
    specs = [_fake("densa off", "densa")]
    waves, variants = run_speculative(specs, settings, _prompts(settings), tmp_path / "logs")
    assert waves == [] and list(variants) == ["densa off"]


def test_densa_serve_speculates_through_the_bench(tmp_path: Path) -> None:
    """The bundled SmolLM2 drafting for itself: every proposal is accepted, so each streamed
    event carries several tokens."""
    from densa.text.tokenizer import Tokenizer
    from densa_bench.peers.specs import PeerContext as Context

    gguf = Path(default_model_path())
    hf_dir = resolve_model_dir(str(gguf))
    settings = SpecBenchSettings(
        concurrency=(1,), prompt_len=24, output_len=9, warmup=0, workloads=("code-edit",),
        methods=("draft",), num_speculative_tokens=4,
    )  # fmt: skip
    ctx = Context(
        gguf=gguf, hf_dir=hf_dir, llama_server=None, threads=2, max_concurrency=1,
        context_len=512, output_len=9,
    )  # fmt: skip
    tokenizer = Tokenizer.from_dir(hf_dir)
    prompts = SpecPrompts(
        lambda text: tokenizer.render_chat([{"role": "user", "content": text}]),
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        [],
        settings,
    )
    # The draft is the target itself: estimated, each guess costs a whole target step and k
    # would (rightly) stay 0. This test is of the bench's counting, so guesses are made free.
    variants = [dataclasses.replace(v, argv=(*v.argv, "--speculative-proposer-cost", "0"))
                for v in build_variants(settings, ctx, gguf)]  # fmt: skip
    waves, _ = run_speculative(variants, settings, prompts, tmp_path / "logs")
    (wave,) = waves
    (request,) = wave.peer_wave.requests
    assert request.completion_tokens == 9
    # 1 token from the prompt's step, then one event per verified step of 1 + accepted tokens.
    # The draft computes the same weights in other chunk shapes (its catch-up rows go through
    # prefill attention, docs/architecture.md 'Batch invariance'), so a near-tie may reject a
    # guess: the counts are checked against the stream, not assumed all-accepted.
    num_steps = len(request.event_s) - 1
    proposed, accepted = wave.spec_counters or (0, 0)  # densa's /metrics over the wave
    assert accepted == request.completion_tokens - 1 - num_steps
    assert accepted <= proposed <= 4 * num_steps
    assert num_steps <= 4  # 8 tokens after the first in at most 4 steps: guesses were taken
