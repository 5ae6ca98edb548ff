"""The demo's teacher and the distill presets: the teacher is the arith preset's own run (greedy validation
accuracy at least 0.8, the policy's tokenizer), and 100 steps of pure distillation from it raise the warm
start's greedy validation accuracy by at least 0.15 (measured: 0.445 -> 0.725)."""

from __future__ import annotations

import json

import pytest

import rlplat_demo as demo
from rlplat.config import load_config
from rlplat.trainer import Trainer
from rlplat.trainer.tracking import read_metrics
from rlplat_demo import build


def test_the_teacher_is_the_arith_run_above_the_threshold_with_the_policys_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((demo.assets_dir() / "build_info.json").read_text())["teacher"]
    assert info["val_accuracy"] >= 0.8 and info["transformers_greedy_accuracy"] >= 0.8
    assert AutoTokenizer.from_pretrained(demo.teacher_dir()).get_vocab() == AutoTokenizer.from_pretrained(demo.model_dir()).get_vocab()
    model = AutoModelForCausalLM.from_pretrained(demo.teacher_dir()).eval()
    assert sum(parameter.numel() for parameter in model.parameters()) == info.get("parameters", 527_744)


@pytest.mark.parametrize("name, rl", [("distill", 0), ("distill-rl", 1)])
def test_the_presets_distil_from_the_teacher_with_and_without_the_reward(name, rl):
    config = load_config(overrides=demo.preset(name), algo="grpo")
    assert config.distillation.teachers.arith.model_path == str(demo.teacher_dir())
    assert config.actor.loss.policy_loss_coef == rl and config.actor.loss.terms[0].loss_mode == "reverse_kl_topk"


@pytest.mark.slow
def test_a_hundred_steps_of_distillation_raise_greedy_accuracy_by_at_least_0_15(tmp_path):
    config = load_config(overrides=[*demo.preset("distill"), "trainer.test_freq=100", f"trainer.output_dir={tmp_path}",
                                    "trainer.logger=[jsonl]"], algo="grpo")
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    accuracy = {row["step"]: row[build.VALIDATION_ACCURACY] for row in read_metrics(tmp_path) if build.VALIDATION_ACCURACY in row}
    assert sorted(accuracy) == [0, 100]
    assert accuracy[100] - accuracy[0] >= 0.15, accuracy
