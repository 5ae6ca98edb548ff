"""A profiled step's trace (``trainer.profile``, Chrome-trace JSON) as a per-phase timeline PNG.

One row per thread of each process (the driver first), the spans of a row stacked by their nesting (a worker
call inside a driver phase sits under it), each span name one colour throughout the figure; names are written
on the bars wide enough to hold them; the run sentinel's events are vertical red lines.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

ROW_HEIGHT = 1.0
DEPTH_HEIGHT = 0.22  # of each nesting level inside a row


def trace_rows(trace: dict[str, Any]) -> tuple[list[tuple[str, list[tuple[float, float, int, str]]]], list[float]]:
    """``([(row label, [(start s, duration s, depth, name), ...]), ...], [instant times s])`` of ``trace``."""
    names = {event["pid"]: event["args"]["name"] for event in trace["traceEvents"] if event.get("ph") == "M"}
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X":
            rows.setdefault((event["pid"], event["tid"]), []).append(event)
    ordered = sorted(rows, key=lambda key: (0 if names.get(key[0], "").startswith("driver") else 1, key))
    result = []
    for pid, tid in ordered:
        spans, open_ends = [], []
        for event in sorted(rows[(pid, tid)], key=lambda item: (item["ts"], -item["dur"])):
            end = event["ts"] + event["dur"]
            while open_ends and open_ends[-1] <= event["ts"]:
                open_ends.pop()
            spans.append((event["ts"] / 1e6, event["dur"] / 1e6, len(open_ends), event["name"]))
            open_ends.append(end)
        label = names.get(pid, f"pid {pid}") + (f" (thread {tid})" if tid else "")
        result.append((label, spans))
    instants = [event["ts"] / 1e6 for event in trace["traceEvents"] if event.get("ph") == "i"]
    return result, instants


def colour(name: str) -> Any:
    from matplotlib import colormaps

    return colormaps["tab20"](zlib.crc32(name.split(" ")[0].encode()) % 20)


def save_timeline(trace_path: Path, png_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    trace = json.loads(trace_path.read_text())
    rows, instants = trace_rows(trace)
    figure = Figure(figsize=(12.0, 1.2 + 1.1 * len(rows)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    extent = max((start + duration for _, spans in rows for start, duration, _, _ in spans), default=1.0) or 1.0
    for index, (_, spans) in enumerate(rows):
        base = (len(rows) - 1 - index) * ROW_HEIGHT
        for start, duration, depth, name in spans:
            bottom = base + ROW_HEIGHT - (depth + 1) * DEPTH_HEIGHT
            axes.broken_barh([(start, duration)], (bottom, DEPTH_HEIGHT * 0.9), facecolors=colour(name), edgecolor="none")
            if duration > 0.06 * extent:
                axes.text(start + duration / 2, bottom + DEPTH_HEIGHT * 0.45, name, ha="center", va="center", fontsize=7,
                          clip_on=True)
    for moment in instants:
        axes.axvline(moment, color="red", linewidth=1)
    axes.set_yticks([(len(rows) - 1 - index) * ROW_HEIGHT + ROW_HEIGHT / 2 for index in range(len(rows))],
                    [label for label, _ in rows], fontsize=8)
    axes.set_xlim(0, extent * 1.01)
    axes.set_xlabel("seconds since the step started")
    step = trace.get("otherData", {}).get("step")
    axes.set_title(f"step {step} timeline" if step is not None else trace_path.name)
    axes.grid(axis="x", alpha=0.3)
    figure.savefig(png_path, dpi=100)
