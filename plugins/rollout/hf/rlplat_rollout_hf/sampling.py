"""Choosing the next token: temperature, top-k, top-p, greedy; and the log-probability of the choice
under the distribution it was actually drawn from (after the filters).

Unseeded rows draw from a ``torch.Generator`` (one ``torch.multinomial`` for all of them). A seeded row
draws from a stream of its own, counter-based so that every seeded row of a step draws in one batched
operation: its token number ``t`` (0 for the first new token) is the inverse CDF of its filtered
distribution at ``u_t``, the ``t``-th number of the SplitMix64 sequence whose state starts at the row's
stream key (:func:`stream_keys`: a hash of the seed and of the row's index in a seeded ``generate``, 0
for ``generate_tokens``). ``u_t`` is a function of the key and ``t`` alone, so a seeded row's tokens
depend on its seed, that index and its logits only: not on the rows batched with it, the order they
joined in, the engine instance or its generator. The hashing runs on uint64 numpy arrays, whose
arithmetic wraps modulo 2**64 by definition, then the ``[rows]`` uniforms move to the logits' device.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import numpy as np
import torch

from rlplat.contracts.rollout import SamplingParams

SPLITMIX64_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's state increment (the odd integer nearest 2**64 / golden ratio)."""


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


def mix64(states: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of each uint64 state (a bijection of 64-bit integers)."""
    z = np.atleast_1d(np.asarray(states, dtype=np.uint64))  # arrays, not numpy scalars: those warn when they wrap
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_keys(seed: int, rows: Sequence[int]) -> np.ndarray:
    """The stream keys (uint64 [len(rows)]) of rows ``rows`` of a request seeded with ``seed`` (any
    integer, taken modulo 2**64): ``mix64(mix64(seed) + row * gamma)``. ``generate_tokens`` is row 0;
    ``generate`` numbers the rows of its ``n``-repeated batch from 0. Hashing the seed first keeps the
    streams of nearby seeds (``seed + k`` per conversation and turn) unrelated."""
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"hf rollout: SamplingParams.seed must be an integer, got {seed!r}") from None
    base = mix64(np.array([seed % 2**64], dtype=np.uint64))
    return mix64(base + np.asarray(rows, dtype=np.uint64) * np.uint64(SPLITMIX64_GAMMA))


def stream_uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Float64 [rows] in [0, 1): number ``steps[i]`` (from 0) of the SplitMix64 sequence whose state
    starts at ``keys[i]``, its top 53 bits scaled by 2**-53."""
    states = np.asarray(keys, dtype=np.uint64) + (np.asarray(steps, dtype=np.uint64) + np.uint64(1)) * np.uint64(SPLITMIX64_GAMMA)
    return (mix64(states) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def inverse_cdf_tokens(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token [rows] of each row of ``probabilities`` [rows, vocabulary] (not necessarily normalised) at
    its uniform in [0, 1) (float64 [rows]): the first token whose cumulative probability exceeds
    ``uniform * total``, so a token of probability 0 is never taken."""
    cumulative = probabilities.double().cumsum(-1)  # float64: the cumulative sums of a large vocabulary stay exact enough
    # in float64 uniform * total < total whenever uniform < 1: the search stops at a token with probability > 0
    targets = uniforms.to(cumulative.device, torch.float64)[:, None] * cumulative[:, -1:]
    tokens = torch.searchsorted(cumulative, targets, right=True).squeeze(-1)
    return tokens.clamp(max=probabilities.shape[-1] - 1)  # only NaN probabilities get this far


def greedy_choice(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The arg-max and its log-probability under ``log_softmax(logits)`` (temperature 1, no filter): the
    policy's own probability of the token it would always pick."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    tokens = log_probs.argmax(dim=-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def choose(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probabilities [B] (float32), every row drawn from ``generator``
    (greedy: see :func:`greedy_choice`)."""
    if sampling.greedy:
        return greedy_choice(logits)
    log_probs = torch.log_softmax(filtered_logits(logits, sampling), dim=-1)
    tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def choose_per_row(
    logits: torch.Tensor, sampling: SamplingParams, keys: Sequence[Optional[int]], steps: Sequence[int],
    shared_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`choose` with a random stream per row: row ``i`` with a stream key (``keys[i]``, from
    :func:`stream_keys`) draws its token number ``steps[i]`` of that stream (all such rows in one
    batched inverse-CDF draw); rows whose key is None draw from ``shared_generator`` (in one draw, in
    row order), as :func:`choose` does for them. Greedy rows ignore both."""
    if sampling.greedy:
        return greedy_choice(logits)
    seeded = [row for row, key in enumerate(keys) if key is not None]
    if not seeded:
        return choose(logits, sampling, shared_generator)
    log_probs = torch.log_softmax(filtered_logits(logits, sampling), dim=-1)
    probabilities = log_probs.exp()
    uniforms = torch.from_numpy(stream_uniforms(np.array([keys[row] for row in seeded], dtype=np.uint64),
                                                np.array([steps[row] for row in seeded], dtype=np.uint64)))
    if len(seeded) == len(keys):
        tokens = inverse_cdf_tokens(probabilities, uniforms)
    else:
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        shared_index = torch.tensor([row for row, key in enumerate(keys) if key is None], device=logits.device)
        tokens[shared_index] = torch.multinomial(probabilities[shared_index], 1, generator=shared_generator).squeeze(-1)
        seeded_index = torch.tensor(seeded, device=logits.device)
        tokens[seeded_index] = inverse_cdf_tokens(probabilities[seeded_index], uniforms)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
