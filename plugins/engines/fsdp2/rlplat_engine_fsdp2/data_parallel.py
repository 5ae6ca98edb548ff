"""The two data-parallel layouts of the engine's parameters (``data_parallel``) and the collectives each needs.

``shard`` (the default): :func:`shard` wraps every decoder layer and the root in FSDP2's ``fully_shard`` over one
mesh of the whole process group; parameters are ``DTensor`` shards, gathered for each forward and reduce-scattered
(averaged) in backward. :func:`full_tensor` reads the whole of one.

``replicate`` (DDP's layout, float32 only): every rank holds the plain module. Rank 0's weights are copied to the
others at start (:func:`broadcast_from_rank0`) and gradients are averaged once per optimizer step
(:func:`all_reduce_gradients`), in flat buckets of at most :data:`~rlplat_engine_fsdp2.config.REDUCE_BUCKET_BYTES`.

One rank needs neither: it trains the plain module, and when it computes in bfloat16 or float16, :class:`ComputeCopies`
casts the weights for each call and accumulates the gradients in float32, as FSDP2's mixed precision would.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlplat_engine_fsdp2 import modeling
from rlplat_engine_fsdp2.config import REDUCE_BUCKET_BYTES


def shard(model: torch.nn.Module, device_type: str, world_size: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
          reshard_after_forward: bool) -> None:
    """``fully_shard`` on each decoder layer of ``model``, then on ``model`` itself, over ``world_size`` ranks."""
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in modeling.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: gathered from every rank when it is FSDP2's DTensor (a collective), else itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def flat_buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """``tensors`` in consecutive groups of at most :data:`REDUCE_BUCKET_BYTES` (one tensor may exceed it)."""
    bucket, size = [], 0
    for tensor in tensors:
        if bucket and size + tensor.numel() * tensor.element_size() > REDUCE_BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


def all_reduce_gradients(module: torch.nn.Module, world_size: int) -> None:
    """``replicate``: every trainable parameter's gradient summed over the ranks and divided by their number
    (what FSDP2's averaging reduce-scatter gives), flattened into buckets. A parameter this rank's forward
    did not reach gets a zero gradient, so every rank reduces the same layout."""
    for parameter in module.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    gradients = [parameter.grad for parameter in module.parameters() if parameter.requires_grad]
    for bucket in flat_buckets(gradients):
        flat = torch.cat([gradient.reshape(-1) for gradient in bucket])
        dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for gradient in bucket:
            gradient.copy_(flat[offset : offset + gradient.numel()].view_as(gradient))
            offset += gradient.numel()


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values of ``tensors`` on every rank (flattened into buckets per dtype)."""
    with torch.no_grad():
        for dtype in sorted({tensor.dtype for tensor in tensors}, key=str):
            for bucket in flat_buckets([tensor for tensor in tensors if tensor.dtype == dtype]):
                flat = torch.cat([tensor.reshape(-1) for tensor in bucket])
                dist.broadcast(flat, src=0)
                offset = 0
                for tensor in bucket:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


class ComputeCopies:
    """One rank computing in a lower precision without FSDP2 (``sharded`` is False): the module keeps its float32
    parameters (the master weights the optimizer, checkpoints and weight sync read), and inside :meth:`active` every
    parameter is replaced on its module by a ``param_dtype`` copy; each copy's gradient, once backward has formed it, is
    cast to ``reduce_dtype`` and then added in float32 to its master's gradient. That is what FSDP2's
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` computes over one rank (cast, compute, cast the gradient, reduce
    over one rank, accumulate in float32), without its per-layer all-gather, reduce-scatter and DTensor dispatch. Tied
    parameters get one copy. Buffers are not cast (neither does FSDP2). The copies exist only inside :meth:`active`:
    between calls the engine holds the float32 weights alone."""

    def __init__(self, module: torch.nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.module, self.param_dtype, self.reduce_dtype = module, param_dtype, reduce_dtype

    def slots(self) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        return [(owner, name, parameter) for owner in self.module.modules() for name, parameter in owner._parameters.items()
                if parameter is not None]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        slots = self.slots()
        copies: dict[int, torch.nn.Parameter] = {}
        handles = []
        for _, _, master in slots:
            if id(master) in copies:
                continue
            copy = torch.nn.Parameter(master.detach().to(self.param_dtype), requires_grad=master.requires_grad)
            if master.requires_grad:
                handles.append(copy.register_post_accumulate_grad_hook(functools.partial(self.accumulate, master)))
            copies[id(master)] = copy
        try:
            for owner, name, master in slots:
                owner._parameters[name] = copies[id(master)]
            yield
        finally:
            for owner, name, master in slots:
                owner._parameters[name] = master
            for handle in handles:
                handle.remove()

    def accumulate(self, master: torch.nn.Parameter, copy: torch.nn.Parameter) -> None:
        gradient = copy.grad if self.reduce_dtype == master.dtype else copy.grad.to(self.reduce_dtype)
        copy.grad = None
        if master.grad is None:
            master.grad = gradient.to(master.dtype)
        else:  # adds in float32: the compute-dtype value widens exactly, as a cast first would give
            master.grad.add_(gradient)
