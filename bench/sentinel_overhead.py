"""What the run sentinel costs, and whether it stays quiet on a clean run: the demo recipe (`rlplat run`, its
defaults) for ``--steps`` steps with ``trainer.sentinel`` on and off, in that order and then the other way round
(``--pairs`` times), once with the demo's weights shared in place (no weight fingerprints: the rollout reads the
actor's tensors) and once with ``rollout.share_weights=false`` (every sync copied and fingerprinted on both sides).

Per case it prints the median step time (``timing_s/step``, steps after the first 5) of the runs with the
sentinel on and off and their ratio, the sentinel's events over all the "on" runs (a clean run should have
none: each is a false positive), and the time spent in the sentinel's own work, measured inside the "on" runs
(the driver's checks, ``status.json`` writes and the weight fingerprints, each wrapped with ``perf_counter``)
as a share of the step. The whole-run ratio carries the machine's noise; the attributed share does not.

Run: ``.venv/bin/python bench/sentinel_overhead.py [--steps 200] [--pairs 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import print_table  # noqa: E402

CASES = {"shared weights (demo)": [], "copied weights": ["rollout.share_weights=false"]}
WARMUP_STEPS = 5


def child(output: str, sentinel: bool, steps: int, extra: list[str]) -> None:
    """One run, in this process, with the sentinel's work timed (written to ``output/sentinel_cost.json``)."""
    from rlplat.cli.main import main
    from rlplat.kits import weights
    from rlplat.trainer import sentinel as sentinel_module
    from rlplat.trainer import status

    spent = {"seconds": 0.0}

    def timed(function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - started
        return wrapper

    for name in ("take_events", "check_versions", "check_advantages", "check_update", "check_collapse", "step_metrics",
                 "replica_health"):
        setattr(sentinel_module.Sentinel, name, timed(getattr(sentinel_module.Sentinel, name)))
    status.RunStatus.write = timed(status.RunStatus.write)
    weights.fingerprint = timed(weights.fingerprint)
    weights.compare = timed(weights.compare)
    arguments = ["run", f"trainer.total_training_steps={steps}", f"trainer.output_dir={output}", "trainer.test_freq=0",
                 "trainer.save_freq=0", f"trainer.sentinel.enabled={str(sentinel).lower()}", *extra]
    try:
        main(arguments)
    except SystemExit as exit:
        if exit.code:
            raise
    Path(output, "sentinel_cost.json").write_text(json.dumps(spent))


def run(output: Path, sentinel: bool, steps: int, extra: list[str]) -> dict:
    subprocess.run([sys.executable, __file__, "--child", str(output), "--sentinel", str(int(sentinel)), "--steps", str(steps),
                    *[f"--extra={item}" for item in extra]], check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    records = [record for record in records if record.get("step", 0) > 0]
    step_times = [record["timing_s/step"] for record in records[WARMUP_STEPS:]]
    return {"step_times": step_times, "events": sum(record.get("sentinel/events", 0) for record in records),
            "spent": json.loads((output / "sentinel_cost.json").read_text())["seconds"],
            "wall_steps": sum(record["timing_s/step"] for record in records),
            "verified": min((record.get("sentinel/weights_verified", 0) for record in records), default=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=1, help="on/off then off/on, this many times per case")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sentinel", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--extra", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, bool(args.sentinel), args.steps, args.extra)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlplat-sentinel-bench-") as root:
        for case, extra in CASES.items():
            results = {True: [], False: []}
            for pair in range(args.pairs):
                for order in ((True, False), (False, True)):
                    for on in order:
                        output = Path(root, f"{case[:6]}-{pair}-{len(results[on])}-{int(on)}".replace(" ", "_"))
                        results[on].append(run(output, on, args.steps, extra))
            on = statistics.median(t for result in results[True] for t in result["step_times"])
            off = statistics.median(t for result in results[False] for t in result["step_times"])
            share = sum(r["spent"] for r in results[True]) / sum(r["wall_steps"] for r in results[True])
            rows.append([case, f"{on * 1000:.1f}", f"{off * 1000:.1f}", f"{on / off:.3f}", f"{share * 100:.2f}%",
                         str(int(sum(r["events"] for r in results[True]))), f"{min(r['verified'] for r in results[True]):.0f}"])
    print_table(f"The run sentinel on the demo recipe: {args.steps} steps, {args.pairs * 2} runs on and off per case",
                ["case", "on ms/step", "off ms/step", "on/off", "sentinel's share", "events (on)", "verified"], rows,
                ["on/off: median step time ratio (noise included); sentinel's share: time inside the sentinel's checks, "
                 "status.json writes and fingerprints over the steps' time; events: false positives on a clean run; "
                 "verified: 1 when every sync's weights were fingerprinted and matched (0 for shared weights: nothing is copied)"])


if __name__ == "__main__":
    main()
