"""Running a training engine's test on several processes: one gloo group of plain ``python`` processes, and the
comparison of what two layouts computed.

A test writes a worker script that joins the group from the environment (``torch.distributed.init_process_group(
"gloo", init_method="env://")``), builds the engine, computes, and has rank 0 save its results; then::

    from rlplat.testing.distributed import launch_ranks, max_difference

    launch_ranks(2, [worker_path, json.dumps(spec)])
    results = torch.load(spec["out"], weights_only=True)
    assert max_difference(results["tp2/weights"], results["tp1/weights"]) <= 1e-5

Fresh processes (not forked from the test's) so each rank imports the engine as a run would, and a rank that
fails fails the test with its own output. No torch at import.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any, Mapping, Sequence

#: Characters of a failed rank's output the error quotes (its end, where the traceback is).
OUTPUT_TAIL = 6000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the group's rendezvous)."""
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def launch_ranks(world_size: int, arguments: Sequence[str], timeout: float = 600) -> list[str]:
    """Run ``python *arguments`` on ``world_size`` processes that form one group through ``env://`` (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set; ``OMP_NUM_THREADS=1`` so the ranks do
    not contend for the cores) and wait for all of them; returns each rank's output (stdout and stderr).

    Raises ``AssertionError`` naming the first rank that exited with an error, with the end of its output. A rank
    still running after ``timeout`` seconds, or when another rank's wait fails, is killed.
    """
    port = free_port()
    processes = []
    for rank in range(world_size):
        environment = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen([sys.executable, *arguments], env=environment, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} of {world_size} failed (exit code {process.returncode}):\n{output[-OUTPUT_TAIL:]}"
    return outputs


def max_difference(left: Mapping[str, Any], right: Mapping[str, Any]) -> float:
    """The largest absolute element-wise difference between same-named tensors of ``left`` and ``right``, which
    must hold the same names (weights, gradients or outputs of two layouts)."""
    assert sorted(left) == sorted(right), f"different names: {sorted(set(left) ^ set(right))}"
    return max(float((left[name] - right[name]).abs().max()) for name in left)
