"""The advantage estimator ``example_group_median``: a response's score minus its group's median score.

It follows :class:`rlplat.contracts.algorithm.AdvantageEstimator`. The median is a baseline that one
outlier cannot move: a single lucky 1.0 among seven 0.0 scores leaves it at 0.0, so that response keeps
the whole credit, where GRPO's mean baseline would hand every other response a small negative advantage.
"""

from __future__ import annotations

import torch


def group_median(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """``score - median(scores of the group)`` on every valid token of a response, 0 elsewhere.

    A response's score is the sum of its token-level rewards; ``index`` holds each row's group id (the
    prompt's ``uid``). The median of an even-sized group is the mean of its two middle scores
    (``torch.quantile(scores, 0.5)``), so a group of one gets 0. Returns are the advantages, as for
    every outcome-level estimator without a critic. ``values`` and ``config`` are not read.
    """
    if token_level_rewards.shape != response_mask.shape or len(index) != token_level_rewards.shape[0]:
        raise ValueError(
            f"example_group_median: token_level_rewards has shape {tuple(token_level_rewards.shape)}, response_mask "
            f"{tuple(response_mask.shape)} and index {len(index)} rows; they must describe the same [B, R] batch"
        )
    scores = token_level_rewards.sum(dim=-1).to(torch.float32)
    group_numbers: dict = {}
    groups = torch.tensor([group_numbers.setdefault(group, len(group_numbers)) for group in index])
    baselines = torch.empty_like(scores)
    for group in range(len(group_numbers)):
        members = groups == group
        baselines[members] = torch.quantile(scores[members], 0.5)
    advantages = (scores - baselines).unsqueeze(-1) * response_mask.to(torch.float32)
    return advantages, advantages.clone()
