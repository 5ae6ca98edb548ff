"""Log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits of its slice of the vocabulary ``[start, start + V/tp)``. The
softmax normaliser, the target's logit (held by one rank) and the entropy's expectation are sums over
the vocabulary: each rank sums its slice and an all-reduce over the tensor-parallel group completes them
(megatron's ``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward, right
because every rank then computes the same loss from the same sums). The max for numerical stability is
an all-reduce of maxima with no gradient (the log-sum-exp does not depend on it). Everything is float32
after dividing the logits by the temperature, as the rollout samples.

For distillation losses: the log-probs at given ids (:func:`gathered_log_probs`, with gradients, the same
sums) and the ``k`` most likely tokens (:func:`top_k`: each rank's own ``k`` candidates, all-gathered over the
tensor-parallel group, the best ``k`` of them; no gradient).
"""

from __future__ import annotations

import torch


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(tensor)


def global_max(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    result = tensor.detach().clone()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(result, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return result


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                          vocab_start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits`` [..., V/tp] (this rank's slice, starting at token ``vocab_start``), ``targets`` [...]
    (global token ids) -> float32 log-probs [...] and, when asked, entropy [...]."""
    scaled = logits.float() / temperature
    shifted = scaled - global_max(scaled.max(-1).values).unsqueeze(-1)
    exp = shifted.exp()
    normaliser = reduce_sum(exp.sum(-1))
    log_normaliser = normaliser.log()
    local = targets - vocab_start
    here = (local >= 0) & (local < scaled.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, scaled.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * here
    log_probs = reduce_sum(picked) - log_normaliser
    entropy = None
    if with_entropy:
        expectation = reduce_sum((exp * shifted).sum(-1)) / normaliser
        entropy = log_normaliser - expectation
    return log_probs, entropy


def gathered_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, vocab_start: int) -> torch.Tensor:
    """``logits`` [..., V/tp] (this rank's slice), ``ids`` [..., k] (global token ids) -> float32 log-probs [..., k]."""
    scaled = logits.float() / temperature
    shifted = scaled - global_max(scaled.max(-1).values).unsqueeze(-1)
    log_normaliser = reduce_sum(shifted.exp().sum(-1)).log()
    local = ids - vocab_start
    here = (local >= 0) & (local < scaled.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, scaled.shape[-1] - 1)) * here
    return reduce_sum(picked) - log_normaliser.unsqueeze(-1)


def top_k(logits: torch.Tensor, temperature: float, k: int, vocab_start: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest float32 log-probs at each position and their global ids (``[..., k]`` each, descending),
    from this rank's slice ``logits`` [..., V/tp] of a ``vocab_size``-token vocabulary; no gradient."""
    from megatron.core import parallel_state

    if not 1 <= k <= vocab_size:
        raise ValueError(f"top_k={k}: it must be between 1 and the vocabulary size {vocab_size}")
    with torch.no_grad():
        scaled = logits.float() / temperature
        shifted = scaled - global_max(scaled.max(-1).values).unsqueeze(-1)
        log_probs = shifted - reduce_sum(shifted.exp().sum(-1)).log().unsqueeze(-1)
        local = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
        values, ids = local.values, local.indices + vocab_start
        world = parallel_state.get_tensor_model_parallel_world_size()
        if world > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            all_values, all_ids = [torch.empty_like(values) for _ in range(world)], [torch.empty_like(ids) for _ in range(world)]
            torch.distributed.all_gather(all_values, values.contiguous(), group=group)
            torch.distributed.all_gather(all_ids, ids.contiguous(), group=group)
            values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
        best = values.topk(k, dim=-1)
        return best.values, ids.gather(-1, best.indices)


#: The last stage's float32 logits of a micro-batch's response positions up to this size are computed whole;
#: above it the output layer runs a chunk of tokens at a time (:class:`ChunkedOutput`).
KEEP_FLOAT32_BYTES = 16 << 20


class ChunkedOutput:
    """Stands in for the last stage's output layer's ``forward`` during a schedule: the model returns its final
    hidden states ``[b, T, h]`` instead of logits (the tied embedding's weight, when GPTModel passes it, is kept),
    and :meth:`outputs` applies the real layer to ``chunk_tokens`` response tokens at a time, their
    vocabulary-parallel log-probs (entropy, gathered log-probs, top-k) computed and the logits dropped; with
    gradients each chunk is recomputed in backward (``torch.utils.checkpoint``; its tensor-parallel collectives
    run again in the same order on every rank). So the ``[b, T, V/tp]`` logits never exist."""

    def __init__(self, layer: torch.nn.Module, chunk_tokens: int):
        self.layer = layer
        self.chunk_tokens = chunk_tokens
        self.weight: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None, **_):
        self.weight = weight
        return hidden, None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[b, w, h]`` -> this rank's ``[b, w, V/tp]`` logits, through the layer's own forward."""
        output, _ = type(self.layer).forward(self.layer, hidden.transpose(0, 1), weight=self.weight)
        return output.transpose(0, 1)

    def outputs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, vocab_start: int,
                vocab_size: int, gather_ids: torch.Tensor | None = None, top_k_count: int = 0) -> dict[str, torch.Tensor]:
        """What ``outputs_of`` returns, from the hidden states ``[b, R, h]`` of the response positions."""
        from torch.utils.checkpoint import checkpoint

        rows, positions = hidden.shape[:2]
        width = max(1, self.chunk_tokens // max(rows, 1))
        recompute = torch.is_grad_enabled() and hidden.requires_grad

        def scores(piece: torch.Tensor, piece_targets: torch.Tensor, *ids: torch.Tensor) -> torch.Tensor:
            logits = self.logits(piece)
            log_probs, entropy = log_probs_and_entropy(logits, piece_targets, temperature, with_entropy, vocab_start)
            columns = [log_probs.unsqueeze(-1)] + ([entropy.unsqueeze(-1)] if entropy is not None else [])
            if ids:
                columns.append(gathered_log_probs(logits, ids[0], temperature, vocab_start))
            return torch.cat(columns, dim=-1)

        pieces, values, indices = [], [], []
        for start in range(0, positions, width):
            arguments = [hidden[:, start : start + width], targets[:, start : start + width]]
            if gather_ids is not None:
                arguments.append(gather_ids[:, start : start + width])
            pieces.append(checkpoint(scores, *arguments, use_reentrant=False) if recompute else scores(*arguments))
            if top_k_count:
                with torch.no_grad():
                    best = top_k(self.logits(arguments[0]), temperature, top_k_count, vocab_start, vocab_size)
                values.append(best[0])
                indices.append(best[1])
        merged = torch.cat(pieces, dim=1) if pieces else hidden[:, :0, :1].float()
        result = {"log_probs": merged[..., 0]}
        column = 1
        if with_entropy:
            result["entropy"] = merged[..., column]
            column += 1
        if gather_ids is not None:
            result["gathered_log_probs"] = merged[..., column:]
        if top_k_count:
            result["top_k_log_probs"], result["top_k_ids"] = torch.cat(values, dim=1), torch.cat(indices, dim=1)
        return result
