"""What scoring in a scorer process costs (``reward.config.isolation``): ``python bench/scorer_isolation.py [--repeats 15]``.

Scores 256 short responses with an exact-match function from a user's file (a ``CustomScorer``, so ``auto``
would isolate it) through the ``naive`` and ``async`` managers: in this process without a deadline (a plain
call), on a thread with ``timeout_s`` (``isolation=thread``, one thread per sample) and in one warm scorer
process (``isolation=process``), taking turns. Prints the median call over ``--repeats`` calls and the
per-sample time added against the plain call; then the time to start a scorer process (the first call,
which a kill pays again).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rlplat.scorers import CustomScorer
from rlplat.testing import reward_batch, word_tokenizer
from rlplat_rewards.managers import NaiveRewardManager
from rlplat_rewards.reward_loop import AsyncRewardManager

SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": correct}
'''
SAMPLES = 256


def median_calls(managers: dict[str, object], batch, repeats: int) -> dict[str, float]:
    """The median call of each manager, the managers taking turns so that a busy moment hits them all."""
    times: dict[str, list[float]] = {name: [] for name in managers}
    for manager in managers.values():
        manager(batch)  # a warm start: the scorer process, imports, caches
    for _ in range(repeats):
        for name, manager in managers.items():
            started = time.perf_counter()
            manager(batch)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    arguments = parser.parse_args()
    words = [str(number) for number in range(10)]
    tokenizer = word_tokenizer(words)
    batch = reward_batch(tokenizer, [" ".join(words[(row + k) % 10] for k in range(3)) for row in range(SAMPLES)],
                         ["0 1 2"] * SAMPLES)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "reward.py"
        path.write_text(SCORER)
        scorer = CustomScorer(path)
        print(f"{SAMPLES} samples, median of {arguments.repeats} calls")
        for name, factory in (("naive", NaiveRewardManager), ("async", AsyncRewardManager)):
            managers = {"in process, no deadline": factory(scorer, tokenizer, {}),
                        "isolation=thread": factory(scorer, tokenizer, {"timeout_s": 30, "isolation": "thread"}),
                        "isolation=process": factory(scorer, tokenizer, {"timeout_s": 30, "isolation": "process"})}
            medians = median_calls(managers, batch, arguments.repeats)
            plain = medians["in process, no deadline"]
            for mode, seconds in medians.items():
                print(f"{name:6} {mode:24} {seconds * 1e3:8.1f} ms  {(seconds - plain) / SAMPLES * 1e6:+7.1f} us a sample")
            managers["isolation=process"].close()
        starts = []
        for _ in range(arguments.repeats):
            manager = NaiveRewardManager(scorer, tokenizer, {"timeout_s": 30, "isolation": "process"})
            started = time.perf_counter()
            manager(reward_batch(tokenizer, ["0"], ["0"]))
            starts.append(time.perf_counter() - started)
            manager.close()
        print(f"starting a scorer process (first call of one sample): {statistics.median(starts) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
