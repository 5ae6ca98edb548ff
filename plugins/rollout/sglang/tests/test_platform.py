"""Where the installed SGLang runs, decided without importing sglang or torch: the registration's ``needs_gpu``,
and ``SGLANG_USE_CPU_ENGINE`` set for SGLang's CPU engine before sglang is imported."""

from __future__ import annotations

import sys

import pytest

from rlplat_rollout_sglang import platform


@pytest.fixture
def installed(monkeypatch):
    """Pretend the distributions named are installed (with their versions), no others."""
    def pretend(versions: dict[str, str]):
        def version(name):
            if name not in versions:
                raise platform.metadata.PackageNotFoundError(name)
            return versions[name]

        monkeypatch.setattr(platform.metadata, "version", version)
        monkeypatch.setattr(platform.metadata, "distribution", version)
        monkeypatch.setenv(platform.CPU_ENGINE_VARIABLE, "")  # so that its state before the test comes back after it
        monkeypatch.delenv(platform.CPU_ENGINE_VARIABLE)

    return pretend


@pytest.mark.parametrize("versions, cpu", [
    ({"torch": "2.14.1", "sglang": "0.5.23", "sglang-kernel": "0.4.10"}, False),  # SGLang's own dependency list: CUDA
    ({"torch": "2.13.0+cpu", "sglang": "0.5.23", "sglang-kernel": "0.4.10"}, True),  # a CPU torch runs nothing on CUDA
    ({"torch": "2.13.0", "sglang": "0.5.23", "rlplat-sgl-kernel-cpu": "0.1.0"}, True),  # make test's environment
])
def test_the_cpu_engine_is_chosen_where_no_cuda_build_is_installed(installed, versions, cpu):
    installed(versions)
    assert platform.cpu_engine() is cpu and platform.needs_gpu() is (not cpu)


@pytest.mark.parametrize("value, cpu", [("1", True), ("0", False)])
def test_sglang_use_cpu_engine_set_by_the_user_decides(installed, monkeypatch, value, cpu):
    installed({"torch": "2.13.0+cpu"})
    monkeypatch.setenv(platform.CPU_ENGINE_VARIABLE, value)
    assert platform.cpu_engine() is cpu


def test_use_cpu_engine_sets_the_variable_sglang_reads(installed, monkeypatch):
    installed({"torch": "2.13.0+cpu"})  # the variable unset, restored after the test
    monkeypatch.setattr(sys, "modules", {name: module for name, module in sys.modules.items() if not name.startswith("sglang.srt")})
    assert platform.use_cpu_engine() is True
    assert platform.os.environ[platform.CPU_ENGINE_VARIABLE] == "1"


def test_sglang_imported_before_the_variable_is_an_error_that_says_what_to_set(installed, monkeypatch):
    installed({"torch": "2.13.0+cpu"})
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", object())
    with pytest.raises(RuntimeError, match="SGLang was imported in this process before SGLANG_USE_CPU_ENGINE=1 was set"):
        platform.use_cpu_engine()
