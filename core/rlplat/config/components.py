"""What each component of a run receives from the run config, and the plugin-owned nodes checked when
the config loads (part of :mod:`rlplat.config`, which re-exports every name here).

* :func:`engine_node`, :func:`rollout_node`, :func:`sampling_node`: the node a training engine's,
  a rollout's factory and a generation receive, built from the run config (core's keys first, then
  the plugin's own node); :data:`ENGINE_BUILD_SOURCES` and friends name the run-config key each core
  key comes from, for messages.
* :func:`plugin_nodes`: every node of the run config whose schema a plugin declares, as a
  :class:`PluginNode` (its key, owner, schema and values) that :meth:`PluginNode.check` reads with the
  reader the plugin uses in its worker.

Nothing here imports torch: the loss factories' schemas of core's own losses are named in
:data:`BUILTIN_LOSS_SCHEMAS` rather than read from the classes, whose modules need torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlplat.config_node import ConfigError, did_you_mean, read_config_node, resolve_schema
from rlplat.config.moe import moe_build_keys
from rlplat.losses.config import LOSS_SET_KEYS

__all__ = ["ENGINE_BUILD_SOURCES", "ROLLOUT_BUILD_SOURCES", "SAMPLING_SOURCES", "BUILTIN_LOSS_SCHEMAS", "PluginNode",
           "optimizer_build", "engine_node", "rollout_node", "sampling_node", "total_training_steps", "uses_critic", "entry_schema",
           "loss_schema", "plugin_nodes", "owned_nodes"]


# -- the nodes each component receives -----------------------------------------------------------------

#: EngineBuildConfig key -> (run-config key it comes from; ``{role}`` is actor or critic).
ENGINE_BUILD_SOURCES = {
    "model_path": "model.path", "seed": "trainer.seed", "lr": "{role}.optim.lr",
    "weight_decay": "{role}.optim.weight_decay", "betas": "{role}.optim.betas",
    "lr_warmup_steps": "{role}.optim.warmup_steps", "lr_scheduler_type": "{role}.optim.lr_scheduler_type",
    "min_lr_ratio": "{role}.optim.min_lr_ratio", "grad_clip": "{role}.optim.grad_clip",
    "total_training_steps": "trainer.total_training_steps (in optimizer steps)", "ppo_mini_batch_size": "{role}.ppo_mini_batch_size",
    "ppo_epochs": "{role}.ppo_epochs", "micro_batch_size_per_gpu": "{role}.micro_batch_size_per_gpu",
    "use_dynamic_bsz": "{role}.use_dynamic_bsz", "max_token_len_per_gpu": "{role}.max_token_len_per_gpu",
    "value_model": "the role (true for the critic)", "reward_model": "the role (true for the reward model's engine)",
    "lora": "actor.lora (when its rank is above 0)", "moe": "actor.moe (when a setting differs from its default)",
}
ROLLOUT_BUILD_SOURCES = {"model_path": "model.path", "load_weights": "the trainer (false: the engine syncs its weights in)",
                         "record_routes": "actor.moe.router_replay (true for r3)"}


def optimizer_build(config: DictConfig, optim: DictConfig) -> dict[str, Any]:
    """The :class:`~rlplat.contracts.engine.EngineBuildConfig` keys of the model, the seed and the optimizer
    (``optim`` is a role's ``optim`` node), as ``rlplat run`` and ``rlplat sft`` both give them."""
    return {
        "model_path": config.model.path, "seed": config.trainer.seed, "lr": optim.lr,
        "weight_decay": optim.weight_decay, "betas": list(optim.betas), "lr_warmup_steps": optim.warmup_steps,
        "lr_scheduler_type": optim.lr_scheduler_type, "min_lr_ratio": optim.min_lr_ratio,
        "grad_clip": optim.grad_clip,
    }


def engine_node(config: DictConfig, role: str, total_steps: int) -> dict[str, Any]:
    """What the engine factory of ``role`` (``actor`` or ``critic``) receives: the
    :class:`~rlplat.contracts.engine.EngineBuildConfig` keys from the run config, then ``<role>.engine_config``."""
    node = config[role]
    build = {
        **optimizer_build(config, node.optim),
        "total_training_steps": total_steps * (config.data.train_batch_size // node.ppo_mini_batch_size) * node.ppo_epochs,
        "ppo_mini_batch_size": node.ppo_mini_batch_size * config.rollout.n, "ppo_epochs": node.ppo_epochs,
        "micro_batch_size_per_gpu": node.micro_batch_size_per_gpu, "use_dynamic_bsz": node.use_dynamic_bsz,
        "max_token_len_per_gpu": node.max_token_len_per_gpu, "value_model": role == "critic",
    }
    if role == "actor" and OmegaConf.to_container(node.lora, resolve=True).get("rank"):
        build["lora"] = OmegaConf.to_container(node.lora, resolve=True)
    if role == "actor":
        build.update(moe_build_keys(config)[0])
    return {**build, **OmegaConf.to_container(node.engine_config, resolve=True)}


def rollout_node(config: DictConfig) -> dict[str, Any]:
    """What the rollout factory receives: the :class:`~rlplat.contracts.rollout.RolloutBuildConfig` keys,
    then ``rollout.config``."""
    return {"model_path": config.model.path, "load_weights": False, **moe_build_keys(config)[1],
            **OmegaConf.to_container(config.rollout.config, resolve=True)}


#: SamplingParams field -> the run-config key that sets it.
SAMPLING_SOURCES = {"n": "rollout.n", "temperature": "rollout.temperature", "top_p": "rollout.top_p",
                    "top_k": "rollout.top_k", "max_new_tokens": "rollout.response_length"}


def sampling_node(config: DictConfig) -> dict[str, Any]:
    """The default :class:`~rlplat.contracts.rollout.SamplingParams` fields of a run's generation."""
    rollout = config.rollout
    return {"n": rollout.n, "temperature": rollout.temperature, "top_p": rollout.top_p,
            "top_k": rollout.top_k, "max_new_tokens": rollout.response_length}


def total_training_steps(config: DictConfig, rows_per_epoch: int) -> int:
    """``trainer.total_training_steps``, or ``trainer.total_epochs`` passes over ``rows_per_epoch`` prompts."""
    if config.trainer.total_training_steps:
        return int(config.trainer.total_training_steps)
    per_epoch = rows_per_epoch / config.data.train_batch_size
    return int(per_epoch if config.data.drop_last else math.ceil(per_epoch)) * config.trainer.total_epochs


def uses_critic(config: DictConfig, algorithm: Any) -> bool:
    return algorithm.needs_critic if config.critic.enable is None else bool(config.critic.enable)


# -- plugin-owned nodes ---------------------------------------------------------------------------------

@dataclasses.dataclass
class PluginNode:
    """A node of the run config whose schema a plugin declares: its dotted ``key``, who owns it, the
    schema (None: the owner declares none, so only core's keys are known), what the owner receives
    (``values``) and which of its keys core fills in (the user may not set them in the node; a schema need
    not declare them: an engine's schema that does not extend ``EngineBuildConfig`` still validates)."""

    key: str
    owner: str
    schema: Any
    values: dict[str, Any]
    core_keys: dict[str, str] = dataclasses.field(default_factory=dict)
    user_keys: tuple[str, ...] = ()

    def check(self) -> Any:
        """The node read with its schema (the plugin's own reader); :class:`ConfigError` if it does not fit."""
        for key in self.user_keys:
            if key in self.core_keys:
                raise ConfigError(f"'{self.key}.{key}' is set from {self.core_keys[key]}: set that instead [{self.owner}].")
        if self.schema is None:
            return self.values
        # the keys core fills in reach the plugin whether or not its schema declares them; the schema checks the rest
        declared = {field.name for field in dataclasses.fields(self.schema)}
        values = {key: value for key, value in self.values.items() if key in declared or key not in self.core_keys}
        try:
            return read_config_node(values, self.schema, self.key)
        except ConfigError as error:
            raise ConfigError(f"{error} [{self.owner}]") from None


def entry_schema(kind: str, name: str, key: str) -> tuple[Any, str]:
    """``(schema dataclass or None, owner description)`` of a registry entry, checked to be usable."""
    from rlplat import registry
    from rlplat.registry import RegistryError

    try:
        entry = registry.entry(kind, name)
    except RegistryError as error:
        raise ConfigError(f"{key}: {error}") from None
    if entry.status != "ok":
        raise ConfigError(f"{key}: {kind} {name!r} is {entry.status}.")
    owner = f"{kind} {name!r} from {entry.origin}"
    try:
        return resolve_schema(entry.config_schema), owner
    except Exception as error:
        raise ConfigError(f"{key}: the config schema of {owner} cannot be loaded: {error}") from None


#: The ``config_schema`` of core's own loss factories, by the path an algorithm names them with (the
#: defaults of :class:`~rlplat.contracts.algorithm.Algorithm`): read from here, the config is checked
#: without importing the losses' module, which needs torch. A test keeps it equal to the classes' attribute.
BUILTIN_LOSS_SCHEMAS = {
    "rlplat.losses:ActorLoss": "rlplat.losses.config:PolicyLossConfig",
    "rlplat.losses:CriticLoss": "rlplat.losses.config:ValueLossConfig",
}


def loss_schema(algorithm: Any, role: str) -> Any:
    """The schema of ``role``'s loss node (``actor`` or ``critic``): :meth:`Algorithm.loss_schema
    <rlplat.contracts.algorithm.Algorithm.loss_schema>`, taken from :data:`BUILTIN_LOSS_SCHEMAS` when
    the algorithm names one of core's losses by its path and does not override that method."""
    from rlplat.contracts.algorithm import Algorithm

    factory = getattr(algorithm, f"{role}_loss", None)
    if (isinstance(factory, str) and factory in BUILTIN_LOSS_SCHEMAS
            and getattr(type(algorithm), "loss_schema", None) is Algorithm.loss_schema):
        return resolve_schema(BUILTIN_LOSS_SCHEMAS[factory])
    return algorithm.loss_schema(role)


def check_aggregation_supported(config: DictConfig, loss_mode: str, owner: str) -> None:
    """``actor.loss.loss_agg_mode`` is one the policy loss declares it supports (by its registration's
    ``loss_agg_modes`` or its plugin's API range, :func:`rlplat.losses.config.declared_loss_agg_modes`); a loss
    that declares neither is not checked."""
    from rlplat import registry
    from rlplat.losses.config import PolicyLossConfig, declared_loss_agg_modes

    entry = registry.entry("policy_loss", loss_mode)
    supported = declared_loss_agg_modes(entry, registry.plugin(entry.plugin).api)
    mode = OmegaConf.select(config, "actor.loss.loss_agg_mode", default=PolicyLossConfig.loss_agg_mode)
    if supported is not None and mode not in supported:
        raise ConfigError(f"actor.loss.loss_agg_mode={mode}: the policy loss {owner} supports only "
                          f"{', '.join(supported)}; choose one of them, or another policy loss.")


def plugin_nodes(config: DictConfig, algorithm: Any, total_steps: int) -> list[PluginNode]:
    """Every plugin-owned node of ``config`` with its schema and owner (see the module docstring)."""
    from rlplat.contracts.algorithm import algorithm_node_schema
    from rlplat.contracts.engine import EngineBuildConfig
    from rlplat.contracts.role import RoleConfig

    def user_keys(node: Any) -> tuple[str, ...]:
        return tuple(OmegaConf.to_container(node, resolve=True)) if node is not None else ()

    nodes = []
    for role in ("actor", "critic"):
        schema, owner = entry_schema("engine", config[role].engine, f"{role}.engine")
        sources = {key: source.format(role=role) for key, source in ENGINE_BUILD_SOURCES.items()}
        nodes.append(PluginNode(f"{role}.engine_config", owner, schema, engine_node(config, role, total_steps),
                                {k: sources[k] for k in (f.name for f in dataclasses.fields(EngineBuildConfig))},
                                user_keys(config[role].engine_config)))
    schema, owner = entry_schema("rollout", config.rollout.name, "rollout.name")
    nodes.append(PluginNode("rollout.config", owner, schema, rollout_node(config), dict(ROLLOUT_BUILD_SOURCES),
                            user_keys(config.rollout.config)))
    schema, owner = entry_schema("reward_manager", config.reward.manager, "reward.manager")
    nodes.append(PluginNode("reward.config", owner, schema, OmegaConf.to_container(config.reward.config, resolve=True)))
    for role in ("actor", "critic"):
        loss_node = OmegaConf.to_container(config[role].loss, resolve=True)
        for engine_set in LOSS_SET_KEYS:
            if loss_node.get(engine_set) is not None:
                raise ConfigError(f"'{role}.loss.{engine_set}' is set by rlplat (per micro-batch, or from "
                                  "algorithm.rollout_correction); remove it.")
        if getattr(algorithm, f"{role}_loss", None) is None and (role == "actor" or uses_critic(config, algorithm)):
            raise ConfigError(f"algorithm {algorithm.name!r} defines no {role} loss ({role}_loss=None), so it cannot "
                              f"train {'an actor' if role == 'actor' else 'a critic: leave critic.enable unset'}.")
        try:
            schema = loss_schema(algorithm, role)
        except Exception as error:
            raise ConfigError(f"{role}.loss: the {role} loss of algorithm {algorithm.name!r} cannot be loaded: {error}") from None
        nodes.append(PluginNode(f"{role}.loss", f"the {role} loss of algorithm {algorithm.name!r}", schema, loss_node))
    policy_node = dict(OmegaConf.to_container(config.actor.loss, resolve=True).get("policy_loss") or {})
    loss_mode = policy_node.get("loss_mode", algorithm.policy_loss)
    schema, owner = entry_schema("policy_loss", loss_mode, "actor.loss.policy_loss.loss_mode")
    check_aggregation_supported(config, loss_mode, owner)
    nodes.append(PluginNode("actor.loss.policy_loss", owner, schema, {"loss_mode": loss_mode, **policy_node}))
    for index, term in enumerate(OmegaConf.to_container(config.actor.loss, resolve=True).get("terms") or []):
        if isinstance(term, dict) and term.get("loss_mode"):  # its shape is PolicyLossConfig's check
            where = f"actor.loss.terms[{index}]"
            schema, owner = entry_schema("policy_loss", term["loss_mode"], f"{where}.loss_mode")
            check_aggregation_supported(config, term["loss_mode"], owner)
            nodes.append(PluginNode(where, owner, schema, {key: value for key, value in term.items() if key != "coef"}))
    schema, owner = entry_schema("algorithm", config.algorithm.name, "algorithm.name")
    try:
        schema = algorithm_node_schema(schema)
    except TypeError as error:
        raise ConfigError(f"algorithm.name: {owner}: {error}") from None
    nodes.append(PluginNode("algorithm", owner, schema, OmegaConf.to_container(config.algorithm, resolve=True)))
    from rlplat import registry

    for name, node in OmegaConf.to_container(config.roles, resolve=True).items():
        if name not in registry.names("role"):
            raise ConfigError(f"roles.{name}: unknown role {name!r}; the roles are {', '.join(registry.names('role'))}."
                              f"{did_you_mean(name, registry.names('role'), 'roles.')}")
        schema, owner = entry_schema("role", name, f"roles.{name}")
        nodes.append(PluginNode(f"roles.{name}", owner, schema or RoleConfig, node or {}))
    return nodes + owned_nodes(config)


def owned_nodes(config: DictConfig) -> list[PluginNode]:
    """The nodes plugins own (kind ``config_node``: ``agent``, ``reward.model``, ...) and the plugin-owned
    nodes inside each, from the function its entry's ``metadata["nodes"]`` names."""
    from rlplat import registry
    from rlplat.registry import resolve_dotted_path

    nodes = []
    for entry in sorted(registry.entries("config_node"), key=lambda entry: entry.name):
        values = OmegaConf.select(config, entry.name, default=None)
        values = OmegaConf.to_container(values, resolve=True) if values is not None else {}
        nodes.append(PluginNode(entry.name, entry.origin, resolve_schema(entry.config_schema), values))
        inner = entry.metadata.get("nodes")
        if inner is not None:
            try:
                function = resolve_dotted_path(inner) if isinstance(inner, str) else inner
            except Exception as error:
                raise ConfigError(f"{entry.name}: the nodes of {entry.origin} could not be loaded: {error}") from None
            nodes += function(config)
    return nodes
