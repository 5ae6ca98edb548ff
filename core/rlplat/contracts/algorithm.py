"""Algorithms: advantage estimators, policy losses, and the spec that ties them into the loop.

Tensor shapes: ``B`` responses, ``R`` response tokens; ``response_mask`` is 1 on tokens the policy
produced and 0 on padding and on tool/observation spans of multi-turn data.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Protocol

from rlplat.config_node import CORE_KEYS_OF_PLUGIN_NODES

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rlplat.contracts.rollout import SamplingParams
    from rlplat.protocol import DataProto


class AdvantageEstimator(Protocol):
    """``fn(token_level_rewards, response_mask, index, values=None, config=None, **extra)``.

    ``token_level_rewards`` and ``response_mask`` are [B, R]; ``index`` is a numpy array of B group ids
    (the non-tensor ``uid``: responses to the same prompt share one); ``values`` [B, R] for estimators
    with a critic; ``config`` the run's ``algorithm`` node, typed by the algorithm's schema: an
    :class:`AlgorithmConfig` (or the subclass the algorithm registers), so ``config.gamma`` works (an
    estimator that also accepts a mapping or None reads it with
    ``rlplat.read_config_node(config, AlgorithmConfig, "algorithm", strict=False)``). ``extra`` carries
    the inputs the algorithm's :meth:`Algorithm.estimator_inputs` returns (e.g. ``reward_baselines`` for
    ReMax). Returns ``(advantages, returns)``, both [B, R] float32 and 0 where ``response_mask`` is 0.
    Inputs are not modified. :mod:`rlplat.kits.advantages` has the shape checks, the grouping by ``uid`` and
    the broadcasting every estimator needs. The registered object *is* the function.
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

    All tensors [B, R]; ``log_prob`` carries gradients. ``loss_agg_mode`` is one of the modes the loss
    supports: those its registration lists (``metadata={"loss_agg_modes": [...]}``), else those of the
    plugin API version its plugin declares (API 1.0's four; ``token-sum`` from 1.1), out of
    ``rlplat.losses.LOSS_AGG_MODES``. Another raises ``ValueError``; aggregating through
    :func:`rlplat.losses.aggregate_with_settings` handles every mode. ``config`` is the ``actor.loss`` node as a
    :class:`rlplat.losses.PolicyLossConfig` whose ``global_token_count`` and ``global_sequence_count``
    attributes hold the mini-batch's totals over every data-parallel rank (set per micro-batch by
    :class:`rlplat.losses.ActorLoss`): aggregate with
    ``rlplat.losses.aggregate_with_settings(per_token, response_mask, loss_agg_mode, config)`` and the
    loss of each micro-batch is its share of the mini-batch's. The loss's own knobs are in
    ``config.policy_loss`` (a dict, checked at load against the schema its registry entry declares;
    ``rlplat.read_config_node(config.policy_loss, MyKnobs, "actor.loss.policy_loss")`` types it, leaving out
    rlplat's ``loss_mode`` when ``MyKnobs`` does not declare it).
    Returns a scalar loss and a dict of numbers (``actor/pg_clipfrac``, ``actor/ppo_kl``, ...), means
    over this micro-batch's tokens (the actor loss scales them into contributions): floats, or detached 0-dim
    tensors (the built-in losses' since plugin API 1.3: the engine reads them after its micro-batch loop, so no
    metric makes the host wait for the device). A caller that needs a Python number calls ``float()``. The
    registered object *is* the function.
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
class KLControlConfig:
    """How the coefficient of a KL penalty in the reward evolves (``algorithm.kl_ctrl``)."""

    type: str = "fixed"
    """``fixed`` keeps ``kl_coef``; ``adaptive`` steers it toward ``target_kl`` (Ziegler et al., 2019)."""
    kl_coef: float = 0.001
    """Initial (for ``fixed``: constant) coefficient of the KL penalty."""
    horizon: int = 10000
    """Adaptive controller: samples over which a proportional error of 20% changes the coefficient by 20%."""
    target_kl: float = 0.1
    """Adaptive controller: the KL per token it aims for."""


@dataclasses.dataclass
class AlgorithmConfig:
    """The ``algorithm`` node, as far as the loop, the estimators and the KL-in-reward step read it.

    An algorithm whose node has more keys registers a subclass as its entry's ``config_schema``.
    """

    name: str = "grpo"
    """The registered algorithm (kind ``algorithm``); ``--algo`` sets it."""
    adv_estimator: str = "gae"
    """Registered advantage estimator (kind ``advantage_estimator``)."""
    gamma: float = 1.0
    """Discount factor of GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE lambda (bias/variance trade-off of the advantage)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO and Pass@k divide the centred score by the group's std; False is Dr. GRPO's choice."""
    epsilon: float = 1e-6
    """Added to a group's std before dividing (GRPO, Pass@k)."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_coef * KL(actor || reference)`` from the token-level scores before estimating; the run
    then builds a reference model."""
    kl_penalty: str = "kl"
    """KL estimator used in the reward: k1/kl, k2/mse, k3/low_var_kl, abs, or a straight-through ``+`` variant."""
    kl_ctrl: KLControlConfig = dataclasses.field(default_factory=KLControlConfig)
    """Controller of the KL-in-reward coefficient."""
    rollout_correction: Optional[Dict[str, Any]] = None
    """Correction between the rollout's and the trainer's log-probs (verl's node and presets:
    ``{preset: decoupled_token_is}``, ``rollout_is``, ``rollout_is_threshold``, ``rollout_rs``,
    ``rollout_rs_threshold``, ``bypass_mode``; :class:`rlplat.losses.rollout_correction.RolloutCorrectionConfig`).
    None: no correction (the ``rollout_corr/*`` diagnostics are reported whenever the rollout returns log-probs).
    Checked when the run config is (``rlplat.config.validate_config``)."""

    # Plugin API 1.0 gave estimators the node as a mapping (``config["gamma"]``, ``config.get("gamma")``);
    # that reading keeps working, with a DeprecationWarning, until plugin API 1.3.
    def __getitem__(self, key: str) -> Any:
        self._warn_mapping_access(f"config[{key!r}]", key)
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        self._warn_mapping_access(f"config.get({key!r})", key)
        return getattr(self, key, default)

    def __contains__(self, key: str) -> bool:
        self._warn_mapping_access(f"{key!r} in config", key)
        return key in {field.name for field in dataclasses.fields(self)}

    def _warn_mapping_access(self, old: str, key: str) -> None:
        from rlplat.deprecation import warn

        warn(f"{old} on the algorithm node (a mapping in plugin API 1.0; an {type(self).__name__} since 1.1)",
             f"config.{key}", "2.0", stacklevel=3)


# The algorithm node's keys are the loop's: a plugin's own schema never has to declare them.
CORE_KEYS_OF_PLUGIN_NODES["algorithm"] = tuple(field.name for field in dataclasses.fields(AlgorithmConfig))


@functools.lru_cache(maxsize=None)
def algorithm_node_schema(schema: type | None) -> type:
    """The dataclass the ``algorithm`` node is read with, for an algorithm whose entry declares ``schema``:
    :class:`AlgorithmConfig` when it declares none; the schema itself when it extends AlgorithmConfig (as
    documented); else a dataclass that is both, the schema's keys and the loop's, whose instances are
    instances of ``schema``. A schema therefore never has to declare the keys rlplat reads (``name``,
    ``adv_estimator``, ...) and its algorithm's estimator still receives every key it declared."""
    if schema is None:
        return AlgorithmConfig
    if issubclass(schema, AlgorithmConfig):
        return schema

    def __post_init__(self: Any) -> None:
        base_check = getattr(AlgorithmConfig, "__post_init__", None)
        if base_check is not None:
            base_check(self)
        if hasattr(schema, "__post_init__"):
            schema.__post_init__(self)

    def __reduce__(self: Any) -> tuple[Any, ...]:
        # pickled as (its plugin's schema, its values): the combined class is made again where it is loaded
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return rebuild_algorithm_node, (schema, values)

    try:
        return dataclasses.make_dataclass(
            schema.__name__, [], bases=(schema, AlgorithmConfig),
            namespace={"__post_init__": __post_init__, "__reduce__": __reduce__, "__doc__": schema.__doc__,
                       "__module__": schema.__module__})
    except TypeError as error:
        raise TypeError(f"the algorithm schema {schema.__qualname__} cannot be combined with AlgorithmConfig "
                        f"({error}); give each of its fields a default, or extend AlgorithmConfig") from None


def rebuild_algorithm_node(schema: type, values: Mapping[str, Any]) -> Any:
    """An ``algorithm`` node of :func:`algorithm_node_schema` ``(schema)`` from its values (unpickling)."""
    return algorithm_node_schema(schema)(**values)


@dataclasses.dataclass
class Algorithm:
    """What an algorithm is, for the driver loop. The registered factory takes no arguments and returns
    one (``register("my_algo", "my_pkg.specs:my_algo")``); a few lines are enough::

        def my_algo() -> Algorithm:
            return Algorithm(name="my_algo", adv_estimator="my_estimator", policy_loss="my_loss")

    ``adv_estimator`` and ``policy_loss`` name registry entries of kinds ``advantage_estimator`` and
    ``policy_loss``. ``needs_critic`` makes the loop build a critic and compute ``values``.

    **Reference model.** The loop builds one when a KL term reads it: ``actor.loss.use_kl_loss`` or
    ``algorithm.use_kl_in_reward`` in the resolved config. ``needs_reference=True`` builds it always.

    **Defaults** (:meth:`default_nodes`). ``default_config`` is laid out under the run config before the
    user's file and overrides: its ``actor`` key goes to ``actor.loss``, ``critic`` to ``critic.loss``,
    ``reward`` to ``reward.manager`` (its ``manager`` key) and ``reward.config`` (the rest), and every
    other key to the ``algorithm`` node, with ``name`` and ``adv_estimator`` from the spec; the policy
    loss ``policy_loss`` becomes ``actor.loss.policy_loss.loss_mode``.

    **Losses.** ``actor_loss`` and ``critic_loss`` build the per-micro-batch
    :class:`~rlplat.contracts.engine.LossFunction` the workers hand to ``TrainingEngine.train_batch``:
    each is a callable ``(config) -> LossFunction`` (or its ``"module:attribute"`` path) taking the
    ``actor.loss`` / ``critic.loss`` node. Its ``config_schema`` attribute (a dataclass) is the schema
    that node is checked against when the config loads. The defaults are the public
    :class:`rlplat.losses.ActorLoss` (the registered policy loss, plus the KL loss and the entropy
    bonus) and :class:`rlplat.losses.CriticLoss` (the clipped value loss).

    **The algorithm node** is checked against the ``config_schema`` of the algorithm's registry entry
    (default :class:`AlgorithmConfig`; a schema that does not extend it is read together with it,
    :func:`algorithm_node_schema`); the trainer sets :attr:`config` to it, typed, before the loop.

    Subclasses override the hooks below to change a step of the loop; the defaults leave it as it is.
    """

    name: str
    adv_estimator: str
    policy_loss: str = "vanilla"
    needs_critic: bool = False
    needs_reference: bool = False
    reads_old_log_probs: bool = False
    """True when a hook of this algorithm (``estimator_inputs``, ``after_generate``...) reads
    ``old_log_probs`` before the update; the loop then always runs their forward pass first
    (``actor.recompute_old_log_prob``)."""
    default_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    description: str = ""
    actor_loss: Any = "rlplat.losses:ActorLoss"
    critic_loss: Any = "rlplat.losses:CriticLoss"
    kl_controller: Any = "rlplat.losses.kl:build_kl_controller"
    """``(kl_ctrl_node) -> controller`` (or its path): an object with ``value`` (the coefficient) and
    ``update(current_kl, n_steps)``, used when ``algorithm.use_kl_in_reward`` is true."""
    reward_kl: Any = "rlplat.losses.kl:apply_kl_penalty"
    """``(token_level_scores, old_log_probs, ref_log_prob, response_mask, controller, algorithm_node)
    -> (token_level_rewards, metrics)`` (or its path): the KL-in-reward step."""
    config: Optional[Any] = None
    """The run's resolved ``algorithm`` node (an instance of the entry's schema), set by the trainer."""

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

    def loss_schema(self, which: str) -> Any:
        """The dataclass the ``actor.loss`` / ``critic.loss`` node is checked against (the loss factory's
        ``config_schema``), or None when the factory declares none or there is no factory (an algorithm
        written for plugin API 1.0 set ``critic_loss=None`` when it needed no critic)."""
        if getattr(self, f"{which}_loss") is None:
            return None
        return getattr(self.resolve(f"{which}_loss"), "config_schema", None)

    def default_nodes(self) -> dict[str, Any]:
        """``default_config`` laid out as run-config nodes (see the class docstring)."""
        defaults = dict(self.default_config)
        actor = dict(defaults.pop("actor", None) or {})
        actor["policy_loss"] = {"loss_mode": self.policy_loss, **dict(actor.get("policy_loss") or {})}
        nodes: dict[str, Any] = {"actor": {"loss": actor}}
        if defaults.get("critic") is not None:
            nodes["critic"] = {"loss": dict(defaults.pop("critic"))}
        defaults.pop("critic", None)
        if defaults.get("reward") is not None:
            reward = dict(defaults.pop("reward"))
            nodes["reward"] = {"config": reward}
            if "manager" in reward:
                nodes["reward"]["manager"] = reward.pop("manager")
        defaults.pop("reward", None)
        nodes["algorithm"] = {**defaults, "name": self.name, "adv_estimator": self.adv_estimator}
        return nodes

    def uses_reference(self, actor_loss: Any, algorithm_node: Any) -> bool:
        """Whether the run needs reference log-probs: ``needs_reference``, or a KL term in the resolved
        ``actor.loss`` (``use_kl_loss``) or ``algorithm`` node (``use_kl_in_reward``) reads them."""
        def flag(node: Any, key: str) -> bool:
            value = node.get(key, False) if isinstance(node, Mapping) else getattr(node, key, False)
            return bool(value)

        return self.needs_reference or flag(actor_loss or {}, "use_kl_loss") or flag(algorithm_node or {}, "use_kl_in_reward")

    # -- loop hooks ----------------------------------------------------------------------------------

    def after_generate(self, batch: "DataProto", generate: GenerateFunction, sampling: "SamplingParams") -> "DataProto":
        """Called with the freshly generated batch; may add rows or columns using ``generate``
        (ReMax adds a greedy baseline). Returns the batch the loop continues with."""
        return batch

    def filter_batch(self, batch: "DataProto") -> "DataProto":
        """Called after rewards; may drop rows (DAPO drops groups whose scores are all equal).
        The loop samples again while the filtered batch is smaller than wanted, within a bound."""
        return batch

    def make_accumulator(self, train_batch_size: int) -> Any:
        """An object gathering filtered batches until a step's batch is full, or None (the default: the
        first filtered batch is the step's batch). Its ``add(filtered_batch)`` returns None while
        groups are missing and the full batch when ``train_batch_size`` groups are in (DAPO)."""
        return None

    def estimator_inputs(self, batch: "DataProto") -> dict[str, Any]:
        """Extra keyword inputs of the advantage estimator, taken from the batch before advantages are
        computed (ReMax returns ``{"reward_baselines": ...}``). Default: none."""
        return {}
