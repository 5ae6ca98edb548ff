"""Scoring that overlaps generation: the agent-loop manager hands each finished trajectory to the reward
loop while the others still generate (the hf rollout on a tiny model), and the driver's
``precomputed_scores`` equals what the ``async`` manager computes from the same batch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from rlplat import LocalWorkerGroup, WorkerSpec
from rlplat_agents.config import AgentConfig
from rlplat_agents.manager import AgentLoopManager, EngineClient
from rlplat.contracts.rollout import SamplingParams
from rlplat.data import collate
from rlplat.registry import EngineRegistry
from rlplat_rewards.reward_loop import LOOP_COLUMNS, SCORE_COLUMN, AsyncRewardManager, RewardLoop, precomputed_scores
from rlplat.testing import ScriptedClient
from rlplat.testing.tiny_models import arithmetic_tokenizer, save_tiny_model
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

PROBLEMS = [(12, 34), (5, 6), (40, 2), (7, 7)]
SAMPLES, RESPONSE_LENGTH = 2, 8

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(character.isdigit() for character in solution_str)
    return {"score": 1.0 if solution_str == ground_truth else digits / 8, "digits": digits}
'''


def digits_score(data_source, solution_str, ground_truth, extra_info=None):
    """Partial credit for digits, so that a random tiny model's responses get different scores."""
    digits = sum(character.isdigit() for character in solution_str)
    return {"score": 1.0 if solution_str == ground_truth else digits / 8, "digits": digits}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return arithmetic_tokenizer()


@pytest.fixture(scope="module")
def rollout(model_dir):
    return EngineRegistry("rollout").build("hf", {"model_path": model_dir})


def arithmetic_prompts(tokenizer):
    rows = [{"input_ids": tokenizer.encode(f"{a}+{b}="), "raw_prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "data_source": "arith", "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"index": index},
             "index": index} for index, (a, b) in enumerate(PROBLEMS)]
    return collate(rows, tokenizer.pad_token_id)


class TimedClient(EngineClient):
    """The engine as a client, noting when each request's answer came back."""

    def __init__(self, engine):
        super().__init__(engine)
        self.answered: list[float] = []

    async def generate(self, prompt_ids, sampling):
        output = await super().generate(prompt_ids, sampling)
        self.answered.append(time.perf_counter())
        return output


class TimedScorer:
    """``digits_score`` that notes when each call starts and takes ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.lock = seconds, [], threading.Lock()

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        with self.lock:
            self.started.append(time.perf_counter())
        time.sleep(self.seconds)
        return digits_score(data_source, solution_str, ground_truth, extra_info)


@pytest.fixture(scope="module")
def overlapped(rollout, tokenizer):
    """A batch generated through single_turn loops, two conversations at a time, each trajectory scored
    as it finished (20 ms per score)."""
    client, scorer = TimedClient(rollout), TimedScorer(0.02)
    manager = AgentLoopManager([client], tokenizer, AgentConfig(loop="single_turn", max_concurrency=2),
                               pad_token_id=tokenizer.pad_token_id, max_prompt_length=16,
                               reward_loop=RewardLoop(scorer, tokenizer, {"max_concurrency": 4}))
    batch = manager.generate(arithmetic_prompts(tokenizer), SamplingParams(n=SAMPLES, temperature=1.0, seed=5), RESPONSE_LENGTH)
    return batch, client, scorer


def test_finished_trajectories_are_scored_while_the_others_still_generate(overlapped):
    batch, client, scorer = overlapped
    assert len(batch) == len(PROBLEMS) * SAMPLES == len(scorer.started) == len(client.answered)
    last_answer = max(client.answered)
    early = [started for started in scorer.started if started < last_answer]
    # two conversations at a time: the first two end (and are scored) while six more still have to generate
    assert len(early) >= 2, f"{len(early)} of {len(scorer.started)} scores started before the last trajectory ended"
    metrics = precomputed_scores(batch).meta_info["reward_metrics"]
    assert 0 < metrics["reward/overlap_fraction"] <= 1
    assert metrics["timing_s/reward_after_generation"] < metrics["timing_s/reward_scoring"]


def test_the_workers_scores_equal_the_async_managers_on_the_same_batch(overlapped, tokenizer):
    batch, _, _ = overlapped
    assert set(LOOP_COLUMNS) <= set(batch.non_tensor_batch)
    precomputed = precomputed_scores(batch)
    driver = AsyncRewardManager(digits_score, tokenizer, {"max_concurrency": 4})(batch)
    assert torch.equal(precomputed.batch["token_level_scores"], driver.batch["token_level_scores"])
    assert len(set(batch.non_tensor_batch[SCORE_COLUMN].tolist())) > 1, "every response got the same score: a weak check"
    assert list(precomputed.non_tensor_batch) == list(driver.non_tensor_batch) == ["digits"]
    assert list(precomputed.non_tensor_batch["digits"]) == list(driver.non_tensor_batch["digits"])
    counted = ("reward/errors", "reward/timeouts", "reward/retries", "reward/defaults", "reward/digits/mean")
    assert {key: precomputed.meta_info["reward_metrics"][key] for key in counted} == \
        {key: driver.meta_info["reward_metrics"][key] for key in counted}


def test_scores_of_responses_replaced_after_generation_are_not_used(overlapped):
    batch, _, _ = overlapped
    changed = batch.select_idxs(list(range(len(batch))))
    responses = changed.batch["responses"].clone()
    responses[3, 0] = (responses[3, 0] + 1) % 14 + 1  # another token, still not the pad
    changed.batch["responses"] = responses
    assert precomputed_scores(batch) is not None and precomputed_scores(changed) is None


def test_counts_sum_over_the_rows_of_several_workers(overlapped):
    from rlplat.protocol import DataProto

    batch, _, _ = overlapped
    first, second = batch.select_idxs(list(range(4))), batch.select_idxs(list(range(4, 8)))
    for part, errors in ((first, [1, 0, 2, 0]), (second, [0, 0, 0, 1])):
        part.non_tensor_batch["reward_errors"] = np.asarray(errors, dtype=np.int64)
    second.non_tensor_batch["reward_round"] = second.non_tensor_batch["reward_round"] + 1  # another worker's round
    metrics = precomputed_scores(DataProto.concat([first, second])).meta_info["reward_metrics"]
    assert metrics["reward/errors"] == 4


def test_an_environments_trajectory_is_scored_too():
    from rlplat_agents.chat import ChatRenderer
    from rlplat.testing.chat_tokenizers import CHATML_TOOLS, chat_tokenizer

    tokenizer = chat_tokenizer(CHATML_TOOLS)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    manager = AgentLoopManager([ScriptedClient(tokenizer, ["5", "1776"], stop)], tokenizer,
                               AgentConfig(loop="env", environment="retry"), pad_token_id=tokenizer.pad_token_id,
                               max_prompt_length=200, reward_loop=RewardLoop(digits_score, tokenizer, {}))
    messages = [{"role": "user", "content": "37*48="}]
    prompts = collate([{"input_ids": ChatRenderer(tokenizer).prompt_ids(messages),
                        "raw_prompt": messages, "data_source": "t", "reward_model": {"ground_truth": "1776"},
                        "extra_info": {}, "index": 0}], tokenizer.pad_token_id)
    batch = manager.generate(prompts, SamplingParams(), response_length=64)
    assert batch.non_tensor_batch["agent_reward"].tolist() == [1.0]
    # the decoded response holds both attempts, "5" and "1776" (5 digits), and the environment's feedback
    assert batch.non_tensor_batch[SCORE_COLUMN].tolist() == [5 / 8]
    driver = AsyncRewardManager(digits_score, tokenizer, {})(batch)
    assert torch.equal(precomputed_scores(batch).batch["token_level_scores"], driver.batch["token_level_scores"])


# -- through the rollout worker ---------------------------------------------------------------------------

def worker_config(model_dir, reward_path, **reward_settings):
    return {"roles": ["rollout"], "rollout": "hf", "rollout_config": {"model_path": model_dir},
            "sampling": {"n": SAMPLES, "max_new_tokens": RESPONSE_LENGTH, "temperature": 1.0, "seed": 3},
            "rollout_driver": "agent_loops", "driver_node": {"loop": "single_turn"}, "tokenizer_path": model_dir,
            "prompt_length": 16,
            "reward": {"manager": "async", "scorer": None, "custom_function": {"path": reward_path, "name": "compute_score"},
                       "config": reward_settings}}


def generate_in_a_worker(config, prompts):
    group = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, config), role="rollout")
    try:
        group.init_model()
        return group.generate_sequences(prompts)
    finally:
        group.shutdown()


def test_the_rollout_worker_scores_agent_batches_when_the_async_manager_overlaps(model_dir, tokenizer, tmp_path):
    from rlplat.scorers import scorer_for

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    prompts = arithmetic_prompts(tokenizer)
    batch = generate_in_a_worker(worker_config(model_dir, str(reward), max_concurrency=2), prompts)
    precomputed = precomputed_scores(batch)
    driver = AsyncRewardManager(scorer_for(None, str(reward)), tokenizer, {})(batch)
    assert torch.equal(precomputed.batch["token_level_scores"], driver.batch["token_level_scores"])
    assert precomputed.meta_info["reward_metrics"]["reward/max_in_flight"] <= 2

    unscored = generate_in_a_worker(worker_config(model_dir, str(reward), overlap=False), prompts)
    assert SCORE_COLUMN not in unscored.non_tensor_batch and precomputed_scores(unscored) is None


# -- a run ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_with_the_async_manager_and_agent_loops_logs_the_workers_scoring(model_dir, tmp_path):
    from rlplat.config import load_config
    from rlplat.kits.data import write_parquet
    from rlplat.trainer.tracking import read_metrics
    from rlplat.trainer import Trainer

    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"ground_truth": str(a + b)}} for a, b in PROBLEMS]
    train = write_parquet(rows, tmp_path / "train.parquet")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    config = load_config(overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "rollout.n=2", "rollout.response_length=4", "actor.micro_batch_size_per_gpu=8", f"reward.custom_function.path={reward}",
        "reward.manager=async", "reward.config.max_concurrency=3", "agent.loop=single_turn", "cluster.backend=local",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "trainer.total_training_steps=2",
        "trainer.test_freq=0",
    ], algo="grpo")
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    steps = [record for record in read_metrics(config.trainer.output_dir) if record["step"] >= 1]
    assert len(steps) == 2
    for record in steps:
        assert record["reward/errors"] == record["reward/defaults"] == 0
        assert 1 <= record["reward/max_in_flight"] <= 3
        assert record["reward/digits/mean"] >= 0
        assert 0 < record["reward/overlap_fraction"] <= 1, "the run's scores were not computed while generating"
        assert 0 <= record["timing_s/reward_after_generation"] <= record["timing_s/reward_scoring"]
