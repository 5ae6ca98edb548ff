"""Advantage estimators, numerically those of verl's ``core_algos`` (registered names in brackets).

Every estimator has the contract's signature
``fn(token_level_rewards, response_mask, index, values=None, config=None, **extra) -> (advantages, returns)``:
[B, R] float32 tensors that are 0 wherever ``response_mask`` is 0. ``index`` holds the group id of
each row (responses to one prompt share one); ``config`` is the ``algorithm`` node
(:class:`rlplat.contracts.algorithm.AlgorithmConfig`, a mapping or None; keys of other components in it are ignored). Inputs are never modified.
Outcome estimators take a response's score as the sum of its token-level rewards.

Choices where the field has variants, all verl's unless said otherwise:

* Group statistics use ``torch.std`` (unbiased, Bessel-corrected) and add ``epsilon`` (1e-6) to it.
* A group of one response has mean 0 and std 1 (GRPO, GPG, REINFORCE++-baseline, OPO), so its
  advantage is its raw score; RLOO leaves a lone response's score unchanged too (verl's ``rloo``,
  not its ``rloo_vectorized``, which gives 0); Pass@k refuses groups of one.
* GAE, REINFORCE++ and REINFORCE++-baseline whiten advantages over the whole batch's valid tokens
  (masked mean, unbiased masked variance, ``rsqrt(var + 1e-8)``). GRPO and the others do not.
* Masked tokens inside a response (tool or observation spans of multi-turn data) are transparent:
  GAE carries the next value and the running advantage across them, and REINFORCE++ carries its
  running return across them without discounting (both as verl 0.9.1 does).
* Returns (and, for GAE, advantages) are multiplied by the mask, which verl leaves to the loss; the
  values on valid tokens are unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlplat.kits.advantages import check_shapes, group_rows, outcome_advantages
from rlplat.config_node import read_config_node
from rlplat.contracts.algorithm import AlgorithmConfig
from rlplat.losses.aggregation import masked_whiten


def gae(token_level_rewards, response_mask, index=None, values=None, config=None, **extra):
    """Generalised advantage estimation with a critic's ``values``, then whitened over the batch.

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next`` where "next" is
    the next *valid* token (masked tokens are skipped); ``returns = A + V`` before whitening.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values (values=None was given)")
    check_shapes("gae", token_level_rewards, response_mask, values=values)
    settings = read_config_node(config, AlgorithmConfig, "algorithm", strict=False)
    mask = response_mask.to(torch.float32)
    rewards, values = token_level_rewards.to(torch.float32), values.to(torch.float32)
    with torch.no_grad():
        next_values = torch.zeros_like(rewards[:, 0])
        running = torch.zeros_like(rewards[:, 0])
        reversed_advantages = []
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + settings.gamma * next_values - values[:, t]
            candidate = delta + settings.gamma * settings.lam * running
            next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
            running = candidate * mask[:, t] + (1 - mask[:, t]) * running
            reversed_advantages.append(running)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns * mask


def _group_centred(scores: torch.Tensor, index: Any, divide_by_std: bool, epsilon: float) -> torch.Tensor:
    result = scores.clone()
    for rows in group_rows(index).values():
        group = scores[rows]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = torch.mean(group), torch.std(group)
        result[rows] = (group - mean) / (std + epsilon) if divide_by_std else group - mean
    return result


def grpo(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """GRPO: ``(score - group mean) / (group std + epsilon)``; with ``norm_adv_by_std_in_grpo=False``
    only the mean is subtracted. A group of one gets mean 0 and std 1."""
    check_shapes("grpo", token_level_rewards, response_mask, index)
    settings = read_config_node(config, AlgorithmConfig, "algorithm", strict=False)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        centred = _group_centred(scores, index, settings.norm_adv_by_std_in_grpo, settings.epsilon)
    return outcome_advantages(centred, response_mask)


def dr_grpo(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """Dr. GRPO (Liu et al., 2025): ``score - group mean``, never divided by the std (whatever
    ``norm_adv_by_std_in_grpo`` says); pair it with ``seq-mean-token-sum-norm`` aggregation."""
    check_shapes("dr_grpo", token_level_rewards, response_mask, index)
    settings = read_config_node(config, AlgorithmConfig, "algorithm", strict=False)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        centred = _group_centred(scores, index, False, settings.epsilon)
    return outcome_advantages(centred, response_mask)


def rloo(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """RLOO (Ahmadian et al., 2024): the mean of the *other* responses of the group is the baseline,
    computed as verl does: ``score * n / (n - 1) - mean * n / (n - 1)``. A lone response keeps its score."""
    check_shapes("rloo", token_level_rewards, response_mask, index)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        result = scores.clone()
        for rows in group_rows(index).values():
            count = len(rows)
            if count > 1:
                group = scores[rows]
                result[rows] = group * count / (count - 1) - torch.mean(group) * count / (count - 1)
    return outcome_advantages(result, response_mask)


def opo(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """OPO (Hao et al., 2025): the baseline is the length-weighted mean score of the group,
    ``sum(len_i * score_i) / sum(len_i)`` with ``len`` the count of valid tokens; 0 for a group of one."""
    check_shapes("opo", token_level_rewards, response_mask, index)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        lengths = response_mask.to(torch.float32).sum(dim=-1)
        result = scores.clone()
        for rows in group_rows(index).values():
            if len(rows) > 1:
                baseline = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
                result[rows] = scores[rows] - baseline
    return outcome_advantages(result, response_mask)


def gpg(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """GPG (Chu et al., 2025): ``alpha * (score - group mean)`` with ``alpha = B / max(1, #non-zero
    scores in the batch)`` and no std division (verl's ``f_norm`` is 1); mean 0 for a group of one."""
    check_shapes("gpg", token_level_rewards, response_mask, index)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        result = alpha * _group_centred(scores, index, False, 0.0)
    return outcome_advantages(result, response_mask)


def grpo_passk(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """Pass@k GRPO (Chen et al., 2025): only the best response of each group gets an advantage,
    ``best - second best`` (divided by ``group std + epsilon`` when ``norm_adv_by_std_in_grpo``).
    Ties for best go to the one ``torch.topk`` returns; groups of one raise ``ValueError``."""
    check_shapes("grpo_passk", token_level_rewards, response_mask, index)
    settings = read_config_node(config, AlgorithmConfig, "algorithm", strict=False)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        result = torch.zeros_like(scores)
        for group, rows in group_rows(index).items():
            if len(rows) < 2:
                raise ValueError(f"grpo_passk needs at least 2 responses per group; group {group!r} has {len(rows)}")
            group_scores = scores[rows]
            top, top_rows = torch.topk(group_scores, 2)
            advantage = top[0] - top[1]
            if settings.norm_adv_by_std_in_grpo:
                advantage = advantage / (torch.std(group_scores) + settings.epsilon)
            result[rows[top_rows[0]]] = advantage
    return outcome_advantages(result, response_mask)


def reinforce_plus_plus(token_level_rewards, response_mask, index=None, values=None, config=None, **extra):
    """REINFORCE++ (Hu, 2025): discounted return-to-go (``gamma``) per token, whitened over the batch.

    The return runs over valid tokens only: a masked span (a tool or observation span of multi-turn
    data) is skipped, not a restart, as in verl 0.9.1."""
    check_shapes("reinforce_plus_plus", token_level_rewards, response_mask)
    settings = read_config_node(config, AlgorithmConfig, "algorithm", strict=False)
    mask = response_mask.to(torch.float32)
    rewards = token_level_rewards.to(torch.float32)
    with torch.no_grad():
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            stepped = rewards[:, t] + settings.gamma * running
            running = stepped * mask[:, t] + (1 - mask[:, t]) * running
            returns[:, t] = running
        returns = returns * mask
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def reinforce_plus_plus_baseline(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """REINFORCE++ with a group baseline: ``score - group mean`` on every valid token, then whitened
    over the batch's valid tokens; a group of one has mean 0."""
    check_shapes("reinforce_plus_plus_baseline", token_level_rewards, response_mask, index)
    mask = response_mask.to(torch.float32)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        centred = _group_centred(scores, index, False, 0.0)
        advantages = centred.unsqueeze(-1).tile([1, mask.shape[1]]) * mask
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, advantages.clone()


def remax(token_level_rewards, response_mask, index=None, values=None, config=None, reward_baselines=None, **extra):
    """ReMax (Li et al., 2023): return-to-go minus the score of the greedy response to the same prompt.

    ``reward_baselines`` [B] (a keyword input) holds each row's greedy score; the ``remax`` algorithm
    spec computes it with an extra greedy rollout. ``returns`` is the undiscounted return-to-go.
    """
    check_shapes("remax", token_level_rewards, response_mask)
    if reward_baselines is None:
        raise ValueError("advantage estimator 'remax' needs reward_baselines=[B] (the greedy rollout's scores)")
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"advantage estimator 'remax': reward_baselines has shape {tuple(reward_baselines.shape)}, "
            f"expected ({token_level_rewards.shape[0]},)"
        )
    mask = response_mask.to(torch.float32)
    with torch.no_grad():
        returns = (token_level_rewards.to(torch.float32) * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.to(torch.float32).unsqueeze(-1) * mask
    return advantages * mask, returns * mask
