"""20 GRPO steps of the demo task through the OpenEnv adapter: the ``retry`` demo (``a+b=``, up to 3
answers with "wrong, try again" after a wrong one, the tool-demo model) with its episodes played by
``rlplat_openenv.agent:run`` in the ``blackbox`` loop against the arithmetic OpenEnv environment, served on
127.0.0.1 in the rollout worker; the environment's rubric gives the reward."""

from __future__ import annotations

import json

import pytest

STEPS = 20


def demo_data_for_the_blackbox_loop(folder) -> tuple[str, str]:
    """The demo's ``arith_chat`` train and validation files without their ``agent_name`` column (it names
    the ``env`` loop per row, which would win over ``agent.loop``)."""
    import pyarrow.parquet as pq
    from rlplat_demo import tools

    paths = []
    for split in ("env_train", "env_val"):
        path = folder / f"{split}.parquet"
        pq.write_table(pq.read_table(tools.data_file(split)).drop_columns(["agent_name"]), path)
        paths.append(str(path))
    return paths[0], paths[1]


@pytest.mark.slow
def test_20_grpo_steps_on_the_demo_task_through_the_openenv_adapter(tmp_path):
    from rlplat.cli.command_line import resolved_config
    from rlplat.trainer import Trainer

    train, val = demo_data_for_the_blackbox_loop(tmp_path)
    overrides = [
        f"trainer.output_dir={tmp_path / 'run'}", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=20",
        f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        "agent.loop=blackbox", "agent.loops.blackbox.agent=rlplat_openenv.agent:run",
        "agent.loops.blackbox.agent_kwargs={app: 'rlplat_openenv.arithmetic:app', reset_kwargs: {max_attempts: 3}}",
    ]
    config = resolved_config(None, overrides, algo=None, engine=None, rollout=None, demo="retry")
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "critic/score/mean" in row]
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    for row in steps:
        assert row["agent/agent_errors/mean"] == 0.0, row["step"]
        assert row["agent/turns/max"] > 1  # wrong answers got the environment's feedback and another turn
        # rlplat's own scorer, reading the tokens the gateway recorded (answers and feedback), judges the
        # last answer as the environment's rubric did
        assert row["reward/acc/mean"] == pytest.approx(row["critic/score/mean"])
    validation = [row["val/arith_chat/acc/mean"] for row in rows if "val/arith_chat/acc/mean" in row]
    assert len(validation) == 2  # steps 0 and 20
    assert validation[-1] >= validation[0] - 0.05, validation  # 20 steps at lr 2e-5 move greedy accuracy little
