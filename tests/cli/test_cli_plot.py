"""``rlplat plot RUN_DIR``: one PNG per chart under RUN_DIR/plots, absent charts noted, errors exit 2. Two runs go
through the installed console script (charts written, exit 2), the others through ``rlplat.cli.main.main`` in
this process."""

from __future__ import annotations

import json
import math
import struct

from rlplat.cli.plot import CHARTS, chart_series

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_CHARTS = ["reward", "validation_accuracy", "response_length", "kl", "entropy", "timing"]


def write_metrics(run_dir, records):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def training_step(step):
    return {
        "step": step, "time": 1000.0 + step,
        "critic/score/mean": 0.1 * step, "response_length/mean": 40.0 + step,
        "actor/ppo_kl": 0.001 * step, "actor/kl_loss": None if step == 2 else 0.002 * step,
        "actor/entropy": 1.0 - 0.1 * step,
        "timing_s/gen": 0.5, "timing_s/reward": 0.1, "timing_s/update_actor": 0.3, "timing_s/step": 0.9,
    }


def full_run():
    """Validation before training (step 0) and at step 3, on two data sources, plus three training steps."""
    validation = {"val/gsm8k/acc/mean": 0.2, "val/math/acc/mean": 0.1, "val/gsm8k/score/mean": 0.2}
    return [{"step": 0, "time": 1000.0, **validation}, training_step(1), training_step(2),
            {**training_step(3), "val/gsm8k/acc/mean": 0.5, "val/math/acc/mean": 0.3}]


def png_size(path):
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_one_png_per_chart_and_prints_their_paths(tmp_path, cli_run):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, full_run())
    result = cli_run("plot", str(run_dir))
    assert result.returncode == 0, result.stderr
    expected = [run_dir / "plots" / f"{name}.png" for name in ALL_CHARTS]
    assert result.stdout.splitlines() == [str(path) for path in expected]
    for path in expected:
        width, height = png_size(path)
        assert (width, height) == (800, 450), path  # FIGURE_SIZE (8 x 4.5 inches) at DPI 100
        assert path.stat().st_size > 5000, f"{path} is too small to hold a chart"
    assert "skipped" not in result.stderr


def test_an_sft_run_gets_its_loss_perplexity_and_timing_charts_and_no_rl_notes(tmp_path, cli_in_process):
    run_dir = tmp_path / "sft"
    records = [{"step": step, "time": 1000.0 + step, "train/loss": 2.0 / step, "train/grad_norm": 1.0, "timing_s/step": 0.2}
               for step in (1, 2, 3)]
    records[1].update({"val/loss": 1.5, "val/perplexity": math.exp(1.5), "timing_s/validate": 0.1})
    write_metrics(run_dir, records)
    result = cli_in_process("plot", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(run_dir / "plots" / f"{name}.png") for name in ("loss", "perplexity", "timing")]
    assert "skipped" not in result.stderr  # the RL charts (reward, KL, ...) are not an SFT run's


def test_charts_without_values_are_skipped_with_a_note(tmp_path, cli_in_process):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, [
        {"step": 1, "time": 1.0, "critic/score/mean": 0.5, "timing_s/step": 1.0, "actor/entropy": None},
        {"step": 2, "time": 2.0, "critic/score/mean": 0.7, "timing_s/step": 1.1, "actor/entropy": None},
    ])
    result = cli_in_process("plot", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in (run_dir / "plots").iterdir()) == ["reward.png", "timing.png"]
    metrics_path = run_dir / "metrics.jsonl"
    for name, wanted in [("validation_accuracy", "val/<source>/acc/mean"), ("response_length", "response_length/mean"),
                         ("kl", "actor/ppo_kl or actor/kl_loss"), ("entropy", "actor/entropy")]:
        assert f"rlplat plot: skipped {name}: no values of {wanted} in {metrics_path}" in result.stderr


def test_a_run_without_any_plotted_metric_writes_nothing_and_exits_1(tmp_path, cli_in_process):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, [{"step": 1, "time": 1.0, "perf/throughput": 10.0}])
    result = cli_in_process("plot", str(run_dir))
    assert result.returncode == 1
    assert f"no chart written: {run_dir / 'metrics.jsonl'} has none of the plotted metrics" in result.stderr
    assert not (run_dir / "plots").exists()


def test_a_missing_run_dir_exits_2_with_one_line_naming_it(tmp_path, cli_run):
    missing = tmp_path / "no_such_run"
    result = cli_run("plot", str(missing))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rlplat plot: {missing} does not exist; pass a run's output directory (trainer.output_dir)"
    ]


def test_a_run_dir_without_metrics_jsonl_exits_2_with_one_line_naming_it(tmp_path, cli_in_process):
    result = cli_in_process("plot", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rlplat plot: {tmp_path / 'metrics.jsonl'} does not exist; a run writes it when trainer.logger includes 'jsonl'"
    ]


def test_a_bad_line_in_metrics_jsonl_exits_2_naming_the_file_and_line(tmp_path, cli_in_process):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\nnot json\n{"step": 2}\n')
    result = cli_in_process("plot", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith(f"rlplat plot: cannot read {tmp_path / 'metrics.jsonl'}: {tmp_path / 'metrics.jsonl'}:2:")
    assert "Traceback" not in result.stderr


def test_validation_accuracy_has_one_series_per_source_from_step_0():
    validation = next(chart for chart in CHARTS if chart.name == "validation_accuracy")
    assert chart_series(full_run(), validation) == {"gsm8k": ([0, 3], [0.2, 0.5]), "math": ([0, 3], [0.1, 0.3])}


def test_null_values_are_left_out_of_a_series():
    kl = next(chart for chart in CHARTS if chart.name == "kl")
    records = [{**training_step(1)}, {**training_step(2), "actor/kl_loss": math.nan}, {**training_step(3)}]
    assert chart_series(records, kl)["actor/kl_loss"] == ([1, 3], [0.002, 0.006])


def test_timing_has_one_series_per_stage_including_the_step_total():
    timing = next(chart for chart in CHARTS if chart.name == "timing")
    assert list(chart_series(full_run(), timing)) == ["gen", "reward", "update_actor", "step"]


def test_help_does_not_import_matplotlib(python_run):
    result = python_run("""
        import sys
        from rlplat.cli.main import main
        try:
            main(["--help"])
        except SystemExit as exit:
            assert not exit.code, exit.code
        print("MATPLOTLIB", "matplotlib" in sys.modules)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "MATPLOTLIB False"
