"""Algorithms: advantage estimators, policy losses, and the spec that ties them into the loop.

Tensor shapes: ``B`` responses, ``R`` response tokens; ``response_mask`` is 1 on tokens the policy
produced and 0 on padding and on tool/observation spans of multi-turn data.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rlplat.contracts.rollout import SamplingParams
    from rlplat.protocol import DataProto


class AdvantageEstimator(Protocol):
    """``fn(token_level_rewards, response_mask, index, values=None, config=None, **extra)``.

    ``token_level_rewards`` and ``response_mask`` are [B, R]; ``index`` is a numpy array of B group ids
    (the non-tensor ``uid``: responses to the same prompt share one); ``values`` [B, R] for estimators
    with a critic; ``config`` the algorithm config node. ``extra`` carries estimator-specific inputs
    (e.g. ``reward_baselines`` for ReMax). Returns ``(advantages, returns)``, both [B, R] float32 and
    0 where ``response_mask`` is 0. Inputs are not modified.
    """

    def __call__(
        self,
        token_level_rewards: "torch.Tensor",
        response_mask: "torch.Tensor",
        index: "np.ndarray",
        values: "torch.Tensor | None" = None,
        config: Any = None,
        **extra: Any,
    ) -> tuple["torch.Tensor", "torch.Tensor"]: ...


class PolicyLoss(Protocol):
    """``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config) -> (loss, metrics)``.

    All tensors [B, R]; ``log_prob`` carries gradients. ``loss_agg_mode`` is one of ``token-mean``,
    ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``. Returns a scalar loss
    and a dict of floats (``actor/pg_clipfrac``, ``actor/ppo_kl``, ...).
    """

    def __call__(
        self,
        old_log_prob: "torch.Tensor",
        log_prob: "torch.Tensor",
        advantages: "torch.Tensor",
        response_mask: "torch.Tensor",
        loss_agg_mode: str,
        config: Any,
    ) -> tuple["torch.Tensor", dict[str, float]]: ...


GenerateFunction = Callable[["DataProto", "SamplingParams"], "DataProto"]


@dataclasses.dataclass
class Algorithm:
    """What an algorithm is, for the driver loop.

    ``adv_estimator`` and ``policy_loss`` name registry entries of kinds ``advantage_estimator`` and
    ``policy_loss``. ``needs_critic`` makes the loop build a critic and compute ``values``;
    ``needs_reference`` a reference model and ``ref_log_prob``. ``default_config`` is merged under the
    user's ``algorithm`` config node. ``actor_loss`` and ``critic_loss`` build the per-micro-batch
    :class:`~rlplat.contracts.engine.LossFunction` the workers hand to ``TrainingEngine.train_batch``:
    each is a callable ``(config) -> LossFunction`` (or its ``"module:attribute"`` path) taking the
    ``actor`` / ``critic`` config node. Subclasses override the hooks below to change a step of the
    loop; the defaults leave the loop as it is.
    """

    name: str
    adv_estimator: str
    policy_loss: str = "vanilla"
    needs_critic: bool = False
    needs_reference: bool = False
    default_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str = ""
    actor_loss: Any = None
    critic_loss: Any = None
    kl_controller: Any = None
    """``(kl_ctrl_node) -> controller`` (or its path): an object with ``value`` (the coefficient) and
    ``update(current_kl, n_steps)``, used when ``algorithm.use_kl_in_reward`` is true."""
    reward_kl: Any = None
    """``(token_level_scores, old_log_probs, ref_log_prob, response_mask, controller, algorithm_node)
    -> (token_level_rewards, metrics)`` (or its path): the KL-in-reward step."""

    def resolve(self, field: str) -> Any:
        """The callable held in ``field``, importing a ``"module:attribute"`` path."""
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"algorithm {self.name!r} defines no {field}")
        if isinstance(value, str):
            from rlplat.registry import resolve_dotted_path

            return resolve_dotted_path(value)
        return value

    def build_loss(self, which: str, config: Any) -> Any:
        """The loss function for ``which`` (``"actor"`` or ``"critic"``) built from its config node."""
        return self.resolve(f"{which}_loss")(config)

    def after_generate(self, batch: "DataProto", generate: GenerateFunction, sampling: "SamplingParams") -> "DataProto":
        """Called with the freshly generated batch; may add rows or columns using ``generate``
        (ReMax adds a greedy baseline). Returns the batch the loop continues with."""
        return batch

    def filter_batch(self, batch: "DataProto") -> "DataProto":
        """Called after rewards; may drop rows (DAPO drops groups whose scores are all equal).
        The loop samples again while the filtered batch is smaller than wanted, within a bound."""
        return batch
