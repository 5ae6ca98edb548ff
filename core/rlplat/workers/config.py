"""Configs of the role workers: which plugins to build, with which nodes."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlplat.contracts.rollout import SamplingParams


@dataclasses.dataclass
class ActorRolloutRefConfig:
    """What :class:`~rlplat.workers.actor_rollout_ref.ActorRolloutRefWorker` builds in its process."""

    roles: tuple[str, ...] = ("actor", "rollout", "ref")
    """Which of ``actor``, ``rollout``, ``ref`` live in this worker (colocated); the others are absent."""

    engine: str = "fsdp2"
    """Registered training engine (kind ``engine``) of the actor and the reference."""

    engine_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's own config node (model, optimizer, micro-batches)."""

    reference_engine_config: Mapping[str, Any] | None = None
    """The reference model's engine node; None reuses ``engine_config`` (same initial weights)."""

    rollout: str = "hf"
    """Registered rollout engine (kind ``rollout``)."""

    rollout_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The rollout's own config node."""

    algorithm: str = "grpo"
    """Registered algorithm whose actor loss ``update_actor`` uses."""

    actor: Mapping[str, Any] | None = None
    """The ``actor.loss`` node given to the algorithm's actor loss (None: the algorithm's default)."""

    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Default :class:`SamplingParams` fields; a batch's ``meta_info`` overrides them per call."""

    weight_bucket_bytes: int = 256 << 20
    """Size bound of one bucket of weights moved from the engine to the rollout."""

    share_weights: bool = True
    """Let the colocated rollout read the engine's parameters in place when both allow it (no copy per
    sync, one copy of the model); else weights are copied bucket by bucket."""

    free_rollout_between_phases: bool = False
    """Put the rollout to sleep after generating and wake it for the next weight sync (frees memory)."""

    rollout_driver: str | None = None
    """The run's rollout driver (kind ``rollout_driver``, :func:`rlplat.config.rollout_driver`), or None:
    batches go through the rollout's ``generate``."""

    driver_node: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The run-config node the driver's entry names (``metadata["config_node"]``, e.g. ``agent``)."""

    tokenizer_path: str | None = None
    """Where the tokenizer (and its chat template) is: ``model.path``; rollout drivers need it."""

    prompt_length: int = 512
    """``data.max_prompt_length``: the width of the data loader's prompts."""

    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """``data.apply_chat_template_kwargs``: what rollout drivers render chat templates with."""

    reward: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The run's ``reward`` node (``manager``, ``scorer``, ``custom_function``, ``config``): a rollout driver
    asks the manager built from it for its :meth:`~rlplat.contracts.reward.RewardManager.trajectory_scorer`."""

    partial_rollout: str = "off"
    """``trainer.partial_rollout`` of a rollout in a pool of its own: ``keep`` or ``recompute`` makes a weight
    load land during the generations in flight (each a set of ``generate_tokens`` calls), which go on with the
    new weights in that mode; ``off`` (and always for a colocated rollout): loads come between generations."""

    weight_checks: bool = True
    """``trainer.sentinel.weight_checks`` (with the sentinel on): after each weight sync, compare the rollout's
    weights with what was sent (:mod:`rlplat.kits.weights`) and count the policy version as applied only
    when they match."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.roles) - {"actor", "rollout", "ref"})
        if unknown or not self.roles:
            raise ValueError(f"roles must be a non-empty subset of actor, rollout, ref; got {list(self.roles)}")
        SamplingParams(**self.sampling)


@dataclasses.dataclass
class CriticConfig:
    """What :class:`~rlplat.workers.critic.CriticWorker` builds: a value-model engine and its loss."""

    engine: str = "fsdp2"
    engine_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The engine node; the worker asks the engine for a value model (``value_model: true``)."""

    algorithm: str = "ppo"
    """Registered algorithm whose critic loss ``update_critic`` uses."""

    critic: Mapping[str, Any] | None = None
    """The ``critic.loss`` node given to the algorithm's critic loss (None: the algorithm's default)."""
