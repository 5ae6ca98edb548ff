"""Settings for the whole test run: ``tests/`` and every built-in plugin's ``tests/``."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    # torch caps OMP_NUM_THREADS at the machine's cores (OMP_NUM_THREADS=4 gives 2 threads on 2 cores), so
    # `make test-matrix` sets the test process's threads with this to run as a machine with more cores does.
    threads = os.environ.get("RLPLAT_TEST_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
