"""Passes nothing reads are skipped, and skipping them changes no number: the old-log-prob pass of a
strictly on-policy update (``actor.recompute_old_log_prob``) and the reference pass without a KL term."""

from __future__ import annotations

import math

import pytest

from rlplat.config import ConfigError, load_config
from rlplat.kits.data import write_parquet
from rlplat.testing.tiny_models import save_tiny_model
from rlplat.trainer.tracking import read_metrics
from rlplat.trainer import Trainer

pytestmark = pytest.mark.slow  # training runs: left out of `make test-fast`

ALGORITHMS = ["grpo", "ppo", "dr_grpo", "rloo", "reinforce_pp", "remax", "dapo", "gspo"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    rows = [
        {"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "reward_model": {"ground_truth": str(a + b)}}
        for a, b in [(12, 34), (5, 6), (40, 2), (7, 7), (21, 13), (9, 1), (3, 30), (11, 11)]
    ]
    return {"model": save_tiny_model(root / "model", seed=0), "train": write_parquet(rows, root / "train.parquet")}


def overrides(assets, output_dir, *extra):
    return [
        f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", "data.val_files=[]",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=2", "rollout.n=4",
        "rollout.response_length=4", "rollout.temperature=1.5", "actor.optim.lr=3e-3", "actor.micro_batch_size_per_gpu=4",
        "critic.optim.lr=1e-3", "reward.scorer=exact_match", "cluster.backend=local", f"trainer.output_dir={output_dir}",
        "trainer.logger=[jsonl]", "trainer.total_training_steps=3", "trainer.save_freq=0", "trainer.resume=disable", *extra,
    ]


def run(assets, output_dir, *extra, algo="grpo") -> list[dict]:
    trainer = Trainer(load_config(overrides=overrides(assets, output_dir, *extra), algo=algo))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return read_metrics(output_dir)


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/")) and k != "time"}


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_skipping_the_old_log_prob_pass_leaves_every_metric_as_it_was(assets, tmp_path, algo):
    # an algorithm whose defaults put KL in the reward (rloo, reinforce_pp) reads old_log_probs before the
    # update: without that term its update is on-policy too
    extra = ["algorithm.use_kl_in_reward=false"]
    always = run(assets, tmp_path / "always", "actor.recompute_old_log_prob=always", *extra, algo=algo)
    skipped = run(assets, tmp_path / "auto", *extra, algo=algo)
    assert [r["step"] for r in always] == [r["step"] for r in skipped] == [1, 2, 3]
    for separate, fused in zip(always, skipped):
        assert "timing_s/old_log_prob" in separate and "timing_s/old_log_prob" not in fused
        # the separate pass computes entropy anyway and reports it; the update computes it only for a loss that reads it
        separate = {k: v for k, v in separate.items() if k != "actor/entropy" or k in fused}
        assert numbers(separate).keys() == numbers(fused).keys()
        for key, value in numbers(separate).items():
            assert math.isclose(fused[key], value, rel_tol=1e-6, abs_tol=1e-6), (key, value, fused[key])
        assert fused["rollout/log_prob_diff_max"] < 1e-4  # the health metric is there without the pass


def test_auto_keeps_the_pass_where_the_update_is_not_strictly_on_policy(assets, tmp_path):
    records = run(assets, tmp_path / "kl_in_reward", "algorithm.use_kl_in_reward=true")
    assert all("timing_s/old_log_prob" in r and "actor/reward_kl_penalty" in r for r in records)
    records = run(assets, tmp_path / "epochs", "actor.ppo_epochs=2")
    assert all("timing_s/old_log_prob" in r for r in records)
    records = run(assets, tmp_path / "minibatches", "actor.ppo_mini_batch_size=2")
    assert all("timing_s/old_log_prob" in r for r in records)


def test_no_reference_pass_without_a_kl_term_and_one_with_it(assets, tmp_path):
    assert all("timing_s/ref" not in r for r in run(assets, tmp_path / "nokl", "actor.loss.use_kl_loss=false"))
    with_kl = run(assets, tmp_path / "kl", "actor.loss.use_kl_loss=true", "actor.loss.kl_loss_coef=0.1")
    assert all("timing_s/ref" in r and math.isfinite(r["actor/kl_loss"]) for r in with_kl)


@pytest.mark.parametrize("extra, named", [
    (["actor.ppo_epochs=2"], "actor.ppo_epochs=2"),
    (["actor.ppo_mini_batch_size=2"], "actor.ppo_mini_batch_size=2 < data.train_batch_size=4"),
    (["algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward=true"),
])
def test_never_on_an_update_that_is_not_on_policy_is_refused_at_load(assets, tmp_path, extra, named):
    with pytest.raises(ConfigError, match="recompute_old_log_prob=never") as error:
        load_config(overrides=overrides(assets, tmp_path, "actor.recompute_old_log_prob=never", *extra))
    assert named in str(error.value)


def test_an_unknown_mode_is_refused_with_the_closest(assets, tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'always'"):
        load_config(overrides=overrides(assets, tmp_path, "actor.recompute_old_log_prob=alway"))


def test_with_an_entropy_term_the_skipped_pass_reports_the_same_entropy(assets, tmp_path):
    extra = ["actor.loss.entropy_coeff=0.01"]
    always = run(assets, tmp_path / "always", "actor.recompute_old_log_prob=always", *extra)
    skipped = run(assets, tmp_path / "auto", *extra)
    for separate, fused in zip(always, skipped):
        assert "timing_s/old_log_prob" not in fused
        assert math.isclose(fused["actor/entropy"], separate["actor/entropy"], rel_tol=1e-6, abs_tol=1e-6)
