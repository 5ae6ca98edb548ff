"""The demo's GRPO step phase by phase against a plain single-process PyTorch GRPO loop's, on the same machine in one run.

* ``rlplat``: ``rlplat run`` (the demo: its model, data, reward, one process, float32) for ``--steps`` steps, no
  validation, no checkpoints; per-step times from its ``metrics.jsonl``: ``timing_s/gen`` (generation),
  ``timing_s/update_actor`` (the update) and ``timing_s/step`` (everything from batch to batch).
* ``plain``: ``bench/plain_grpo.py``'s loop on the same model, prompts (32 a step, 8 samples each, 4 new tokens), seed
  and sampling streams (``streams=True``: rlplat's per-row random numbers), 2 torch threads: its sampling + scoring +
  advantages (``gen``), its forward + backward + AdamW step (``update``) and the whole step.

Each side runs in a child process of its own, ``--rounds`` times alternating which goes first; medians over the steps
after ``--warmup`` of every round. The last lines give each phase's ratio rlplat / plain (<= 1.0: rlplat's is no
slower), so a regression in either phase shows at once.

Run: ``.venv/bin/python bench/demo_phases.py [--steps 60] [--warmup 10] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import describe_environment, print_table  # noqa: E402

PHASES = ("gen", "update", "step")
RESULT_TAG = "DEMO_PHASES_RESULT "


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="first steps of each run left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating which goes first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    return args


def environment() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def run_rlplat(args: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="bench-demo-phases-") as folder:
        output = Path(folder) / "run"
        launcher = Path(sys.executable).with_name("rlplat")
        command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "rlplat.cli.main"]
        command += ["run", f"trainer.total_training_steps={args.steps}", f"trainer.output_dir={output}", "trainer.logger=[jsonl]",
                    "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.resume=disable",
                    f"trainer.seed={args.seed}", f"data.seed={args.seed}"]
        done = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"rlplat run exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [record for record in records if "timing_s/step" in record][args.warmup:]
    keys = {"gen": "timing_s/gen", "update": "timing_s/update_actor", "step": "timing_s/step"}
    return {phase: [record[key] for record in records] for phase, key in keys.items()}


def run_plain(args: argparse.Namespace) -> dict[str, list[float]]:
    command = [sys.executable, __file__, "--plain-child", "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    done = subprocess.run(command, capture_output=True, text=True, env=environment(), timeout=1800)
    tagged = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode != 0 or not tagged:
        raise SystemExit(f"the plain loop exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(tagged[-1][len(RESULT_TAG):])


def plain_child(args: argparse.Namespace) -> None:
    import plain_grpo

    result = plain_grpo.run(args.steps, seed=args.seed, threads=2, streams=True)
    skip = args.warmup
    print(RESULT_TAG + json.dumps({"gen": result["gen_s"][skip:], "update": result["train_s"][skip:], "step": result["step_s"][skip:]}))


def main() -> None:
    args = parse_arguments()
    if args.plain_child:
        plain_child(args)
        return
    times: dict[str, dict[str, list[float]]] = {"rlplat": {phase: [] for phase in PHASES}, "plain": {phase: [] for phase in PHASES}}
    for round_index in range(args.rounds):
        order = [("rlplat", run_rlplat), ("plain", run_plain)]
        for name, runner in order if round_index % 2 == 0 else order[::-1]:
            for phase, values in runner(args).items():
                times[name][phase] += values
    medians = {name: {phase: statistics.median(values) * 1e3 for phase, values in phases.items()} for name, phases in times.items()}
    rows = [[name, *(f"{medians[name][phase]:.1f}" for phase in PHASES)] for name in ("rlplat", "plain")]
    rows.append(["rlplat / plain", *(f"{medians['rlplat'][phase] / medians['plain'][phase]:.2f}" for phase in PHASES)])
    print_table(f"The demo's GRPO step by phase, ms (medians of steps {args.warmup + 1}-{args.steps} of {args.rounds} run(s) each)",
                ["", "generation", "update", "whole step"], rows,
                ["generation: rlplat's timing_s/gen, the plain loop's sampling + scoring + advantages; update: timing_s/update_actor "
                 "vs forward + backward + AdamW; target: each ratio <= 1.0"])
    for phase in PHASES:
        print(f"demo {phase}: rlplat / plain = {medians['rlplat'][phase] / medians['plain'][phase]:.2f}")
    print(describe_environment({"steps": str(args.steps), "rounds": str(args.rounds)}))


if __name__ == "__main__":
    main()
