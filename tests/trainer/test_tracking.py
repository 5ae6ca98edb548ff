"""rlplat.trainer.tracking: metrics.jsonl, the console progress, TensorBoard and wandb backends."""

from __future__ import annotations

import io
import math
import re
import sys

import pytest

from rlplat.trainer.tracking import BACKENDS, BackendPackageMissing, Tracker, format_duration, read_metrics, wandb_mode


def jsonl_lines(run_dir) -> list[str]:
    """metrics.jsonl's lines with the wall-clock time replaced by ``T``."""
    text = (run_dir / "metrics.jsonl").read_text()
    return [re.sub(r'"time": [0-9.]+', '"time": T', line) for line in text.splitlines()]


def test_jsonl_writes_one_line_per_step_in_logged_order_with_null_for_non_finite(tmp_path):
    with Tracker(tmp_path, backends=["jsonl"]) as tracker:
        tracker.log({"critic/score/mean": 0.25, "actor/pg_loss": -1.5}, step=1)
        tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": math.nan, "actor/ppo_kl": math.inf}, step=2)

    assert jsonl_lines(tmp_path) == [
        '{"step": 1, "time": T, "critic/score/mean": 0.25, "actor/pg_loss": -1.5}',
        '{"step": 2, "time": T, "critic/score/mean": 0.5, "actor/pg_loss": null, "actor/ppo_kl": null}',
    ]


def test_jsonl_line_is_on_disk_right_after_log(tmp_path):
    with Tracker(tmp_path, backends="jsonl") as tracker:
        tracker.log({"timing_s/gen": 1.5}, step=1)
        assert jsonl_lines(tmp_path) == ['{"step": 1, "time": T, "timing_s/gen": 1.5}']


def test_lists_gathered_from_workers_are_averaged(tmp_path):
    with Tracker(tmp_path, backends=["jsonl"]) as tracker:
        tracker.log({"actor/entropy": [1.0, 2.0, 4.5], "perf/throughput": (100, 200)}, step=1)

    # (1 + 2 + 4.5) / 3 = 2.5; (100 + 200) / 2 = 150
    assert jsonl_lines(tmp_path) == ['{"step": 1, "time": T, "actor/entropy": 2.5, "perf/throughput": 150.0}']


def test_non_finite_values_are_counted_per_metric(tmp_path):
    with Tracker(tmp_path, backends=["jsonl"]) as tracker:
        tracker.log({"actor/pg_loss": math.nan, "actor/entropy": 1.0}, step=1)
        tracker.log({"actor/pg_loss": [1.0, math.inf], "actor/entropy": -math.inf}, step=2)

    assert tracker.nonfinite_counts == {"actor/pg_loss": 2, "actor/entropy": 1}


def test_a_metric_that_is_not_a_number_is_an_error_naming_it(tmp_path):
    with Tracker(tmp_path, backends=["jsonl"]) as tracker:
        with pytest.raises(TypeError, match=r"metric 'actor/pg_loss' at step 3 is a str"):
            tracker.log({"actor/pg_loss": "0.5"}, step=3)


def test_resume_drops_the_lines_a_killed_run_left_after_its_checkpoint(tmp_path):
    with Tracker(tmp_path, backends=["jsonl"]) as tracker:
        for step in (1, 2, 3, 4, 5):
            tracker.log({"critic/score/mean": step / 10}, step=step)
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 6, "time": 1.0, "critic/sco')  # killed mid-write

    # The checkpoint was taken after step 3: the resumed run logs step 4 again.
    with Tracker(tmp_path, backends=["jsonl"], start_step=4) as tracker:
        assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2, 3]
        tracker.log({"critic/score/mean": 0.75}, step=4)

    records = read_metrics(tmp_path)
    assert [(record["step"], record["critic/score/mean"]) for record in records] == [
        (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.75),
    ]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_read_metrics_gives_nan_for_null_and_skips_a_torn_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 5.0, "actor/pg_loss": null}\n{"step": 2, "ti')

    [record] = read_metrics(tmp_path)
    assert record["step"] == 1 and math.isnan(record["actor/pg_loss"])


def test_read_metrics_names_file_and_line_of_a_bad_line_in_the_middle(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')

    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON object"):
        read_metrics(tmp_path)


# -- console ----------------------------------------------------------------------------------------------


def console_lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_console_prints_one_compact_line_per_step_when_not_a_terminal(tmp_path):
    stream = io.StringIO()
    with Tracker(tmp_path, backends=["console"], total_steps=100, console=stream) as tracker:
        tracker.log({"critic/score/mean": 0.41, "actor/ppo_kl": 0.002, "timing_s/step": 3.1}, step=1)

    # 99 steps left * 3.1 s = 306.9 s -> 5m07s
    assert console_lines(stream) == ["step 1/100 | reward 0.41 | kl 0.002 | 3.1 s/step | ETA 5m07s"]


def test_console_eta_uses_the_median_of_recent_step_times(tmp_path):
    stream = io.StringIO()
    with Tracker(tmp_path, backends=["console"], total_steps=100, start_step=10, console=stream) as tracker:
        for step, seconds in ((10, 30.0), (11, 3.1), (12, 2.9)):
            tracker.log({"critic/score/mean": 0.41, "actor/ppo_kl": 0.002, "timing_s/step": seconds}, step=step)

    # median(30, 3.1, 2.9) = 3.1 s; 88 steps left * 3.1 s = 272.8 s -> 4m33s
    assert console_lines(stream)[-1] == "step 12/100 | reward 0.41 | kl 0.002 | 3.1 s/step | ETA 4m33s"


def test_console_falls_back_to_rewards_and_kl_loss_and_leaves_out_what_is_missing(tmp_path):
    stream = io.StringIO()
    with Tracker(tmp_path, backends=["console"], console=stream) as tracker:
        tracker.log({"critic/rewards/mean": -0.5, "actor/kl_loss": 0.01, "timing_s/step": 12.0}, step=3)
        tracker.log({"timing_s/step": 14.0}, step=4)

    # No total_steps: no denominator, no ETA. Step 4's time is median(12, 14) = 13.
    assert console_lines(stream) == ["step 3 | reward -0.5 | kl 0.01 | 12 s/step", "step 4 | 13 s/step"]


def test_console_ignores_a_non_finite_step_time(tmp_path):
    stream = io.StringIO()
    with Tracker(tmp_path, backends=["console"], total_steps=10, console=stream) as tracker:
        tracker.log({"timing_s/step": math.nan}, step=1)
        tracker.log({"timing_s/step": 4.0}, step=2)

    assert console_lines(stream) == ["step 1/10", "step 2/10 | 4 s/step | ETA 32s"]


def test_console_prints_validation_metrics_on_their_own_line(tmp_path):
    stream = io.StringIO()
    with Tracker(tmp_path, backends=["console"], total_steps=10, console=stream) as tracker:
        tracker.log({"val/test_score/gsm8k": 0.125}, step=0)
        tracker.log({"critic/score/mean": 0.5, "timing_s/step": 2.0, "val/test_score/gsm8k": 0.25}, step=5)

    assert console_lines(stream) == [
        "step 0 validation | val/test_score/gsm8k 0.125",
        "step 5/10 | reward 0.5 | 2 s/step | ETA 10s",
        "step 5 validation | val/test_score/gsm8k 0.25",
    ]


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_draws_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    stream = TerminalStream()
    with Tracker(tmp_path, backends=["console"], total_steps=10, console=stream) as tracker:
        tracker.log({"critic/score/mean": 0.5, "timing_s/step": 2.0}, step=1)
        tracker.log({"val/test_score/gsm8k": 0.25}, step=1)

    output = stream.getvalue()
    assert "step 1/10 | reward 0.5 | 2 s/step | ETA 18s" in output
    assert "step 1 validation | val/test_score/gsm8k 0.25" in output
    assert "━" in output  # rich's bar


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0s"), (45, "45s"), (59.6, "1m00s"), (272.8, "4m33s"), (3720, "1h02m"), (183600, "2d03h"),
     (math.inf, "?"), (math.nan, "?"), (-1, "?")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# -- backends ---------------------------------------------------------------------------------------------


def test_unknown_backend_is_an_error_listing_the_known_ones_and_the_closest(tmp_path):
    with pytest.raises(ValueError) as error:
        Tracker(tmp_path / "run", backends=["console", "tensorbord"])

    assert str(error.value) == (
        "unknown logging backend 'tensorbord'; the backends are: console, jsonl, tensorboard, wandb. "
        "Did you mean 'tensorboard'?"
    )
    assert not (tmp_path / "run").exists()


def test_backends_as_one_comma_separated_string(tmp_path):
    with Tracker(tmp_path, backends="jsonl, console", console=io.StringIO()) as tracker:
        assert list(tracker.backends) == ["jsonl", "console"]
    assert set(BACKENDS) == {"console", "jsonl", "tensorboard", "wandb"}


def test_numpy_steps_and_values_are_plain_numbers_in_the_file(tmp_path):
    numpy = pytest.importorskip("numpy")
    with Tracker(tmp_path, backends=["jsonl"]) as tracker:
        metrics = {"actor/entropy": numpy.float32(0.5), "perf/throughput": numpy.array([1.0, 3.0])}
        tracker.log(metrics, step=numpy.int64(7))

    assert jsonl_lines(tmp_path) == ['{"step": 7, "time": T, "actor/entropy": 0.5, "perf/throughput": 2.0}']


def test_log_after_close_is_an_error(tmp_path):
    tracker = Tracker(tmp_path, backends=["jsonl"])
    tracker.close()
    tracker.close()

    with pytest.raises(RuntimeError, match="closed Tracker"):
        tracker.log({"actor/pg_loss": 1.0}, step=1)


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(tmp_path, backends=["tensorboard"]) as tracker:
        tracker.log({"critic/score/mean": 0.25, "actor/pg_loss": [1.0, 2.0]}, step=1)
        tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": -0.5}, step=2)

    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 1.5), (2, -0.5)]


def test_tensorboard_on_resume_hides_the_steps_a_killed_run_left_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(tmp_path, backends=["tensorboard"]) as tracker:
        for step in (1, 2, 3):
            tracker.log({"critic/score/mean": step / 4}, step=step)
    with Tracker(tmp_path, backends=["tensorboard"], start_step=2) as tracker:
        tracker.log({"critic/score/mean": 1.0}, step=2)

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 1.0)]


def test_tensorboard_without_its_package_fails_at_construction_with_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)

    with pytest.raises(BackendPackageMissing, match=r"needs the tensorboard package.*`pip install tensorboard`"):
        Tracker(tmp_path, backends=["jsonl", "tensorboard"])


def test_wandb_without_its_package_fails_at_construction_with_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)

    with pytest.raises(BackendPackageMissing, match=r"needs the wandb package.*`pip install wandb`"):
        Tracker(tmp_path, backends=["wandb"])


@pytest.mark.parametrize(
    ("environ", "netrc", "mode"),
    [
        ({}, None, "offline"),
        ({"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}, None, "offline"),
        ({"WANDB_MODE": "disabled"}, None, "disabled"),
        ({"WANDB_API_KEY": "k" * 40}, None, "online"),
        ({}, "machine api.wandb.ai login user password secret\n", "online"),
        ({"WANDB_BASE_URL": "https://wandb.example.com"}, "machine api.wandb.ai login u password p\n", "offline"),
    ],
)
def test_wandb_mode_is_offline_unless_set_or_an_api_key_is_configured(tmp_path, environ, netrc, mode):
    netrc_path = tmp_path / "netrc"
    if netrc is not None:
        netrc_path.write_text(netrc)
        netrc_path.chmod(0o600)

    assert wandb_mode({"NETRC": str(netrc_path), **environ}) == mode


def test_wandb_offline_run_writes_its_files_under_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for variable in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    import wandb
    from omegaconf import OmegaConf

    run_dir = tmp_path / "run"
    config = OmegaConf.create({"actor": {"optim": {"lr": 1e-6}}})

    with Tracker(run_dir, backends=["wandb"], experiment="test", config=config) as tracker:
        assert tracker.backends["wandb"].mode == "offline"
        assert wandb.run.config["actor"] == {"optim": {"lr": 1e-6}}
        tracker.log({"critic/score/mean": 0.5}, step=1)

    [run_files] = (run_dir / "wandb").glob("offline-run-*")
    assert list(run_files.glob("run-*.wandb"))


def test_importing_tracking_imports_no_backend_package(python_run):
    result = python_run("""
        import sys
        import rlplat.trainer.tracking
        print(sorted(m for m in ("torch", "tensorboard", "wandb", "rich") if m in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
