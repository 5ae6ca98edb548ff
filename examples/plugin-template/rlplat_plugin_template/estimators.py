"""The advantage estimator ``example_group_median``: a response's score minus its group's median score.

It follows :class:`rlplat.contracts.algorithm.AdvantageEstimator`, built with the public estimator kit
(:mod:`rlplat.kits.advantages`). The median is a baseline that one
outlier cannot move: a single lucky 1.0 among seven 0.0 scores leaves it at 0.0, so that response keeps
the whole credit, where GRPO's mean baseline would hand every other response a small negative advantage.
"""

from __future__ import annotations

import torch

from rlplat.kits.advantages import check_shapes, group_rows, outcome_advantages


def group_median(token_level_rewards, response_mask, index, values=None, config=None, **extra):
    """``score - median(scores of the group)`` on every valid token of a response, 0 elsewhere.

    A response's score is the sum of its token-level rewards; ``index`` holds each row's group id (the
    prompt's ``uid``). The median of an even-sized group is the mean of its two middle scores
    (``torch.quantile(scores, 0.5)``), so a group of one gets 0. Returns are the advantages, as for
    every outcome-level estimator without a critic. ``values`` and ``config`` are not read.
    """
    check_shapes("example_group_median", token_level_rewards, response_mask, index)
    scores = token_level_rewards.sum(dim=-1).to(torch.float32)
    baselines = torch.empty_like(scores)
    for rows in group_rows(index).values():
        baselines[rows] = torch.quantile(scores[rows], 0.5)
    return outcome_advantages(scores - baselines, response_mask)
