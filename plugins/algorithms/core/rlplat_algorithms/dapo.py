"""DAPO (Yu et al., 2025): clip-higher, token-mean loss, dynamic sampling, overlong reward shaping.

* Clip-higher and token-mean are actor defaults of the spec (``clip_ratio_low=0.2``,
  ``clip_ratio_high=0.28``, ``clip_ratio_c=10``, ``loss_agg_mode=token-mean``); no KL.
* Dynamic sampling: :meth:`DAPO.filter_batch` drops every group (``uid``) whose metric is the same
  for all its responses (``np.std == 0``; a group of one is kept, as in verl), and
  :class:`GroupAccumulator` gathers filtered batches until the step has ``train_batch_size`` groups,
  failing after ``filter_groups.max_num_gen_batches`` generation rounds (0: no bound).
* Overlong reward shaping is done by the ``dapo`` reward manager of ``rlplat-rewards``, which the
  spec names in ``default_config["reward"]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlplat.contracts.algorithm import Algorithm
from rlplat_algorithms.config import DAPOConfig, FilterGroupsConfig
from rlplat_algorithms.specs import _actor_node, _algorithm_node, make_spec


def group_metric(batch: Any, metric: str) -> np.ndarray:
    """Per-row values of the filtering metric: ``seq_reward`` (summed ``token_level_scores``),
    ``seq_final_reward`` (summed ``token_level_rewards``) or the name of a non-tensor column (``acc``)."""
    if metric == "seq_reward":
        return batch.batch["token_level_scores"].sum(dim=-1).numpy()
    if metric == "seq_final_reward":
        return batch.batch["token_level_rewards"].sum(dim=-1).numpy()
    if metric in batch.non_tensor_batch:
        return np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)
    raise KeyError(
        f"dapo: filter_groups.metric {metric!r} is neither seq_reward, seq_final_reward nor a non-tensor "
        f"column of the batch ({sorted(batch.non_tensor_batch)})"
    )


class DAPO(Algorithm):
    """The DAPO spec; its ``filter_batch`` implements the group filter of dynamic sampling."""

    def filter_batch(self, batch):
        """Keep the rows of groups whose metric varies (or that have one response); a new DataProto."""
        settings = self.filter_settings()
        if not settings.enable:
            return batch
        values = group_metric(batch, settings.metric)
        uids = batch.non_tensor_batch["uid"]
        rows_of: dict[Any, list[int]] = {}
        for row, uid in enumerate(uids):
            rows_of.setdefault(uid, []).append(row)
        kept = [
            row
            for rows in rows_of.values()
            if len(rows) == 1 or np.std(values[rows]) > 0
            for row in rows
        ]
        return batch.select_idxs(np.asarray(kept, dtype=np.int64))

    def make_accumulator(self, train_batch_size: int) -> "GroupAccumulator | None":
        """A :class:`GroupAccumulator` with ``filter_groups.max_num_gen_batches`` (None when filtering is off)."""
        settings = self.filter_settings()
        if not settings.enable:
            return None
        return GroupAccumulator(train_batch_size, settings.max_num_gen_batches)

    def filter_settings(self) -> FilterGroupsConfig:
        """``algorithm.filter_groups`` of the run (:attr:`config`, set by the trainer), else the defaults."""
        from rlplat.config_node import read_config_node

        node = self.config if self.config is not None else self.default_nodes()["algorithm"]
        return read_config_node(node, DAPOConfig, "algorithm", strict=False).filter_groups


class GroupAccumulator:
    """Gathers filtered batches until ``wanted_groups`` groups are in, as verl's DAPO trainer does.

    Call :meth:`add` once per generation round with the round's *filtered* batch: it returns None
    while groups are missing, and the batch trimmed to exactly ``wanted_groups`` groups (groups are
    contiguous rows, as the rollout writes them) when enough are in. It raises ``RuntimeError`` when
    ``max_num_gen_batches`` rounds (> 0) did not suffice.
    """

    def __init__(self, wanted_groups: int, max_num_gen_batches: int = 0):
        if wanted_groups < 1:
            raise ValueError(f"wanted_groups must be >= 1, got {wanted_groups}")
        self.wanted_groups = wanted_groups
        self.max_num_gen_batches = max_num_gen_batches
        self.rounds = 0
        self.parts: list[Any] = []

    @property
    def groups(self) -> int:
        return sum(len(set(part.non_tensor_batch["uid"])) for part in self.parts)

    def add(self, filtered_batch: Any) -> Any | None:
        from rlplat.protocol import DataProto

        self.rounds += 1
        if len(filtered_batch):
            self.parts.append(filtered_batch)
        if self.groups >= self.wanted_groups:
            collected = DataProto.concat(self.parts)
            uids = collected.non_tensor_batch["uid"]
            seen: set[Any] = set()
            keep = 0
            for uid in uids:
                if uid not in seen:
                    if len(seen) == self.wanted_groups:
                        break
                    seen.add(uid)
                keep += 1
            return collected.slice(0, keep)
        if 0 < self.max_num_gen_batches <= self.rounds:
            raise RuntimeError(
                f"dapo dynamic sampling: {self.rounds} generation rounds gave {self.groups} of the "
                f"{self.wanted_groups} groups whose scores vary (filter_groups.max_num_gen_batches="
                f"{self.max_num_gen_batches}). The data may be too easy or too hard for the model; raise "
                "the bound, or set it to 0 to sample until the batch is full."
            )
        return None


def dapo() -> Algorithm:
    """DAPO with verl's recipe values (clip 0.2 / 0.28, dual clip 10, 4096-token overlong buffer)."""
    return make_spec(
        DAPO,
        name="dapo",
        description="DAPO: clip-higher, token-mean loss, dynamic sampling of informative groups, overlong shaping.",
        algorithm={
            **_algorithm_node("grpo"),
            "filter_groups": {"enable": True, "metric": "seq_reward", "max_num_gen_batches": 10},
        },
        actor=_actor_node(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean"),
        reward={
            "manager": "dapo",
            "overlong_buffer": {"enable": True, "len": 4096, "penalty_factor": 1.0, "log": False},
        },
    )
