"""Expert parallelism runs on CPU/gloo: megatron-core 0.16.1's MoE GPT model with its allgather token
dispatcher, experts split over 2 processes (EP=2), gives the logits and router gradients of one process
holding every expert (EP=1), inside rlplat's CPU substitutes (which also supply the ``te_general_gemm`` name
megatron-core's router reads without Transformer Engine). The engine does not build MoE models yet; this
pins what it will build on. (The alltoall dispatcher does not run on CPU: it creates CUDA streams.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # two processes importing megatron-core

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_ep_worker.py")


def launch(out: str, world: int) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                   "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, WORKER, out], env={**environment, "RANK": str(rank)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]


def test_expert_parallel_2_equals_1_on_gloo(tmp_path):
    launch(str(tmp_path), 2)
    for rank in range(2):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        one, two = found["ep1"], found["ep2"]
        assert torch.allclose(two["logits"], one["logits"], atol=1e-6, rtol=0)
        assert two["router_grads"].keys() == one["router_grads"].keys() and len(one["router_grads"]) == 2
        for name, gradient in one["router_grads"].items():
            assert gradient.abs().sum() > 0 and torch.allclose(two["router_grads"][name], gradient, atol=1e-7, rtol=0), name
