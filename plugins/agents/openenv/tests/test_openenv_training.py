"""20 GRPO steps of the demo task through the OpenEnv adapter: the ``retry`` demo (``a+b=``, up to 3
answers with "wrong, try again" after a wrong one, the tool-demo model) with its episodes played by
``rlplat_openenv.agent:run`` in the ``blackbox`` loop against the arithmetic OpenEnv environment, served on
127.0.0.1 in the rollout worker; the environment's rubric gives the reward."""

from __future__ import annotations

import json

import pytest

STEPS = 20
SMALLER = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4"]
"""Half the demo's 16 prompts a step and half its 8 samples, on both sides of the comparison: the suite's time."""


def train(demo: str, output, overrides: list[str]) -> list[dict]:
    """The metrics rows of a run of the ``demo`` preset with ``overrides``, into ``output``."""
    from rlplat.cli.command_line import resolved_config
    from rlplat.trainer import Trainer

    config = resolved_config(None, [f"trainer.output_dir={output}", *SMALLER, *overrides], algo=None, engine=None, rollout=None,
                             demo=demo)
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_20_grpo_steps_on_the_demo_task_through_the_openenv_adapter(tmp_path):
    overrides = [
        f"trainer.total_training_steps={STEPS}", "trainer.test_freq=0", "trainer.val_before_train=false",
        "agent.loop_names={env: blackbox}", "agent.loops.blackbox.agent=rlplat_openenv.agent:run",
        "agent.loops.blackbox.agent_kwargs={app: 'rlplat_openenv.arithmetic:app', reset_kwargs: {max_attempts: 3}}",
    ]
    rows = train("retry", tmp_path / "run", overrides)
    steps = [row for row in rows if "critic/score/mean" in row]
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    for row in steps:
        assert row["agent/agent_errors/mean"] == 0.0, row["step"]
        assert row["agent/turns/max"] > 1  # wrong answers got the environment's feedback and another turn
        # rlplat's own scorer, reading the tokens the gateway recorded (answers and feedback), judges the
        # last answer as the environment's rubric did
        assert row["reward/acc/mean"] == pytest.approx(row["critic/score/mean"])
    # the same first step through rlplat's own env loop and retry environment: same seed, same sampled tokens
    # and feedback turns, so the same rewards and lengths
    native = train("retry", tmp_path / "native", ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                                  "trainer.test_freq=0"])[-1]
    assert steps[0]["critic/score/mean"] == native["critic/score/mean"]
    assert steps[0]["response_length/mean"] == native["response_length/mean"]
