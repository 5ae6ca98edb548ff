"""Algorithm specs (kind ``algorithm``): each registered factory takes no argument and returns an
:class:`rlplat.contracts.algorithm.Algorithm`.

``default_config`` holds the defaults of the ``algorithm`` node (keys of
:class:`rlplat.contracts.algorithm.AlgorithmConfig`, plus ``filter_groups`` for DAPO), and the defaults
the algorithm implies for sibling nodes under their own names: ``actor`` (keys of
:class:`rlplat.losses.PolicyLossConfig`, laid out under ``actor.loss``), ``critic``
(``ValueLossConfig``, under ``critic.loss``) and ``reward`` (``manager`` and its settings); see
:meth:`rlplat.contracts.algorithm.Algorithm.default_nodes`. The values are those of verl's example scripts for each algorithm.
A reference model is built exactly when the resolved config uses a KL term, in the reward or in the loss
(:meth:`rlplat.contracts.algorithm.Algorithm.uses_reference`).
"""

from __future__ import annotations

from typing import Any

from rlplat.contracts.algorithm import Algorithm


def _algorithm_node(adv_estimator: str, **overrides: Any) -> dict[str, Any]:
    node: dict[str, Any] = {
        "adv_estimator": adv_estimator,
        "gamma": 1.0,
        "lam": 1.0,
        "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": False,
        "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": 0.001, "horizon": 10000, "target_kl": 0.1},
    }
    node.update(overrides)
    return node


def _actor_node(**overrides: Any) -> dict[str, Any]:
    node: dict[str, Any] = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "kl_loss_coef": 0.001,
        "kl_loss_type": "low_var_kl",
        "policy_loss": {"loss_mode": "vanilla"},
    }
    node.update(overrides)
    return node


def make_spec(cls: type[Algorithm] = Algorithm, *, name: str, description: str, needs_critic: bool = False,
              algorithm: dict[str, Any], actor: dict[str, Any], **sibling_nodes: Any) -> Algorithm:
    """Build a spec whose estimator and policy loss follow from its config nodes. The losses, the KL
    controller and the KL-in-reward step are core's public ones (the contract's defaults); whether a
    reference model is built follows from the resolved config (a KL term that reads it)."""
    return cls(
        name=name,
        adv_estimator=algorithm["adv_estimator"],
        policy_loss=actor["policy_loss"]["loss_mode"],
        needs_critic=needs_critic,
        default_config={**algorithm, "actor": actor, **sibling_nodes},
        description=description,
    )


def ppo() -> Algorithm:
    """PPO: GAE with a critic, clipped surrogate, no KL (verl's default ``use_kl_in_reward=False``)."""
    return make_spec(
        name="ppo",
        description="PPO: GAE advantages from a critic, clipped surrogate loss.",
        needs_critic=True,
        algorithm=_algorithm_node("gae"),
        actor=_actor_node(),
        critic={"cliprange_value": 0.5, "loss_agg_mode": "token-mean"},
    )


def grpo() -> Algorithm:
    """GRPO: group-normalised outcome advantages, clipped surrogate, low-variance KL loss."""
    return make_spec(
        name="grpo",
        description="GRPO: group-normalised outcome advantages, no critic, k3 KL loss to the reference.",
        algorithm=_algorithm_node("grpo"),
        actor=_actor_node(use_kl_loss=True),
    )


def dr_grpo() -> Algorithm:
    """Dr. GRPO: no std division, constant-normaliser aggregation, no KL."""
    return make_spec(
        name="dr_grpo",
        description="Dr. GRPO: group-centred advantages without std, seq-mean-token-sum-norm loss, no KL.",
        algorithm=_algorithm_node("dr_grpo", norm_adv_by_std_in_grpo=False),
        actor=_actor_node(loss_agg_mode="seq-mean-token-sum-norm"),
    )


def rloo() -> Algorithm:
    """RLOO: leave-one-out baseline, KL (k1) in the reward."""
    return make_spec(
        name="rloo",
        description="RLOO: leave-one-out group baseline, KL penalty in the reward.",
        algorithm=_algorithm_node("rloo", use_kl_in_reward=True),
        actor=_actor_node(),
    )


def reinforce_pp() -> Algorithm:
    """REINFORCE++: whitened discounted returns, k2 (mse) KL loss."""
    return make_spec(
        name="reinforce_pp",
        description="REINFORCE++: batch-whitened returns without a critic, clipped loss, k2 KL loss.",
        algorithm=_algorithm_node("reinforce_plus_plus"),
        actor=_actor_node(use_kl_loss=True, kl_loss_type="mse"),
    )


def gspo() -> Algorithm:
    """GSPO: GRPO advantages with the sequence-level ratio loss and its tiny clip ranges."""
    return make_spec(
        name="gspo",
        description="GSPO: GRPO advantages, sequence-level importance ratio, seq-mean-token-mean loss.",
        algorithm=_algorithm_node("grpo"),
        actor=_actor_node(
            clip_ratio_low=3e-4,
            clip_ratio_high=4e-4,
            loss_agg_mode="seq-mean-token-mean",
            policy_loss={"loss_mode": "gspo"},
        ),
    )
