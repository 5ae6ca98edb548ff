"""``trainer.mode=separate_async`` vs ``sync`` with a long tail of slow environment steps.

The task is the built-in ``retry-single`` demo (``rlplat run --demo retry-single``: GRPO through the
``env`` agent loop, a+b= answered in one attempt, 16 prompts x 8 samples, 40 new tokens), with one
change: its environment is ``slow_retry``, the ``retry`` environment whose answer check takes
``--delay`` seconds longer for a fixed ``--slow-fraction`` of the prompts (chosen by a hash of the
prompt, so every sample of such a prompt waits). The environment is a plugin written by this script
into a temporary folder put on ``PYTHONPATH`` (every Ray worker inherits it), the way a user's
``pip install``-ed plugin would be found.

Both contenders run ``rlplat run`` on a private Ray cluster, one after the other, from the same seed:

* ``sync``: the actor and the rollout in one process (the machine's cores as its threads);
* ``separate_async``: the rollout in a pool of its own (``trainer.mode=separate_async``,
  ``trainer.max_staleness``, default 1) of ``--replicas`` processes (default 2) that each generate whole
  batches (``trainer.rollout_dispatch=replica``), so one batch's slow tail overlaps the next batch's
  generation; one thread per process (``cluster.cpus_per_process=0.5``: three processes share the two
  cores);
* ``partial``: the same, with partial rollouts (``trainer.partial_rollout``, ``--partial``, default
  ``keep``): each rollout process runs the generations in flight at once (one batch's slow tail overlaps the
  next batch on the same process) and a weight load lands between two tokens instead of after the
  generations started before it.

Wall time is from the step-0 record (written after the validation before training) to the record of the
last step (``--steps``) less that step's validation (``timing_s/validate``): the steps and everything
between them, start-up and validations outside, the same for both. The table gives each one's wall
time, median step time, the final greedy validation accuracy (200 prompts), and the separate run's
staleness and overlap; the last lines are the speed-ups (sync / separate_async, separate_async / partial) and
the accuracy gaps.

Run: python bench/async_training.py [--steps 50] [--delay 2.0] [--slow-fraction 0.1] [--staleness 1]
[--replicas 2] [--partial keep] [--modes sync,separate_async,partial]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN = '''
import asyncio
import dataclasses
import json
import zlib

from rlplat_agents.environments import RetryConfig, RetryEnvironment
from rlplat.hookspecs import hookimpl


@dataclasses.dataclass
class SlowRetryConfig(RetryConfig):
    delay_s: float = 2.0
    slow_fraction: float = 0.1


class SlowRetryEnvironment(RetryEnvironment):
    """``retry``, whose answer check takes ``delay_s`` longer for ``slow_fraction`` of the prompts."""

    def __init__(self, config=None):
        config = dict(config or {})
        self.delay_s, self.slow_fraction = float(config.pop("delay_s", 2.0)), float(config.pop("slow_fraction", 0.1))
        super().__init__(config)

    async def step(self, response):
        prompt = json.dumps(self.row.get("raw_prompt"), sort_keys=True, default=str)
        if zlib.crc32(prompt.encode()) % 1000 < self.slow_fraction * 1000:
            await asyncio.sleep(self.delay_s)
        return await super().step(response)


@hookimpl
def register_environments(register):
    register("slow_retry", "rlplat_bench_latency:SlowRetryEnvironment", config_schema="rlplat_bench_latency:SlowRetryConfig",
             description="retry with a long tail of slow answer checks (bench/async_training.py)")
'''


def write_plugin(site: Path) -> None:
    dist_info = site / "rlplat_bench_latency-0.0.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlplat-bench-latency\nVersion: 0.0.0\n")
    (dist_info / "entry_points.txt").write_text("[rlplat]\nbench_latency = rlplat_bench_latency\n")
    (site / "rlplat_bench_latency.py").write_text(PLUGIN)


def run(name: str, extra: list[str], args: argparse.Namespace, site: Path, root: Path) -> list[dict]:
    from rlplat.trainer.tracking import read_metrics

    output = root / name
    rlplat = Path(sys.executable).with_name("rlplat")
    launcher = [str(rlplat)] if rlplat.exists() else [sys.executable, "-c", "from rlplat.cli.main import main; main()"]
    overrides = [
        "--demo", "retry-single", "cluster.backend=ray", "cluster.devices_per_node=1", f"trainer.output_dir={output}",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.steps}", "trainer.val_before_train=true",
        "trainer.save_freq=0", "trainer.logger=[jsonl]", f"trainer.seed={args.seed}", "agent.environment=slow_retry",
        f"agent.environment_config.delay_s={args.delay}", f"agent.environment_config.slow_fraction={args.slow_fraction}",
        *extra, *args.override,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    with (root / f"{name}.log").open("w") as log:
        result = subprocess.run([*launcher, "run", *overrides], stdout=log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = (root / f"{name}.log").read_text()[-3000:]
        raise SystemExit(f"{name}: rlplat run exited with {result.returncode}\n{tail}")
    return read_metrics(output)


def summary(records: list[dict]) -> dict[str, float]:
    first, last = records[0], records[-1]
    steps = [record for record in records if record["step"] > 0]
    accuracy = next(key for key in last if key.startswith("val/") and key.endswith("/acc/mean"))
    return {
        "wall_s": last["time"] - first["time"] - last.get("timing_s/validate", 0.0), "step_s": statistics.median(r["timing_s/step"] for r in steps),
        "acc_before": first[accuracy], "acc_after": last[accuracy],
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in steps),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in steps),
        "overlap_fraction": statistics.median(r.get("async/overlap_fraction", 0.0) for r in steps),
        "dropped": sum(r.get("async/samples_dropped", 0.0) for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--delay", type=float, default=2.0, help="extra seconds of a slow prompt's environment step")
    parser.add_argument("--slow-fraction", type=float, default=0.1)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=2, help="rollout processes of separate_async")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partial", default="keep", choices=["keep", "recompute"], help="the partial contender's mode")
    parser.add_argument("--modes", default="sync,separate_async,partial", help="contenders to run, comma-separated")
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE for every run")
    args = parser.parse_args()
    separate = ["trainer.mode=separate_async", f"trainer.max_staleness={args.staleness}", "cluster.threads_per_process=1",
                "algorithm.rollout_correction.allow_uncorrected=true",  # as the README's figure was measured
                f"roles.rollout.devices_per_node={args.replicas}", "cluster.cpus_per_process=0.5",
                f"trainer.rollout_dispatch={'replica' if args.replicas > 1 else 'split'}"]
    contenders = {"sync": ["trainer.mode=sync"], "separate_async": separate,
                  "partial": [*separate, f"trainer.partial_rollout={args.partial}"]}
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = sorted(set(modes) - set(contenders))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; the contenders are {', '.join(contenders)}")
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        root = Path(tmp)
        site = root / "site"
        write_plugin(site)
        results = {mode: summary(run(mode, contenders[mode], args, site, root)) for mode in modes}
    print(f"{args.steps} steps of the retry-single demo; {args.slow_fraction:.0%} of prompts wait {args.delay} s longer "
          f"in the environment; max_staleness={args.staleness}; separate_async and partial ({args.partial}) on "
          f"{args.replicas} rollout process(es)")
    print(f"{'mode':<16}{'wall s':>9}{'step s (median)':>17}{'val acc before':>16}{'after':>8}"
          f"{'staleness mean/max':>20}{'overlap':>9}{'dropped':>9}")
    for name, result in results.items():
        print(f"{name:<16}{result['wall_s']:>9.1f}{result['step_s']:>17.2f}{result['acc_before']:>16.3f}{result['acc_after']:>8.3f}"
              f"{result['staleness_mean']:>13.2f} / {result['staleness_max']:<4.0f}{result['overlap_fraction']:>9.2f}"
              f"{result['dropped']:>9.0f}")
    for slow, fast in (("sync", "separate_async"), ("separate_async", "partial")):
        if slow in results and fast in results:
            print(f"speed-up ({slow} wall / {fast} wall): {results[slow]['wall_s'] / results[fast]['wall_s']:.2f}x; "
                  f"validation accuracy after: {results[fast]['acc_after'] - results[slow]['acc_after']:+.3f} ({fast} - {slow})")


if __name__ == "__main__":
    main()
