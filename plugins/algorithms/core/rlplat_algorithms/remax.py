"""ReMax (Li et al., 2023): the score of a greedy response to the same prompt is the baseline.

The spec uses three loop hooks, so the driver needs no ReMax-specific code:

1. :meth:`ReMax.after_generate` takes the first sample of every group (``uid``), generates one greedy
   response to its prompt, and appends those rows to the batch, marked ``remax_baseline=True`` in
   ``non_tensor_batch`` (sampled rows are ``False``). The reward step then scores them with the rest.
2. :meth:`ReMax.filter_batch` (after rewards) removes the greedy rows and writes each sampled row's
   ``reward_baselines`` [B] column: the summed ``token_level_scores`` of its group's greedy row.
3. :meth:`ReMax.estimator_inputs` hands that column to the ``remax`` advantage estimator.

This is verl's arrangement (greedy generation per prompt, scored with the same reward function,
``reward_baselines = scores.sum(-1)``) expressed through rlplat's hooks.
"""

from __future__ import annotations

import dataclasses
import numpy as np
import torch

from rlplat.contracts.algorithm import Algorithm
from rlplat_algorithms.specs import _actor_node, _algorithm_node, make_spec

BASELINE_FLAG = "remax_baseline"


class ReMax(Algorithm):
    """The ReMax spec: estimator ``remax``, KL in the reward, an extra greedy rollout per prompt."""

    def after_generate(self, batch, generate, sampling):
        """Append one greedy response per group, flagged ``remax_baseline``; see the module docstring.

        Reads ``prompts`` [N, P], ``attention_mask`` and ``position_ids`` [N, P + R] and the non-tensor
        ``uid``; calls ``generate(prompts, greedy sampling with n=1)``.
        """
        from rlplat.protocol import DataProto

        first_rows, seen = [], set()
        for row, uid in enumerate(batch.non_tensor_batch["uid"]):
            if uid not in seen:
                seen.add(uid)
                first_rows.append(row)
        representatives = batch.select_idxs(first_rows)
        prompt_width = representatives.batch["prompts"].shape[1]
        prompts = DataProto.from_dict(
            tensors={
                "input_ids": representatives.batch["prompts"],
                "attention_mask": representatives.batch["attention_mask"][:, :prompt_width],
                "position_ids": representatives.batch["position_ids"][..., :prompt_width],
            },
            non_tensors={
                key: value
                for key, value in representatives.non_tensor_batch.items()
                if key != BASELINE_FLAG
            },
            meta_info=batch.meta_info,
        )
        greedy = generate(prompts, dataclasses.replace(sampling, n=1, greedy=True))
        baseline_tensors = {key: representatives.batch[key] for key in batch.batch.keys()}
        baseline_tensors.update({key: greedy.batch[key] for key in greedy.batch.keys() if key in baseline_tensors})
        baseline_rows = DataProto.from_dict(
            tensors=baseline_tensors,
            non_tensors={**representatives.non_tensor_batch, BASELINE_FLAG: [True] * len(first_rows)},
            meta_info=batch.meta_info,
        )
        sampled_rows = DataProto.from_dict(
            tensors=dict(batch.batch.items()),
            non_tensors={**batch.non_tensor_batch, BASELINE_FLAG: [False] * len(batch)},
            meta_info=batch.meta_info,
        )
        return DataProto.concat([sampled_rows, baseline_rows])

    def estimator_inputs(self, batch):
        """``reward_baselines`` [B] (written by :meth:`filter_batch`) for the ``remax`` estimator."""
        return {"reward_baselines": batch.batch["reward_baselines"]}

    def filter_batch(self, batch):
        """Drop the greedy rows and add ``reward_baselines`` [B] from their ``token_level_scores``."""
        flags = batch.non_tensor_batch[BASELINE_FLAG].astype(bool)
        if not flags.any():
            raise ValueError(
                "remax: the batch has no greedy baseline rows; after_generate must run before filter_batch"
            )
        uids = batch.non_tensor_batch["uid"]
        scores = batch.batch["token_level_scores"].sum(dim=-1)
        baseline_of = {uids[row]: scores[row] for row in np.flatnonzero(flags)}
        sampled = batch.select_idxs(np.flatnonzero(~flags))
        missing = sorted({str(uid) for uid in sampled.non_tensor_batch["uid"]} - {str(uid) for uid in baseline_of})
        if missing:
            raise ValueError(f"remax: no greedy baseline for group(s) {missing[:5]}")
        reward_baselines = torch.stack([baseline_of[uid] for uid in sampled.non_tensor_batch["uid"]])
        tensors = dict(sampled.batch.items())
        tensors["reward_baselines"] = reward_baselines.to(torch.float32)
        non_tensors = {key: value for key, value in sampled.non_tensor_batch.items() if key != BASELINE_FLAG}
        from rlplat.protocol import DataProto

        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=batch.meta_info)


def remax() -> Algorithm:
    """ReMax: greedy-rollout baseline, k1 KL in the reward (verl's example)."""
    return make_spec(
        ReMax,
        name="remax",
        description="ReMax: return minus the greedy response's score; one extra greedy rollout per prompt.",
        algorithm=_algorithm_node("remax", use_kl_in_reward=True),
        actor=_actor_node(),
    )
