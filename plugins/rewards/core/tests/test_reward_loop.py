"""The asynchronous reward loop and the ``async`` reward manager: the concurrency bound, timeouts of
hanging scorers, retries, default scores, their counts, and the manager contract."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from rlplat import registry
from rlplat.config_node import ConfigError, read_config_node
from rlplat_rewards.reward_loop import AsyncRewardManager, RewardLoopConfig, precomputed_scores
from rlplat.testing.reward_managers import RewardManagerConformance, reward_batch, word_tokenizer

WORDS = ["the", "answer", "is", "4", "5", "slow"]


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(WORDS)


def batch_of(tokenizer, count, response="the answer is 4", truth="4"):
    return reward_batch(tokenizer, [response] * count, [truth] * count)


def ends_with_truth(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.split()[-1] == ground_truth
    return {"score": 1.0 if correct else 0.25, "acc": correct}


class InFlight:
    """Counts the calls of a scorer running at once (from any thread) and remembers the most."""

    def __init__(self):
        self.lock, self.now, self.most, self.calls = threading.Lock(), 0, 0, 0

    def enter(self):
        with self.lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)

    def leave(self):
        with self.lock:
            self.now -= 1


def metrics_of(output):
    return output.meta_info["reward_metrics"]


# -- the contract ---------------------------------------------------------------------------------------

class TestAsyncRewardManager(RewardManagerConformance):
    @pytest.fixture
    def reward_manager(self, tokenizer):
        return AsyncRewardManager(ends_with_truth, tokenizer, {"max_concurrency": 2})

    @pytest.fixture
    def reward_batch(self, tokenizer):
        return reward_batch(tokenizer, ["the answer is 4", "5", "the answer is 5"], ["4", "4", "5"], width=6)

    @pytest.fixture
    def expected_scores(self):
        return [1.0, 0.25, 1.0]


def test_the_async_manager_is_registered_with_its_config_schema():
    assert registry.get("reward_manager", "async") is AsyncRewardManager
    assert registry.entry("reward_manager", "async").config_schema == "rlplat_rewards.reward_loop:RewardLoopConfig"


@pytest.mark.parametrize("key, value, message", [
    ("max_concurrency", 0, "max_concurrency must be an integer >= 1, got 0"),
    ("timeout_s", 0, "timeout_s must be a number of seconds > 0 or null"),
    ("retries", -1, "retries must be an integer >= 0, got -1"),
    ("retry_backoff_s", -0.5, "retry_backoff_s must be a number of seconds >= 0"),
    ("default_score", float("nan"), "default_score must be a finite number"),
])
def test_bad_settings_are_config_errors_naming_the_node(key, value, message):
    with pytest.raises(ConfigError, match=f"reward.config: {message}"):
        read_config_node({key: value}, RewardLoopConfig, "reward.config")


def test_an_unknown_setting_names_the_closest_one(tokenizer):
    with pytest.raises(ConfigError, match="reward.config.timeout.*Did you mean 'reward.config.timeout_s'"):
        AsyncRewardManager(ends_with_truth, tokenizer, {"timeout": 1})


# -- the concurrency bound (the acceptance) --------------------------------------------------------

def test_64_samples_of_a_100_ms_sync_scorer_take_about_16_rounds_of_4_and_never_more_than_4_at_once(tokenizer):
    counter = InFlight()

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        counter.enter()
        try:
            time.sleep(0.1)
            return ends_with_truth(data_source, solution_str, ground_truth)
        finally:
            counter.leave()

    manager = AsyncRewardManager(slow, tokenizer, {"max_concurrency": 4})
    started = time.perf_counter()
    output = manager(batch_of(tokenizer, 64))
    seconds = time.perf_counter() - started
    assert 1.5 <= seconds < 3.0, f"64 samples x 100 ms / 4 at once should take about 1.6 s, took {seconds:.2f} s"
    assert counter.calls == 64 and counter.most == 4
    assert output.batch["token_level_scores"].sum().item() == 64.0
    metrics = metrics_of(output)
    assert metrics["reward/max_in_flight"] == 4
    assert 1.5 <= metrics["timing_s/reward_scoring"] <= seconds
    assert metrics["reward/errors"] == metrics["reward/defaults"] == metrics["reward/retries"] == 0


def test_64_samples_of_a_100_ms_async_scorer_take_about_16_rounds_of_4_and_never_more_than_4_at_once(tokenizer):
    counter = InFlight()

    async def slow(data_source, solution_str, ground_truth, extra_info=None):
        counter.enter()
        try:
            await asyncio.sleep(0.1)
            return ends_with_truth(data_source, solution_str, ground_truth)
        finally:
            counter.leave()

    manager = AsyncRewardManager(slow, tokenizer, {"max_concurrency": 4})
    started = time.perf_counter()
    output = manager(batch_of(tokenizer, 64))
    seconds = time.perf_counter() - started
    assert 1.5 <= seconds < 3.0, f"took {seconds:.2f} s"
    assert counter.calls == 64 and counter.most == 4
    assert metrics_of(output)["reward/max_in_flight"] == 4
    assert output.batch["token_level_scores"].sum().item() == 64.0


# -- failures ------------------------------------------------------------------------------------------

def test_a_hanging_sync_scorer_times_out_gets_the_default_score_and_is_counted(tokenizer):
    release = threading.Event()  # never set during the call: the scorer hangs until the test ends

    def hangs(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.endswith("slow"):
            release.wait()
        return 1.0

    batch = reward_batch(tokenizer, ["the answer is slow", "4", "slow", "5"], ["4"] * 4)
    manager = AsyncRewardManager(hangs, tokenizer, {"timeout_s": 0.2, "default_score": -1.0, "max_concurrency": 4})
    try:
        started = time.perf_counter()
        output = manager(batch)
        seconds = time.perf_counter() - started
    finally:
        release.set()
    assert seconds < 1.5, f"the call waited {seconds:.2f} s for scorers past their 0.2 s timeout"
    assert output.batch["token_level_scores"].sum(-1).tolist() == [-1.0, 1.0, -1.0, 1.0]
    metrics = metrics_of(output)
    assert (metrics["reward/timeouts"], metrics["reward/errors"], metrics["reward/defaults"]) == (2, 2, 2)


def test_a_hanging_sync_scorer_does_not_keep_the_interpreter_from_exiting(python_run):
    result = python_run("""
        import asyncio
        import time
        from rlplat_rewards.reward_loop import RewardLoop, ScoringSample

        def forever(data_source, solution_str, ground_truth, extra_info=None):
            while True:
                time.sleep(1)

        loop = RewardLoop(forever, None, {"timeout_s": 0.1})
        scoring = asyncio.run(loop.score_all([ScoringSample("t", "4", "4", None, last_token=0, tokens_hash=0)]))
        print("status", scoring.outcomes[0].status, flush=True)
    """, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "status timeout"


def test_a_hanging_async_scorer_is_cancelled_at_the_timeout(tokenizer):
    cancelled = []

    async def hangs(data_source, solution_str, ground_truth, extra_info=None):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(solution_str)
            raise

    manager = AsyncRewardManager(hangs, tokenizer, {"timeout_s": 0.1, "default_score": 0.5, "max_concurrency": 3})
    output = manager(batch_of(tokenizer, 3))
    assert sorted(cancelled) == ["the answer is 4"] * 3
    assert output.batch["token_level_scores"].sum(-1).tolist() == [0.5] * 3
    assert metrics_of(output)["reward/timeouts"] == 3 and metrics_of(output)["reward/defaults"] == 3


def test_a_sample_that_fails_its_first_attempt_is_retried_counted_and_scored(tokenizer):
    attempts: dict[str, list[float]] = {}

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        times = attempts.setdefault(extra_info["id"], [])
        times.append(time.perf_counter())
        if len(times) == 1:
            raise ConnectionError("the judge's server dropped the request")
        return ends_with_truth(data_source, solution_str, ground_truth)

    batch = reward_batch(tokenizer, ["the answer is 4", "5"], ["4", "4"], extra_infos=[{"id": "a"}, {"id": "b"}])
    manager = AsyncRewardManager(flaky, tokenizer, {"retries": 2, "retry_backoff_s": 0.05})
    output = manager(batch)
    assert output.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.25]
    assert list(output.non_tensor_batch["acc"]) == [True, False]
    metrics = metrics_of(output)
    assert (metrics["reward/retries"], metrics["reward/errors"], metrics["reward/defaults"]) == (2, 2, 0)
    assert all(len(times) == 2 and times[1] - times[0] >= 0.05 for times in attempts.values()), "no backoff before the retry"


def test_a_sample_whose_every_attempt_fails_gets_the_default_score_and_no_fields(tokenizer):
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "5":
            return "not a score"
        return ends_with_truth(data_source, solution_str, ground_truth)

    batch = reward_batch(tokenizer, ["the answer is 4", "5"], ["4", "4"])
    output = AsyncRewardManager(broken, tokenizer, {"retries": 1, "default_score": -2.0})(batch)
    assert output.batch["token_level_scores"].sum(-1).tolist() == [1.0, -2.0]
    assert list(output.non_tensor_batch["acc"]) == [True, None]
    metrics = metrics_of(output)
    assert (metrics["reward/errors"], metrics["reward/retries"], metrics["reward/defaults"]) == (2, 1, 1)
    assert metrics["reward/acc/mean"] == 1.0


def test_raise_on_error_names_the_row_and_the_data_source(tokenizer):
    def fails_on_five(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "5":
            raise ValueError("cannot parse the answer")
        return 1.0

    batch = reward_batch(tokenizer, ["4", "4", "5", "4"], ["4"] * 4, data_source="arith")
    manager = AsyncRewardManager(fails_on_five, tokenizer, {"raise_on_error": True, "retries": 1})
    with pytest.raises(RuntimeError, match=r"failed on row 2 \(data_source 'arith'\) in 2 attempt\(s\); "
                                           r"last: ValueError: cannot parse the answer"):
        manager(batch)


# -- calling it ------------------------------------------------------------------------------------------

def test_the_manager_works_from_a_thread_that_runs_an_event_loop(tokenizer):
    manager = AsyncRewardManager(ends_with_truth, tokenizer, {})

    async def inside_a_loop():
        return manager(batch_of(tokenizer, 3))

    output = asyncio.run(inside_a_loop())
    assert output.batch["token_level_scores"].sum().item() == 3.0


def test_a_custom_async_function_from_a_file_is_awaited(tokenizer, tmp_path):
    from rlplat.scorers import scorer_for

    path = tmp_path / "reward.py"
    path.write_text("import asyncio\n\nasync def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    await asyncio.sleep(0)\n    return float(solution_str == ground_truth)\n")
    output = AsyncRewardManager(scorer_for(None, str(path)), tokenizer, {})(reward_batch(tokenizer, ["4", "5"], ["4", "4"]))
    assert output.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0]


def test_in_the_driver_nothing_overlaps_generation():
    tokenizer = word_tokenizer(WORDS)
    metrics = metrics_of(AsyncRewardManager(ends_with_truth, tokenizer, {})(batch_of(tokenizer, 4)))
    assert metrics["reward/overlap_fraction"] == 0.0
    assert metrics["timing_s/reward_after_generation"] == metrics["timing_s/reward_scoring"]


def test_a_batch_without_scores_of_its_workers_has_no_precomputed_scores(tokenizer):
    assert precomputed_scores(batch_of(tokenizer, 2)) is None


def test_token_level_scores_are_float32_at_the_last_valid_token(tokenizer):
    batch = reward_batch(tokenizer, ["the answer is 4", "4"], ["4", "4"], width=7)
    scores = AsyncRewardManager(ends_with_truth, tokenizer, {})(batch).batch["token_level_scores"]
    expected = torch.zeros(2, 7)
    expected[0, 4], expected[1, 1] = 1.0, 1.0  # the EOS closing each response is its last valid token
    assert scores.dtype == torch.float32 and torch.equal(scores, expected)
    assert np.array_equal(batch.batch["response_mask"].sum(-1).numpy(), [5, 2])
