"""``rlplat run``: the help lists what is installed, config errors stop in seconds, a run writes its directory."""

from __future__ import annotations

import json

import time

import pytest

from rlplat.kits.data import write_parquet
from rlplat.testing.tiny_models import save_tiny_model

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(solution_str.strip() == ground_truth)\n"


def cli(argv: list[str], capfd) -> tuple[int, str, str]:
    """``rlplat <argv>`` in this process: its exit code, stdout and stderr."""
    from rlplat.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capfd.readouterr()
    return exited.value.code, out, err


def test_help_lists_the_installed_algorithms_engines_and_rollouts(capfd, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, stdout, _ = cli(["run", "--help"], capfd)
    assert code == 0
    text = " ".join(stdout.split())
    assert "Installed algorithms: dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, remax, rloo." in text
    assert "Engines: fsdp2, megatron." in text
    # the backend rollouts are installed without their backend in this environment
    assert "Rollouts: hf (unavailable here: sglang, vllm; see rlplat plugins list)." in text


def test_a_config_error_exits_2_in_seconds_with_one_paragraph_and_no_traceback(cli_run, tmp_path):
    started = time.monotonic()
    result = cli_run("run", "--algo", "grpo", "--engine", "fsdp3", f"model.path={tmp_path}")
    assert result.returncode == 2
    assert time.monotonic() - started < 30
    assert result.stderr.startswith("rlplat: config error: actor.engine: unknown engine 'fsdp3'")
    assert "Did you mean 'fsdp2'?" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_short_run_prints_its_directory_and_writes_config_metrics_and_checkpoint(capfd, tmp_path):
    model = save_tiny_model(tmp_path / "model")
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+1="}], "reward_model": {"ground_truth": str(a + 1)}}
            for a in range(10, 14)]
    train = write_parquet(rows, tmp_path / "train.parquet")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run_dir = tmp_path / "run"
    code, _, stderr = cli([
        "run", "--algo", "grpo", "--engine", "fsdp2", "--rollout", "hf",
        f"model.path={model}", f"data.train_files=[{train}]", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "rollout.n=2", "rollout.response_length=3", f"reward.custom_function.path={reward}", "cluster.backend=local",
        f"trainer.output_dir={run_dir}", "trainer.total_training_steps=2", "trainer.logger=[console,jsonl]",
    ], capfd)
    assert code == 0, stderr[-3000:]
    assert f"rlplat: run directory {run_dir}" in stderr
    assert "step 2/2" in stderr
    assert (run_dir / "config.yaml").exists() and (run_dir / "metrics.jsonl").exists()
    assert (run_dir / "checkpoints" / "global_step_2" / "COMPLETE").exists()


def test_the_demo_settings_validate_and_the_users_overrides_win():
    from rlplat_demo import overrides as demo_overrides
    from rlplat.config import load_config

    config = load_config(overrides=demo_overrides() + ["trainer.total_training_steps=3"], algo="grpo")
    assert config.trainer.total_training_steps == 3 and config.rollout.n == 8
    assert config.model.path.endswith("model") and config.cluster.backend == "local"


@pytest.mark.slow
def test_the_demo_on_two_ray_workers_trains_with_the_on_policy_update_and_copied_weights(tmp_path):
    """The demo's recipe in the layout it had before it moved to one process: 2 fsdp2 workers on Ray."""
    from rlplat.config import load_config
    from rlplat_demo import overrides as demo_overrides
    from rlplat.trainer.tracking import read_metrics
    from rlplat.trainer import Trainer

    run_dir = tmp_path / "ray"
    config = load_config(overrides=demo_overrides() + [
        "cluster.backend=ray", "cluster.devices_per_node=2", "trainer.total_training_steps=3", "trainer.test_freq=3",
        "trainer.save_freq=0", f"trainer.output_dir={run_dir}", "trainer.logger=[jsonl]", "trainer.resume=disable",
        "trainer.profile.steps=[2]", "trainer.profile.torch=true"], algo="grpo")
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    records = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert "timing_s/old_log_prob" not in record and record["rollout/log_prob_diff_max"] < 1e-4
        assert record["sync/shared"] == 0.0 and record["sync/bytes"] > 2e6  # two ranks hold shards: weights are copied
        assert record["actor/grad_norm"] > 0
        assert record["sentinel/weights_verified"] == 1 and record["sentinel/events"] == 0  # both ranks' syncs checked
    assert 0.0 <= records[-1]["val/arith/acc/mean"] <= 1.0
    # the profiled step: the driver and both worker processes on one timeline, and a torch trace per worker
    trace = json.loads((run_dir / "profile" / "step_2.trace.json").read_text())
    names = {event["pid"]: event["args"]["name"] for event in trace["traceEvents"] if event["ph"] == "M"}
    assert sorted(names.values()) == ["actor rank 0", "actor rank 1", "driver"]
    for pid, name in names.items():
        calls = {event["name"] for event in trace["traceEvents"] if event["ph"] == "X" and event["pid"] == pid}
        assert ("update_actor" if name == "driver" else "actor.update_actor") in calls, (name, calls)
    assert len(list((run_dir / "profile" / "step_2").glob("torch_rank*_pid*.json"))) == 2
