"""The pieces every rule of the verl key table is made of: what a rule reads (:class:`Item`, the whole
command line as a :class:`Context`), what it answers (:class:`Outcome`), the builders the table's modules
call (:func:`rename`, :func:`ignore`, :func:`refuse`, :func:`special`, ...) and the reasons they share.

Each builder appends its rule to :data:`RULES_BUILT`; :mod:`rlplat_verl.table` imports the table's
modules in order and freezes the list. Imports only the standard library and omegaconf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omegaconf import OmegaConf

# Top-level nodes only verl has: a key under them needs a rule, or it is refused.
VERL_ONLY_ROOTS = (
    "actor_rollout_ref", "reward_model", "custom_reward_function", "reward_manager", "sandbox_fusion",
    "global_profiler", "ray_kwargs", "ray_init", "transfer_queue", "skip", "hydra",
)
# rlplat's defaults that some conversions read when the command line does not set the key; a test checks
# them against rlplat's config.
RLPLAT_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "rollout.temperature": 1.0,
    "actor.ppo_mini_batch_size": 8, "actor.ppo_epochs": 1, "actor.use_dynamic_bsz": False,
    "actor.max_token_len_per_gpu": 16384, "critic.ppo_mini_batch_size": 8, "critic.ppo_epochs": 1,
    "critic.use_dynamic_bsz": False, "critic.max_token_len_per_gpu": 16384, "cluster.nnodes": 1,
    "cluster.devices_per_node": 1, "algorithm.name": "grpo",
}
# verl's advantage estimators whose algorithm rlplat registers under another name, or which need that
# algorithm's hooks (remax's greedy baseline) or critic (gae); the others run under the default, grpo.
ESTIMATOR_ALGORITHMS = {"gae": "ppo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp", "remax": "remax"}
CRITIC_ALGORITHMS = ("ppo",)
ROLLOUTS = ("hf", "vllm", "sglang")
VERBATIM = object()  # a setting whose value is the argument's text as the user wrote it
# verl's agent_name values that name an rlplat agent loop of another name (the agents' own reading of them agrees;
# a test checks it)
VERL_LOOP_NAMES = {"single_turn_agent": "single_turn", "tool_agent": "tool"}


# -- the pieces a rule works with ---------------------------------------------------------------------


@dataclasses.dataclass
class Item:
    """One ``key=value`` of the command line (``source="overrides"``) or a leaf of the YAML file
    (``source="file"``); ``raw`` is the text after ``=`` (None for the file)."""

    key: str
    value: Any
    raw: str | None
    source: str
    prefix: str = ""
    """Hydra's ``+`` or ``++`` the argument had before its key."""


@dataclasses.dataclass
class Outcome:
    """What a rule made of an item: rlplat settings (key, value or VERBATIM), a note, or a refusal."""

    settings: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    note: str | None = None
    refusal: str | None = None
    translated: bool = True


@dataclasses.dataclass(frozen=True)
class Target:
    """An rlplat key a rule may write; ``rollout`` names the rollout whose ``rollout.config`` holds it."""

    key: str
    rollout: str | None = None

    def __str__(self) -> str:
        return f"`{self.key}` ({self.rollout})" if self.rollout else f"`{self.key}`"


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one verl key (or, ending in ``.*``, every key below a node) becomes rlplat's."""

    key: str
    targets: tuple[Target, ...]
    summary: str
    handle: Callable[[Item, "Context"], Outcome]
    verl_only: bool = True
    """False for a key rlplat has too (its rule converts only verl's spellings of the value)."""


class Context:
    """Everything given, for rules that depend on other keys: command-line values win over the file's,
    and ``--algo`` / ``--rollout`` sit between them, as in ``load_config``."""

    def __init__(self, items: Sequence[Item], algo: str | None, rollout: str | None) -> None:
        self.file = {item.key: item.value for item in items if item.source == "file"}
        self.overrides = {item.key: item.value for item in items if item.source == "overrides"}
        self.algo, self.rollout = algo, rollout
        self.verl_dialect = any(is_verl_only(item.key) for item in items)

    def given(self, *keys: str) -> bool:
        return any(key in self.overrides or key in self.file for key in keys)

    def value(self, *keys: str, default: Any = None) -> Any:
        for layer in (self.overrides, self.file):
            for key in keys:
                if key in layer and layer[key] != "???":
                    return layer[key]
        return default

    def setting(self, rlplat_key: str, *verl_keys: str) -> Any:
        """The value of an rlplat setting from its verl or rlplat key, else rlplat's default."""
        return self.value(*verl_keys, rlplat_key, default=RLPLAT_DEFAULTS.get(rlplat_key))

    def chosen(self, rlplat_key: str, verl_key: str, option: str | None) -> Any:
        for key in (verl_key, rlplat_key):
            if key in self.overrides:
                return self.overrides[key]
        if option:
            return option
        return self.value(verl_key, rlplat_key)

    def rollout_name(self) -> str:
        return str(self.chosen("rollout.name", "actor_rollout_ref.rollout.name", self.rollout) or "hf")

    def algorithm_name(self) -> str | None:
        """The algorithm the user named (``--algo``, ``algorithm.name``), else the one implied."""
        named = self.chosen("algorithm.name", "algorithm.name", self.algo)
        return named or implied_algorithm(self)

    def critic_used(self) -> bool:
        enable = self.value("critic.enable")
        if enable is not None:
            return bool(enable)
        name = self.algorithm_name()
        return name in CRITIC_ALGORITHMS if name else self.value("algorithm.adv_estimator") == "gae"

    def world_size(self) -> int:
        if self.value("cluster.backend") == "local":
            return 1
        nodes = self.setting("cluster.nnodes", "trainer.nnodes")
        return int(nodes) * int(self.setting("cluster.devices_per_node", "trainer.n_gpus_per_node"))

    def optimizer_steps_per_step(self, role: str) -> int:
        """Optimizer steps of ``role`` per training step: mini-batches per batch times epochs."""
        prefix = "actor_rollout_ref.actor" if role == "actor" else "critic"
        prompts = int(self.setting("data.train_batch_size"))
        mini = int(self.setting(f"{role}.ppo_mini_batch_size", f"{prefix}.ppo_mini_batch_size"))
        epochs = int(self.setting(f"{role}.ppo_epochs", f"{prefix}.ppo_epochs"))
        return max(1, prompts // max(1, mini)) * epochs


def implied_algorithm(context: Context) -> str | None:
    if context.chosen("algorithm.name", "algorithm.name", context.algo) or not context.verl_dialect:
        return None
    if context.value("algorithm.filter_groups.enable") is True:
        return "dapo"
    return ESTIMATOR_ALGORITHMS.get(str(context.value("algorithm.adv_estimator")))


def verl_drops_the_ppo_loss(context: Context) -> bool:
    """verl's pure distillation: ``distillation.enabled`` with ``distillation_loss.use_task_rewards=false``, where verl
    multiplies its whole PPO loss, KL loss and entropy bonus included, by 0."""
    return (context.value("distillation.enabled") is True
            and context.value("distillation.distillation_loss.use_task_rewards", default=True) is False)


def is_verl_only(key: str) -> bool:
    from rlplat_verl.table import find_rule  # the table's modules import this one

    rule = find_rule(key)
    return (rule.verl_only if rule is not None else False) or key.split(".")[0] in VERL_ONLY_ROOTS


# -- values -------------------------------------------------------------------------------------------


def parse_value(raw: str) -> Any:
    """The value of ``key=raw`` as ``load_config`` will read it (OmegaConf's YAML)."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={raw}"]))["value"]
    except Exception:
        return raw


def format_value(value: Any) -> str:
    """``value`` as text that :func:`parse_value` reads back unchanged."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(element) for element in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {format_value(element)}" for key, element in value.items()) + "}"
    text = str(value)
    if parse_value(f"[{text}]") == [text]:
        return text
    return "'" + text.replace("'", "''") + "'"


def is_off(value: Any) -> bool:
    """verl's ways of leaving a feature off or a key unset."""
    return value is None or value is False or value == 0 or value in ("", "???") or value == [] or value == {}


def show(item: Item) -> str:
    return f"{item.key}={item.raw if item.raw is not None else format_value(item.value)}"


# -- outcomes -----------------------------------------------------------------------------------------


def unchanged(item: Item) -> Outcome:
    return Outcome([(item.key, VERBATIM)], translated=False)


def mapped(item: Item, target: str, also: Sequence[tuple[str, Any, str]] = ()) -> Outcome:
    note = f"verl key {item.key} -> {target}"
    settings: list[tuple[str, Any]] = [(target, VERBATIM)]
    for key, value, why in also:
        settings.append((key, value))
        note += f"; also {key}={format_value(value)} ({why})"
    return Outcome(settings, note)


def converted(item: Item, target: str, value: Any, why: str) -> Outcome:
    return Outcome([(target, value)], f"verl key {show(item)} -> {target}={format_value(value)} ({why})")


def ignored(item: Item, why: str) -> Outcome:
    return Outcome([], f"verl key {show(item)} accepted and ignored: {why}")


def refused(item: Item, why: str) -> Outcome:
    return Outcome(refusal=f"{show(item)}: {why}")


# -- rule builders ------------------------------------------------------------------------------------

RULES_BUILT: list[Rule] = []


def add(rule: Rule) -> Rule:
    RULES_BUILT.append(rule)
    return rule


def rename(key: str, target: str, summary: str = "same meaning", *, critic: tuple[str, str] | None = None) -> Rule:
    """``key`` -> ``target``, value as written. ``critic=(critic's verl key, critic's rlplat key)``: when the
    run has a critic and neither is given, the critic gets the same value, as verl's critic defaults to it."""

    def handle(item: Item, context: Context) -> Outcome:
        if critic and context.critic_used() and not context.given(*critic):
            return mapped(item, target, [(critic[1], item.value, f"verl's critic takes the actor's {critic[0].rsplit('.', 1)[1]}")])
        return mapped(item, target)

    targets = (Target(target),) + ((Target(critic[1]),) if critic else ())
    return add(Rule(key, targets, summary + (f"; sets `{critic[1]}` too when the run has a critic and does not set it" if critic else ""), handle))


def ignore(key: str, why: str) -> Rule:
    return add(Rule(key, (), f"accepted and ignored: {why}", lambda item, context: ignored(item, why)))


def refuse(key: str, why: str) -> Rule:
    return add(Rule(key, (), f"refused: {why}", lambda item, context: refused(item, why)))


PLAIN_OFF = ("unset", "off", "0", "none", "no override")  # reasons the summary's "off or unset" already gives


def only(key: str, accept: Callable[[Any], bool], when: str, why_ignored: str, why_refused: str) -> Rule:
    """Accepted and ignored when ``accept(value)`` (described by ``when``), refused otherwise."""

    def handle(item: Item, context: Context) -> Outcome:
        return ignored(item, why_ignored) if accept(item.value) else refused(item, why_refused)

    reason = "" if why_ignored in PLAIN_OFF else f" ({why_ignored})"
    return add(Rule(key, (), f"{when}: accepted and ignored{reason}; otherwise refused: {why_refused}", handle))


def off_only(key: str, why_ignored: str, why_refused: str) -> Rule:
    return only(key, is_off, "off or unset", why_ignored, why_refused)


def equal_only(key: str, accepted: Any, why_ignored: str, why_refused: str) -> Rule:
    return only(key, lambda value: value == accepted, format_value(accepted), why_ignored, why_refused)


def gated(node: str, gate: str, why_refused: str, is_on: Callable[[Any], bool] = lambda value: not is_off(value),
          on: str = "on") -> Rule:
    """Every key below ``node``: its switch ``gate`` is refused when on (``on`` says what that means); the
    other keys are read only when it is on, so they are accepted and ignored."""

    def handle(item: Item, context: Context) -> Outcome:
        if item.key == f"{node}.{gate}":
            return refused(item, why_refused) if is_on(item.value) else ignored(item, "the feature is off, as in rlplat")
        return ignored(item, f"verl reads it only when {node}.{gate} is on")

    return add(Rule(f"{node}.*", (), f"`{gate}` {on} is refused ({why_refused}); every other key is read only with it, so ignored", handle))


def per_rollout(key: str, summary: str, targets: Mapping[str, str | tuple[str, str]]) -> Rule:
    """A rollout-engine key: for each rollout, an rlplat key under ``rollout.config``, or
    ``("ignore", why)``. A rollout not listed refuses it."""

    def handle(item: Item, context: Context) -> Outcome:
        name = context.rollout_name()
        target = targets.get(name)
        if target is None:
            return refused(item, f"rlplat does not know which key of rollout {name!r} this is")
        if isinstance(target, tuple):
            return ignored(item, f"rollout {name}: {target[1]}")
        return mapped(item, target)

    rule_targets = tuple(Target(target, name) for name, target in targets.items() if isinstance(target, str))
    return add(Rule(key, rule_targets, summary, handle))


def optional_rename(key: str, target: str, summary: str = "same meaning; null (unset) leaves rlplat's default") -> Rule:
    def handle(item: Item, context: Context) -> Outcome:
        return ignored(item, "unset: rlplat's default applies") if item.value is None else mapped(item, target)

    return add(Rule(key, (Target(target),), summary, handle))


def special(key: str, targets: Sequence[Target | str], summary: str, *, verl_only: bool = True):
    """Decorator: a rule with its own handler."""

    def decorate(handle: Callable[[Item, Context], Outcome]) -> Callable[[Item, Context], Outcome]:
        add(Rule(key, tuple(Target(t) if isinstance(t, str) else t for t in targets), summary, handle, verl_only))
        return handle

    return decorate


SPEED_ONLY = "it only makes verl faster, and rlplat computes the same result without it"
VERL_INTERNAL = "verl fills it in itself"
TEXT_ONLY = "rlplat trains on text prompts only"
REFERENCE_FOLLOWS_ACTOR = "rlplat's reference model runs with the actor's engine settings"
