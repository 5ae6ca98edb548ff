"""How many CUDA devices this process would see, asked without torch and without initialising CUDA.

``cluster.use_gpu=auto`` and the check that ``cluster.use_gpu=true`` has a device to use run while the
config is read, before torch is imported (a config error must come in seconds) and before Ray or any
worker process starts. Initialising CUDA in the driver (``cuInit``, which ``torch.cuda.device_count`` may
do) would also break CUDA in processes forked from it, so the count comes from NVML, the driver's
management library, which does neither: :func:`visible_cuda_devices` is NVML's device count narrowed by
``CUDA_VISIBLE_DEVICES`` the way the CUDA runtime reads it.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["visible_cuda_devices", "cuda_devices_description"]

NVML_LIBRARY = "libnvidia-ml.so.1"


def nvml_device_count() -> int | None:
    """Devices NVML reports on this machine; None when there is no NVIDIA driver (no NVML library, or
    NVML fails to start)."""
    try:
        library = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return None
    try:
        if library.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint(0)
        status = library.nvmlDeviceGetCount_v2(ctypes.byref(count))
        library.nvmlShutdown()
    except AttributeError:  # an NVML too old to have the _v2 functions
        return None
    return int(count.value) if status == 0 else None


def visible_count(visible: str | None, installed: int) -> int:
    """Devices the CUDA runtime exposes given ``CUDA_VISIBLE_DEVICES=visible`` and ``installed`` devices.

    The runtime reads the list up to its first invalid entry: an empty one, a negative or out-of-range
    index, or text that is neither an index nor a device UUID (``GPU-...``, ``MIG-...``); unset means every
    device."""
    if visible is None:
        return installed
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit():
            if int(entry) >= installed:
                break
        elif not entry.startswith(("GPU-", "MIG-")):
            break
        count += 1
    return min(count, installed)


def visible_cuda_devices() -> int:
    """CUDA devices this process would see (0 on a machine without an NVIDIA driver)."""
    installed = nvml_device_count()
    return 0 if not installed else visible_count(os.environ.get("CUDA_VISIBLE_DEVICES"), installed)


def cuda_devices_description() -> str:
    """What this machine offers, for an error message: the driver's count and ``CUDA_VISIBLE_DEVICES``."""
    installed = nvml_device_count()
    if installed is None:
        return f"no NVIDIA driver here ({NVML_LIBRARY} cannot be loaded)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    text = f"the driver reports {installed} device{'s' if installed != 1 else ''}"
    return text + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
