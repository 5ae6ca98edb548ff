"""Reward managers: the conformance suite, where scores go, extra fields, failures, timeouts, DAPO shaping."""

import logging
import threading

import pytest
import torch

from rlplat import registry
from rlplat.testing import RewardManagerConformance, reward_batch, word_tokenizer
from rlplat_rewards import gsm8k
from rlplat_rewards.managers import BatchRewardManager, DAPORewardManager, NaiveRewardManager

WORDS = ["the", "answer", "is", "####", "4", "5", "tool", "output", "x"]


@pytest.fixture
def tokenizer():
    return word_tokenizer(WORDS)


def batch_gsm8k(data_sources, solution_strs, ground_truths, extra_infos):
    """A vectorised scorer, as the batch manager calls it."""
    return [gsm8k.score(d, s, g, e) for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]


MANAGERS = {
    "naive": gsm8k.score,
    "batch": batch_gsm8k,
    "dapo": gsm8k.score,
}


class TestRegisteredManagers(RewardManagerConformance):
    @pytest.fixture(params=sorted(MANAGERS))
    def reward_manager(self, request, tokenizer):
        factory = registry.get("reward_manager", request.param)
        return factory(MANAGERS[request.param], tokenizer, {})

    @pytest.fixture
    def reward_batch(self, tokenizer):
        return reward_batch(tokenizer, ["the answer is #### 4", "#### 5", "x"], ground_truths=["4", "4", "4"], width=8)

    @pytest.fixture
    def expected_scores(self):
        return [1.0, 0.0, 0.0]


def test_the_score_lands_on_the_last_valid_token_after_a_masked_tool_span(tokenizer):
    # response "the tool output #### 4 <eos>" with "tool output" masked: the score goes to position 5
    batch = reward_batch(tokenizer, ["the tool output #### 4"], ground_truths=["4"], width=8)
    batch.batch["response_mask"][0, 1:3] = 0
    scores = NaiveRewardManager(gsm8k.score, tokenizer)(batch).batch["token_level_scores"]
    assert scores[0].tolist() == [0, 0, 0, 0, 0, 1.0, 0, 0]


def test_extra_fields_become_columns_and_metrics(tokenizer):
    batch = reward_batch(tokenizer, ["#### 4", "#### 5"], ground_truths=["4", "4"])
    output = NaiveRewardManager(gsm8k.score, tokenizer)(batch)
    assert list(output.non_tensor_batch["acc"]) == [True, False]
    assert list(output.non_tensor_batch["pred"]) == ["4", "5"]
    assert output.meta_info["reward_metrics"]["reward/acc/mean"] == 0.5
    assert "reward/pred/mean" not in output.meta_info["reward_metrics"]  # not numeric


def scorer_failing_on(bad_answer):
    def score(data_source, solution_str, ground_truth, extra_info=None):
        if bad_answer in solution_str:
            raise ZeroDivisionError("the scorer's own bug")
        return gsm8k.score(data_source, solution_str, ground_truth, extra_info)

    return score


def test_a_failing_sample_gets_the_fallback_and_is_counted_with_one_logged_traceback(tokenizer, caplog):
    batch = reward_batch(tokenizer, ["#### 4", "#### 5", "#### 5 x"], ground_truths=["4", "4", "4"])
    manager = NaiveRewardManager(scorer_failing_on("5"), tokenizer, {"fallback_score": -1.0})
    with caplog.at_level(logging.ERROR, logger="rlplat_rewards"):
        output = manager(batch)
    assert output.batch["token_level_scores"].sum(dim=-1).tolist() == [1.0, -1.0, -1.0]
    assert output.meta_info["reward_metrics"]["reward/errors"] == 2.0
    assert list(output.non_tensor_batch["acc"]) == [True, None, None]
    assert len(caplog.records) == 1 and "ZeroDivisionError" in caplog.text and "row 1" in caplog.text


def test_raise_on_error_stops_and_names_the_row(tokenizer):
    batch = reward_batch(tokenizer, ["#### 4", "#### 5"], ground_truths=["4", "4"])
    manager = NaiveRewardManager(scorer_failing_on("5"), tokenizer, {"raise_on_error": True})
    with pytest.raises(RuntimeError, match="row 1.*ZeroDivisionError"):
        manager(batch)


def test_a_sample_over_its_time_limit_falls_back_and_counts_as_a_timeout(tokenizer):
    release = threading.Event()

    def hangs_on_five(data_source, solution_str, ground_truth, extra_info=None):
        if "5" in solution_str:
            release.wait(30)
        return 1.0

    batch = reward_batch(tokenizer, ["#### 4", "#### 5"], ground_truths=["4", "4"])
    try:
        output = NaiveRewardManager(hangs_on_five, tokenizer, {"timeout_s": 0.2})(batch)
    finally:
        release.set()
    assert output.batch["token_level_scores"].sum(dim=-1).tolist() == [1.0, 0.0]
    assert output.meta_info["reward_metrics"]["reward/timeouts"] == 1.0


def test_an_async_scorer_is_awaited(tokenizer):
    async def score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "seen": solution_str}

    batch = reward_batch(tokenizer, ["#### 4"], ground_truths=["4"])
    output = NaiveRewardManager(score, tokenizer, {"timeout_s": 5})(batch)
    assert output.batch["token_level_scores"].sum().item() == 0.5
    assert list(output.non_tensor_batch["seen"]) == ["#### 4"]


def test_the_batch_manager_makes_one_call_with_lists(tokenizer):
    calls = []

    def score(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(solution_strs)
        return [float(text.endswith(truth)) for text, truth in zip(solution_strs, ground_truths)]

    batch = reward_batch(tokenizer, ["#### 4", "#### 5"], ground_truths=["4", "4"])
    output = BatchRewardManager(score, tokenizer)(batch)
    assert calls == [["#### 4", "#### 5"]]
    assert output.batch["token_level_scores"].sum(dim=-1).tolist() == [1.0, 0.0]


def test_a_failing_batch_call_falls_back_for_every_row(tokenizer):
    def score(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]  # one result for two rows

    batch = reward_batch(tokenizer, ["#### 4", "#### 5"], ground_truths=["4", "4"])
    output = BatchRewardManager(score, tokenizer, {"fallback_score": 0.25})(batch)
    assert output.batch["token_level_scores"].sum(dim=-1).tolist() == [0.25, 0.25]
    assert output.meta_info["reward_metrics"]["reward/errors"] == 2.0


@pytest.mark.parametrize(
    ("words", "expected_penalty"),
    [
        (4, 0.0),  # 4 words + EOS = 5 tokens <= expected 6: min(+0.25, 0) = 0
        (7, -0.5),  # 8 tokens: -(8 - 6) / 4 * 1.0
        (9, -1.0),  # 10 tokens, the full length: -(10 - 6) / 4
    ],
)
def test_dapo_penalises_the_overlong_part_linearly(tokenizer, words, expected_penalty):
    # max_resp_len 10, buffer 4 -> expected_len 6; the scorer gives 1.0 for "#### 4" at the end
    text = " ".join(["x"] * (words - 2) + ["####", "4"])
    batch = reward_batch(tokenizer, [text], ground_truths=["4"], width=10)
    config = {"max_resp_len": 10, "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}}
    output = DAPORewardManager(gsm8k.score, tokenizer, config)(batch)
    assert output.batch["token_level_scores"].sum().item() == pytest.approx(1.0 + expected_penalty)
    assert output.non_tensor_batch["overlong_reward"][0] == pytest.approx(expected_penalty)
    assert output.non_tensor_batch["overlong"][0] == (expected_penalty < 0)


def test_dapo_without_the_buffer_is_the_naive_manager(tokenizer):
    batch = reward_batch(tokenizer, ["x x x x x x x #### 4"], ground_truths=["4"], width=10)
    output = DAPORewardManager(gsm8k.score, tokenizer, {"overlong_buffer": {"enable": False}})(batch)
    assert output.batch["token_level_scores"].sum().item() == 1.0


def test_every_manager_is_listed():
    assert {"naive", "batch", "dapo"} <= set(registry.names("reward_manager"))
