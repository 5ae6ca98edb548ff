"""One rank of a multi-process numerics run of the megatron engine (launched by two_process_launch.launch
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set): ``python numerics_worker.py SPEC_JSON``.

For each layout of the spec it builds the engine from the same HF checkpoint, records the log-probs and
entropy of the test batch, optionally the HF export, takes one optimizer step on this rank's data-parallel
share of the batch, records the full weights, and optionally checks that save -> load -> step repeats the
uninterrupted second step exactly. Then the fsdp2 engine on the same ranks gives its log-probs. With a
``memory`` spec, memory_worker's measurement runs before all that and every rank's peaks are kept. Rank 0
writes everything to the spec's ``out`` file (torch.save of tensors and floats).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rlplat.testing.engines import tiny_engine_batch  # noqa: E402


class PolicyGradientLoss:
    """Token-mean ``-sum(advantages * log_probs * mask) / global_token_count``; also reports the token-mean of the
    log-probs gathered at the batch's ``gather`` ids (the engine's ``gather_ids`` feature), as a contribution."""

    gather_ids = "gather"

    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        tokens = micro_batch.meta_info["global_token_count"]
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / tokens
        gathered = (outputs["gathered_log_probs"].detach().sum(-1) * batch["response_mask"]).sum() / tokens
        return loss, {"test/pg_loss": float(loss.detach()), "test/gathered": float(gathered)}


def collected(engine, tensor):
    """The tensor of the collecting rank with data-parallel rank 0, on every rank."""
    dp_rank, _, collect = engine.data_parallel_info()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensor if (collect and dp_rank == 0) else None)
    return next(item for item in gathered if item is not None)


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from rlplat_engine_megatron.engine import MegatronEngine

    results: dict[str, object] = {}
    if spec.get("memory"):  # first, in processes that have run nothing else yet
        from memory_worker import measure

        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, measure(spec["memory"]))
        results["memory"] = peaks
    batch = tiny_engine_batch(spec.get("rows", 8), seed=3)
    rows, width = batch.batch["responses"].shape
    vocabulary = json.load(open(os.path.join(spec["model"], "config.json")))["vocab_size"]
    batch.batch["gather"] = torch.randint(0, vocabulary, (rows, width, 3), generator=torch.Generator().manual_seed(4))
    base = dict(model_path=spec["model"], seed=7, lr=1e-3, micro_batch_size_per_gpu=2)
    for layout in spec["layouts"]:
        name = layout["name"]
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        # AdamW's first step is lr * g / (|g| + eps): with eps 1e-8 a gradient element near 0 turns a
        # rounding difference of 1e-9 into an update difference of up to lr; eps 1e-4 keeps the step a
        # smooth function of the gradient, so the comparison measures the gradients.
        config = dict(base, eps=1e-4, tensor_parallel_size=layout.get("tp", 1), pipeline_parallel_size=layout.get("pp", 1),
                      context_parallel_size=layout.get("cp", 1), **layout.get("extra", {}))
        from rlplat_engine_megatron import vocab_parallel

        vocab_parallel.KEEP_FLOAT32_BYTES = layout.get("keep_float32_bytes", 16 << 20)
        engine = MegatronEngine(config)
        engine.init_model()
        results[f"{name}/info"] = [collected_info for collected_info in gather_infos(engine)]
        output = engine.forward(batch, calculate_entropy=True)
        results[f"{name}/log_probs"] = collected(engine, output.batch["log_probs"])
        results[f"{name}/entropy"] = collected(engine, output.batch["entropy"])
        top = engine.forward(batch, top_k=3).batch
        results[f"{name}/top_k"] = collected(engine, (top["top_k_log_probs"], top["top_k_ids"]))
        if layout.get("single_row"):  # fewer rows than pipeline stages
            results[f"{name}/single_row"] = collected(engine, engine.forward(batch.select_idxs([0])).batch["log_probs"])
        if layout.get("export"):
            directory = os.path.join(spec["scratch"], f"export-{name}")
            engine.export_hf(directory)
            if rank == 0:
                from safetensors.torch import load_file

                exported = load_file(os.path.join(directory, "model.safetensors"))
                original = {}
                for file in sorted(os.listdir(spec["model"])):
                    if file.endswith(".safetensors"):
                        original.update(load_file(os.path.join(spec["model"], file)))
                results[f"{name}/export_names_equal"] = sorted(exported) == sorted(original)
                results[f"{name}/export_max_diff"] = max(float((exported[key] - original[key]).abs().max()) for key in original)
        dp_rank, dp_size, _ = engine.data_parallel_info()
        share = batch.chunk(dp_size)[dp_rank]
        share.meta_info["ppo_mini_batch_size"] = None
        metrics = engine.train_batch(share, PolicyGradientLoss())
        results[f"{name}/metrics"] = metrics
        weights = {}
        largest = 0
        for bucket in engine.named_weights(bucket_bytes=64 << 10):
            largest = max(largest, sum(tensor.numel() * tensor.element_size() for _, tensor in bucket) if len(bucket) > 1 else 0)
            for weight_name, tensor in bucket:
                weights[weight_name] = tensor.clone()
        results[f"{name}/largest_multi_tensor_bucket"] = largest
        results[f"{name}/weights"] = weights
        if layout.get("resume"):
            checkpoint = os.path.join(spec["scratch"], f"checkpoint-{name}")
            engine.save(checkpoint)
            engine.train_batch(share, PolicyGradientLoss())
            after = engine.forward(batch).batch["log_probs"]
            resumed = MegatronEngine(config)
            resumed.init_model()
            resumed.load(checkpoint)
            resumed.train_batch(share, PolicyGradientLoss())
            again = resumed.forward(batch).batch["log_probs"]
            results[f"{name}/resume_max_diff"] = collected(engine, (after - again).abs().max())
        dist.barrier()
    if spec.get("fsdp2"):
        from rlplat_engine_fsdp2.engine import FSDP2Engine

        fsdp2 = FSDP2Engine(dict(base, dtype="float32"))
        fsdp2.init_model()
        results["fsdp2/log_probs"] = fsdp2.forward(batch, calculate_entropy=True).batch["log_probs"]
        top = fsdp2.forward(batch, top_k=3).batch
        results["fsdp2/top_k"] = (top["top_k_log_probs"], top["top_k_ids"])
    if rank == 0:
        torch.save(results, spec["out"])
    dist.barrier()
    dist.destroy_process_group()


def gather_infos(engine):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tuple(engine.data_parallel_info()))
    return gathered


if __name__ == "__main__":
    main()
