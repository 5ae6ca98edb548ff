"""The reward-model role: scores equal to a direct ``transformers`` forward (with the policy's tokens, and
re-tokenised for a reward model with a tokenizer of its own), the ``reward.model`` node checked at load,
how the score joins the rule score, and PPO runs with the model's reward, colocated and separate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlplat import DataProto
from rlplat.config import ConfigError, load_config
from rlplat.kits.data import write_parquet
from rlplat_reward_model.config import RewardModelConfig, combine
from rlplat.testing import RoleConformance
from rlplat.testing.chat_tokenizers import CHATML_TOOLS, chat_tokenizer
from rlplat.testing.tiny_models import arithmetic_tokenizer, save_tiny_model, tiny_qwen2_config
from rlplat.trainer.tracking import read_metrics
from rlplat.trainer import Trainer
from rlplat_reward_model.worker import RewardModelWorker

ROWS = 64


def save_classifier(directory, tokenizer, seed: int) -> str:
    """A one-label sequence classifier over ``tokenizer``'s vocabulary, its head large enough to spread scores."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_qwen2_config(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_model")
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "reward_model": {"ground_truth": str(a + b)}}
            for a, b in [(12, 34), (5, 6), (40, 2), (7, 7)]]
    return {
        "policy": save_tiny_model(root / "policy", seed=0),
        "same": save_classifier(root / "rm_same", arithmetic_tokenizer(), seed=1),
        "chat": save_classifier(root / "rm_chat", chat_tokenizer(CHATML_TOOLS), seed=2),
        "train": write_parquet(rows, root / "train.parquet"),
    }


def trainer_batch(tokenizer, rows: int = ROWS, seed: int = 0) -> DataProto:
    """Rows as the trainer holds them after generation: left-padded ``a+b=`` prompts and right-padded
    answers (digits, EOS on most), with ``raw_prompt`` messages."""
    rng = np.random.default_rng(seed)
    prompts, answers, messages = [], [], []
    for _ in range(rows):
        a, b = rng.integers(1, 100, size=2)
        text = f"{a}+{b}="
        prompts.append(tokenizer(text)["input_ids"])
        digits = tokenizer(str(rng.integers(0, 200)), add_special_tokens=False)["input_ids"]
        answers.append(digits + ([tokenizer.eos_token_id] if rng.random() < 0.8 else []))
        messages.append([{"role": "user", "content": text}])
    width_p, width_r = max(map(len, prompts)), 5
    prompt_ids = torch.zeros(rows, width_p, dtype=torch.long)
    response_ids = torch.zeros(rows, width_r, dtype=torch.long)
    prompt_mask, response_mask = torch.zeros_like(prompt_ids), torch.zeros_like(response_ids)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        prompt_ids[row, width_p - len(prompt):], prompt_mask[row, width_p - len(prompt):] = torch.tensor(prompt), 1
        response_ids[row, : len(answer)], response_mask[row, : len(answer)] = torch.tensor(answer), 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto.from_dict(
        {"prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
         "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
         "response_mask": response_mask.float()},
        non_tensors={"raw_prompt": np.array(messages + [None], dtype=object)[:-1]},
    )


def direct_score(path: str, ids: list[int]) -> float:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def worker(assets, rm: str, **settings) -> RewardModelWorker:
    node = {"engine": "fsdp2", "engine_config": {"model_path": assets[rm], "dtype": "float32", "micro_batch_size_per_gpu": 16},
            "policy_tokenizer_path": assets["policy"], "tokenizer_path": assets[rm], **settings}
    built = RewardModelWorker(node)
    return built


def test_scores_of_the_policys_tokens_equal_a_direct_forward(assets):
    from transformers import AutoModelForSequenceClassification

    batch = trainer_batch(arithmetic_tokenizer())
    rm = worker(assets, "same")
    assert rm.init_model() == {"retokenize": False}
    scores = rm.compute_rm_score(batch).batch["rm_scores"]
    model = AutoModelForSequenceClassification.from_pretrained(assets["same"], dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for row in range(ROWS):
            ids = batch.batch["input_ids"][row][batch.batch["attention_mask"][row].bool()]
            expected.append(float(model(input_ids=ids.unsqueeze(0)).logits[0, 0]))
    # transformers pools at the last token that is not the pad id: no row here contains pad id 0
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-6, rtol=1e-6), (scores - torch.tensor(expected)).abs().max()
    assert scores.std() > 0.01


def test_a_reward_model_with_its_own_tokenizer_scores_the_conversation_rendered_with_its_template(assets):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy = arithmetic_tokenizer()
    batch = trainer_batch(policy, seed=1)
    rm = worker(assets, "chat")
    assert rm.init_model() == {"retokenize": True}
    scores = rm.compute_rm_score(batch).batch["rm_scores"]
    tokenizer = AutoTokenizer.from_pretrained(assets["chat"])
    model = AutoModelForSequenceClassification.from_pretrained(assets["chat"], dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for row in range(ROWS):
            mask = batch.batch["response_mask"][row].bool()
            answer = policy.decode(batch.batch["responses"][row][mask].tolist(), skip_special_tokens=True)
            conversation = batch.non_tensor_batch["raw_prompt"][row] + [{"role": "assistant", "content": answer}]
            ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
            expected.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-6, rtol=1e-6), (scores - torch.tensor(expected)).abs().max()


def test_max_length_keeps_the_end_of_a_long_conversation_and_counts_it(assets):
    batch = trainer_batch(arithmetic_tokenizer(), rows=4, seed=2)
    rm = worker(assets, "chat", max_length=12)
    rm.init_model()
    output = rm.compute_rm_score(batch)
    assert output.meta_info["metrics"]["reward/model/truncated"] == 4.0
    assert torch.isfinite(output.batch["rm_scores"]).all()


def test_combine_sums_with_weights_and_normalizes_each_component():
    rule = torch.zeros(4, 3)
    rule[:, 1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    model = torch.tensor([0.5, -1.0, 2.0, 3.0])
    summed, metrics = combine(rule, model, mask, RewardModelConfig(path="x", weight=2.0, rule_weight=0.5))
    assert summed[0].tolist() == [0.0, 0.5 + 1.0, 0.0]
    assert summed[1].tolist() == [0.0, 0.0, -2.0]
    assert summed[2].tolist() == [4.0, 0.5, 0.0]
    assert summed[3].tolist() == [0.0, 0.0, 0.0]  # no response token: the model's score has nowhere to go
    assert metrics == {"reward/model/mean": 1.125, "reward/model/min": -1.0, "reward/model/max": 3.0}
    normalized, _ = combine(rule, model, mask, RewardModelConfig(path="x", combine="normalized"))
    z_model = (model - model.mean()) / model.std(unbiased=False)
    z_rule = torch.tensor([1.0, -1.0, 1.0, -1.0])
    assert torch.allclose(normalized.sum(-1)[:3], (z_model + z_rule)[:3])
    assert normalized[3].abs().sum() == 0


def overrides(assets, output_dir, *extra):
    return [
        f"model.path={assets['policy']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=3",
        "actor.micro_batch_size_per_gpu=4", f"trainer.output_dir={output_dir}", "trainer.logger=[jsonl]",
        "trainer.total_training_steps=3", "trainer.save_freq=0", *extra,
    ]


def test_the_reward_model_node_is_checked_at_load(assets, tmp_path):
    with pytest.raises(ConfigError, match=r"reward.model.path: .* \(no config.json there\)"):
        load_config(overrides=overrides(assets, tmp_path, f"reward.model.path={tmp_path}"))
    with pytest.raises(ConfigError, match="combine must be one of sum, normalized"):
        load_config(overrides=overrides(assets, tmp_path, f"reward.model.path={assets['same']}", "reward.model.combine=mean"))
    with pytest.raises(ConfigError, match=r"unknown config key 'reward.model.wieght'.*'reward.model.weight'"):
        load_config(overrides=overrides(assets, tmp_path, "reward.model.wieght=2"))
    with pytest.raises(ConfigError, match="reward.model.placement=separate needs cluster.backend=ray"):
        load_config(overrides=overrides(assets, tmp_path, f"reward.model.path={assets['same']}", "cluster.backend=local",
                                        "reward.model.placement=separate"))
    with pytest.raises(ConfigError, match="reward.model.engine_config.model_path' is set from reward.model.path"):
        load_config(overrides=overrides(assets, tmp_path, f"reward.model.path={assets['same']}",
                                        f"reward.model.engine_config.model_path={assets['same']}"))
    with pytest.raises(ConfigError, match="reward.model.engine_config"):
        load_config(overrides=overrides(assets, tmp_path, f"reward.model.path={assets['same']}", "reward.model.engine_config.dtyp=float32"))


def train_with_reward_model(assets, run, *extra):
    config = load_config(overrides=overrides(assets, run, f"reward.model.path={assets['same']}", *extra), algo="ppo")
    trainer = Trainer(config)
    try:
        trainer.fit()
        groups = {name: group.world_size for name, group in trainer.placement.groups.items()}
        pids = {name: set(group.pids()) for name, group in trainer.placement.groups.items()} if hasattr(trainer.actor, "pids") else {}
    finally:
        trainer.shutdown()
    return groups, pids, read_metrics(run)


def test_ppo_runs_three_steps_rewarded_by_the_colocated_reward_model_alone(assets, tmp_path):
    groups, _, metrics = train_with_reward_model(assets, tmp_path / "run", "cluster.backend=local", "reward.model.rule_weight=0")
    assert set(groups) == {"actor", "critic", "reward_model"}
    steps = [row for row in metrics if "reward/model/mean" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    for row in steps:
        # rewarded by the model alone: the sequence score is the model's score
        assert math.isclose(row["critic/score/mean"], row["reward/model/mean"], rel_tol=1e-5, abs_tol=1e-6)
        assert row["reward/model/min"] <= row["reward/model/mean"] <= row["reward/model/max"]
        assert row["timing_s/reward_model"] > 0


@pytest.mark.slow
def test_ppo_runs_three_steps_with_the_reward_model_in_a_pool_of_its_own(assets, tmp_path, local_ray):
    groups, pids, metrics = train_with_reward_model(
        assets, tmp_path / "run", "reward.model.placement=separate")
    assert groups == {"actor": 1, "critic": 1, "reward_model": 1}
    assert not pids["actor"] & pids["reward_model"]
    assert [row["step"] for row in metrics if "reward/model/mean" in row] == [1, 2, 3]


class TestRewardModelRole(RoleConformance):
    @pytest.fixture
    def role(self):
        from rlplat import registry

        return registry.get("role", "reward_model")()
