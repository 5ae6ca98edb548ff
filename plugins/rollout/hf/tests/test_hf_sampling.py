"""Seeded rows of the hf rollout draw from counter-based streams: the numbers are SplitMix64's, one
per (seed, row, step) and uniform, and drawing tokens from them by inverse CDF samples the same
distribution as ``generate`` (temperature, top-k, top-p), while greedy and unseeded rows draw as before."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat_rollout_hf.sampling import (
    SPLITMIX64_GAMMA, choose, choose_per_row, inverse_cdf_tokens, mix64, stream_keys, stream_uniforms,
)

# SplitMix64 seeded with 1234567: its first five outputs (Rosetta Code, "Pseudo-random numbers/Splitmix64")
SPLITMIX64_FROM_1234567 = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                           16408922859458223821]

# probabilities 0.35, 0.25, 0.15, 0.12, 0.08, 0.05 and what each setting samples from (the filters of
# filtered_logits, renormalised):
PROBABILITIES = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]
SAMPLED = {
    # temperature 1: the probabilities themselves
    "temperature 1": (SamplingParams(), PROBABILITIES),
    # temperature 0.5: p**2 / sum(p**2), sum(p**2) = 0.2308
    "temperature 0.5": (SamplingParams(temperature=0.5), [p * p / 0.2308 for p in PROBABILITIES]),
    # top-k 3: the first three, / 0.75
    "top-k 3": (SamplingParams(top_k=3), [0.35 / 0.75, 0.25 / 0.75, 0.15 / 0.75, 0, 0, 0]),
    # top-p 0.8: the tokens before the fifth already hold 0.87 >= 0.8, so four are kept, / 0.87
    "top-p 0.8": (SamplingParams(top_p=0.8), [0.35 / 0.87, 0.25 / 0.87, 0.15 / 0.87, 0.12 / 0.87, 0, 0]),
}
# the 0.999 quantile of the chi-square distribution with 1..5 degrees of freedom
CHI_SQUARE_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
DRAWS = 40_000


@functools.cache
def first_draw_keys() -> list[int]:
    """The stream keys of ``generate_tokens`` requests seeded with 0 .. DRAWS - 1."""
    return [int(stream_keys(seed, [0])[0]) for seed in range(DRAWS)]


def test_stream_numbers_are_those_of_splitmix64():
    states = np.array([1234567 + step * SPLITMIX64_GAMMA for step in range(1, 6)], dtype=object) % 2**64
    assert mix64(states.astype(np.uint64)).tolist() == SPLITMIX64_FROM_1234567
    uniforms = stream_uniforms(np.full(5, 1234567, dtype=np.uint64), np.arange(5))
    assert uniforms.tolist() == [(output >> 11) * 2.0**-53 for output in SPLITMIX64_FROM_1234567]


def test_stream_keys_hash_the_seed_and_the_row():
    seed_key = mix64(np.array([42], dtype=np.uint64))[0]
    expected = [int(mix64(np.array([(int(seed_key) + row * SPLITMIX64_GAMMA) % 2**64], dtype=np.uint64))[0]) for row in range(3)]
    assert stream_keys(42, range(3)).tolist() == expected
    assert stream_keys(-1, [0]).tolist() == stream_keys(2**64 - 1, [0]).tolist()  # seeds are taken modulo 2**64
    with pytest.raises(TypeError, match=r"SamplingParams.seed must be an integer, got 1.5"):
        stream_keys(1.5, [0])


def test_different_seeds_and_rows_give_different_streams():
    # the agent loops' seeds: run seed + 104729 per conversation, + 7919 per turn
    seeds = [0, 1, 7_919, 104_729, 104_729 + 7_919]
    keys = np.concatenate([stream_keys(seed, range(4)) for seed in seeds])
    streams = {tuple(stream_uniforms(np.full(16, key, dtype=np.uint64), np.arange(16)).tolist()) for key in keys}
    assert len(streams) == len(seeds) * 4


def test_the_numbers_of_one_stream_are_uniform_and_uncorrelated_from_step_to_step():
    uniforms = stream_uniforms(np.full(DRAWS, stream_keys(3, [0])[0], dtype=np.uint64), np.arange(DRAWS))
    assert ((uniforms >= 0) & (uniforms < 1)).all() and len(set(uniforms.tolist())) == DRAWS
    # a uniform's mean is 1/2 and variance 1/12: standard errors 0.0014 and 0.0005 for 40000 draws
    assert abs(uniforms.mean() - 0.5) < 0.006 and abs(uniforms.var() - 1 / 12) < 0.002
    # correlation of consecutive numbers: standard error 1 / sqrt(40000) = 0.005
    assert abs(np.corrcoef(uniforms[:-1], uniforms[1:])[0, 1]) < 0.02
    counts = np.bincount((uniforms * 10).astype(int), minlength=10)
    assert ((counts - DRAWS / 10) ** 2 / (DRAWS / 10)).sum() < 27.877  # chi-square, 9 degrees of freedom, 0.999


def chi_square(counts: torch.Tensor, expected: list[float]) -> float:
    kept = [token for token, probability in enumerate(expected) if probability > 0]
    return sum((counts[token].item() - DRAWS * expected[token]) ** 2 / (DRAWS * expected[token]) for token in kept)


@pytest.mark.parametrize("setting", SAMPLED)
@pytest.mark.parametrize("streams", ["one draw of many seeds", "many draws of one seed"])
def test_seeded_draws_follow_the_filtered_distribution(setting, streams):
    sampling, expected = SAMPLED[setting]
    logits = torch.log(torch.tensor(PROBABILITIES)).expand(DRAWS, -1)
    if streams == "one draw of many seeds":
        keys, steps = first_draw_keys(), [0] * DRAWS
    else:
        keys, steps = [int(stream_keys(11, [0])[0])] * DRAWS, list(range(DRAWS))
    tokens, log_probs = choose_per_row(logits, sampling, keys, steps, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=len(PROBABILITIES))
    assert all(counts[token] == 0 for token, probability in enumerate(expected) if probability == 0)
    kept = sum(probability > 0 for probability in expected)
    assert chi_square(counts, expected) < CHI_SQUARE_999[kept - 1]
    assert (counts / DRAWS - torch.tensor(expected)).abs().max() < 0.01  # standard error <= 0.0025
    # each log-probability is that of the token under the distribution it was drawn from
    assert torch.allclose(log_probs.exp(), torch.tensor(expected)[tokens], atol=1e-4)


def test_inverse_cdf_takes_the_first_token_whose_cumulative_probability_exceeds_the_uniform():
    probabilities = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, -1)
    uniforms = torch.tensor([0.0, 0.25, 0.4999, 0.5, 1 - 2.0**-53], dtype=torch.float64)
    # cumulative 0, 0.5, 0.5, 1, 1: tokens of probability 0 are never taken, not even at 0 or next to 1
    assert inverse_cdf_tokens(probabilities, uniforms).tolist() == [1, 1, 1, 3, 3]
    # unnormalised rows: the uniform scales the row's total (2 + 1 = 3; 0.7 * 3 = 2.1 > 2)
    assert inverse_cdf_tokens(torch.tensor([[2.0, 1.0], [2.0, 1.0]]), torch.tensor([0.6, 0.7], dtype=torch.float64)).tolist() == [0, 1]


def test_greedy_rows_ignore_their_streams():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, log_probs = choose_per_row(logits, SamplingParams(greedy=True), [5, None], [0, 0], torch.Generator())
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(log_probs, torch.log_softmax(logits, -1).max(-1).values)


def test_unseeded_rows_of_a_mixed_batch_draw_what_choose_draws_for_them_and_seeded_rows_what_they_draw_alone():
    logits = torch.randn(6, 9, generator=torch.Generator().manual_seed(1))
    sampling = SamplingParams(temperature=0.8, top_k=6)
    keys = [None, int(stream_keys(4, [0])[0]), None, None, int(stream_keys(9, [0])[0]), None]
    steps = [0, 3, 0, 0, 7, 0]
    tokens, log_probs = choose_per_row(logits, sampling, keys, steps, torch.Generator().manual_seed(2))
    unseeded = [0, 2, 3, 5]
    alone_tokens, alone_log_probs = choose(logits[unseeded], sampling, torch.Generator().manual_seed(2))
    assert tokens[unseeded].tolist() == alone_tokens.tolist()
    assert torch.equal(log_probs[unseeded], alone_log_probs)
    for row in (1, 4):
        token, log_prob = choose_per_row(logits[row : row + 1], sampling, keys[row : row + 1], steps[row : row + 1], torch.Generator())
        assert tokens[row] == token[0] and log_probs[row] == log_prob[0]
