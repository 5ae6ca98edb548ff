"""The ``openenv`` environment of the ``env`` agent loop: rlplat's environment conformance suite on the
demo's OpenEnv environment, served on 127.0.0.1, and one GRPO step of the ``retry`` demo through it
against the same step through rlplat's own ``retry`` environment."""

from __future__ import annotations

import json

import pytest

from rlplat.testing.agents import EnvironmentCase, EnvironmentConformance
from rlplat_openenv.environment import OpenEnvConfig, OpenEnvEnvironment

ROW = {"raw_prompt": [{"role": "user", "content": "49+12="}], "data_source": "arith_chat",
       "reward_model": {"ground_truth": "61"}, "extra_info": {"split": "train", "index": 7}, "uid": "u-7"}


class TestOpenEnvEnvironment(EnvironmentConformance):
    @pytest.fixture
    def make_environment(self):
        return lambda: OpenEnvEnvironment({"reset_kwargs": {"max_attempts": 3}})

    @pytest.fixture
    def environment_cases(self):
        other = {**ROW, "raw_prompt": [{"role": "user", "content": "90+15="}], "reward_model": {"ground_truth": "105"}}
        return [EnvironmentCase(ROW, solving="61", failing="60"), EnvironmentCase(other, solving="105", failing="15")]


def test_a_config_without_a_module_path_is_refused():
    with pytest.raises(ValueError, match="module:attribute"):
        OpenEnvConfig(app="arithmetic")


def test_prompt_field_makes_the_reset_observation_the_first_message():
    from rlplat.kits.aio import run_async

    environment = OpenEnvEnvironment({"prompt_field": "question", "reset_kwargs": {"question": "2+2=", "answer": "4"}})

    async def episode():
        first = await environment.reset(ROW)
        step = await environment.step("4")
        await environment.close()
        return first, step

    first, step = run_async(episode())
    assert first == [{"role": "user", "content": "2+2="}]
    assert (step.reward, step.done, step.observation) == (1.0, True, None)


def first_step_reward(tmp_path, name: str, overrides: list[str]) -> float:
    from rlplat.cli.command_line import resolved_config
    from rlplat.trainer import Trainer

    output = tmp_path / name
    config = resolved_config(None, [f"trainer.output_dir={output}", "trainer.total_training_steps=1",
                                    "trainer.val_before_train=false", "trainer.test_freq=0", *overrides],
                             algo=None, engine=None, rollout=None, demo="retry")
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return next(row for row in rows if row["step"] == 1)["critic/score/mean"]


@pytest.mark.slow
def test_the_openenv_rubric_rewards_the_retry_demo_step_as_rlplat_retry_environment_does(tmp_path):
    """Same seed, same model, same env loop: the first step's 128 conversations are the same tokens, so the
    OpenEnv environment's rewards (its rubric) must add up to what rlplat's ``retry`` environment gives."""
    native = first_step_reward(tmp_path, "retry", [])
    openenv = first_step_reward(tmp_path, "openenv", ["agent.environment=openenv",
                                                     "agent.environment_config={reset_kwargs: {max_attempts: 3}}"])
    assert 0.0 < native < 1.0
    assert openenv == native
