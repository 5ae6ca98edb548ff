"""What a run asks of the machine and of its directory, checked before Ray or any worker starts:
``cluster.use_gpu`` (``auto`` by default), the local backend's one process, and a fresh run that never
mixes with an earlier one (``trainer.resume=disable``, ``trainer.overwrite``)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from rlplat import cuda_devices
from rlplat.config import ConfigError, check_machine, load_config
from rlplat.kits.data import write_parquet
from rlplat.config.trainer import check_run_directory, first_logged_step, prepare_run_directory


@pytest.fixture
def paths(run_files):
    model, train = run_files
    return [f"model.path={model}", f"data.train_files=[{train}]"]


@pytest.fixture
def run_paths(tmp_path):
    """A tiny model's directory (the memory plan reads its config.json) and a parquet of one row."""
    from rlplat.testing.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny")
    train = write_parquet([{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}],
                            "reward_model": {"ground_truth": "2"}}], tmp_path / "rows.parquet")
    return [f"model.path={model}", f"data.train_files=[{train}]", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"]


@pytest.fixture
def no_driver(monkeypatch):
    """This process sees no NVIDIA driver, whatever the machine has."""
    monkeypatch.setattr(cuda_devices, "nvml_device_count", lambda: None)


@pytest.fixture
def eight_gpus(monkeypatch):
    """NVML reports 8 devices, and CUDA_VISIBLE_DEVICES does not narrow them."""
    monkeypatch.setattr(cuda_devices, "nvml_device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# -- which CUDA devices this process sees ---------------------------------------------------------------

@pytest.mark.parametrize("visible, installed, expected", [
    (None, 4, 4),                  # unset: every device
    ("", 4, 0),                    # set but empty: none (a common way to hide GPUs)
    ("-1", 4, 0),                  # a negative index ends the list
    ("0,2", 4, 2),
    ("3,1,0,2", 4, 4),
    ("0,7,1", 4, 1),               # the runtime stops at the first index out of range
    ("GPU-3b1c,GPU-77aa", 4, 2),   # device UUIDs
    ("MIG-5e2f", 1, 1),
    ("0,foo,1", 4, 1),             # and at the first entry that is neither
    ("0,1,2,3,4", 2, 2),
    ("0", 0, 0),
])
def test_visible_devices_are_read_up_to_the_first_invalid_entry_like_the_cuda_runtime(visible, installed, expected):
    assert cuda_devices.visible_count(visible, installed) == expected


def test_no_driver_means_no_device(no_driver):
    assert cuda_devices.visible_cuda_devices() == 0
    assert "no NVIDIA driver" in cuda_devices.cuda_devices_description()


def test_cuda_visible_devices_narrows_what_the_driver_reports(eight_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert cuda_devices.visible_cuda_devices() == 2
    assert cuda_devices.cuda_devices_description() == "the driver reports 8 devices, CUDA_VISIBLE_DEVICES='1,3'"


# -- cluster.use_gpu --------------------------------------------------------------------------------------

def test_use_gpu_is_auto_by_default_and_the_resolved_config_says_cpu_without_a_gpu(paths, no_driver):
    config = load_config(overrides=paths)
    assert config.cluster.use_gpu is False


def test_use_gpu_auto_takes_the_gpus_of_a_machine_that_has_them(paths, eight_gpus):
    # the README's quickstart (cluster.devices_per_node=8 and no use_gpu) on an 8-GPU machine
    config = load_config(overrides=paths + ["cluster.devices_per_node=8", "data.train_batch_size=8",
                                            "actor.ppo_mini_batch_size=8"])
    assert config.cluster.use_gpu is True
    check_machine(config)


def test_use_gpu_auto_follows_cuda_visible_devices(paths, eight_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert load_config(overrides=paths).cluster.use_gpu is False


@pytest.mark.parametrize("value", ["true", "false"])
def test_an_explicit_use_gpu_is_kept(paths, eight_gpus, value):
    assert load_config(overrides=paths + [f"cluster.use_gpu={value}"]).cluster.use_gpu is (value == "true")


def test_a_use_gpu_that_is_neither_auto_nor_a_boolean_is_refused(paths):
    with pytest.raises(ConfigError, match="cluster.use_gpu must be auto, true or false, got 'maybe'"):
        load_config(overrides=paths + ["cluster.use_gpu=maybe"])


def test_use_gpu_true_without_a_visible_device_is_refused_with_what_to_do(paths, no_driver):
    config = load_config(overrides=paths + ["cluster.use_gpu=true"])  # valid as a config: rlplat plan may use it
    with pytest.raises(ConfigError) as refused:
        check_machine(config)
    message = str(refused.value)
    assert message.startswith("cluster.use_gpu=true, but this process sees no CUDA device (no NVIDIA driver here")
    assert "cluster.use_gpu=auto" in message and "cluster.use_gpu=false" in message


def test_use_gpu_true_joining_a_cluster_is_not_checked_against_this_machine(paths, no_driver):
    # the driver of a Ray cluster often runs on a machine without GPUs; Ray places the workers on the GPUs
    check_machine(load_config(overrides=paths + ["cluster.use_gpu=true", "cluster.address=10.0.0.1:6379"]))


def test_rlplat_run_refuses_use_gpu_true_on_a_machine_without_a_gpu_in_one_line(run_paths, no_driver, cli_in_process, tmp_path):
    run_dir = tmp_path / "run"
    result = cli_in_process("run", *run_paths, "cluster.use_gpu=true", f"trainer.output_dir={run_dir}")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("rlplat: config error: cluster.use_gpu=true, but this process sees no CUDA device")
    assert "Traceback" not in result.stderr and not run_dir.exists()


@pytest.mark.parametrize("extra, asked", [(["cluster.devices_per_node=2"], 2), (["cluster.nnodes=2"], 2),
                                          (["cluster.nnodes=2", "cluster.devices_per_node=4"], 8)])
def test_the_local_backend_refuses_more_than_one_process(paths, extra, asked):
    with pytest.raises(ConfigError, match=f"cluster.backend=local runs one worker process, but .* asks for {asked}: "
                                          f"use cluster.backend=ray for {asked} processes"):
        load_config(overrides=paths + ["cluster.backend=local", *extra])


# -- the run directory --------------------------------------------------------------------------------------

def trainer_node(directory, resume="disable", overwrite=False):
    return OmegaConf.create({"output_dir": str(directory), "resume": resume, "overwrite": overwrite})


def earlier_run(directory):
    """A directory as a run leaves it: its config, metrics from step 0 and a checkpoint."""
    (directory / "checkpoints" / "global_step_1").mkdir(parents=True)
    (directory / "config.yaml").write_text("trainer: {}\n")
    (directory / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/acc": 0.5}) + "\n")
    return directory


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_a_fresh_run_may_start_in_a_missing_or_empty_directory(tmp_path, state):
    directory = tmp_path / "run"
    if state == "empty":
        directory.mkdir()
    assert prepare_run_directory(trainer_node(directory)) == directory and directory.is_dir()


def test_a_fresh_run_into_an_earlier_runs_directory_is_refused_and_nothing_is_touched(tmp_path):
    directory = earlier_run(tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        prepare_run_directory(trainer_node(directory))
    assert str(refused.value) == (
        f"trainer.resume=disable starts a fresh run, but trainer.output_dir {directory} already holds checkpoints, "
        "config.yaml, metrics.jsonl: add trainer.overwrite=true to clear it first, choose another trainer.output_dir, "
        "or resume it with trainer.resume=auto.")
    assert sorted(entry.name for entry in directory.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]


def test_overwrite_clears_an_earlier_run_but_never_follows_a_link(tmp_path):
    kept = tmp_path / "elsewhere"
    kept.mkdir()
    (kept / "precious.txt").write_text("mine")
    directory = earlier_run(tmp_path / "run")
    (directory / "linked").symlink_to(kept)
    prepare_run_directory(trainer_node(directory, overwrite=True))
    assert list(directory.iterdir()) == []
    assert (kept / "precious.txt").read_text() == "mine"


def test_overwrite_refuses_a_directory_that_is_not_a_runs(tmp_path):
    directory = tmp_path / "project"
    directory.mkdir()
    (directory / "notes.txt").write_text("not a run")
    with pytest.raises(ConfigError, match="trainer.overwrite=true clears only a run's directory, and .* holds notes.txt "
                                          "but no config.yaml of a run"):
        prepare_run_directory(trainer_node(directory, overwrite=True))
    assert (directory / "notes.txt").exists()


def test_overwrite_with_a_resume_is_a_contradiction(tmp_path):
    directory = earlier_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="trainer.overwrite=true clears .* but trainer.resume=auto resumes from it"):
        check_run_directory(trainer_node(directory, resume="auto", overwrite=True))
    assert (directory / "config.yaml").exists()


def test_a_resumed_run_accepts_its_own_directory(tmp_path):
    check_run_directory(trainer_node(earlier_run(tmp_path / "run"), resume="auto"))


def test_rlplat_run_refuses_a_fresh_run_into_a_used_directory_before_anything_starts(run_paths, cli_in_process, tmp_path):
    directory = earlier_run(tmp_path / "run")
    before = (directory / "metrics.jsonl").read_text()
    result = cli_in_process("run", *run_paths, f"trainer.output_dir={directory}", "trainer.resume=disable")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("rlplat: config error: trainer.resume=disable starts a fresh run")
    assert (directory / "metrics.jsonl").read_text() == before


def test_a_fresh_run_logs_from_step_0_and_a_resumed_one_after_its_checkpoint():
    # the metrics an earlier run left at or past this step are dropped: all of them for a fresh run
    assert first_logged_step(0) == 0 and first_logged_step(7) == 8


@pytest.mark.slow
def test_a_fresh_run_keeps_none_of_an_earlier_runs_metrics(tmp_path):
    from rlplat_demo import overrides as demo_overrides
    from rlplat.trainer.tracking import read_metrics
    from rlplat.trainer import Trainer

    directory = tmp_path / "run"
    common = demo_overrides() + ["trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.save_freq=0",
                                 "trainer.logger=[jsonl]", f"trainer.output_dir={directory}", "data.train_batch_size=8",
                                 "actor.ppo_mini_batch_size=8", "rollout.n=2"]
    for extra in (["trainer.resume=disable"], ["trainer.resume=disable", "trainer.overwrite=true"]):
        trainer = Trainer(load_config(overrides=common + extra, algo="grpo"))
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
        assert [row["step"] for row in read_metrics(directory)] == [0, 1]
    # a run killed before its first checkpoint left metrics; resume=auto finds no checkpoint and starts afresh
    for checkpoint in (directory / "checkpoints").iterdir():
        if checkpoint.is_dir():
            import shutil

            shutil.rmtree(checkpoint)
        else:
            checkpoint.unlink()
    trainer = Trainer(load_config(overrides=common + ["trainer.resume=auto"], algo="grpo"))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    assert [row["step"] for row in read_metrics(directory)] == [0, 1]
