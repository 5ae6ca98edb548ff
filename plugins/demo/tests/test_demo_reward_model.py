"""The demo's reward model: shipped with the arithmetic demo, a one-label classifier over the policy's own
tokenizer that ranks the right sum first, and the preset and example config that train GRPO with it alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import rlplat_demo as demo
from rlplat.config import load_config
from rlplat_demo import build
from rlplat_demo.reward_model import answer_ids, prompt_ids, score_sequences
from rlplat.trainer.tracking import read_metrics
from rlplat.trainer import Trainer

REPOSITORY = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def reward_model():
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = demo.reward_model_dir()
    return AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_the_reward_model_is_a_one_label_classifier_over_the_policys_tokenizer(reward_model):
    from transformers import AutoTokenizer

    model, tokenizer = reward_model
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    policy = AutoTokenizer.from_pretrained(demo.model_dir())
    assert tokenizer.get_vocab() == policy.get_vocab()  # the role scores the policy's tokens as they are
    assert sum(path.stat().st_size for path in demo.reward_model_dir().rglob("*") if path.is_file()) < 4_000_000


def test_the_right_sum_scores_above_every_other_answer_on_most_validation_prompts(reward_model):
    model, tokenizer = reward_model
    _, validation = build.split_pairs(0)
    answers = [(str(value), eos) for value in range(200) for eos in (True, False)]
    top = 0
    with torch.no_grad():
        for a, b in validation[:40]:
            prompt = prompt_ids(tokenizer, a, b)
            scores = score_sequences(model, tokenizer, [prompt + answer_ids(tokenizer, text, eos) for text, eos in answers])
            top += answers[int(scores.argmax())] == (str(a + b), True)
    assert top / 40 >= 0.6, top


def test_the_preset_and_the_example_config_reward_grpo_by_the_model_alone(monkeypatch):
    preset = load_config(overrides=demo.preset("reward-model"), algo="grpo")
    monkeypatch.chdir(REPOSITORY)
    example = load_config(str(REPOSITORY / "examples" / "reward_model_grpo.yaml"))
    for config in (preset, example):
        assert Path(config.reward.model.path).resolve() == demo.reward_model_dir().resolve()
        assert config.reward.model.rule_weight == 0 and config.algorithm.name == "grpo"
    for key in ("data.train_batch_size", "rollout.n", "actor.optim.lr", "trainer.total_training_steps", "trainer.output_dir"):
        assert OmegaConf.select(preset, key) == OmegaConf.select(example, key), key


@pytest.mark.slow
def test_two_steps_of_the_preset_score_with_the_reward_model(tmp_path):
    config = load_config(overrides=[*demo.preset("reward-model"), "trainer.total_training_steps=2", "trainer.test_freq=2",
                                    f"trainer.output_dir={tmp_path}", "trainer.logger=[jsonl]", "trainer.val_before_train=false"],
                         algo="grpo")
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows if "reward/model/mean" in row] == [1, 2]
    assert "val/arith/acc/mean" in rows[-1] and "val/reward/model/mean" in rows[-1]
