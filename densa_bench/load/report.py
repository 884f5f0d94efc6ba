"""`densa bench load`: start a server (or use one), run the load (load.py), write the report."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

import httpx

from densa.serve.process import serve_engine_in_thread
from densa.setup.args import EngineArgs
from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.common.stats import latency_stats, spread
from densa_bench.load.runner import ClientResult, LoadRun, LoadSettings, find_problems, run_load


def run_load_bench(
    settings: LoadSettings, engine_args: EngineArgs, url: str | None, model: str | None
) -> tuple[BenchReport, list[str]]:
    """Against `url`, or against a server started here from engine_args; returns (report,
    problems)."""
    if url is not None:
        run = run_load(url.rstrip("/"), model or _served_model(url), settings)
        problems = find_problems(run)
        return build_report(run, settings, {"url": url}, problems), problems
    with serve_engine_in_thread(engine_args) as (base_url, client):
        run = run_load(base_url, client.served.name, settings)
        num_pages = client.served.num_kv_pages
    server = {"engine_args": asdict(engine_args), "kv_pages": num_pages}
    problems = find_problems(run)
    return build_report(run, settings, server, problems), problems


def _served_model(url: str) -> str:
    response = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def build_report(
    run: LoadRun, settings: LoadSettings, server: dict[str, Any], problems: list[str]
) -> BenchReport:
    complete = [r for r in run.results if r.is_complete]
    summary = {
        "wall_s": run.wall_s,
        "clients": len(run.results),
        "outcomes_client": dict(Counter(r.outcome for r in run.results)),
        "outcomes_server": dict(run.server_counts("outcome")),
        "preemptions": run.delta("densa_preemptions_total"),
        "cached_prompt_tokens": run.delta("densa_cached_prompt_tokens_total"),
        "problems": problems,
    }
    if complete:
        summary["ttft_s"] = latency_stats([r.ttft_s for r in complete if r.ttft_s is not None])
        summary["e2e_s"] = latency_stats([(r.end_s or 0) - r.submit_s for r in complete])
    report = BenchReport(
        name="load",
        settings={**asdict(settings), "server": server},
        samples=[_sample(r) for r in run.results],
        summary=[summary],
        notes=LOAD_NOTES,
    )
    report.tables = [_outcome_table(run), _check_table(problems)]
    if complete:
        report.tables.append(_latency_table(summary))
        report.plots = [_ttft_plot(complete)]
    return report


LOAD_NOTES = [
    "Every client starts at once; `complete` clients read the whole stream, `disconnect` clients "
    "close the connection after 1-3 events, `cancel` clients are cancelled 0-50 ms after their "
    "first event. Prompts are random token ids; half share a prefix.",
    "Server counts are /metrics deltas over the run, read once the engine was idle again.",
    "Latencies are client-side (loopback), for complete answers only.",
]


def _sample(r: ClientResult) -> dict[str, Any]:
    return {
        "client": r.plan.client_idx,
        "behaviour": r.plan.behaviour,
        "prompt_len": len(r.plan.prompt),
        "status": r.status,
        "outcome": r.outcome,
        "events": r.num_events,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "ttft_s": r.ttft_s,
        "e2e_s": None if r.end_s is None else r.end_s - r.submit_s,
    }


def _outcome_table(run: LoadRun) -> Table:
    client = Counter(r.outcome for r in run.results)
    server = run.server_counts("outcome")
    rows = [[o, str(client[o]), str(server[o])] for o in sorted(set(client) | set(server))]
    return Table("Requests by outcome", ["outcome", "clients saw", "/metrics counted"], rows)


def _check_table(problems: list[str]) -> Table:
    rows = [["nothing lost, nothing leaked, /metrics agrees", "yes" if not problems else "NO"]]
    rows += [["problem", problem] for problem in problems]
    return Table("Account", ["check", "result"], rows)


def _latency_table(summary: dict[str, Any]) -> Table:
    rows = [
        [name, *(f"{summary[key][q] * 1000:.0f}" for q in ("median", "p95", "p99", "max"))]
        for name, key in (("TTFT", "ttft_s"), ("end to end", "e2e_s"))
    ]
    return Table("Latency of complete answers (ms)", ["", "median", "p95", "p99", "max"], rows)


def _ttft_plot(complete: list[ClientResult]) -> LinePlot:
    by_len: dict[int, list[float]] = {}
    for r in complete:
        if r.ttft_s is not None:
            by_len.setdefault(len(r.plan.prompt), []).append(r.ttft_s)
    xs = sorted(by_len)
    stats = [spread(by_len[x]) for x in xs]
    series = Series(
        "complete answers",
        [float(x) for x in xs],
        [s["median"] for s in stats],
        [s["min"] for s in stats],
        [s["max"] for s in stats],
    )
    return LinePlot("ttft_by_prompt_len", "TTFT under load", "prompt tokens", "TTFT (s)", [series])
