"""Where the installed SGLang runs, read without importing sglang or torch (so that config validation and
``rlplat plan`` stay fast): on GPUs (a CUDA build: SGLang's CUDA kernel package ``sglang-kernel`` beside a CUDA
torch) or on CPUs, through SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``: pure-torch layers, ``torch_native``
attention; ``make test`` builds such an environment, ``.venv-sglang-cpu``)."""

from __future__ import annotations

import os
import sys
from importlib import metadata

CPU_ENGINE_VARIABLE = "SGLANG_USE_CPU_ENGINE"
#: SGLang's CUDA kernels (a dependency of ``sglang`` itself; absent from a CPU environment)
CUDA_KERNEL_DISTRIBUTIONS = ("sglang-kernel", "sgl-kernel")


def installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
        return True
    except metadata.PackageNotFoundError:
        return False


def cpu_build_torch() -> bool:
    """The installed torch is a CPU build (its version carries ``+cpu``)."""
    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False


def cpu_engine() -> bool:
    """True when SGLang runs on CPUs here: ``SGLANG_USE_CPU_ENGINE`` says so (``1``, or ``0`` for a CUDA build),
    else no CUDA kernel package of SGLang is installed or torch is a CPU build."""
    chosen = os.environ.get(CPU_ENGINE_VARIABLE)
    if chosen in ("0", "1"):
        return chosen == "1"
    return cpu_build_torch() or not any(installed(name) for name in CUDA_KERNEL_DISTRIBUTIONS)


def needs_gpu() -> bool:
    """The registration's ``needs_gpu``: a CUDA build of SGLang needs ``cluster.use_gpu=true``; its CPU engine runs
    on the workers' CPUs."""
    return not cpu_engine()


def use_cpu_engine() -> bool:
    """Before sglang is first imported in this process: set ``SGLANG_USE_CPU_ENGINE=1`` when :func:`cpu_engine`
    (SGLang reads it once, at import, and its child processes inherit it). Returns :func:`cpu_engine`."""
    cpu = cpu_engine()
    if cpu and os.environ.get(CPU_ENGINE_VARIABLE) != "1":
        if any(name.startswith("sglang.srt") for name in sys.modules):
            raise RuntimeError(f"sglang rollout: SGLang was imported in this process before {CPU_ENGINE_VARIABLE}=1 was set, so it "
                               f"took the CUDA path, which this CPU environment cannot run; set {CPU_ENGINE_VARIABLE}=1 in the "
                               "environment (or build the rollout before importing sglang)")
        os.environ[CPU_ENGINE_VARIABLE] = "1"
    return cpu
