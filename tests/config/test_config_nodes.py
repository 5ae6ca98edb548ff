"""Every plugin-owned node of the run config is checked when the config loads: a misspelled or mistyped
key anywhere, invalid sampling settings or a missing reward function stop `rlplat run` with exit code 2 in
one line, in seconds, before any worker or run directory exists."""

from __future__ import annotations

import time

import pytest

from rlplat.config import ConfigError, load_config
from rlplat_demo import overrides as demo_overrides

# (override, what the one-line error must say)
MISSPELLED = [
    ("actor.engine_config.micro_batch_sise=4", "unknown config key 'actor.engine_config.micro_batch_sise'. Did you mean 'actor.engine_config.micro_batch_size_per_gpu'?"),
    ("critic.engine_config.enable_gradient_checkpoint=true", "Did you mean 'critic.engine_config.enable_gradient_checkpointing'?"),
    ("rollout.config.max_batch_row=8", "unknown config key 'rollout.config.max_batch_row'. Did you mean 'rollout.config.max_batch_rows'?"),
    ("reward.config.fallback_scor=0.5", "unknown config key 'reward.config.fallback_scor'. Did you mean 'reward.config.fallback_score'?"),
    ("actor.loss.clip_ratoi=0.3", "unknown config key 'actor.loss.clip_ratoi'. Did you mean 'actor.loss.clip_ratio'?"),
    ("critic.loss.cliprange_valu=0.3", "unknown config key 'critic.loss.cliprange_valu'. Did you mean 'critic.loss.cliprange_value'?"),
    ("actor.loss.policy_loss.clip_cov_rati=0.1", "Did you mean 'actor.loss.policy_loss.clip_cov_ratio'?"),
    ("algorithm.gama=0.9", "unknown config key 'algorithm.gama'. Did you mean 'algorithm.gamma'?"),
    ("roles.critic.placment=separate", "unknown config key 'roles.critic.placment'. Did you mean 'roles.critic.placement'?"),
]
MISTYPED = [
    ("actor.engine_config.enable_gradient_checkpointing=sometimes", "actor.engine_config.enable_gradient_checkpointing: expected bool, got str 'sometimes'"),
    ("rollout.config.max_batch_rows=many", "rollout.config.max_batch_rows: expected int, got str 'many'"),
    ("reward.config.timeout_s=soon", "reward.config.timeout_s: expected float or None, got str 'soon'"),
    ("actor.loss.clip_ratio=wide", "actor.loss.clip_ratio: expected float, got str 'wide'"),
    ("critic.loss.cliprange_value=[1,2]", "critic.loss.cliprange_value: expected float, got list [1, 2]"),
    ("algorithm.lam=[0.9]", "algorithm.lam: expected float, got list [0.9]"),
]
OTHER = [
    ("rollout.n=0", "invalid sampling settings: rollout.n must be >= 1, got 0"),
    ("rollout.temperature=-1", "invalid sampling settings: rollout.temperature must be > 0"),
    ("reward.custom_function.name=no_such_function", "reward.custom_function.name: "),
    ("actor.engine_config.lr=0.1", "'actor.engine_config.lr' is set from actor.optim.lr: set that instead"),
]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    return path


def arguments(override: str, reward_file) -> list[str]:
    extra = [f"reward.custom_function.path={reward_file}"] if override.startswith("reward.custom_function.name=") else []
    return [*demo_overrides(), *extra, override]


@pytest.mark.parametrize(("override", "message"), MISSPELLED + MISTYPED + OTHER)
def test_load_config_refuses_it_naming_the_key(override, message, reward_file):
    with pytest.raises(ConfigError) as raised:
        load_config(None, arguments(override, reward_file), algo="grpo")
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_missing_reward_function_lists_the_functions_the_file_defines(reward_file):
    with pytest.raises(ConfigError, match=r"defines no 'no_such_function'; its functions are: compute_score"):
        load_config(None, arguments("reward.custom_function.name=no_such_function", reward_file))


def cli_exit(argv: list[str], capsys) -> tuple[int, str]:
    """``rlplat <argv>`` in this process: its exit code and what it wrote to stderr."""
    from rlplat.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("override", "message"), MISSPELLED[::2] + MISTYPED[::2] + OTHER)
def test_rlplat_run_exits_2_in_one_line_within_10_s_and_creates_no_run_directory(override, message, reward_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    code, stderr = cli_exit(["run", *arguments(override, reward_file)[len(demo_overrides()):], f"trainer.output_dir={run_dir}"],
                            capsys)
    elapsed = time.monotonic() - started
    assert code == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("rlplat: config error:")]
    assert len(errors) == 1 and message in errors[0], stderr
    assert "Traceback" not in stderr
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert not run_dir.exists()


@pytest.mark.slow
def test_the_installed_command_exits_2_in_one_line_within_10_s_from_a_fresh_process(reward_file, tmp_path, cli_run):
    """As a user runs it: a new process that imports rlplat, loads the config and stops, within 10 s, in
    one line, without a traceback or a run directory (the cases above check every message in-process)."""
    override, message = MISSPELLED[0]
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = cli_run("run", *arguments(override, reward_file)[len(demo_overrides()):], f"trainer.output_dir={run_dir}")
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("rlplat: config error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert not run_dir.exists()
