"""A benchmark's results on disk: one JSON file, one Markdown page and PNG plots in one folder.

<out>/results.json   command, date, hardware, settings, raw samples, summary
<out>/README.md      the command, the hardware, the tables and the plots (renders on GitHub)
<out>/<plot>.png     one file per LinePlot
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from densa.utils.sizes import format_bytes
from densa_bench.common.hardware import command_line, describe_hardware, hardware_summary

JSON_NAME = "results.json"
MARKDOWN_NAME = "README.md"


@dataclass
class Table:
    """A Markdown table: a title, column headers and rows of already formatted cells."""

    title: str
    columns: list[str]
    rows: list[list[str]]

    def to_markdown(self) -> str:
        lines = [
            f"### {self.title}",
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "---|" * len(self.columns),
        ]
        lines += [
            "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in self.rows
        ]
        return "\n".join(lines)


@dataclass
class Series:
    """One line of a plot: y (median) at each x, with the min..max spread drawn as error bars."""

    label: str
    x: list[float]
    y: list[float]
    y_min: list[float] | None = None
    y_max: list[float] | None = None


@dataclass
class LinePlot:
    """A line plot saved as `<name>.png`; one Series per engine or configuration."""

    name: str
    title: str
    x_label: str
    y_label: str
    series: list[Series]
    log_x: bool = False  # concurrency sweeps (1, 8, 32, ...) read better on a log axis

    def save(self, path: Path, caption: str) -> None:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: benchmarks run on headless machines
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for s in self.series:
            ax.errorbar(s.x, s.y, yerr=_error_bars(s), marker="o", capsize=3, label=s.label)
        if self.log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for s in self.series for x in s.x}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set(title=self.title, xlabel=self.x_label, ylabel=self.y_label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if self.series:
            ax.legend()
        fig.text(0.01, 0.01, caption, fontsize=7, alpha=0.7)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _error_bars(series: Series) -> list[list[float]] | None:
    if series.y_min is None or series.y_max is None:
        return None
    below = [y - lo for y, lo in zip(series.y, series.y_min, strict=True)]
    above = [hi - y for y, hi in zip(series.y, series.y_max, strict=True)]
    return [below, above]


@dataclass
class BenchReport:
    """Everything one benchmark run produced, plus what is needed to reproduce and judge it."""

    name: str
    settings: dict[str, Any]
    samples: list[dict[str, Any]] = field(default_factory=list)  # raw, one per timed run
    summary: list[dict[str, Any]] = field(default_factory=list)  # aggregated, one per variant
    tables: list[Table] = field(default_factory=list)
    plots: list[LinePlot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the numbers do and do not show
    command: str = field(default_factory=command_line)
    date: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    hardware: dict[str, Any] = field(default_factory=describe_hardware)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "command": self.command,
            "date": self.date,
            "hardware": self.hardware,
            "settings": self.settings,
            "summary": self.summary,
            "samples": self.samples,
            "notes": self.notes,
        }

    def write(self, out_dir: Path) -> list[Path]:
        """Write JSON, Markdown and plots into out_dir (created if needed); return the paths."""
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / JSON_NAME
        json_path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        paths = [json_path]
        caption = f"{hardware_summary(self.hardware)}; {self.date}"
        for plot in self.plots:
            paths.append(out_dir / f"{plot.name}.png")
            plot.save(paths[-1], caption)
        md_path = out_dir / MARKDOWN_NAME
        md_path.write_text(self.to_markdown())
        paths.append(md_path)
        return paths

    def to_markdown(self) -> str:
        parts = [
            f"# Benchmark: {self.name}",
            f"Command (run {self.date}):\n\n```\n{self.command}\n```",
            _hardware_table(self.hardware).to_markdown(),
            _settings_table(self.settings).to_markdown(),
            *(table.to_markdown() for table in self.tables),
            *(f"![{plot.title}]({plot.name}.png)" for plot in self.plots),
        ]
        if self.notes:
            parts.append("### Notes\n\n" + "\n".join(f"- {note}" for note in self.notes))
        parts.append(f"Raw samples: [{JSON_NAME}]({JSON_NAME})")
        return "\n\n".join(parts) + "\n"


def _hardware_table(hardware: dict[str, Any]) -> Table:
    rows = [[key, _cell(key, value)] for key, value in hardware.items()]
    return Table("Hardware", ["", "value"], rows)


def _settings_table(settings: dict[str, Any]) -> Table:
    rows = [[key, _cell(key, value)] for key, value in _flatten(settings).items()]
    return Table("Settings", ["", "value"], rows)


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"engine": {"dtype": "float32"}} -> {"engine.dtype": "float32"}: one table row per option."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _cell(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
