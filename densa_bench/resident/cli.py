"""`densa bench resident`: sessions of `--session-len` tokens admitted one after another into a
KV budget of `--kv-budget`; then each returns (newest first) with one more line, and a return
whose prompt the server finds in its cache (>= 90% of it) was resident. The count of resident
sessions is the measurement; the arithmetic of each format is printed beside it.

Engines: densa with its pages in `--kv-cache-memory BUDGET` (INT8, FP8, ...: one server per
format, every session a request; the pool keeps finished sessions' pages as prefix cache, least
recently used out first); llama-server with one slot per session it can hold (`-np N`,
`-c N x session-len`, non-unified: a slot keeps its last prompt's KV) for the most N whose KV
buffer, as the server itself reports it at start-up, stays within the budget, for each
`-ctk/-ctv` type (q8_0, f16), and `--cache-ram 0` so that only the KV buffer holds prompts.

A full-size run (8 GiB, 32k-token sessions) prefills ~600k tokens per engine; the same ratio of
budget to session length at 1/16 the size (512 MiB, 2,048 tokens) gives the same counts up to
page rounding, in minutes: `--kv-budget 512MiB --session-len 2048`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densa_bench.peers.cli import find_llama_server
from densa_bench.peers.servers import PeerServer, PeerSpec

HIT_SHARE = 0.9  # a return counts as resident when this much of its prompt was cached
OUTPUT_TOKENS = 8
DENSA_FORMATS = ("int8", "fp8_e4m3", "bfloat16")
LLAMA_TYPES = ("q8_0", "f16")


def add_resident_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "resident",
        help="how many long sessions a KV budget keeps resident, densa vs llama-server",
        description=__doc__.split("\n\n")[0],
    )
    g = parser.add_argument_group("benchmark")
    g.add_argument("--kv-budget", default="512MiB", help="KV memory (densa: --kv-cache-memory)")
    g.add_argument("--session-len", type=int, default=2048, help="tokens per session")
    g.add_argument(
        "--densa-formats", nargs="*", default=["int8", "fp8_e4m3"], choices=DENSA_FORMATS
    )
    g.add_argument("--llama-types", nargs="*", default=list(LLAMA_TYPES), choices=LLAMA_TYPES)
    g.add_argument(
        "--extra-sessions",
        type=int,
        default=2,
        help="sessions sent beyond the most the arithmetic says fit",
    )
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--model", default="qwen2.5-coder-1.5b")
    g.add_argument("--llama-server", type=Path, default=None)
    g.add_argument("--out", type=Path, default=Path("docs/benchmarks/resident"))
    parser.set_defaults(handler=_resident)


@dataclass
class Result:
    engine: str
    kv_type: str
    sessions_sent: int
    resident: int
    computed: int  # what the format's bytes per token say
    kv_buffer_bytes: int  # what the server allocated (densa: its pages; llama: its log)
    returns: list[dict[str, Any]]
    wall_s: float


def _resident(ns: argparse.Namespace) -> int:
    from densa.model.catalog import resolve_model_arg
    from densa.model.loader import resolve_model_dir
    from densa.quant.calibration_data import lambada_passages
    from densa.text.tokenizer import Tokenizer
    from densa.utils.cpu import usable_cpus
    from densa.utils.sizes import parse_memory
    from densa_bench.resident.report import build_report

    budget = int(parse_memory(ns.kv_budget))
    gguf = Path(resolve_model_arg(ns.model))
    hf_dir = resolve_model_dir(str(gguf))
    tokenizer = Tokenizer.from_dir(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    threads = ns.threads or usable_cpus()
    # A session is session_len tokens: its prompt, then OUTPUT_TOKENS generated.
    passages, texts = lambada_passages(), list[str]()

    def texts_for(count: int) -> list[str]:
        """The first `count` sessions' texts (the same texts for every engine), made as needed:
        a budget may hold more sessions than any fixed list."""
        if len(texts) < count:
            length = ns.session_len - OUTPUT_TOKENS - 4
            texts[:] = _session_texts(passages, tokenizer, length, count)
        return texts[:count]

    log_dir = ns.out / "logs"
    results = []
    for kv in ns.densa_formats:
        computed = _densa_fits(config, kv, budget, ns.session_len)
        spec = _densa_spec(
            gguf, kv, ns.kv_budget, ns.session_len, computed + ns.extra_sessions, threads
        )
        results.append(
            _measure(
                spec, f"densa {kv}", kv, texts_for(computed + ns.extra_sessions), computed, log_dir
            )
        )
        _write(results, ns, budget)
    llama = find_llama_server(ns.llama_server)
    for kv in ns.llama_types:
        if llama is None:
            print("densa bench resident: no llama-server (scripts/setup.sh peers)", file=sys.stderr)
            break
        estimate = budget // (ns.session_len * _llama_token_bytes(config, kv))
        slots, kv_bytes = _llama_slots(
            llama, gguf, kv, budget, ns.session_len, threads, log_dir, max(1, estimate)
        )
        spec = _llama_spec(llama, gguf, kv, slots, ns.session_len, threads)
        result = _measure(
            spec, f"llama.cpp {kv}", kv, texts_for(slots + ns.extra_sessions), slots, log_dir
        )
        result.kv_buffer_bytes = kv_bytes
        results.append(result)
        _write(results, ns, budget)
    report = build_report(results, _settings(ns, budget, gguf))
    for table in report.tables:
        print(table.to_markdown() + "\n")
    return 0


def _write(results: list[Result], ns: argparse.Namespace, budget: int) -> None:
    from densa_bench.resident.report import build_report

    build_report(results, _settings(ns, budget, Path(ns.model))).write(ns.out)


def _settings(ns: argparse.Namespace, budget: int, gguf: Path) -> dict[str, Any]:
    return {
        "kv_budget_bytes": budget,
        "session_len": ns.session_len,
        "model": str(gguf),
        "hit_share": HIT_SHARE,
        "extra_sessions": ns.extra_sessions,
    }


def _session_texts(passages: list[str], tokenizer: Any, length: int, count: int) -> list[str]:
    """`count` distinct texts of ~`length` tokens (LAMBADA passages joined, no shared prefix)."""
    texts, cursor = [], 0
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(passages[cursor % len(passages)] + "\n\n", False)
            cursor += 1
        texts.append(tokenizer.decode(ids[:length]))
    return texts


# ---- densa ------------------------------------------------------------------------------------
def _densa_fits(config: dict[str, Any], kv: str, budget: int, session_len: int) -> int:
    """Sessions the budget's whole pages hold (docs/kv-cache.md's bytes per token)."""
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_value = {"int8": dim + 2, "fp8_e4m3": dim + 1, "bfloat16": 2 * dim}[kv]
    page = 16 * 2 * layers * heads * per_value
    return (budget // page) // -(-session_len // 16)


def _densa_spec(
    gguf: Path, kv: str, budget: str, session_len: int, seqs: int, threads: int
) -> PeerSpec:
    argv = (
        sys.executable,
        "-m",
        "densa.cli",
        "serve",
        "--port",
        "{port}",
        "--model",
        str(gguf),
        "--served-model-name",
        "m",
        "--kv-cache-dtype",
        kv,
        "--kv-cache-memory",
        budget,
        "--max-model-len",
        str(session_len),
        "--max-num-seqs",
        str(max(seqs, 1)),
    )
    return PeerSpec(
        name=f"densa {kv}",
        engine="densa",
        argv=argv,
        model="m",
        extra_body={"ignore_eos": True},
        env={"OMP_NUM_THREADS": str(threads)},
    )


# ---- llama-server -----------------------------------------------------------------------------
_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB")  # logged at -lv 4


def _llama_argv(
    llama: Path, gguf: Path, kv: str, slots: int, session_len: int, threads: int
) -> tuple[str, ...]:
    return (
        str(llama),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * session_len),
        "-ctk",
        kv,
        "-ctv",
        kv,
        "-fa",
        "on",
        "-no-kvu",
        "--cache-ram",
        "0",
        "--alias",
        "m",
        "--no-webui",
    )


def _llama_spec(
    llama: Path, gguf: Path, kv: str, slots: int, session_len: int, threads: int
) -> PeerSpec:
    return PeerSpec(
        name=f"llama.cpp {kv}",
        engine="llama.cpp",
        argv=_llama_argv(llama, gguf, kv, slots, session_len, threads),
        model="m",
        extra_body={"ignore_eos": True, "cache_prompt": True},
        ready_path="/health",
    )


def _llama_token_bytes(config: dict[str, Any], kv: str) -> int:
    """K and V bytes per token in a ggml type (q8_0: 34 bytes per 32 values)."""
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    values = 2 * layers * heads * dim
    return values * 2 if kv == "f16" else values * 34 // 32


def _llama_slots(
    llama: Path,
    gguf: Path,
    kv: str,
    budget: int,
    session_len: int,
    threads: int,
    log_dir: Path,
    estimate: int,
) -> tuple[int, int]:
    """The most slots of session_len tokens whose KV buffer, as llama-server reports it at
    start-up, fits the budget: starts at `estimate` and steps until the answer is bracketed."""
    sizes: dict[int, int] = {}

    def size(slots: int) -> int:
        if slots not in sizes:
            spec = PeerSpec(
                name=f"llama.cpp {kv} probe {slots}",
                engine="llama.cpp",
                argv=(*_llama_argv(llama, gguf, kv, slots, session_len, threads), "-lv", "4"),
                model="m",
                ready_path="/health",
            )
            server = PeerServer(spec, log_dir)
            with server:
                sizes[slots] = _llama_kv_bytes(server.log_path)
        return sizes[slots]

    slots = estimate
    while slots > 1 and size(slots) > budget:
        slots -= 1
    while size(slots + 1) <= budget:
        slots += 1
    return slots, size(slots)


def _llama_kv_bytes(log: Path) -> int:
    total = sum(float(m) for m in _KV_SIZE.findall(log.read_text(errors="replace")))
    if not total:
        raise RuntimeError(f"no KV size line in {log}")
    return int(total * 2**20)


# ---- the measurement --------------------------------------------------------------------------
def _measure(
    spec: PeerSpec, engine: str, kv: str, texts: list[str], computed: int, log_dir: Path
) -> Result:
    """Admit every session (one after another), then return to each, newest first."""
    server = PeerServer(spec, log_dir)
    started = time.perf_counter()
    returns = []
    with server:
        for text in texts:
            _complete(server, spec, text, OUTPUT_TOKENS)
        # Newest first, the same prompt again: a return allocates at most its prompt's tail
        # page, evicting at most the tail page of the least recently used session (pages are
        # freed tail first), whose own return then still finds >= HIT_SHARE of its prompt.
        for idx in reversed(range(len(texts))):
            body = _complete(server, spec, texts[idx], 1)
            prompt, cached = _prompt_and_cached(body)
            returns.append({"session": idx, "prompt_tokens": prompt, "cached_tokens": cached})
    resident = sum(r["cached_tokens"] >= HIT_SHARE * r["prompt_tokens"] for r in returns)
    kv_bytes = 0
    if spec.engine == "densa":
        kv_bytes = _densa_kv_bytes(server.log_path)
    return Result(
        engine, kv, len(texts), resident, computed, kv_bytes, returns, time.perf_counter() - started
    )


def _complete(server: PeerServer, spec: PeerSpec, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        **spec.extra_body,
    }
    request = urllib.request.Request(
        f"{server.endpoint.base_url}/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def _prompt_and_cached(body: dict[str, Any]) -> tuple[int, int]:
    usage = body.get("usage") or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None:  # llama-server: its own timings
        cached = (body.get("timings") or {}).get("cache_n", 0)
    return prompt, int(cached)


_DENSA_KV = re.compile(
    r"KV cache: (\d+) pages x (\d+) tokens = \d+ tokens \([^,]+(?:, [^,]+)?, "
    r"([\d.]+) (MiB|GiB)"
)


def _densa_kv_bytes(log: Path) -> int:
    found = _DENSA_KV.search(log.read_text(errors="replace"))
    if found is None:
        return 0
    return int(float(found.group(3)) * (2**20 if found.group(4) == "MiB" else 2**30))
