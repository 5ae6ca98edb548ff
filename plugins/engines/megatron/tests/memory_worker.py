"""One rank of the megatron engine's memory measurement: :func:`measure`, which numerics_worker.py runs first
in the two-process launch the memory and numerics tests share; alone, with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set: ``python memory_worker.py SPEC_JSON``.

For each layout of the spec, in the same processes: a fresh megatron parallel state, then under
:class:`rlplat.testing.memory.LiveStorageMeter` (live tensor storage bytes, frees seen in any thread) the engine
is built, takes one update (the optimizer states exist from then on), and the peaks of a forward
(``forward``), a second update (``update``) and a weight sync (``export``: ``named_weights`` consumed bucket by
bucket) are recorded. Each rank prints one JSON line: ``{layout name: {call: peak bytes}}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist


def measure(spec: dict) -> dict[str, dict[str, int]]:
    """This rank's ``{layout name: {call: peak bytes}}`` for every layout of ``spec`` (the process group is
    initialised; the parallel state is destroyed again at the end)."""
    from megatron.core import parallel_state

    from rlplat.testing.memory import LiveStorageMeter, PolicyGradientLoss, synthetic_batch
    from rlplat_engine_megatron.engine import MegatronEngine

    results = {}
    for layout in spec["layouts"]:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        gc.collect()
        config = dict(spec["config"], **layout["config"])
        dp = dist.get_world_size() // (config.get("tensor_parallel_size", 1) * config.get("context_parallel_size", 1)
                                        * config.get("pipeline_parallel_size", 1))
        data = synthetic_batch(spec["rows"], spec["prompt_length"], spec["response_length"], spec["vocab_size"],
                               seed=dist.get_rank() if dp > 1 else 0)
        data.meta_info["ppo_mini_batch_size"] = spec["rows"] * dp
        with LiveStorageMeter() as meter:
            engine = MegatronEngine(config)
            engine.init_model()
            engine.train_batch(data, PolicyGradientLoss())
            with meter.phase("forward"):
                engine.forward(data)
            with meter.phase("update"):
                engine.train_batch(data, PolicyGradientLoss())
            with meter.phase("export"):
                for bucket in engine.named_weights(spec["bucket_bytes"]):
                    del bucket
        results[layout["name"]] = meter.peaks()
        del engine, meter
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    gc.collect()
    return results


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo", init_method="env://")
    torch.set_num_threads(1)
    results = measure(spec)
    print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort at interpreter exit after a clean run


if __name__ == "__main__":
    main()
