"""What ``make demo-tools`` reports: ``python -m rlplat_demo.compare TOOLS_RUN RETRY_RUN SINGLE_RUN``.

Reads each run's ``metrics.jsonl`` and prints, for the tool demo, greedy validation accuracy and the
tool-call rate at the first and the last validation with the training time between them; for the env
demo, the last validation accuracy with up to 3 attempts against the single-attempt baseline after the
same number of steps. Each figure is checked against the demo's target (exit 0 either way: a demo
reports, the tests judge).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TARGETS = {"accuracy_gain": 0.25, "retry_margin": 0.10, "seconds": 300.0}


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run the demo first (make demo-tools)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def validations(records: list[dict[str, Any]], key_end: str) -> list[tuple[int, float, dict[str, Any]]]:
    """``(step, value, record)`` of every record holding a validation metric ending in ``key_end``."""
    found = []
    for record in records:
        keys = [key for key in record if key.startswith("val/") and key.endswith(key_end)]
        if keys:
            found.append((int(record["step"]), sum(record[key] for key in keys) / len(keys), record))
    return found


def tool_summary(run: str | Path) -> dict[str, float]:
    records = read_metrics(run)
    accuracy = validations(records, "/acc/mean")
    if len(accuracy) < 2:
        raise ValueError(f"{run}: fewer than two validations in metrics.jsonl")
    (first_step, first, first_record), (last_step, last, last_record) = accuracy[0], accuracy[-1]
    rate = "val/agent/tool_call_rate"
    seconds = float(last_record["time"]) - float(first_record["time"])
    return {"first_step": first_step, "last_step": last_step, "accuracy_first": first, "accuracy_last": last,
            "tool_call_rate_first": float(first_record.get(rate, float("nan"))),
            "tool_call_rate_last": float(last_record.get(rate, float("nan"))), "seconds": seconds}


def last_accuracy(run: str | Path) -> tuple[int, float]:
    step, value, _ = validations(read_metrics(run), "/acc/mean")[-1]
    return step, value


def report(tools_run: str, retry_run: str, single_run: str) -> list[str]:
    tools = tool_summary(tools_run)
    gain = tools["accuracy_last"] - tools["accuracy_first"]
    lines = [
        f"tool demo ({tools_run}): greedy validation accuracy {tools['accuracy_first']:.3f} (step {tools['first_step']}) "
        f"-> {tools['accuracy_last']:.3f} (step {tools['last_step']}): +{gain:.3f} (target >= +{TARGETS['accuracy_gain']}: "
        f"{'met' if gain >= TARGETS['accuracy_gain'] else 'NOT met'})",
        f"  tool-call rate {tools['tool_call_rate_first']:.3f} -> {tools['tool_call_rate_last']:.3f} "
        f"({'rose' if tools['tool_call_rate_last'] > tools['tool_call_rate_first'] else 'did NOT rise'}); "
        f"{tools['seconds']:.0f} s from the first validation to the last (target <= {TARGETS['seconds']:.0f} s: "
        f"{'met' if tools['seconds'] <= TARGETS['seconds'] else 'NOT met'})",
    ]
    retry_step, retry = last_accuracy(retry_run)
    single_step, single = last_accuracy(single_run)
    margin = retry - single
    lines.append(
        f"env demo: up to 3 attempts {retry:.3f} (step {retry_step}) vs one attempt {single:.3f} (step {single_step}): "
        f"{100 * margin:+.1f} points (target >= +{100 * TARGETS['retry_margin']:.0f}: "
        f"{'met' if margin >= TARGETS['retry_margin'] and retry_step == single_step else 'NOT met'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    try:
        lines = report(*argv)
    except (FileNotFoundError, ValueError) as error:
        print(f"rlplat_demo.compare: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
