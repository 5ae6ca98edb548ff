"""The run config: sources merged in order, and every validation case with its message."""

from __future__ import annotations

import pytest

from rlplat.config import ConfigError, load_config


@pytest.fixture
def paths(run_files):
    model, train = run_files
    return {"model.path": str(model), "data.train_files": f"[{train}]"}


def overrides(paths, *extra):
    return [f"{key}={value}" for key, value in paths.items()] + list(extra)


def test_the_algorithm_fills_its_defaults_and_overrides_win(paths):
    config = load_config(overrides=overrides(paths, "actor.loss.clip_ratio_high=0.28"), algo="grpo")
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor.loss.use_kl_loss is True  # grpo's default
    assert config.actor.loss.clip_ratio_high == 0.28


def test_a_yaml_file_sits_between_the_defaults_and_the_overrides(paths, tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("actor:\n  optim:\n    lr: 3.0e-4\nrollout:\n  n: 4\n")
    config = load_config(file, overrides(paths, "rollout.n=8"))
    assert config.actor.optim.lr == 3e-4 and config.rollout.n == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (["actor.optim.lrr=1e-6"], "unknown config key 'actor.optim.lrr'. Did you mean 'actor.optim.lr'?"),
        (["algorithm.gama=0.9"], "unknown config key 'algorithm.gama'. Did you mean 'algorithm.gamma'?"),
        (["trainer.save_freq=often"], "trainer.save_freq = 'often' has the wrong type"),
        (["actor.engine=fsdp"], "actor.engine: unknown engine 'fsdp'; available: fsdp2"),
        (["rollout.name=vlm"], "rollout.name: unknown rollout 'vlm'"),
        (["rollout.config.max_batch_row=8"], "unknown config key 'rollout.config.max_batch_row'. Did you mean 'rollout.config.max_batch_rows'? [rollout 'hf'"),
        (["reward.scorer=gsm9k"], "Did you mean 'gsm8k'?"),
        (["algorithm.name=grpoo"], "unknown algorithm 'grpoo'"),
        (["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "train_batch_size=6 prompts do not split into actor.ppo_mini_batch_size=4"),
        (["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "cluster.devices_per_node=2"], "3 responses do not split over the 2 worker processes of the actor"),
        (["algorithm.name=ppo", "critic.enable=false"], "algorithm 'ppo' needs a critic, but critic.enable=false"),
        (["algorithm.name=ppo", "critic.ppo_mini_batch_size=3"], "do not split into critic.ppo_mini_batch_size=3"),
        (["model.path=/no/such/model"], "model.path: /no/such/model is not a directory"),
        (["data.val_files=[/no/val.parquet]"], "data.val_files: /no/val.parquet does not exist"),
        (["reward.custom_function.path=/no/reward.py"], "reward.custom_function.path: no file at '/no/reward.py'"),
    ],
)
def test_invalid_configs_are_explained(paths, extra, message):
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=overrides(paths, "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", *extra))
    assert message in str(raised.value)


def test_a_missing_config_file_and_bad_yaml_are_named(paths, tmp_path):
    with pytest.raises(ConfigError, match="--config: .*nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml", overrides(paths))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, overrides(paths))


def test_a_missing_model_path_says_how_to_set_it():
    with pytest.raises(ConfigError, match="model.path is not set"):
        load_config()


@pytest.mark.slow
def test_config_show_prints_yaml_and_exits_2_on_an_error_without_a_traceback(paths, cli_run):
    shown = cli_run("config", "show", "--algo", "grpo", *overrides(paths, "rollout.n=4"))
    assert shown.returncode == 0, shown.stderr
    assert "adv_estimator: grpo" in shown.stdout and "'n': 4" in shown.stdout
    wrong = cli_run("config", "show", *overrides(paths, "actor.optim.lrr=1"))
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == "rlplat: config error: overrides: unknown config key 'actor.optim.lrr'. Did you mean 'actor.optim.lr'?"
