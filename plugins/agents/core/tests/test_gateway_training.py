"""A black-box agent written only against the ``openai`` client trains the tool demo through the gateway as the
native ``tool`` loop does: 20 GRPO steps of each, side by side."""

from __future__ import annotations

import json

import pytest


def train(demo: str, output_dir, steps: int = 20) -> list[dict]:
    from rlplat.cli.command_line import resolved_config
    from rlplat.trainer import Trainer

    config = resolved_config(None, [f"trainer.output_dir={output_dir}", f"trainer.total_training_steps={steps}",
                                    f"trainer.test_freq={steps}", "trainer.val_before_train=true", "data.seed=5"],
                             algo=None, engine=None, rollout=None, demo=demo)
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def validation(records: list[dict], key: str) -> list[float]:
    return [record[f"val/{key}"] for record in records if f"val/{key}" in record]


@pytest.mark.slow
def test_a_blackbox_openai_agent_learns_to_call_the_calculator_like_the_tool_loop(tmp_path):
    native = train("tools", tmp_path / "native")
    blackbox = train("tools-blackbox", tmp_path / "blackbox")
    native_rate, blackbox_rate = validation(native, "agent/tool_call_rate"), validation(blackbox, "agent/tool_call_rate")
    native_acc, blackbox_acc = validation(native, "arith_tools/acc/mean"), validation(blackbox, "arith_tools/acc/mean")
    print(f"tool-call rate, validation at steps 0 and 20: native {native_rate}, blackbox {blackbox_rate}; "
          f"accuracy: native {native_acc}, blackbox {blackbox_acc}")
    assert len(blackbox_rate) == 2 and len(native_rate) == 2
    # both start from the same warm start (rarely calling) and learn to call it
    assert abs(blackbox_rate[0] - native_rate[0]) <= 0.1
    assert blackbox_rate[1] >= blackbox_rate[0] + 0.3 and native_rate[1] >= native_rate[0] + 0.3
    assert abs(blackbox_rate[1] - native_rate[1]) <= 0.2
    assert blackbox_acc[1] >= blackbox_acc[0] + 0.2
    train_steps = [record for record in blackbox if "agent/agent_errors/mean" in record and "step" in record]
    assert train_steps and max(record["agent/agent_errors/mean"] for record in train_steps) <= 0.05
    assert all(record.get("agent/prefix_breaks/mean", 0.0) == 0.0 for record in train_steps)
