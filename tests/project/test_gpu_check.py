"""``scripts/gpu_check.py`` (``make gpu-check``) on the CPU: it refuses without a GPU in one line; its
report, summary, install plan and FLOP count; each check run at toy sizes on the CPU (``--cpu-smoke``),
which tests the code of the checks, not the GPU path.

The classes marked ``gpu`` run on a CUDA machine only (``make test-gpu``, and the check's own
``pytest-gpu`` step): rlplat's rollout and engine conformance suites with the hf rollout and the fsdp2
engine on the GPU (FSDP2 over NCCL)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlplat.testing import RolloutEngineConformance, TinyModelRolloutFixtures, TrainingEngineConformance

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import gpu_check  # noqa: E402
import gpu_check_cases  # noqa: E402

NO_GPU = not torch.cuda.is_available()


def record(name: str, status: str, figure: str = "a figure", seconds: float | None = 1.0) -> dict:
    return {"check": name, "name": name, "status": status, "figure": figure, "values": {}, "seconds": seconds}


# -- the driver --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not NO_GPU, reason="this machine has a CUDA GPU")
def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path, capfd):
    # the driver's main in this process (the script's own process is run by the driver test below)
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--work", str(tmp_path / "work")]) == 2
    stdout, stderr = capfd.readouterr()
    assert stdout == ""
    assert stderr.count("\n") == 1
    assert stderr.startswith(f"gpu-check: refused: no CUDA GPU is visible (torch {torch.__version__}, ")
    assert stderr.rstrip().endswith("it runs on a machine with a CUDA GPU (nothing was installed or run)")
    assert not out.exists() and not (tmp_path / "work").exists()


def test_an_unknown_check_name_is_refused_with_the_list():
    with pytest.raises(SystemExit, match=r"unknown check\(s\) \['fsdp3'\]; the checks are doctor, fsdp2-precision, "):
        gpu_check.select("fsdp2-precision,fsdp3")
    assert [check.name for check in gpu_check.select("demo, doctor")] == ["doctor", "demo"]  # in the run order


def test_every_check_has_a_case_and_the_budget_fits_the_minimums():
    assert set(gpu_check.CHECK_NAMES) == set(gpu_check_cases.CASES)
    assert sum(check.minimum_s for check in gpu_check.CHECKS) <= gpu_check.DEFAULT_BUDGET_S <= 8 * 60


def test_a_check_the_budget_cannot_fit_is_reported_not_run(tmp_path, capsys):
    code = gpu_check.main(["--cpu-smoke", "--only", "rollout-sleep,demo", "--budget-s", "15", "--out", str(tmp_path),
                           "--work", str(tmp_path / "work")])
    assert code == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [(line["check"], line["status"]) for line in report["checks"]] == [("rollout-sleep", "not run"), ("demo", "not run")]
    assert report["checks"][0]["figure"].endswith("s of the 15 s budget left, it needs 20 s")
    assert capsys.readouterr().out.splitlines()[-2] == "2 not run"


def test_exit_code_is_0_only_when_something_passed_and_nothing_else_went_wrong():
    assert gpu_check.exit_code([record("a", "pass"), record("b", "info")]) == 0
    assert gpu_check.exit_code([record("a", "pass"), record("b", "fail")]) == 1
    assert gpu_check.exit_code([record("a", "pass"), record("b", "timeout")]) == 1
    assert gpu_check.exit_code([record("a", "pass"), record("b", "not run")]) == 1
    assert gpu_check.exit_code([record("a", "info")]) == 1


def test_the_summary_table_has_one_row_per_line_wraps_long_figures_and_counts():
    lines = [record("fsdp2 bf16 vs fp32", "pass", "max rel loss diff 0.0031", 12.4),
             record("demo", "fail", "validation accuracy 0.350 -> 0.360 in 150 steps " + "x" * 100, 80.0),
             gpu_check.failure_line("throughput", "not run", "20 s left")]
    table = gpu_check.summary_table(lines, width=80).splitlines()
    assert table[0].split() == ["check", "status", "figure", "time"]
    assert table[2].split()[:4] == ["fsdp2", "bf16", "vs", "fp32"] and table[2].endswith("12s")
    assert table[3].startswith("demo") and " FAIL " in table[3] and table[3].endswith("80s")
    assert "x" * 100 in [row.strip() for row in table[4:-2]]  # a word longer than the column gets a row of its own
    assert table[-2].startswith("throughput") and "NOT RUN" in table[-2]
    assert table[-1] == "1 pass, 1 fail, 1 not run"
    assert all(len(row) <= 80 for row in table if "x" * 100 not in row)


def test_the_report_holds_the_environment_the_lines_and_their_counts(tmp_path):
    lines = [record("a", "pass"), record("b", "error")]
    report = gpu_check.write_report(tmp_path / "gpu-check.json", lines, {"torch": "2.11.0"}, 100.0, 160.5)
    assert json.loads((tmp_path / "gpu-check.json").read_text()) == report
    assert report["wall_s"] == 60.5 and report["started"] == "1970-01-01T00:01:40+00:00"
    assert report["counts"]["pass"] == 1 and report["counts"]["error"] == 1 and report["exit_code"] == 1
    assert report["checks"] == lines and report["environment"] == {"torch": "2.11.0"}
    assert [path.name for path in tmp_path.iterdir()] == ["gpu-check.json"]


def running(pid: int) -> bool:
    """The process exists and is not a zombie (its parent may not reap it at once)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stopped_check_takes_the_processes_it_started_with_it():
    started = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
              "print(p.pid, flush=True); time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", started], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(child.stdout.readline())
    assert running(grandchild)
    gpu_check.stop_group(child)
    deadline = time.monotonic() + 10
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(grandchild) and child.returncode is not None
    child.stdout.close()


def test_a_failure_line_takes_only_the_statuses_of_a_check_without_result():
    with pytest.raises(ValueError, match="status must be one of"):
        gpu_check.failure_line("demo", "pass", "no")


# -- installing from the carried wheels --------------------------------------------------------------------


def test_wheel_names_give_the_distribution_and_its_version():
    assert gpu_check.wheel_distribution(Path("tensordict-0.15.3-py3-none-any.whl")) == ("tensordict", "0.15.3")
    assert gpu_check.wheel_distribution(Path("antlr4_python3_runtime-4.13.2-py3-none-any.whl")) == ("antlr4-python3-runtime", "4.13.2")
    with pytest.raises(ValueError, match="not a wheel file name"):
        gpu_check.wheel_distribution(Path("tensordict-0.15.3.tar.gz"))


def test_missing_distributions_and_a_setuptools_older_than_77_are_installed_the_rest_kept():
    wheels = [Path(name) for name in ("tensordict-0.15.3-py3-none-any.whl", "setuptools-84.2.1-py3-none-any.whl",
                                      "pytest-9.2.0-py3-none-any.whl", "omegaconf-2.4.0-py3-none-any.whl")]
    installed = {"setuptools": "70.1.0", "pytest": "8.3.5", "omegaconf": "2.3.0"}
    assert [path.name for path in gpu_check.wheels_to_install(wheels, installed)] == [
        "setuptools-84.2.1-py3-none-any.whl", "tensordict-0.15.3-py3-none-any.whl"]
    assert gpu_check.wheels_to_install(wheels[1:2], {"setuptools": "80.9.0"}) == []


def test_a_peft_older_than_the_fsdp2_engine_requires_is_replaced():
    """The GPU image had peft 0.21.0, the fsdp2 engine requires 0.21.2: doctor refused the environment."""
    import re

    required = re.search(r'"peft>=([\d.]+)"', (ROOT / "plugins/engines/fsdp2/pyproject.toml").read_text()).group(1)
    assert gpu_check.MINIMUM_VERSIONS["peft"] == required
    assert f"peft=={required}" in (ROOT / "constraints/gpu-check.txt").read_text().splitlines()
    wheel = [Path(f"peft-{required}-py3-none-any.whl")]
    assert gpu_check.wheels_to_install(wheel, {"peft": "0.21.0"}) == wheel
    assert gpu_check.wheels_to_install(wheel, {"peft": required}) == []


def test_two_wheels_of_one_distribution_are_refused():
    wheels = [Path("pytest-9.2.0-py3-none-any.whl"), Path("pytest-8.4.0-py3-none-any.whl")]
    with pytest.raises(ValueError, match="two wheels of pytest"):
        gpu_check.wheels_to_install(wheels, {})


def test_the_constraints_name_one_pure_python_version_of_each_wheel():
    pins = [line.split("#")[0].strip() for line in (ROOT / "constraints/gpu-check.txt").read_text().splitlines()]
    pins = [pin for pin in pins if pin]
    names = [pin.split("==")[0] for pin in pins]
    assert all("==" in pin for pin in pins) and len(names) == len(set(names))
    assert {"tensordict", "omegaconf", "setuptools"} <= set(names) and "ray" not in names and "torch" not in names


def test_the_checkout_packages_are_rlplat_then_every_built_in_plugin():
    packages = gpu_check.checkout_packages()
    assert packages[0] == ROOT
    assert ROOT / "plugins/engines/fsdp2" in packages and ROOT / "plugins/rollout/hf" in packages
    assert ROOT / "plugins/demo" in packages and ROOT / "plugins/recipes/sft" in packages
    assert all((path / "pyproject.toml").exists() for path in packages)


# -- figures ------------------------------------------------------------------------------------------------


def test_update_flops_count_the_layers_the_head_on_responses_and_causal_attention():
    config = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                  vocab_size=10)
    # per layer: q and o 8x8 each, k and v 8x4 each, MLP 3 x 8x16 -> 128 + 64 + 384 = 576 multiply-adds a token
    body = 6 * 576 * 2 * 3 * 5  # 2 layers, 3 rows of 5 tokens
    head = 6 * 10 * 8 * 3 * 2  # the lm head on 2 response tokens a row
    attention = 6 * 2 * 8 * 5 * 5 * 3
    assert gpu_check_cases.update_flops(config, rows=3, length=5, response_length=2) == body + head + attention


def test_the_05b_shape_has_about_half_a_billion_parameters():
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(gpu_check_cases.QWEN2_05B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings))
    assert 490e6 < sum(parameter.numel() for parameter in model.parameters()) < 500e6


def test_junit_counts_read_passes_failures_and_skip_reasons(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2">'
                    '<testcase name="a"/><testcase name="b"><failure message="boom"/></testcase>'
                    '<testcase name="c"><skipped message="needs vllm"/></testcase>'
                    '<testcase name="d"><skipped message="needs vllm"/></testcase></testsuite></testsuites>')
    assert gpu_check_cases.junit_counts(path) == {"tests": 4, "failures": 1, "errors": 0, "skipped": 2, "passed": 1,
                                                  "skip_reasons": {"needs vllm": 2}}


def test_the_gpu_tests_found_include_this_file_and_the_backends():
    found = [path.relative_to(ROOT).as_posix() for path in gpu_check_cases.gpu_test_files()]
    assert "tests/project/test_gpu_check.py" in found and "plugins/rollout/vllm/tests/test_gpu.py" in found
    assert "tests/controller/test_ray_backend.py" not in found


# -- the checks at toy sizes on the CPU ---------------------------------------------------------------------


def smoke(name: str, tmp_path, passes: bool = True) -> list[dict]:
    lines = gpu_check_cases.CASES[name](gpu_check_cases.Context(device="cpu", work=tmp_path, smoke=True))
    assert lines and all(record["check"] == name and record["status"] in ("pass", "info") for record in lines), lines
    assert not passes or any(record["status"] == "pass" for record in lines), lines
    json.dumps(lines)  # the report can hold them
    return lines


@pytest.mark.slow
def test_fsdp2_precision_at_toy_sizes_compares_bf16_compute_over_fp32_masters_with_plain_fp32(tmp_path):
    precision, without_fsdp2 = smoke("fsdp2-precision", tmp_path)
    assert precision["values"]["backend"] == "gloo"  # nccl on the GPU
    assert precision["values"]["facts"]["bfloat16"] == dict(sharded=True, compute=["bfloat16"], master=["float32"],
                                                            gradients=["float32"], device="cpu")
    assert precision["values"]["facts"]["float32"] == dict(sharded=False, compute=["float32"], master=["float32"],
                                                           gradients=["float32"], device="cpu")
    assert len(precision["values"]["losses"]["bfloat16"]) == 3
    # one bf16 rank without FSDP2 (the engine's default there) computes what FSDP2 does, bit for bit
    assert precision["values"]["facts"]["bfloat16 no fsdp2"]["sharded"] is False
    assert without_fsdp2["values"]["losses"] == precision["values"]["losses"]["bfloat16"]


@pytest.mark.slow
def test_logprob_parity_at_toy_sizes_has_an_exact_fp32_control(tmp_path):
    # The two paths agree in float32 to the control's tolerance, and bf16 stays within its own bounds. How
    # far bf16 is from float32 depends on the CPU (with native bf16 instructions its matmuls accumulate in
    # float32, and toy sizes can then agree to 3e-7), so nothing is asserted about bf16 differing.
    (parity,) = smoke("logprob-parity", tmp_path)
    bf16, fp32 = parity["values"]["bfloat16"], parity["values"]["float32"]
    assert fp32["max"] <= gpu_check_cases.FP32_LOGPROB_TOLERANCE
    assert bf16["mean"] <= gpu_check_cases.BF16_LOGPROB_MEAN_TOLERANCE and bf16["max"] <= gpu_check_cases.BF16_LOGPROB_MAX_TOLERANCE
    assert bf16["tokens"] > 0 and fp32["tokens"] > 0


def test_rollout_sleep_at_toy_sizes_gives_the_same_samples_after_wake_up(tmp_path):
    frees, same = smoke("rollout-sleep", tmp_path)
    assert same["figure"].startswith("identical responses and log-probs for seed 1234")


def test_throughput_at_toy_sizes_reports_tokens_per_second_and_mfu(tmp_path):
    throughput, compiled, head, grouped = smoke("throughput", tmp_path)
    assert grouped["status"] == "info" and grouped["values"]["grouped_step_s"] > 0
    assert throughput["values"]["tokens_per_s"] > 0 and 0 < throughput["values"]["mfu"]
    assert throughput["values"]["sharded"] is False and "model FLOPs" in throughput["figure"]  # the convention, said
    # compiled, or (a CPU whose torch lives at a path with a space) refused with the reason, as information
    assert compiled["status"] == "info"
    assert compiled["values"].get("options") == {"compile": True} or "does not quote a path" in compiled["figure"]
    assert head["values"]["relative_difference"] <= gpu_check_cases.FUSED_HEAD_TOLERANCE
    assert throughput["values"]["flops_per_step"] == gpu_check_cases.update_flops(gpu_check_cases.QWEN2_TOY, 2, 32, 16)
    profile = throughput["values"]["profile"]  # one more step profiled: where the time went
    assert "error" not in profile, profile
    assert profile["wall_s"] > 0 and profile["busy"] is None and len(profile["top"]) > 5
    assert any(entry["name"].startswith("aten::") and entry["self_ms"] > 0 for entry in profile["top"])


@pytest.mark.slow
def test_offload_at_toy_sizes_runs_the_four_variants_with_the_same_loss(tmp_path):
    lines = smoke("fsdp2-offload", tmp_path)
    assert [record["name"] for record in lines] == ["offload p=0 o=0", "offload p=1 o=0", "offload p=0 o=1", "offload p=1 o=1"]
    assert len({tuple(record["values"]["losses"]) for record in lines}) == 1  # nothing moves on the CPU: bit for bit


@pytest.mark.slow
def test_the_driver_runs_a_check_in_its_own_process_and_reports_it(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--cpu-smoke", "--only", "rollout-sleep,demo",
                             "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["gpu-check.json", "gpu-check.log"]
    report = json.loads((tmp_path / "out/gpu-check.json").read_text())
    assert [line["check"] for line in report["checks"]] == ["rollout-sleep", "rollout-sleep", "demo"]
    assert report["counts"]["pass"] == 3 and report["exit_code"] == 0
    assert report["checks"][2]["values"]["accuracy"][0][0] == 0  # validation before the first step
    assert "===== demo" in (tmp_path / "out/gpu-check.log").read_text()
    assert (tmp_path / "work/demo-run/metrics.jsonl").exists()
    assert result.stdout.splitlines()[-2] == "3 pass"


# -- on a CUDA machine only ---------------------------------------------------------------------------------


TINY_ENGINE = dict(model_config=dict(model_type="qwen2", vocab_size=16, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=64),
                   seed=7, lr=1e-3, micro_batch_size_per_gpu=2, dtype="float32")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from rlplat.testing.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
class TestHFRolloutOnCUDA(TinyModelRolloutFixtures, RolloutEngineConformance):
    @pytest.fixture
    def engine(self, tiny_model_dir):
        from rlplat_rollout_hf.rollout import HFRollout

        return HFRollout({"model_path": tiny_model_dir, "device": "auto"})  # the GPU, as cuda:<index>

    @pytest.fixture
    def rollout(self, engine):
        return engine


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
class TestFSDP2EngineOnCUDAOverNCCL(TrainingEngineConformance):
    """float32 so that the suite's exact checks hold; ``shard_one_rank`` so that FSDP2 and NCCL run."""

    @pytest.fixture
    def engine_factory(self):
        from rlplat_engine_fsdp2.engine import FSDP2Engine

        return lambda: FSDP2Engine(TINY_ENGINE, shard_one_rank=True)

    @pytest.fixture
    def engine_batch(self):
        return gpu_check_cases.token_batch(6, 6, 5, 16, seed=0)


@pytest.mark.slow
def test_the_larger_and_longer_throughput_cases_run_at_toy_sizes(tmp_path):
    (large,) = smoke("throughput-1.5b", tmp_path)
    assert large["values"]["flops_per_step"] == gpu_check_cases.update_flops(gpu_check_cases.QWEN2_TOY, 2, 32, 16)
    four, eight = smoke("throughput-long", tmp_path, passes=False)  # information: no target
    assert (four["values"]["length"], eight["values"]["length"]) == (64, 128) and four["status"] == eight["status"] == "info"


def test_the_datasheet_peak_is_named_by_the_card():
    assert dict(gpu_check_cases.DATASHEET_BF16_TFLOPS)["H100"] == 989.4
    names = [name for name, _ in gpu_check_cases.DATASHEET_BF16_TFLOPS]
    # a longer name that holds a shorter one is looked up first (H100 PCIe before H100)
    assert all(names.index(long) < names.index(short) for long in names for short in names if short != long and short in long)


@pytest.mark.slow
def test_throughput_reports_a_failing_default_and_measures_grouped_attention_instead(tmp_path, monkeypatch):
    measure = gpu_check_cases.measure_update

    def default_fails(context, model_config, **options):
        if not {"packed_attention", "compile", "fused_head"} & set(options):
            raise RuntimeError("the varlen kernel failed")
        return measure(context, model_config, **options)

    monkeypatch.setattr(gpu_check_cases, "measure_update", default_fails)
    lines = gpu_check_cases.check_throughput(gpu_check_cases.Context(device="cpu", work=tmp_path, smoke=True))
    assert [record["status"] for record in lines[:2]] == ["fail", "pass"]
    assert "RuntimeError: the varlen kernel failed" in lines[0]["figure"]
    assert lines[1]["values"]["options"] == {"packed_attention": "grouped"}


@pytest.mark.slow
def test_throughput_reports_a_compile_that_cannot_build_and_keeps_its_other_figures(tmp_path, monkeypatch):
    from rlplat_engine_fsdp2 import modeling

    monkeypatch.setattr(modeling, "compile_problem", lambda device_type: "torch's builder does not quote a path with a space")
    lines = gpu_check_cases.check_throughput(gpu_check_cases.Context(device="cpu", work=tmp_path, smoke=True))
    compiled = [record for record in lines if record["name"] == "actor update, decoder layers compiled"]
    assert compiled and compiled[0]["status"] == "info" and "does not quote a path" in compiled[0]["figure"]
    assert lines[0]["status"] == "pass" and any(record["name"] == "fused vs unfused log-prob head" for record in lines)
