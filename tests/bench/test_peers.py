"""`densa bench peers` without llama.cpp: fake OpenAI-compatible peers (real processes, real
HTTP, the real openai client) check the interleaving, the per-token timing, the report and the
goal ratios, and that a peer which does not produce exactly output_len tokens fails the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from densa_bench.common.openai_load import StreamedRequest
from densa_bench.peers.report import build_report
from densa_bench.peers.runner import PeersSettings, PromptMaker, run_peers
from densa_bench.peers.servers import PeerSpec
from densa_bench.peers.specs import AVX2_ENV, PeerContext, build_specs

FAKE = str(Path(__file__).with_name("fake_openai_server.py"))
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def _fake(name: str, engine: str, *options: str, forced: bool = True) -> PeerSpec:
    return PeerSpec(
        name=name,
        engine=engine,
        argv=(sys.executable, FAKE, "--port", "{port}", *options),
        model="fake",
        formats={"linear": f"{name} weights"},
        extra_body={"ignore_eos": True} if forced else {},
        ready_path="/health",
        start_timeout_s=60,
    )


def _prompts(settings: PeersSettings) -> PromptMaker:
    return PromptMaker(
        [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))],
        encode=lambda text: [len(w) for w in text.split()],
        decode=lambda ids: " ".join("w" for _ in ids),
        settings=settings,
    )


def test_timing_spreads_packed_events_over_their_tokens() -> None:
    record = StreamedRequest(submit_s=0.0, event_s=[1.0, 2.0, 3.0], completion_tokens=6)
    timing = record.timing()
    assert timing.token_s == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert timing.ttft_s == 1.0
    assert timing.tpot_s == pytest.approx(2.0 / 5)


def test_prompts_are_cut_to_length_and_repeat_per_key() -> None:
    settings = PeersSettings(prompt_len=20)
    maker = _prompts(settings)
    first, second = maker.prompts(3, "c3-r0"), maker.prompts(3, "c3-r0")
    assert first == second  # the same key gives every peer the same prompts
    assert all(len(p.split()) == 20 for p in first)


def test_fake_peers_run_interleaved_and_report(tmp_path: Path) -> None:
    settings = PeersSettings(concurrency=(1, 2), prompt_len=8, output_len=6, repeats=2, warmup=1)
    specs = [
        _fake("densa fake", "densa", "--token-delay", "0.002"),
        _fake("llama fake", "llama.cpp", "--token-delay", "0.004", "--tokens-per-event", "2"),
    ]
    waves, peers = run_peers(specs, settings, _prompts(settings), tmp_path / "logs")
    order = [(w.wave.engine, w.wave.concurrency, w.wave.repeat_idx) for w in waves]
    assert order == [
        ("densa fake", 1, 0),
        ("llama fake", 1, 0),
        ("densa fake", 2, 0),
        ("llama fake", 2, 0),
        ("densa fake", 1, 1),
        ("llama fake", 1, 1),
        ("densa fake", 2, 1),
        ("llama fake", 2, 1),
    ]
    for peer_wave in waves:
        assert [r.completion_tokens for r in peer_wave.requests] == [6] * peer_wave.wave.concurrency
        assert all(r.text.split() == ["forced"] * 6 for r in peer_wave.requests)  # extra_body sent
        assert all(t.num_output_tokens == 6 for t in peer_wave.wave.requests)
        assert all(r.prompt_tokens == 8 for r in peer_wave.requests)
        # The fake waits first_delay, then token_delay per token after each event: the last
        # token cannot arrive sooner (arrival gaps can shrink: events may be read together).
        delay, per_event = (0.002, 1) if peer_wave.wave.engine == "densa fake" else (0.004, 2)
        floor = 0.01 + (6 // per_event - 1) * per_event * delay
        assert all(t.e2e_s >= floor * 0.95 for t in peer_wave.wave.requests)
        assert peer_wave.wave.peak_rss_bytes > 0
    llama_events = {
        len(r.event_s) for w in waves if w.wave.engine == "llama fake" for r in w.requests
    }
    assert llama_events == {3}  # 2 tokens per event

    report = build_report(waves, peers, {"what": "test"})
    paths = report.write(tmp_path / "out")
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    kinds = {row["kind"] for row in data["summary"]}
    assert kinds == {"peer", "ratio", "goal"}
    goals = [row for row in data["summary"] if row["kind"] == "goal"]
    decode_goal = next(g for g in goals if g["goal"].startswith("c=1 decode"))
    assert decode_goal["peer"] == "densa fake" and decode_goal["versus"] == "llama fake"
    assert decode_goal["ratio"] > 0
    assert {p.name for p in paths} >= {"results.json", "README.md", "output_tok_s.png"}
    assert "densa fake weights" in (tmp_path / "out" / "README.md").read_text()


def test_a_peer_that_stops_early_fails_the_run(tmp_path: Path) -> None:
    settings = PeersSettings(concurrency=(1,), prompt_len=8, output_len=6, repeats=1, warmup=0)
    specs = [_fake("short fake", "densa", "--short-by", "2")]
    with pytest.raises(RuntimeError, match="do not force the output length"):
        run_peers(specs, settings, _prompts(settings), tmp_path / "logs")


def _context(tmp_path: Path) -> PeerContext:
    """8 slots of 128 tokens of a model shaped like Qwen2.5-1.5B (28 layers, 2 KV heads of 128)."""
    (tmp_path / "hf").mkdir()
    shape = {"num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**shape, "hidden_size": 1536}))
    return PeerContext(
        gguf=tmp_path / "m.gguf", hf_dir=tmp_path / "hf", llama_server=None, threads=2,
        max_concurrency=8, context_len=128, output_len=8,
    )  # fmt: skip


def test_densa_gets_the_kv_memory_llama_server_has(tmp_path: Path) -> None:
    """llama-server holds f16 K and V for 8 x 128 tokens: 28 layers x 2 heads x 128 x 2 x 2 bytes
    = 28 KiB a token, 28 MiB in all; densa's pages get the same bytes (INT8 fits ~2x the tokens)."""
    ctx = _context(tmp_path)
    assert ctx.llama_kv_bytes == 28 * 2 * 128 * 2 * 2 * 8 * 128
    (densa,) = build_specs(["densa"], ctx)
    argv = list(densa.argv)
    assert argv[argv.index("--kv-cache-memory") + 1] == "28MiB"


def test_avx2_peers_run_no_avx512_code_and_the_others_run_native(tmp_path: Path) -> None:
    """densa-avx2 and transformers-avx2 force densa's kernels and torch's (aten, MKL, oneDNN)
    onto AVX2, so an AVX-512 machine can stand in for an AVX2 one; the other peers are native."""
    ctx = _context(tmp_path)
    specs = build_specs(["densa-avx2", "transformers-avx2", "densa", "transformers"], ctx)
    avx2, native = specs[:2], specs[2:]
    for spec in avx2:
        assert AVX2_ENV.items() <= spec.env.items(), spec.name
        assert spec.env["OMP_NUM_THREADS"] == "2"
    assert {"DENSA_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"} <= set(AVX2_ENV)
    for spec in native:
        assert not set(AVX2_ENV) & set(spec.env), spec.name
    assert avx2[1].engine == "transformers"  # the goals compare densa with it by engine


def test_the_memory_goal_is_met_below_its_ratio_at_the_largest_concurrency() -> None:
    """Speed goals are met at >= their ratio; peak RSS at <= 1.2x llama.cpp's, taken at the
    largest concurrency both ran (where the KV pages and activations are the largest)."""
    from densa_bench.peers.report import _goals

    def row(peer: str, c: int, rss: int, prefill: float) -> dict[str, object]:
        speed = {"decode_tok_s": 1.0, "output_tok_s": 1.0, "prefill_tok_s": prefill}
        return {"peer": peer, "concurrency": c, "peak_rss_bytes": rss, **speed}

    peers = {"d": {"engine": "densa"}, "l": {"engine": "llama.cpp"}}
    summary = [row("d", 1, 100, 300.0), row("l", 1, 100, 150.0), row("d", 64, 130, 1.0)]
    summary.append(row("l", 64, 100, 1.0))
    goals = {g["goal"]: g for g in _goals(summary, peers)}
    memory = goals["peak RSS (largest c) vs llama.cpp"]
    assert memory["ratio"] == pytest.approx(1.3) and not memory["met"]
    assert goals["prefill tok/s (c=1) vs llama.cpp"]["met"]
    summary[2] = row("d", 64, 110, 1.0)
    assert next(g for g in _goals(summary, peers) if g["goal"].startswith("peak RSS"))["met"]


def test_several_prompt_lengths_interleave_and_report_per_length(tmp_path: Path) -> None:
    settings = PeersSettings(concurrency=(1,), prompt_len=8, prompt_lens=(8, 16), output_len=4,
                             repeats=1, warmup=0)  # fmt: skip
    specs = [
        _fake("densa fake", "densa", "--token-delay", "0.002"),
        _fake("llama fake", "llama.cpp", "--token-delay", "0.004"),
    ]
    waves, peers = run_peers(specs, settings, _prompts(settings), tmp_path / "logs")
    order = [(w.wave.engine, w.target_len) for w in waves]
    assert order == [("densa fake", 8), ("llama fake", 8), ("densa fake", 16), ("llama fake", 16)]
    assert [w.wave.prompt_len for w in waves] == [8, 8, 16, 16]
    report = build_report(waves, peers, {"what": "test"})
    rows = [r for r in report.summary if r["kind"] == "peer"]
    assert sorted((r["peer"], r["prompt_len"]) for r in rows) == [
        ("densa fake", 8), ("densa fake", 16), ("llama fake", 8), ("llama fake", 16),
    ]  # fmt: skip
    ratios = [r for r in report.summary if r["kind"] == "ratio"]
    assert sorted(r["prompt_len"] for r in ratios) == [8, 16]
    # The short-prompt goals apply to the shortest length; none is stated at 8 or 16 tokens.
    goals = {g["goal"] for g in report.summary if g["kind"] == "goal"}
    assert "c=1 decode tok/s vs llama.cpp" in goals
    assert not any("32k" in g for g in goals)
    assert {p.name for p in report.plots} == {
        "ttft_by_length",
        "prefill_by_length",
        "tpot_by_length",
    }
