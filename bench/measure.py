"""Timing for the benchmarks: warm-up, interleaved repetitions, medians, and a plain-text table.

Nothing here passes or fails: the scripts print what they measured and the ratio to the target.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Contender:
    """One way of doing an operation. ``prepare()`` (untimed) returns the argument of ``run`` for one
    repetition; ``run(argument)`` is the timed part; its result is dropped after the clock stops."""

    name: str
    run: Callable[[Any], Any]
    prepare: Callable[[], Any] = lambda: None
    seconds: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3

    @property
    def min_ms(self) -> float:
        return min(self.seconds) * 1e3

    def time_once(self) -> float:
        argument = self.prepare()
        gc.disable()  # a collection inside the timed part would be charged to whoever triggered it
        try:
            start = time.perf_counter()
            result = self.run(argument)
            elapsed = time.perf_counter() - start
        finally:
            gc.enable()
        del result, argument
        return elapsed


def race(contenders: list[Contender], repetitions: int, warmup: int, budget_s: float = 3.0, most: int = 61) -> list[Contender]:
    """Time every contender after ``warmup`` untimed runs, interleaved: each round runs all of them, and
    the order rotates from round to round so none always goes first.

    At least ``repetitions`` rounds; quick operations get more (as many as fit in ``budget_s``, at most
    ``most``), because on a shared 2-core machine a burst of someone else's work can swallow a few.
    """
    slowest = 0.0
    for _ in range(max(warmup, 1)):
        for contender in contenders:
            slowest = max(slowest, contender.time_once())
    rounds = max(repetitions, min(most, int(budget_s / (slowest * len(contenders)))))
    for round_index in range(rounds):
        gc.collect()
        shift = round_index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            contender.seconds.append(contender.time_once())
    return contenders


def print_table(title: str, header: list[str], rows: list[list[str]], notes: list[str] = ()) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = "  ".join("-" * width for width in widths)
    print(f"\n{title}")
    print("  ".join(str(cell).ljust(width) if i == 0 else str(cell).rjust(width) for i, (cell, width) in enumerate(zip(header, widths))))
    print(line)
    for row in rows:
        print("  ".join(str(cell).ljust(width) if i == 0 else str(cell).rjust(width) for i, (cell, width) in enumerate(zip(row, widths))))
    for note in notes:
        print(note)


def parse_arguments(description: str, repetitions: int, warmup: int) -> argparse.Namespace:
    """The options both benchmarks take; also sets torch's thread count."""
    import torch

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repetitions", type=int, default=repetitions,
                        help="timed runs per contender at least (>= 7); quick operations get up to 61")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed runs per contender before them")
    parser.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch intra-op threads in this process. 1 by default: on a 2-core machine shared with Ray's "
        "processes (or anything else), two threads that wait for each other at every barrier make one "
        "torch.cat of 52 MiB take 20-300 ms instead of 6-11 ms, which drowns what is compared here",
    )
    args = parser.parse_args()
    if args.repetitions < 7:
        parser.error("--repetitions must be at least 7: medians of fewer are noise")
    torch.set_num_threads(args.torch_threads)
    return args


def describe_environment(extra: dict[str, str]) -> str:
    import numpy
    import tensordict
    import torch

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "numpy": numpy.__version__,
        **extra,
    }
    return (
        f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), torch threads {torch.get_num_threads()}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )


def start_private_ray() -> None:
    """A Ray cluster of this process's own (``rlplat.start_ray(num_cpus=4)``), never someone else's.

    ``ray.init()`` without an address joins the cluster named in /tmp/ray/ray_current_cluster, which
    ``ray start`` and ``ray.cluster_utils.Cluster`` (tests running at the same time) write; joining
    it with ``num_cpus`` raises. ``RAY_ADDRESS=local`` makes ``ray.init`` start a new one instead.
    """
    import rlplat

    os.environ["RAY_ADDRESS"] = "local"
    rlplat.start_ray(num_cpus=4)

