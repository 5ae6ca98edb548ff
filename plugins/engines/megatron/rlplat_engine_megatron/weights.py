"""The megatron engine's full weights in Hugging Face naming, gathered from the shards of every parallel
dimension: what :meth:`~FullWeights.named_weights` (the rollout's weight sync) and :meth:`~FullWeights.export_hf`
read.

One parameter at a time, every rank takes part: within the parameter's pipeline stage its tensor-parallel shards
are all-gathered (an expert's over the expert-tensor-parallel ranks) and merged by the bridge, a routed expert is
broadcast from the expert-parallel rank holding it, and the result is broadcast to the other stages, then
converted to Hugging Face's names and layout. So a rank holds at most one bucket of full tensors beyond its own
shards.

:class:`FullWeights` is a base class of :class:`~rlplat_engine_megatron.engine.MegatronEngine`; it reads the
engine's ``chunks``, ``bridge``, ``hf_config``, ``config`` and its ranks and sizes (``pp``, ``tp``, ``ep``, ``etp``).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from rlplat.kits.engine import tokenizer_folder, weight_buckets
from rlplat_engine_megatron import bridge as hf_bridge


class FullWeights:
    """``named_weights``, ``export_hf`` and the gathering they share."""

    def parameter_table(self) -> list[tuple[int, int, str, str, tuple[int, ...], str, bool, int, int]]:
        """Every (pipeline stage, chunk, local name, global name, local shape, dtype, tensor-parallel, partition
        dim, expert-parallel owner) of the model, over all stages and experts: a routed expert's row names the
        expert-parallel rank holding it (-1 for every other parameter, which each expert-parallel rank of a
        stage holds). Each stage's table is all-gathered over the expert-parallel ranks, then the pipeline."""
        from megatron.core import parallel_state

        local = []
        for index, chunk in enumerate(self.chunks):
            module = chunk.module
            mapping = hf_bridge.global_names(self.bridge, module, self.ep_rank, self.ep_size)
            for name, parameter in module.named_parameters():
                owner = self.ep_rank if hf_bridge.is_expert(name) else -1
                local.append((self.pp_rank, index, name, mapping.get(name, name), tuple(parameter.shape), str(parameter.dtype).replace("torch.", ""),
                              bool(getattr(parameter, "tensor_model_parallel", False)), int(getattr(parameter, "partition_dim", -1)), owner))
        if self.ep_size > 1:
            tables: list[Any] = [None] * self.ep_size
            dist.all_gather_object(tables, [row for row in local if row[-1] >= 0], group=parallel_state.get_expert_model_parallel_group())
            local = [row for row in local if row[-1] < 0] + [row for table in tables for row in table]
        if self.pp_size == 1:
            return local
        stages: list[Any] = [None] * self.pp_size
        dist.all_gather_object(stages, local, group=parallel_state.get_pipeline_model_parallel_group())
        return [row for table in stages for row in table]

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` one parameter at a time: its tensor-parallel shards all-gathered
        within its stage (an expert's over the expert-tensor-parallel ranks) and merged, an expert broadcast
        from the expert-parallel rank holding it, the result broadcast to the other stages and converted by
        the bridge. A collective."""
        from megatron.core import parallel_state

        pp_group = parallel_state.get_pipeline_model_parallel_group()
        ep_group = parallel_state.get_expert_model_parallel_group() if self.ep_size > 1 else None
        seen: set[str] = set()
        for stage, index, local_name, global_name, shape, dtype, parallel, partition_dim, owner in self.parameter_table():
            torch_dtype = getattr(torch, dtype)
            expert = owner >= 0
            tp_size = self.etp_size if expert else self.tp_size
            tp_group = parallel_state.get_expert_tensor_parallel_group() if expert else parallel_state.get_tensor_model_parallel_group()
            full_shape = list(shape)
            if parallel and tp_size > 1:
                full_shape[partition_dim] *= tp_size
            with self.megatron():
                if stage == self.pp_rank:
                    if not expert or owner == self.ep_rank:
                        held = dict(self.chunks[index].module.named_parameters())[local_name]
                        parameter = held.detach()
                        if parallel and tp_size > 1:
                            shards = [torch.empty_like(parameter) for _ in range(tp_size)]
                            dist.all_gather(shards, parameter.contiguous(), group=tp_group)
                            merged = self.bridge._weight_merge_across_tp(global_name, shards, held)
                        else:
                            merged = parameter.clone()
                    else:
                        merged = torch.empty(full_shape, dtype=torch_dtype, device="cpu" if self.on_cpu else "cuda")
                    if expert and ep_group is not None:
                        dist.broadcast(merged, src=dist.get_global_rank(ep_group, owner), group=ep_group)
                else:
                    merged = torch.empty(full_shape, dtype=torch_dtype, device="cpu" if self.on_cpu else "cuda")
                if self.pp_size > 1:
                    dist.broadcast(merged, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            if self.config.value_model and global_name in hf_bridge.VALUE_HEAD_NAMES:
                pairs = [(hf_bridge.VALUE_HEAD_NAMES[global_name], merged)]
            else:
                names, tensors = self.bridge._weight_to_hf_format(global_name, merged)
                pairs = list(zip(names, tensors))
            for name, tensor in pairs:
                if name in seen:  # a tied output layer on the last stage repeats the embedding
                    continue
                seen.add(name)
                yield name, tensor

    def named_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights in HF naming, in buckets of at most ``bucket_bytes`` (a larger tensor alone):
        gathered one parameter at a time, so a rank holds at most one bucket beyond its own shards. A
        collective: every rank must consume the whole generator."""
        self.require_model("named_weights")
        yield from weight_buckets(self.full_weights(), bucket_bytes)

    def export_hf(self, path: str) -> None:
        """Write a HF directory (rank 0): ``*ForCausalLM`` or, for a value model, ``*ForTokenClassification``."""
        self.require_model("export_hf")
        tensors = {}
        for name, tensor in self.full_weights():
            if self.rank == 0:
                tensors[name] = tensor.detach().cpu()
        if self.rank == 0:
            hf_bridge.write_hf(path, tensors, self.hf_config, self.config.value_model, self.tokenizer_path())
        dist.barrier()

    def tokenizer_path(self) -> str | None:
        return tokenizer_folder(self.config.tokenizer_path, self.config.model_path)
