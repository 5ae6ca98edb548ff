"""``rlplat plot RUN_DIR``: a run's ``metrics.jsonl`` as PNG charts in ``RUN_DIR/plots/``.

One PNG per chart, each named after its chart (``reward.png``, ``validation_accuracy.png``,
``response_length.png``, ``kl.png``, ``entropy.png``, ``timing.png``); a chart whose metrics the run
did not log (or logged only as null) is skipped with a note on stderr. Each profiled step's trace
(``trainer.profile``) becomes ``timeline_step_<N>.png`` (:mod:`rlplat.cli.timeline_plot`). matplotlib is imported only
when the command runs, and draws through its Agg canvas, so no display is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer

PLOTS_DIRECTORY = "plots"
FIGURE_SIZE = (8.0, 4.5)
DPI = 100
# Grouped bars stay readable up to about this many steps; past it each stage becomes a line.
MAX_GROUPED_STEPS = 40
# Markers show single points (step-0 validation, sparse test_freq) without cluttering long runs.
MAX_MARKED_POINTS = 60

Series = tuple[list[float], list[float]]


def exact(*names: str) -> Callable[[str], Optional[str]]:
    """A metric selector taking the given names, labelled by their own name."""
    return lambda name: name if name in names else None


def validation_accuracy_source(name: str) -> Optional[str]:
    """``val/<source>/acc/mean`` -> ``<source>``; any other name -> None."""
    prefix, suffix = "val/", "/acc/mean"
    if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix):
        return name[len(prefix):-len(suffix)]
    return None


def timing_stage(name: str) -> Optional[str]:
    """``timing_s/<stage>`` -> ``<stage>``; any other name -> None."""
    return name[len("timing_s/"):] if name.startswith("timing_s/") and len(name) > len("timing_s/") else None


@dataclass(frozen=True)
class Chart:
    """One PNG: ``select`` maps a metric name to its legend label (None: not on this chart)."""

    name: str
    title: str
    ylabel: str
    wanted: str
    select: Callable[[str], Optional[str]]
    grouped_bars: bool = False
    kind: str = "rl"
    """Which runs draw it: ``rl`` (``rlplat run``), ``sft`` (``rlplat sft``: its metrics hold ``train/loss``), ``any``."""


CHARTS = (
    Chart("reward", "Reward", "mean score", "critic/score/mean or critic/rewards/mean",
          exact("critic/score/mean", "critic/rewards/mean")),
    Chart("validation_accuracy", "Validation accuracy", "accuracy", "val/<source>/acc/mean",
          validation_accuracy_source),
    Chart("response_length", "Response length", "tokens", "response_length/mean", exact("response_length/mean")),
    Chart("kl", "KL divergence", "KL", "actor/ppo_kl or actor/kl_loss", exact("actor/ppo_kl", "actor/kl_loss")),
    Chart("entropy", "Entropy", "entropy", "actor/entropy", exact("actor/entropy")),
    Chart("loss", "Loss", "NLL per token", "train/loss or val/loss", exact("train/loss", "val/loss"), kind="sft"),
    Chart("perplexity", "Validation perplexity", "perplexity", "val/perplexity", exact("val/perplexity"), kind="sft"),
    # Stages nest (the trainer times reward inside gen), so they are grouped side by side, not stacked.
    Chart("timing", "Stage timing", "seconds", "timing_s/*", timing_stage, grouped_bars=True, kind="any"),
)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def chart_series(records: Sequence[Mapping[str, Any]], chart: Chart) -> dict[str, Series]:
    """Legend label -> (steps, values) for ``chart``, in order of first appearance; NaN (null in the file)
    and records without a numeric step are left out, and so is a series left with no point."""
    series: dict[str, Series] = {}
    for record in records:
        step = record.get("step")
        if not is_number(step):
            continue
        for name, value in record.items():
            label = chart.select(name)
            if label is not None and is_number(value):
                steps, values = series.setdefault(label, ([], []))
                steps.append(step)
                values.append(float(value))
    return series


def draw_lines(axes: Any, series: Mapping[str, Series]) -> None:
    for label, (steps, values) in series.items():
        axes.plot(steps, values, label=label, marker="o" if len(steps) <= MAX_MARKED_POINTS else None, markersize=3)


def draw_grouped_bars(axes: Any, series: Mapping[str, Series]) -> None:
    steps = sorted({step for step_list, _ in series.values() for step in step_list})
    if len(steps) > MAX_GROUPED_STEPS:
        draw_lines(axes, series)
        return
    gap = min((later - earlier for earlier, later in zip(steps, steps[1:])), default=1)
    width = 0.8 * gap / len(series)
    for index, (label, (step_list, values)) in enumerate(series.items()):
        offset = (index - (len(series) - 1) / 2) * width
        axes.bar([step + offset for step in step_list], values, width=width, label=label)


def save_chart(chart: Chart, series: Mapping[str, Series], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # A bare Figure on an Agg canvas: no pyplot state, no display, nothing to close.
    figure = Figure(figsize=FIGURE_SIZE, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    (draw_grouped_bars if chart.grouped_bars else draw_lines)(axes, series)
    axes.set_title(chart.title)
    axes.set_xlabel("step")
    axes.set_ylabel(chart.ylabel)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.savefig(path, dpi=DPI)


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"rlplat plot: {message}", err=True)
    return typer.Exit(code)


def plot(run_dir: Path = typer.Argument(..., help="A run's output directory (it holds metrics.jsonl).")) -> None:
    """Write PNG charts of a run's metrics (reward, validation accuracy, response length, KL, entropy,
    stage timing; for an ``rlplat sft`` run: loss, validation perplexity, stage timing) to RUN_DIR/plots/ and print their paths; charts without data are skipped with a note."""
    from rlplat.trainer.tracking import METRICS_FILE, read_metrics

    if not run_dir.exists():
        raise fail(f"{run_dir} does not exist; pass a run's output directory (trainer.output_dir)")
    if not run_dir.is_dir():
        raise fail(f"{run_dir} is not a directory; pass a run's output directory, which holds {METRICS_FILE}")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise fail(f"{metrics_path} does not exist; a run writes it when trainer.logger includes 'jsonl'")
    try:
        records = read_metrics(run_dir)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise fail(f"cannot read {metrics_path}: {error}")
    if not records:
        raise fail(f"{metrics_path} has no records yet: the run has not finished a step")
    try:
        import matplotlib  # noqa: F401  (checked here for a clear message rather than a traceback)
    except ImportError:
        raise fail("charts need matplotlib, which is not installed: run `pip install matplotlib`", code=1)

    output = run_dir / PLOTS_DIRECTORY
    written = []
    kind = "sft" if any("train/loss" in record for record in records) else "rl"
    for chart in (chart for chart in CHARTS if chart.kind in (kind, "any")):
        series = chart_series(records, chart)
        if not series:
            typer.echo(f"rlplat plot: skipped {chart.name}: no values of {chart.wanted} in {metrics_path}", err=True)
            continue
        path = output / f"{chart.name}.png"
        try:
            output.mkdir(exist_ok=True)
            save_chart(chart, series, path)
        except OSError as error:
            raise fail(f"cannot write {path}: {error.strerror or error}", code=1)
        written.append(path)
        typer.echo(str(path))
    for trace in sorted((run_dir / "profile").glob("step_*.trace.json")):  # trainer.profile's timelines
        from rlplat.cli.timeline_plot import save_timeline

        path = output / f"timeline_{trace.name.removesuffix('.trace.json')}.png"
        try:
            output.mkdir(exist_ok=True)
            save_timeline(trace, path)
        except (OSError, ValueError, KeyError) as error:
            typer.echo(f"rlplat plot: skipped {trace}: cannot draw it ({type(error).__name__}: {error})", err=True)
            continue
        written.append(path)
        typer.echo(str(path))
    if not written:
        raise fail(f"no chart written: {metrics_path} has none of the plotted metrics", code=1)
