"""Choosing the next token: temperature, top-k, top-p, greedy; and the log-probability of the choice
under the distribution it was actually drawn from (after the filters)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from rlplat.contracts.rollout import SamplingParams


def filtered_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """``logits / temperature`` in float32 with everything outside top-k / the top-p nucleus at -inf."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # drop a token once the tokens before it already reach top_p (the first token always stays)
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def choose(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probabilities [B] (float32).

    Greedy takes the arg-max and reports its log-probability under ``log_softmax(logits)`` (temperature 1,
    no filter): the policy's own probability of the token it would always pick.
    """
    if sampling.greedy:
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        tokens = log_probs.argmax(dim=-1)
    else:
        log_probs = torch.log_softmax(filtered_logits(logits, sampling), dim=-1)
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def choose_per_row(
    logits: torch.Tensor, sampling: SamplingParams, row_generators: Sequence[Optional[torch.Generator]],
    shared_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`choose` with a random stream per row: row ``i`` draws from ``row_generators[i]``, or from
    ``shared_generator`` where that is None (those rows in one draw, in row order). A row with its own
    generator draws what :func:`choose` draws for that row alone with that generator, whatever the
    other rows are."""
    if sampling.greedy or all(generator is None for generator in row_generators):
        return choose(logits, sampling, shared_generator)
    log_probs = torch.log_softmax(filtered_logits(logits, sampling), dim=-1)
    probabilities = log_probs.exp()
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    shared_rows = [row for row, generator in enumerate(row_generators) if generator is None]
    if shared_rows:
        shared_index = torch.tensor(shared_rows, device=logits.device)
        tokens[shared_index] = torch.multinomial(probabilities[shared_index], 1, generator=shared_generator).squeeze(-1)
    own = [(row, generator) for row, generator in enumerate(row_generators) if generator is not None]
    rows = probabilities.unbind(0)
    own_index = torch.tensor([row for row, _ in own], device=logits.device)
    tokens[own_index] = torch.cat([torch.multinomial(rows[row], 1, generator=generator) for row, generator in own])
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
