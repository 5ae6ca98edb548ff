"""One rank of the megatron engine's mixture-of-experts run on two processes (gloo; launched by
test_megatron_moe.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set): ``python moe_engine_worker.py SPEC_JSON``.

On a tiny Qwen2-MoE checkpoint (8 experts, 2 per token, a gated shared expert) and a batch carrying recorded
routes that differ from the live ones (``routed_experts`` drawn at random, ``-1`` at padding), with
``router_replay=r3`` and both router losses on:

* ``ep1``: every expert on each rank (2 data-parallel ranks); ``ep2``: the experts split over the two ranks;
  each gives its log-probs, one optimizer step's metrics and the full weights after it; ``ep2`` also exports a
  HF directory and checks that save -> step equals load -> step;
* ``r2``: with EP=2, ``forward`` returns the routes it took (live routing), the update replays them;
* ``cp2`` and ``cp2-r2``: the same as ``ep1`` and ``r2`` with context parallelism (CP=2: each rank's routers see
  half of every row's positions);
* the fsdp2 engine, on the same ranks with the same settings, gives its log-probs, metrics, weights and
  (``r2``) routes.

Rank 0 writes everything to the spec's ``out`` file."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from rlplat.testing.engines import tiny_engine_batch

EXPERTS, TOP_K, LAYERS = 8, 2, 2
MOE = {"router_replay": "r3", "aux_loss_coef": 0.01, "z_loss_coef": 0.001}


class PolicyGradientLoss:
    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"]
        return loss, {"test/pg_loss": float(loss.detach())}


def routed_batch(rows: int = 8):
    """tiny_engine_batch's rows with ``routed_experts`` [rows, T, layers, k]: k distinct random experts per token, -1 at padding."""
    batch = tiny_engine_batch(rows, seed=3)
    mask = batch.batch["attention_mask"].bool()
    generator = torch.Generator().manual_seed(9)
    routes = torch.rand(*mask.shape, LAYERS, EXPERTS, generator=generator).argsort(-1)[..., :TOP_K].to(torch.int16)
    routes[~mask] = -1
    batch.batch["routed_experts"] = routes
    return batch


def weights_of(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone().float() for bucket in engine.named_weights(bucket_bytes=64 << 10) for name, tensor in bucket}


def on_rank0(engine, value):
    """The collecting rank of data-parallel rank 0's ``value``, on every rank."""
    dp_rank, _, collect = engine.data_parallel_info()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value if (collect and dp_rank == 0) else None)
    return next(item for item in gathered if item is not None)


def share_of(engine, batch):
    dp_rank, dp_size, _ = engine.data_parallel_info()
    share = batch.chunk(dp_size)[dp_rank]
    share.meta_info["ppo_mini_batch_size"] = None
    return share


def run(engine, batch, results, name, spec, resume=False, export=False):
    engine.init_model()
    results[f"{name}/local_parameters"] = engine.state()["local_parameters"]
    forward = engine.forward(batch, calculate_entropy=True)
    output = forward.batch
    results[f"{name}/log_probs"] = on_rank0(engine, output["log_probs"])
    if "routed_experts" in output.keys():
        results[f"{name}/routes"] = on_rank0(engine, output["routed_experts"])
        batch = batch.union(forward.select(batch_keys=["routed_experts"]))
    share = share_of(engine, batch)
    results[f"{name}/metrics"] = engine.train_batch(share, PolicyGradientLoss())
    results[f"{name}/weights"] = weights_of(engine)
    if export:
        directory = os.path.join(spec["scratch"], f"export-{name}")
        engine.export_hf(directory)
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            exported = load_file(os.path.join(directory, "model.safetensors"))
            results[f"{name}/export_max_diff"] = max(float((exported[key] - results[f"{name}/weights"][key]).abs().max())
                                                     for key in results[f"{name}/weights"])
            results[f"{name}/export_names_equal"] = sorted(exported) == sorted(results[f"{name}/weights"])
    if resume:
        checkpoint = os.path.join(spec["scratch"], f"checkpoint-{name}")
        engine.save(checkpoint)
        engine.train_batch(share, PolicyGradientLoss())
        after = engine.forward(batch).batch["log_probs"]
        return checkpoint, share, after
    return None


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo", init_method="env://")
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from rlplat_engine_fsdp2.engine import FSDP2Engine
    from rlplat_engine_megatron.engine import MegatronEngine
    from rlplat_rollout_hf.experts import fused_to_checkpoint

    batch = routed_batch()
    plain = batch.select(batch_keys=[key for key in batch.batch.keys() if key != "routed_experts"])
    # AdamW's eps 1e-4 keeps the first step a smooth function of the gradient (see numerics_worker.py)
    base = dict(model_path=spec["model"], seed=7, lr=1e-3, micro_batch_size_per_gpu=2, eps=1e-4)
    results: dict[str, object] = {}
    for name, extra, data, options in (("ep1", {"moe": MOE}, batch, {}),
                                       ("ep2", {"moe": MOE, "expert_model_parallel_size": 2}, batch, {"resume": True, "export": True}),
                                       ("r2", {"moe": {**MOE, "router_replay": "r2"}, "expert_model_parallel_size": 2}, plain, {}),
                                       ("cp2", {"moe": MOE, "context_parallel_size": 2}, batch, {}),
                                       ("cp2-r2", {"moe": {**MOE, "router_replay": "r2"}, "context_parallel_size": 2}, plain, {})):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        config = dict(base, **extra)
        resumed = run(MegatronEngine(config), data, results, name, spec, **options)
        if resumed is not None:
            checkpoint, share, after = resumed
            parallel_state.destroy_model_parallel()
            engine = MegatronEngine(config)
            engine.init_model()
            engine.load(checkpoint)
            engine.train_batch(share, PolicyGradientLoss())
            results[f"{name}/resume_max_diff"] = on_rank0(engine, (engine.forward(batch).batch["log_probs"] - after).abs().max())
        dist.barrier()
    for name, moe, data in (("fsdp2", MOE, batch), ("fsdp2-r2", {**MOE, "router_replay": "r2"}, plain)):
        engine = FSDP2Engine(dict(base, dtype="float32", moe=moe))
        engine.init_model()
        forward = engine.forward(data, calculate_entropy=True)
        output = forward.batch
        results[f"{name}/log_probs"] = output["log_probs"]
        if "routed_experts" in output.keys():
            results[f"{name}/routes"] = output["routed_experts"]
            data = data.union(forward.select(batch_keys=["routed_experts"]))
        results[f"{name}/metrics"] = engine.train_batch(share_of(engine, data), PolicyGradientLoss())
        # transformers keeps the experts fused; megatron names them as the checkpoint does
        results[f"{name}/weights"] = fused_to_checkpoint(engine.module, weights_of(engine).items())
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
