"""rlplat-distill: teachers scoring the policy's samples (equal to a direct ``transformers`` forward, routed by
data source), the ``distillation`` node checked at load, and GRPO runs with distillation terms: zero loss and
gradient when the teacher is the student, two teachers each scoring only its rows, a top-k term on packed rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlplat import DataProto
from rlplat.config import ConfigError, load_config
from rlplat.kits.data import write_parquet
from rlplat_distill.losses import TEACHER_LOG_PROBS, TEACHER_MASK, TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS
from rlplat.testing import RoleConformance
from rlplat.testing.chat_tokenizers import CHATML_TOOLS, chat_tokenizer
from rlplat.testing.tiny_models import arithmetic_tokenizer, save_tiny_model, tiny_causal_lm
from rlplat.trainer import Trainer
from rlplat.trainer.tracking import read_metrics
from rlplat_distill.config import DistillationConfig, read_distillation
from rlplat_distill.teacher import TeacherWorker, score_batch

ROWS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"ground_truth": str(a + b)}}
            for source, a, b in [("x", 12, 34), ("y", 5, 6), ("x", 40, 2), ("y", 7, 7), ("x", 21, 9), ("y", 33, 3)]]
    other = root / "other_tokenizer"
    tiny_causal_lm(seed=9, vocab_size=len(chat_tokenizer(CHATML_TOOLS))).save_pretrained(other)
    chat_tokenizer(CHATML_TOOLS).save_pretrained(other)
    return {
        "policy": save_tiny_model(root / "policy", seed=0),
        "teacher_a": save_tiny_model(root / "teacher_a", seed=1),
        "teacher_b": save_tiny_model(root / "teacher_b", seed=2),
        "other": str(other),
        "train": write_parquet(rows, root / "train.parquet"),
    }


def trainer_batch(sources: list[str], seed: int = 0) -> DataProto:
    """Generated rows as the trainer holds them: left-padded ``a+b=`` prompts, right-padded answers."""
    tokenizer = arithmetic_tokenizer()
    rng = np.random.default_rng(seed)
    prompts, answers = [], []
    for _ in sources:
        a, b = rng.integers(1, 100, size=2)
        prompts.append(tokenizer(f"{a}+{b}=")["input_ids"])
        answers.append(tokenizer(str(rng.integers(0, 200)), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    width_p, width_r = max(map(len, prompts)), 5
    prompt_ids, response_ids = torch.zeros(len(sources), width_p, dtype=torch.long), torch.zeros(len(sources), width_r, dtype=torch.long)
    prompt_mask, response_mask = torch.zeros_like(prompt_ids), torch.zeros_like(response_ids)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        prompt_ids[row, width_p - len(prompt):], prompt_mask[row, width_p - len(prompt):] = torch.tensor(prompt), 1
        response_ids[row, : len(answer)], response_mask[row, : len(answer)] = torch.tensor(answer), 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto.from_dict(
        {"prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
         "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
         "response_mask": response_mask.float()},
        non_tensors={"data_source": np.array(sources, dtype=object)},
    )


def direct_log_probs(path: str, batch: DataProto, temperature: float) -> torch.Tensor:
    """[B, R, V] log-probs of each response position from a plain ``transformers`` forward of ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = batch.batch
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                       position_ids=tensors["position_ids"]).logits
    width = tensors["responses"].shape[1]
    return (logits[:, -width - 1 : -1] / temperature).log_softmax(-1)


def teacher_worker(assets, top_k: int = 0) -> TeacherWorker:
    engine = lambda path: {"model_path": path, "dtype": "float32", "micro_batch_size_per_gpu": 5}  # noqa: E731
    worker = TeacherWorker({"teachers": {"a": {"engine": "fsdp2", "engine_config": engine(assets["teacher_a"])},
                                         "b": {"engine": "fsdp2", "engine_config": engine(assets["teacher_b"])}},
                            "top_k": top_k, "sleep": True})
    worker.init_model()
    return worker


def settings(**overrides) -> DistillationConfig:
    node = {"teachers": {"a": {"model_path": "unused", "data_sources": ["x"]}, "b": {"model_path": "unused", "data_sources": ["y"]}}}
    node.update(overrides)
    from rlplat.config_node import read_config_node

    return read_config_node(node, DistillationConfig, "distillation")


def test_two_teachers_each_score_only_the_rows_of_their_data_source(assets):
    sources = ["x", "y", "y", "x", "x", "y", "x", "y", "x", "x", "y", "y"]
    batch = trainer_batch(sources)
    added = score_batch(teacher_worker(assets, top_k=4), batch, settings(top_k=4), temperature=0.8)
    mask = batch.batch["response_mask"].bool()
    expected = {name: direct_log_probs(assets[f"teacher_{name}"], batch, 0.8) for name in ("a", "b")}
    for row, source in enumerate(sources):
        full = expected["a" if source == "x" else "b"][row]
        valid = mask[row]
        got = added.batch[TEACHER_LOG_PROBS][row][valid]
        assert torch.allclose(got, full.gather(-1, batch.batch["responses"][row].unsqueeze(-1))[..., 0][valid], atol=1e-5)
        assert torch.allclose(added.batch[TEACHER_TOPK_LOG_PROBS][row][valid], full.topk(4, dim=-1).values[valid], atol=1e-5)
        assert torch.equal(added.batch[TEACHER_TOPK_IDS][row][valid], full.topk(4, dim=-1).indices[valid])
    assert torch.equal(added.batch[TEACHER_MASK], batch.batch["response_mask"])
    metrics = added.meta_info["metrics"]
    assert metrics["distill/a/rows"] == sources.count("x") and metrics["distill/b/rows"] == sources.count("y")


def test_a_teacher_served_by_a_rollout_scores_as_one_served_by_an_engine(assets):
    batch = trainer_batch(["x", "y", "x", "y", "x"], seed=3)
    by_engine = teacher_worker(assets, top_k=5)
    by_rollout = TeacherWorker({"teachers": {"a": {"rollout": "hf", "rollout_config": {"model_path": assets["teacher_a"]}},
                                             "b": {"rollout": "hf", "rollout_config": {"model_path": assets["teacher_b"]}}},
                                "top_k": 5})
    by_rollout.init_model()
    expected = score_batch(by_engine, batch, settings(top_k=5), temperature=0.6)
    got = score_batch(by_rollout, batch, settings(top_k=5), temperature=0.6)
    mask = batch.batch["response_mask"].bool()
    for key in (TEACHER_LOG_PROBS, TEACHER_TOPK_LOG_PROBS):
        assert torch.allclose(got.batch[key][mask], expected.batch[key][mask], atol=1e-5), key
    assert torch.equal(got.batch[TEACHER_TOPK_IDS][mask], expected.batch[TEACHER_TOPK_IDS][mask])


def test_rows_no_teacher_serves_stop_the_step_or_are_skipped(assets):
    batch = trainer_batch(["x", "z", "y", "z"])
    worker = teacher_worker(assets)
    with pytest.raises(ValueError, match=r"data_source z, which no teacher serves.*distillation.unrouted=skip"):
        score_batch(worker, batch, settings(), temperature=1.0)
    added = score_batch(worker, batch, settings(unrouted="skip"), temperature=1.0)
    assert added.batch[TEACHER_MASK][[1, 3]].sum() == 0 and added.batch[TEACHER_MASK][[0, 2]].sum() > 0
    assert added.meta_info["metrics"]["distill/unrouted_rows"] == 2


def test_a_default_teacher_takes_every_row_no_other_teacher_claims(assets):
    batch = trainer_batch(["x", "q", "y", "r"])
    added = score_batch(teacher_worker(assets), batch, settings(teachers={
        "a": {"model_path": "unused"}, "b": {"model_path": "unused", "data_sources": ["y"]}}), temperature=1.0)
    assert added.meta_info["metrics"]["distill/a/rows"] == 3 and added.meta_info["metrics"]["distill/b/rows"] == 1


def overrides(assets, output_dir, *extra):
    return [
        f"model.path={assets['policy']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=6", "rollout.n=2", "rollout.response_length=3", "actor.micro_batch_size_per_gpu=4",
        f"trainer.output_dir={output_dir}", "trainer.logger=[jsonl]", "trainer.total_training_steps=2", "trainer.save_freq=0",
        "cluster.backend=local", *extra,
    ]


TERM = "actor.loss.terms=[{loss_mode: reverse_kl, coef: 1.0}]"


@pytest.mark.parametrize("extra, message", [
    (("distillation.teachers.t.model_path={other}", TERM), "its tokenizer .* is not the policy's"),
    (("distillation.teachers.t.model_path={teacher_a}", "distillation.teachers.t.retokenize=text", TERM), "retokenize=text.*not built"),
    (("distillation.teachers.t.model_path={teacher_a}",), "no distillation term"),
    ((TERM,), "distillation.teachers names none"),
    (("distillation.teachers.t.model_path={teacher_a}", "actor.loss.terms=[{loss_mode: jsd_topk}]"), "set distillation.top_k"),
    (("distillation.teachers.t.model_path={teacher_a}", "distillation.top_k=4", TERM), "no term of the actor loss reads"),
    (("distillation.teachers.t.model_path=/nowhere", TERM), r"\(no config.json there\)"),
    (("distillation.teachers.t.model_path={teacher_a}", "distillation.teachers.u.model_path={teacher_b}", TERM), "at most one teacher is the default"),
    (("distillation.teachers.t.model_path={teacher_a}", "distillation.teachers.t.data_sources=[x]",
      "distillation.teachers.u.model_path={teacher_b}", "distillation.teachers.u.data_sources=[x]", TERM), "claimed by teachers t and u"),
    (("distillation.teachers.t.model_path={teacher_a}", "distillation.teachers.t.engine_config.dtyp=float32", TERM),
     "distillation.teachers.t.engine_config"),
    (("distillation.teachers.t.model_path={teacher_a}", "actor.loss.terms=[{loss_mode: reverse_kl, estimator: k9}]"), "estimator"),
    (("distillation.teachers.t.model_path={teacher_a}", "distillation.teachers.t.scorer=rollout",
      "distillation.teachers.t.rollout=sglang", TERM), r"distillation.teachers.t.rollout: rollout 'sglang' is unavailable"),
    (("distillation.teachers.t.model_path={teacher_a}", "distillation.teachers.t.scorer=remote", TERM), "scorer must be one of"),
])
def test_the_distillation_node_is_checked_at_load(assets, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides(assets, tmp_path, *(with_paths(item, assets) for item in extra)))


def with_paths(item: str, assets: dict) -> str:
    for name, path in assets.items():
        item = item.replace("{" + name + "}", path)
    return item


def train(assets, run, *extra) -> list[dict]:
    config = load_config(overrides=overrides(assets, run, *extra))
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return [row for row in read_metrics(run) if row.get("step", 0) > 0 and "actor/grad_norm" in row]


def test_a_teacher_equal_to_the_student_gives_zero_loss_and_zero_gradient(assets, tmp_path):
    rows = train(assets, tmp_path / "run", f"distillation.teachers.self.model_path={assets['policy']}", TERM,
                 "actor.loss.policy_loss_coef=0", "actor.optim.weight_decay=0.0")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["actor/loss"] == 0.0 and row["actor/grad_norm"] == 0.0 and row["distill/reverse_kl"] == 0.0
        assert row["distill/self/rows"] == 12


def test_two_teachers_routed_by_data_source_train_a_top_k_term_on_packed_rows(assets, tmp_path):
    rows = train(assets, tmp_path / "run",
                 f"distillation.teachers.a.model_path={assets['teacher_a']}", "distillation.teachers.a.data_sources=[x]",
                 f"distillation.teachers.b.model_path={assets['teacher_b']}", "distillation.teachers.b.data_sources=[y]",
                 "distillation.top_k=16", "actor.loss.terms=[{loss_mode: jsd_topk, coef: 0.5}, {loss_mode: reverse_kl, coef: 1.0}]",
                 "actor.engine_config.use_remove_padding=true")
    for row in rows:
        assert row["distill/a/rows"] == 6 and row["distill/b/rows"] == 6  # 3 prompts of each source, 2 samples each
        assert row["distill/jsd_topk"] > 0 and math.isfinite(row["distill/reverse_kl"])
        assert row["distill/a/reverse_kl"] > 0 and row["distill/b/reverse_kl"] > 0
        assert row["actor/grad_norm"] > 0 and "actor/pg_loss" in row


class TestTeacherRole(RoleConformance):
    @pytest.fixture
    def role(self):
        from rlplat import registry

        return registry.get("role", "teacher")()


def test_the_old_module_path_of_the_losses_still_imports_with_a_warning():
    """rlplat.losses.distillation moved into this plugin at plugin API 1.3; the old path is the new module until 1.4."""
    import importlib
    import sys

    import rlplat_distill.losses as new

    sys.modules.pop("rlplat.losses.distillation", None)
    with pytest.warns(DeprecationWarning, match=r"rlplat.losses.distillation moved to rlplat_distill.losses .*removed in rlplat plugin API 1.4"):
        old = importlib.import_module("rlplat.losses.distillation")
    assert old is new and old.reverse_kl_loss is new.reverse_kl_loss


def test_read_distillation_of_a_run_without_teachers_is_off(assets, tmp_path):
    assert not read_distillation(load_config(overrides=overrides(assets, tmp_path))).enabled
