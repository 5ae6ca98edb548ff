"""rlplat's own worker roles (kind ``role``), registered by rlplat through ``register_roles``.

``actor``
    :class:`~rlplat.workers.actor_rollout_ref.ActorRolloutRefWorker` with the policy's engine, the
    reference model when a KL term reads it, and the rollout unless the ``rollout`` role is separate
    (HybridFlow's colocated layout). It anchors the colocated processes, so it cannot move.
``rollout``
    The rollout in a resource pool of its own (``roles.rollout.placement=separate``): an
    ``ActorRolloutRefWorker`` with the rollout role only, fed the actor's weights through the object
    store after every update. Colocated (the default), it lives inside the actor's worker and is not a
    group of its own.
``critic``
    :class:`~rlplat.workers.critic.CriticWorker`, when the algorithm needs one or ``critic.enable``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from rlplat.config import engine_node, rollout_node, sampling_node, uses_critic
from rlplat.contracts.role import Role, RoleConfig, RunContext
from rlplat.losses.rollout_correction import actor_loss_node

if TYPE_CHECKING:  # the controller imports torch: validation builds these roles to ask enabled() and settings()
    from rlplat.controller.host import WorkerSpec


def rollout_separate(run: RunContext) -> bool:
    """Whether the run's rollout has a resource pool of its own (``roles.rollout.placement=separate``, or
    ``trainer.mode=separate_async``)."""
    return RolloutRole().settings(run, "rollout").placement == "separate"


def loss_node(run: RunContext, role: str) -> dict[str, Any]:
    return OmegaConf.to_container(run.config[role].loss, resolve=True)


def actor_loss_config(run: RunContext) -> dict[str, Any]:
    """The ``actor.loss`` node the actor's loss is built from: in bypass mode it carries
    ``algorithm.rollout_correction``, which the loss applies to each micro-batch."""
    correction = OmegaConf.select(run.config, "algorithm.rollout_correction", default=None)
    correction = OmegaConf.to_container(correction, resolve=True) if correction is not None else None
    return actor_loss_node(loss_node(run, "actor"), correction)


def actor_rollout_config(run: RunContext, roles: list[str]) -> dict[str, Any]:
    """The ``ActorRolloutRefWorker`` config of this run, for the given roles."""
    from rlplat.config.modes import partial_mode

    config = run.config
    return {
        "roles": roles, "engine": config.actor.engine, "engine_config": engine_node(config, "actor", run.total_steps),
        "rollout": config.rollout.name, "algorithm": run.algorithm.name, "sampling": sampling_node(config),
        "rollout_config": rollout_node(config), "actor": actor_loss_config(run),
        "free_rollout_between_phases": config.rollout.free_between_phases,
        "share_weights": config.rollout.share_weights,
        "weight_checks": bool(config.trainer.sentinel.enabled and config.trainer.sentinel.weight_checks),
        **driver_settings(config), "tokenizer_path": config.model.tokenizer_path or config.model.path,
        "prompt_length": config.data.max_prompt_length,
        "template_kwargs": OmegaConf.to_container(config.data.apply_chat_template_kwargs, resolve=True) or {},
        "reward": reward_node(config),
        "partial_rollout": partial_mode(config.trainer) if config.trainer.mode == "separate_async" else "off",
    }


def driver_settings(config: Any) -> dict[str, Any]:
    """The worker-config keys of the run's rollout driver: its name and the node its entry names."""
    from rlplat import registry
    from rlplat.config import rollout_driver

    name = rollout_driver(config)
    if name is None:
        return {"rollout_driver": None, "driver_node": {}}
    node_path = registry.entry("rollout_driver", name).metadata.get("config_node")
    node = OmegaConf.select(config, node_path, default=None) if node_path else None
    return {"rollout_driver": name, "driver_node": OmegaConf.to_container(node, resolve=True) if node is not None else {}}


def reward_node(config: Any) -> dict[str, Any]:
    """The ``reward`` node for the workers, its custom function's file made absolute: a worker process
    need not share the driver's working directory."""
    node = OmegaConf.to_container(config.reward, resolve=True)
    custom = node.get("custom_function") or {}
    if custom.get("path"):
        custom["path"] = str(Path(custom["path"]).expanduser().absolute())
    return node


class ActorRole(Role):
    """The policy: its training engine, the reference model and (colocated) the rollout."""

    movable = False

    def enabled(self, run: RunContext) -> bool:
        return True

    def worker(self, run: RunContext) -> WorkerSpec:
        from rlplat.controller.host import WorkerSpec
        from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

        roles = ["actor"]
        if not rollout_separate(run):
            roles.append("rollout")
        if run.algorithm.uses_reference(loss_node(run, "actor"), OmegaConf.to_container(run.config.algorithm, resolve=True)):
            roles.append("ref")
        return WorkerSpec(ActorRolloutRefWorker, actor_rollout_config(run, roles))

    def save_checkpoint(self, group: Any, path: str) -> None:
        group.save_checkpoint(path)

    def load_checkpoint(self, group: Any, path: str) -> None:
        group.load_checkpoint(path)


class RolloutRole(Role):
    """The rollout in its own pool (``roles.rollout.placement=separate``); otherwise part of the actor."""

    def enabled(self, run: RunContext) -> bool:
        return rollout_separate(run)

    def settings(self, run: RunContext, name: str) -> RoleConfig:
        settings = super().settings(run, name)
        if run.config.trainer.get("mode") == "separate_async" and settings.placement != "separate":
            settings = dataclasses.replace(settings, placement="separate")
        return settings

    def concurrent_calls(self, run: RunContext) -> int:
        """With ``trainer.partial_rollout``: every generation in flight, a weight load and an abort at once."""
        from rlplat.config.modes import AsyncSettings, partial_mode

        if partial_mode(run.config.trainer) == "off":
            return 1
        return AsyncSettings.of(run.config.trainer).ahead + 3

    def worker(self, run: RunContext) -> WorkerSpec:
        from rlplat.controller.host import WorkerSpec
        from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

        return WorkerSpec(ActorRolloutRefWorker, actor_rollout_config(run, ["rollout"]))


class CriticRole(Role):
    """The value model, trained with the algorithm's critic loss."""

    def enabled(self, run: RunContext) -> bool:
        return uses_critic(run.config, run.algorithm)

    def worker(self, run: RunContext) -> WorkerSpec:
        from rlplat.controller.host import WorkerSpec
        from rlplat.workers.critic import CriticWorker

        config = run.config
        return WorkerSpec(CriticWorker, {
            "engine": config.critic.engine, "engine_config": engine_node(config, "critic", run.total_steps),
            "algorithm": run.algorithm.name, "critic": loss_node(run, "critic"),
        })

    def save_checkpoint(self, group: Any, path: str) -> None:
        group.save_checkpoint(path)

    def load_checkpoint(self, group: Any, path: str) -> None:
        group.load_checkpoint(path)


def actor() -> Role:
    return ActorRole()


def rollout() -> Role:
    return RolloutRole()


def critic() -> Role:
    return CriticRole()
