"""What SGLang 0.5.23 imports from ``sgl_kernel`` when ``SGLANG_USE_CPU_ENGINE=1``, for machines where no CPU build
of sgl-kernel exists (PyPI has none; SGLang's own is built for Intel AMX).

SGLang imports these names at module level on its CPU path. Two of them run on every text-generation batch and
are written here in plain torch: :func:`assign_req_to_token_pool_cpu` (the batch's new KV-cache slots into each
request's row of the request-to-token table) and :func:`copy_all_layer_kv_cache_cpu` (slot-to-slot copies inside
every layer's KV buffer; run once at start-up). The others belong to speculative decoding and draft models,
which rlplat's sglang rollout never turns on: calling one raises an error that names it.

Nothing here registers a ``torch.ops.sgl_kernel`` operator: SGLang takes the presence of
``torch.ops.sgl_kernel.convert_weight_packed`` to mean an AMX build and would route every layer to it.
"""

from __future__ import annotations

import ctypes

import numpy
import torch

__version__ = "0.1.0"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
                                 end_offset: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request ``i`` of the batch: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``
    takes the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (the requests' slots lie
    one after another in it, in batch order), as SGLang's triton kernel ``assign_req_to_token_pool`` does.
    ``pool_len`` is the table's row length (``req_to_token.shape[1]``)."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: pool_len={pool_len} but req_to_token has rows of {req_to_token.shape[1]}")
    lengths = (end_offset - start_offset).to(torch.long)
    total = int(lengths.sum())
    if total == 0:
        return
    if total > out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: the requests need {total} slots but out_cache_loc has {out_cache_loc.numel()}")
    rows = torch.repeat_interleave(req_pool_indices.to(torch.long), lengths)
    # each request's column run start..end, laid end to end
    run_starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    columns = torch.arange(total, dtype=torch.long) - run_starts + torch.repeat_interleave(start_offset.to(torch.long), lengths)
    req_to_token[rows, columns] = out_cache_loc[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """In every KV buffer (one per layer and K/V: its address in ``data_ptrs``, its row size in bytes in
    ``strides``), row ``tgt_loc[j]`` becomes a copy of row ``src_loc[j]``. All source rows are read before any
    target row is written, so chains and swaps (a target that is also a source) copy the old rows."""
    targets, sources = tgt_loc.to(torch.long).numpy(), src_loc.to(torch.long).numpy()
    if targets.shape != sources.shape:
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {targets.size} target rows but {sources.size} source rows")
    if targets.size == 0:
        return
    rows = int(max(targets.max(), sources.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buffer = numpy.ctypeslib.as_array((ctypes.c_uint8 * (rows * int(stride))).from_address(int(address)))
        table = buffer.reshape(rows, int(stride))
        table[targets] = table[sources]  # fancy indexing copies the sources first


def unavailable(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} is not available: this sgl_kernel (rlplat-sgl-kernel-cpu) provides only the "
                           "functions plain text generation calls on SGLang's CPU path; speculative decoding and draft "
                           "models need SGLang's own CPU build of sgl-kernel (Intel AMX)")

    refuse.__name__ = name
    return refuse


# speculative decoding (EAGLE, draft trees), imported at module level on SGLang's CPU path
for _name in ("build_draft_decode_metadata_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotate_input_ids_cpu",
              "verify_tree_greedy_cpu", "build_tree_kernel_efficient_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "assign_extend_cache_locs_cpu"):
    globals()[_name] = unavailable(_name)
del _name
