"""Quality results on disk, written by the benchmarks' report writer (JSON + Markdown + PNG).

<out>/results.json   command, date, hardware, settings, per-item samples, summary
<out>/README.md      the command, hardware, tables with 95% intervals, notes, plots
<out>/<plot>.png     one point-with-interval plot per metric
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densa_bench.common.report import BenchReport, LinePlot, Series, Table
from densa_bench.eval.formats import Format, split_options
from densa_bench.eval.stats import Estimate

DEFAULT_OUT_ROOT = Path("docs/eval")


@dataclass
class QualityReport(BenchReport):
    """A BenchReport titled as a quality evaluation, which also records the formats compared."""

    formats: list[dict[str, Any]] = field(default_factory=list)  # label + options of its own

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "formats": self.formats}

    def to_markdown(self) -> str:
        return super().to_markdown().replace("# Benchmark: ", "# Quality: ", 1)


def new_report(name: str, formats: Sequence[Format], settings: dict[str, Any]) -> QualityReport:
    """A report whose settings hold the engine options all formats share, and whose first table
    lists each format (the first is the reference) with the options that set it apart."""
    common, differing = split_options(formats)
    report = QualityReport(
        name=name,
        settings={**settings, "engine": common},
        formats=[
            {"label": fmt.label, "options": opts}
            for fmt, opts in zip(formats, differing, strict=True)
        ],
    )
    rows = [
        [fmt.label + (" (reference)" if idx == 0 else ""), _options_text(opts)]
        for idx, (fmt, opts) in enumerate(zip(formats, differing, strict=True))
    ]
    report.tables.append(Table("Formats", ["format", "engine options that differ"], rows))
    return report


def _options_text(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "(none: identical engines)"


@dataclass
class IntervalPlot(LinePlot):
    """Points with confidence-interval bars over named categories (formats, tasks).

    Series x values are category indices; y_min / y_max are the interval bounds. Unlike a
    LinePlot, points are not joined, the y axis may go below zero and a reference line is drawn
    (0 for a difference, 1 for an agreement rate).
    """

    categories: list[str] = field(default_factory=list)
    reference_y: float | None = 0.0
    legend: bool = True  # off when the x categories already name what the points are

    def save(self, path: Path, caption: str) -> None:
        import matplotlib

        matplotlib.use("Agg")  # headless machines
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        width = 0.5 / max(1, len(self.series))
        for idx, s in enumerate(self.series):
            # Side by side within a category, so intervals of several series stay readable.
            x = [xi + (idx - (len(self.series) - 1) / 2) * width for xi in s.x]
            ax.errorbar(x, s.y, yerr=_bars(s), fmt="o", capsize=4, label=s.label)
        if self.reference_y is not None:
            ax.axhline(self.reference_y, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(self.categories)), self.categories, rotation=15, ha="right")
        ax.set_xlim(-0.6, len(self.categories) - 0.4)
        ax.set(title=self.title, xlabel=self.x_label, ylabel=self.y_label)
        ax.grid(alpha=0.3, axis="y")
        if self.legend and self.series:
            ax.legend(fontsize=8)
        fig.text(0.01, 0.01, caption, fontsize=7, alpha=0.7)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _bars(series: Series) -> list[list[float]] | None:
    if series.y_min is None or series.y_max is None:
        return None
    below = [max(0.0, y - lo) for y, lo in zip(series.y, series.y_min, strict=True)]
    above = [max(0.0, hi - y) for y, hi in zip(series.y, series.y_max, strict=True)]
    return [below, above]


def interval_series(label: str, estimates: list[Estimate], scale: float = 1.0) -> Series:
    """One plot series from estimates at category indices 0, 1, ..."""
    return Series(
        label=label,
        x=[float(idx) for idx in range(len(estimates))],
        y=[e.value * scale for e in estimates],
        y_min=[e.low * scale for e in estimates],
        y_max=[e.high * scale for e in estimates],
    )


def default_out(name: str) -> Path:
    return DEFAULT_OUT_ROOT / name
