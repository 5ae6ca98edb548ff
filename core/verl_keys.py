"""verl's dotted config keys, translated into rlplat's.

A verl user's command line (``actor_rollout_ref.actor.optim.lr=1e-6 data.train_batch_size=1024
trainer.n_gpus_per_node=8 ...``) or a YAML file in verl's layout (top-level ``actor_rollout_ref``)
becomes rlplat's keys before :func:`rlplat.config.load_config` sees them. Every verl key meets one rule of
:data:`RULES`, which does one of four things:

* **maps** it to rlplat's key, with the value as written (``actor_rollout_ref.actor.optim.lr`` ->
  ``actor.optim.lr``) or converted where the units or conventions differ (verl's ``top_k=-1`` is rlplat's
  ``top_k=0``; verl steps its LR schedule once per training step, rlplat once per optimizer step);
* **accepts and ignores** it, when the value asks for what rlplat does anyway or the key only tunes verl's
  own machinery (kernels, logging, timeouts) and cannot change what is trained or whether it fits;
* **refuses** it, naming it: rlplat has no equivalent. All refusals of one command line are raised together
  in one :class:`rlplat.config.ConfigError`, so the user sees every one at once;
* leaves it **unchanged**: the key is rlplat's already, with the same meaning (``data.train_batch_size``,
  ``algorithm.adv_estimator``, ``trainer.total_epochs``).

Each translation comes with a one-line note (``verl key actor_rollout_ref.actor.optim.lr ->
actor.optim.lr``) that the CLI prints. A key under a node only verl has (``actor_rollout_ref``,
``reward_model``, ...) and no rule is refused; any other key without a rule passes unchanged, and the
config loader judges it. Hydra's ``+key=value`` and ``++key=value`` lose their prefix (rlplat's keys all
exist, so there is nothing to add); ``~key`` (delete) is refused.

Some rules read the rest of the command line (and the ``--config`` file): ``data.truncation`` yields to
``data.filter_overlong_prompts=True``, the reference model's ``fsdp_config`` must match the actor's, the
reward model's and LoRA's settings are read only when they are on, the two multi-turn turn limits give one
``agent.loops.tool.max_turns``, ``trainer.v1``'s sampler is read only in the asynchronous modes, and a
verl-style command line whose ``algorithm.adv_estimator`` implies an rlplat algorithm (``gae`` -> ``ppo``)
selects it unless ``--algo`` or ``algorithm.name`` does.

This module imports only the standard library, omegaconf and :mod:`rlplat.agent.config` (a dataclass): it
runs before anything heavy. It is long (about 1,800 lines) because it is a table: one rule per verl key,
grouped by verl's nodes, kept in one file so that a reader finds every verl key and its fate in one place
and a test can check the whole table against rlplat's schemas and the docs.
``docs/coming-from-verl.md`` holds the table (:func:`markdown_table`) and the reasons.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlplat.agent.config import VERL_LOOP_NAMES

# Top-level nodes only verl has: a key under them needs a rule, or it is refused.
VERL_ONLY_ROOTS = (
    "actor_rollout_ref", "reward_model", "custom_reward_function", "reward_manager", "sandbox_fusion",
    "global_profiler", "ray_kwargs", "ray_init", "transfer_queue", "distillation", "skip", "hydra",
)
# rlplat's defaults that some conversions read when the command line does not set the key; a test checks
# them against rlplat's config.
RLPLAT_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "rollout.temperature": 1.0,
    "actor.ppo_mini_batch_size": 8, "actor.ppo_epochs": 1, "actor.use_dynamic_bsz": False,
    "actor.max_token_len_per_gpu": 16384, "critic.ppo_mini_batch_size": 8, "critic.ppo_epochs": 1,
    "critic.use_dynamic_bsz": False, "critic.max_token_len_per_gpu": 16384, "cluster.nnodes": 1,
    "cluster.devices_per_node": 1,
}
# verl's advantage estimators whose algorithm rlplat registers under another name, or which need that
# algorithm's hooks (remax's greedy baseline) or critic (gae); the others run under the default, grpo.
ESTIMATOR_ALGORITHMS = {"gae": "ppo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp", "remax": "remax"}
CRITIC_ALGORITHMS = ("ppo",)
ROLLOUTS = ("hf", "vllm", "sglang")
TABLE_START, TABLE_END = "<!-- verl-keys-table:start -->", "<!-- verl-keys-table:end -->"
VERBATIM = object()  # a setting whose value is the argument's text as the user wrote it


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


def is_verl_only(key: str) -> bool:
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
        return "{" + ",".join(f"{key}: {format_value(element)}" for key, element in value.items()) + "}"
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


# -- actor_rollout_ref.model ----------------------------------------------------------------------------

rename("actor_rollout_ref.model.path", "model.path")
rename("actor_rollout_ref.model.tokenizer_path", "model.tokenizer_path")
rename("actor_rollout_ref.model.enable_gradient_checkpointing", "actor.engine_config.enable_gradient_checkpointing")
rename("actor_rollout_ref.model.use_remove_padding", "actor.engine_config.use_remove_padding",
       "sequence packing in the fsdp2 engine (same log-probs, no compute on padding)")
ignore("actor_rollout_ref.model.use_shm", "verl copies the model to /dev/shm to load it faster")
ignore("actor_rollout_ref.model.use_liger", SPEED_ONLY)
ignore("actor_rollout_ref.model.use_fused_kernels", SPEED_ONLY)
ignore("actor_rollout_ref.model.fused_kernel_options.impl_backend", SPEED_ONLY)
equal_only("actor_rollout_ref.model.trust_remote_code", False, "rlplat loads models and tokenizers without remote code",
           "rlplat loads the tokenizer and the rollout model with transformers' own classes, without remote code")
off_only("actor_rollout_ref.model.hf_config_path", "unset", "rlplat reads config.json from model.path")
off_only("actor_rollout_ref.model.custom_chat_template", "unset", "rlplat applies the tokenizer's own chat template")
off_only("actor_rollout_ref.model.external_lib", "unset", "rlplat imports no extra module for the model")
off_only("actor_rollout_ref.model.override_config", "no override", "rlplat builds the model from its config.json as it is")
refuse("actor_rollout_ref.model.override_config.*", "rlplat builds the model from its config.json as it is")
off_only("actor_rollout_ref.model.enable_activation_offload", "rlplat keeps activations on the device, as off asks", "rlplat has no activation offloading")
rename("actor_rollout_ref.model.lora_rank", "actor.lora.rank", "same meaning: the adapters' rank on the fsdp2 engine; 0 is "
       "full fine-tuning")
rename("actor_rollout_ref.model.lora_alpha", "actor.lora.alpha", "same meaning: the adapters' update is scaled by alpha / rank")
optional_rename("actor_rollout_ref.model.lora_adapter_path", "actor.lora.adapter_path",
                "same meaning: a peft adapter folder to start from; null (a fresh adapter) leaves rlplat's default")
for _lora_key in ("target_modules", "exclude_modules"):

    @special(f"actor_rollout_ref.model.{_lora_key}", [f"actor.lora.{_lora_key}"], "same meaning (Hugging Face module "
             "names, `all-linear`); one name becomes a one-item list; null ignored")
    def _lora_modules(item: Item, context: Context, key: str = _lora_key) -> Outcome:
        if item.value is None:
            return ignored(item, "unset: " + ("no module is left out, as in rlplat" if key == "exclude_modules"
                                              else "rlplat's default, all-linear"))
        if isinstance(item.value, str):
            return converted(item, f"actor.lora.{key}", [item.value], "rlplat's key takes a list of module names")
        return mapped(item, f"actor.lora.{key}")


def lora_on(context: Context) -> bool:
    """Whether the command line trains LoRA adapters (verl's flat FSDP keys or its Megatron node)."""
    ranks = (context.value("actor_rollout_ref.model.lora_rank", "actor.lora.rank"),
             context.value("actor_rollout_ref.model.lora.rank"))
    return any(isinstance(rank, (int, float)) and not isinstance(rank, bool) and rank > 0 for rank in ranks)


MEGATRON_LORA = ("verl's model.lora node is its Megatron LoRA (Megatron module names); rlplat's LoRA adapters are on the "
                 "fsdp2 engine: give actor_rollout_ref.model.lora_rank, lora_alpha and target_modules (Hugging Face module "
                 "names), which become actor.lora.*")


@special("actor_rollout_ref.model.lora.*", ["actor.lora.sync"], "`merge` -> `actor.lora.sync` (true: `merged`, false: "
         "`adapter`) when LoRA is on; `rank` above 0 refused (Megatron LoRA: use `lora_rank`); the rest read only with it")
def _megatron_lora(item: Item, context: Context) -> Outcome:
    name = item.key[len("actor_rollout_ref.model.lora."):]
    if name == "merge":
        if not lora_on(context):
            return ignored(item, "verl reads it only with LoRA on (lora_rank > 0)")
        return converted(item, "actor.lora.sync", "merged" if item.value else "adapter",
                         "merged: full weights with the adapter merged in reach the rollout; adapter: only the adapter's "
                         "tensors, which the rollout applies")
    if name == "rank":
        return refused(item, MEGATRON_LORA) if not is_off(item.value) else ignored(item, "0: no Megatron LoRA, as in rlplat")
    return ignored(item, "verl reads it only with model.lora.rank > 0 (its Megatron LoRA)")


gated("actor_rollout_ref.model.tiled_mlp", "enabled", "rlplat has no tiled MLP")
gated("actor_rollout_ref.model.mtp", "enable", "rlplat has no multi-token prediction")
equal_only("actor_rollout_ref.hybrid_engine", True, "rlplat colocates actor and rollout in one process, as true asks",
           "verl's trainer accepts only true; rlplat gives the rollout processes of its own with "
           "actor_rollout_ref.rollout.nnodes (-> roles.rollout.placement=separate) or trainer.mode=separate_async")
ignore("actor_rollout_ref.nccl_timeout", "a timeout of verl's collectives")


# -- actor_rollout_ref.actor --------------------------------------------------------------------------

def fsdp_engine(value: Any) -> str | None:
    return {"fsdp": "fsdp2", "fsdp2": "fsdp2", "megatron": "megatron"}.get(str(value))


for _role, _verl in (("actor", "actor_rollout_ref.actor"), ("critic", "critic")):

    def _strategy(item: Item, context: Context, role: str = _role) -> Outcome:
        engine = fsdp_engine(item.value)
        if engine is None:
            return refused(item, "rlplat's training engines are fsdp2 (and megatron where installed)")
        if item.value == engine:
            return mapped(item, f"{role}.engine")
        return converted(item, f"{role}.engine", engine, "rlplat's fsdp2 engine shards as verl's FSDP does")

    special(f"{_verl}.strategy", [f"{_role}.engine"], "`fsdp`/`fsdp2` -> `fsdp2`, `megatron` -> `megatron`; others refused")(_strategy)

rename("actor_rollout_ref.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size", "same meaning: prompts per optimizer step",
       critic=("critic.ppo_mini_batch_size", "critic.ppo_mini_batch_size"))
rename("actor_rollout_ref.actor.ppo_epochs", "actor.ppo_epochs", critic=("critic.ppo_epochs", "critic.ppo_epochs"))
rename("actor_rollout_ref.actor.use_dynamic_bsz", "actor.use_dynamic_bsz", critic=("critic.use_dynamic_bsz", "critic.use_dynamic_bsz"))
rename("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor.max_token_len_per_gpu")
for _loss_key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff", "use_kl_loss",
                  "kl_loss_coef", "kl_loss_type"):
    rename(f"actor_rollout_ref.actor.{_loss_key}", f"actor.loss.{_loss_key}")
rename("actor_rollout_ref.actor.loss_agg_mode", "actor.loss.loss_agg_mode", critic=("critic.loss_agg_mode", "critic.loss.loss_agg_mode"))
rename("actor_rollout_ref.actor.loss_scale_factor", "actor.loss.loss_scale_factor",
       critic=("critic.loss_scale_factor", "critic.loss.loss_scale_factor"))
for _loss_key in ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"):
    rename(f"actor_rollout_ref.actor.policy_loss.{_loss_key}", f"actor.loss.policy_loss.{_loss_key}")
off_only("actor_rollout_ref.actor.policy_loss.dro_beta", "unset", "rlplat has no DRO policy loss")
for _key in ("tau_pos", "tau_neg"):
    ignore(f"actor_rollout_ref.actor.{_key}", "verl reads it only in its sapo policy loss, which rlplat does not have")
ignore("actor_rollout_ref.actor.calculate_entropy", "rlplat reports actor/entropy from the old-log-prob pass when it runs, and from the loss when it has an entropy term")
off_only("actor_rollout_ref.actor.calculate_sum_pi_squared", "off", "rlplat does not compute sum(pi^2)")
ignore("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "verl reads it only with calculate_sum_pi_squared")
ignore("actor_rollout_ref.actor.use_prefix_grouper", SPEED_ONLY)
ignore("actor_rollout_ref.actor.use_torch_compile", SPEED_ONLY)
ignore("actor_rollout_ref.actor.use_fused_kernels", SPEED_ONLY)
ignore("actor_rollout_ref.actor.use_remove_padding", "actor_rollout_ref.model.use_remove_padding sets rlplat's packing")
ignore("actor_rollout_ref.actor.rollout_n", VERL_INTERNAL + " from rollout.n")
off_only("actor_rollout_ref.actor.freeze_vision_tower", "off", TEXT_ONLY)
rename("actor_rollout_ref.actor.grad_clip", "actor.optim.grad_clip", "verl's deprecated spelling of optim.clip_grad")


# -- batching keys that verl counts over all GPUs, and the forward passes' settings -------------------------

def per_gpu(item: Item, context: Context, target: str) -> Outcome:
    """A verl micro-batch size over all GPUs (deprecated in verl) -> per worker process, as verl divides it."""
    if item.value is None:
        return ignored(item, "unset")
    world = context.world_size()
    per_process = int(item.value) // world
    if per_process < 1:
        return refused(item, f"{item.value} rows over {world} worker processes leave less than one per process")
    return converted(item, target, per_process, f"verl's global count divided by {world} worker processes (cluster.nnodes x cluster.devices_per_node), as verl does")


optional_rename("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor.micro_batch_size_per_gpu",
                "same meaning: responses per micro-batch per worker process")
optional_rename("critic.ppo_micro_batch_size_per_gpu", "critic.micro_batch_size_per_gpu",
                "same meaning: responses per micro-batch per worker process")
special("actor_rollout_ref.actor.ppo_micro_batch_size", ["actor.micro_batch_size_per_gpu"],
        "divided by the worker processes -> `actor.micro_batch_size_per_gpu`")(
    lambda item, context: per_gpu(item, context, "actor.micro_batch_size_per_gpu"))
special("critic.ppo_micro_batch_size", ["critic.micro_batch_size_per_gpu"],
        "divided by the worker processes -> `critic.micro_batch_size_per_gpu`")(
    lambda item, context: per_gpu(item, context, "critic.micro_batch_size_per_gpu"))
optional_rename("critic.forward_micro_batch_size_per_gpu", "critic.engine_config.forward_micro_batch_size_per_gpu")
special("critic.forward_micro_batch_size", ["critic.engine_config.forward_micro_batch_size_per_gpu"],
        "divided by the worker processes -> `critic.engine_config.forward_micro_batch_size_per_gpu`")(
    lambda item, context: per_gpu(item, context, "critic.engine_config.forward_micro_batch_size_per_gpu"))

LOG_PROB_KEYS = ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")
FORWARD_MICRO_BATCH = "actor.engine_config.forward_micro_batch_size_per_gpu"

for _key in LOG_PROB_KEYS:

    @special(_key, [FORWARD_MICRO_BATCH], "-> `actor.engine_config.forward_micro_batch_size_per_gpu`, which the "
             "actor's and the reference's log-prob passes share; the smaller of the two verl keys wins")
    def _log_prob_micro_batch(item: Item, context: Context) -> Outcome:
        if item.value is None:
            return ignored(item, "unset: the forward passes use actor.micro_batch_size_per_gpu")
        given = {key: int(context.value(key)) for key in LOG_PROB_KEYS if context.value(key) is not None}
        winner = min(given, key=given.__getitem__)
        if item.key != winner:
            return ignored(item, f"rlplat's old-log-prob and reference passes share {FORWARD_MICRO_BATCH}, set to "
                                 f"{given[winner]} from {winner}" + (" (the smaller)" if given[winner] != int(item.value) else ""))
        return mapped(item, FORWARD_MICRO_BATCH)

for _key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size"):
    special(_key, [FORWARD_MICRO_BATCH], f"divided by the worker processes -> `{FORWARD_MICRO_BATCH}`")(
        lambda item, context: per_gpu(item, context, FORWARD_MICRO_BATCH))


def forward_follows_training(role: str, dynamic_keys: tuple[str, ...], budget_keys: tuple[str, ...]):
    """rlplat's forward passes (log-probs, values) batch as the role's training does: one switch, one token
    budget. verl's separate forward keys are accepted where rlplat's setting does what they ask."""

    def dynamic(item: Item, context: Context) -> Outcome:
        training = bool(context.setting(f"{role}.use_dynamic_bsz", *dynamic_keys))
        if bool(item.value) == training:
            return ignored(item, f"rlplat's forward passes follow {role}.use_dynamic_bsz={format_value(training)}")
        return refused(item, f"rlplat's forward passes follow {role}.use_dynamic_bsz={format_value(training)}; set that instead")

    def budget(item: Item, context: Context) -> Outcome:
        if not context.setting(f"{role}.use_dynamic_bsz", *dynamic_keys):
            return ignored(item, f"verl reads it only with dynamic batch sizes, and {role}.use_dynamic_bsz is off")
        training = int(context.setting(f"{role}.max_token_len_per_gpu", *budget_keys))
        if item.value is None or int(item.value) >= training:
            return ignored(item, f"rlplat's forward passes use the training budget {role}.max_token_len_per_gpu={training}: "
                                 "the same results in no more memory")
        return refused(item, f"rlplat's forward passes use {role}.max_token_len_per_gpu={training}, more than this; "
                             f"lower {role}.max_token_len_per_gpu instead")

    return dynamic, budget


_actor_dynamic, _actor_budget = forward_follows_training(
    "actor", ("actor_rollout_ref.actor.use_dynamic_bsz",), ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",))
for _node in ("actor_rollout_ref.rollout", "actor_rollout_ref.ref"):
    special(f"{_node}.log_prob_use_dynamic_bsz", [], "accepted and ignored when equal to the actor's "
            "`use_dynamic_bsz` (rlplat's forward passes follow it); otherwise refused")(_actor_dynamic)
    special(f"{_node}.log_prob_max_token_len_per_gpu", [], "accepted and ignored when dynamic batch sizes are "
            "off or it is at least the actor's budget (rlplat's forward passes use that); otherwise refused")(_actor_budget)
_critic_dynamic, _critic_budget = forward_follows_training("critic", ("critic.use_dynamic_bsz",), ("critic.ppo_max_token_len_per_gpu",))
special("critic.forward_max_token_len_per_gpu", [], "accepted and ignored when dynamic batch sizes are off or it "
        "is at least the critic's budget; otherwise refused")(_critic_budget)
rename("critic.ppo_max_token_len_per_gpu", "critic.max_token_len_per_gpu")


# -- optimizer (actor and critic) ----------------------------------------------------------------------

for _role, _node in (("actor", "actor_rollout_ref.actor.optim"), ("critic", "critic.optim")):
    if _role == "actor":
        for _key in ("lr", "weight_decay", "betas", "min_lr_ratio"):
            rename(f"{_node}.{_key}", f"actor.optim.{_key}")

    @special(f"{_node}.lr_scheduler_type", [f"{_role}.optim.lr_scheduler_type"], "`constant` and `cosine`; others refused",
             verl_only=_role == "actor")
    def _scheduler(item: Item, context: Context, role: str = _role) -> Outcome:
        if item.value not in ("constant", "cosine"):
            return refused(item, "rlplat's schedules are constant and cosine")
        return mapped(item, f"{role}.optim.lr_scheduler_type") if item.key.startswith("actor_rollout_ref") else unchanged(item)

    @special(f"{_node}.warmup_style", [f"{_role}.optim.lr_scheduler_type"], "verl's deprecated spelling of "
             "`lr_scheduler_type`; null ignored")
    def _warmup_style(item: Item, context: Context, role: str = _role) -> Outcome:
        if item.value is None:
            return ignored(item, "unset")
        if item.value not in ("constant", "cosine"):
            return refused(item, "rlplat's schedules are constant and cosine")
        return mapped(item, f"{role}.optim.lr_scheduler_type")

    rename(f"{_node}.clip_grad", f"{_role}.optim.grad_clip")
    if _role == "actor":  # critic.optim.grad_clip is rlplat's own key
        rename(f"{_node}.grad_clip", "actor.optim.grad_clip", "verl's deprecated spelling of clip_grad")

    @special(f"{_node}.lr_warmup_steps", [f"{_role}.optim.warmup_steps"], "verl counts training steps, rlplat optimizer "
             "steps: multiplied by mini-batches per batch x epochs; negative (use the ratio) ignored")
    def _warmup_steps(item: Item, context: Context, role: str = _role) -> Outcome:
        if item.value is None or int(item.value) < 0:
            return ignored(item, "negative: verl takes lr_warmup_steps_ratio instead")
        return warmup(item, context, role, int(item.value))

    @special(f"{_node}.lr_warmup_steps_ratio", [f"{_role}.optim.warmup_steps"], "times `trainer.total_training_steps` "
             "(which must be given), then as `lr_warmup_steps`; 0 ignored")
    def _warmup_ratio(item: Item, context: Context, role: str = _role, node: str = _node) -> Outcome:
        steps = context.value(f"{node}.lr_warmup_steps")
        if steps is not None and int(steps) >= 0:
            return ignored(item, f"{node}.lr_warmup_steps={steps} is given, and verl then ignores the ratio")
        if not item.value:
            return ignored(item, "no warm-up, rlplat's default")
        total = context.value("trainer.total_training_steps")
        if total is None:
            return refused(item, "the ratio needs trainer.total_training_steps on the same command line (verl multiplies it by "
                                 f"the run's step count); or give {node}.lr_warmup_steps")
        return warmup(item, context, role, int(float(item.value) * int(total)))

    ignore(f"{_node}.total_training_steps", VERL_INTERNAL + " with the run's step count; so does rlplat")
    equal_only(f"{_node}.num_cycles", 0.5, "rlplat's cosine is the half cycle 0.5 gives", "rlplat's cosine decays over one half cycle")
    only(f"{_node}.optimizer", lambda value: str(value).lower() == "adamw", "AdamW", "rlplat's engines use AdamW",
         "rlplat's engines use AdamW only")
    equal_only(f"{_node}.optimizer_impl", "torch.optim", "rlplat uses torch.optim.AdamW", "rlplat uses torch.optim.AdamW only")
    equal_only(f"{_node}.zero_indexed_step", True, "rlplat's warm-up starts at step 0 with lr 0, as true does",
               "rlplat's warm-up starts at step 0")
    off_only(f"{_node}.override_optimizer_config", "unset", "rlplat's AdamW takes only lr, betas and weight_decay")


def warmup(item: Item, context: Context, role: str, training_steps: int) -> Outcome:
    """verl steps its LR schedule once per training step, rlplat once per optimizer step."""
    per_step = context.optimizer_steps_per_step(role)
    target = f"{role}.optim.warmup_steps"
    if per_step == 1 or training_steps == 0:
        return converted(item, target, training_steps, "warm-up over the same training steps: one optimizer step per training step")
    return converted(item, target, training_steps * per_step,
                     f"verl steps its LR schedule once per training step, rlplat once per optimizer step, {per_step} per "
                     "training step here (data.train_batch_size / ppo_mini_batch_size x ppo_epochs): the same span of training")


# -- fsdp_config (actor, critic, reference) ------------------------------------------------------------

FSDP_DEFAULTS: dict[str, Any] = {
    "param_offload": False, "optimizer_offload": False, "offload_policy": False, "reshard_after_forward": True,
    "fsdp_size": -1, "model_dtype": "fp32", "full_determinism": False, "ulysses_sequence_parallel_size": 1,
    "dtype": "bfloat16", "strategy": "fsdp", "seed": 42,
}
FSDP_SPEED_ONLY = ("forward_prefetch", "use_orig_params", "use_torch_compile", "entropy_from_logits_with_chunking",
                   "entropy_from_logits_chunk_size", "entropy_checkpointing", "pad_to_length", "pad_to_length_bucket",
                   "use_no_sync_for_gradient_accumulation", "wrap_policy.min_num_params")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32", "float32": "float32"}

for _role, _nodes in (("actor", ("actor_rollout_ref.actor.fsdp_config",)), ("critic", ("critic.model.fsdp_config", "critic.fsdp"))):
    for _node in _nodes:
        for _key in ("param_offload", "optimizer_offload", "reshard_after_forward"):
            rename(f"{_node}.{_key}", f"{_role}.engine_config.{_key}")
        ignore(f"{_node}.seed", "rlplat seeds its engines with trainer.seed")

        @special(f"{_node}.dtype", [f"{_role}.engine_config.dtype"], "bf16/fp16/fp32 spelled out -> `engine_config.dtype`")
        def _dtype(item: Item, context: Context, role: str = _role) -> Outcome:
            dtype = DTYPES.get(str(item.value))
            if dtype is None:
                return refused(item, f"rlplat's engine dtypes are {', '.join(sorted(set(DTYPES.values())))}")
            return mapped(item, f"{role}.engine_config.dtype") if dtype == item.value else converted(
                item, f"{role}.engine_config.dtype", dtype, "rlplat spells the dtype out")

        off_only(f"{_node}.offload_policy", "off", "rlplat has no FSDP2 CPU offload policy; use param_offload")
        equal_only(f"{_node}.fsdp_size", -1, "rlplat shards over every worker process, as -1 asks", "rlplat has no hybrid sharding (HSDP)")
        only(f"{_node}.model_dtype", lambda value: DTYPES.get(str(value)) == "float32", "fp32",
             "rlplat keeps float32 master weights", "rlplat keeps float32 master weights")
        off_only(f"{_node}.full_determinism", "off", "rlplat has no deterministic-kernel switch")
        equal_only(f"{_node}.ulysses_sequence_parallel_size", 1, "no sequence parallelism, as in rlplat", "rlplat has no sequence parallelism")
        ignore(f"{_node}.strategy", "the engine follows the role's strategy")
        ignore(f"{_node}.forward_only", VERL_INTERNAL + " for the reference model")
        for _key in FSDP_SPEED_ONLY:
            ignore(f"{_node}.{_key}", SPEED_ONLY)
        gated(f"{_node}.qat", "enable", "rlplat has no quantization-aware training")
        ignore(f"{_node}.turbo_config.*", "verl's torchtitan settings")


@special("actor_rollout_ref.ref.fsdp_config.*", [], f"accepted and ignored when equal to the actor's (verl's default "
         f"when the actor's is not given): {REFERENCE_FOLLOWS_ACTOR}; otherwise refused")
def _reference_fsdp(item: Item, context: Context) -> Outcome:
    name = item.key[len("actor_rollout_ref.ref.fsdp_config."):]
    if name in FSDP_SPEED_ONLY or name.startswith(("turbo_config.", "qat.")) or name in ("optimizer_offload", "seed", "forward_only"):
        return ignored(item, f"{REFERENCE_FOLLOWS_ACTOR}; this one does not change what the reference computes or holds")
    actor = context.value(f"actor_rollout_ref.actor.fsdp_config.{name}", default=FSDP_DEFAULTS.get(name))
    if item.value == actor or (name == "dtype" and DTYPES.get(str(item.value)) == DTYPES.get(str(actor))):
        return ignored(item, f"{REFERENCE_FOLLOWS_ACTOR}, and the actor's {name} is {format_value(actor)}")
    return refused(item, f"{REFERENCE_FOLLOWS_ACTOR} (actor_rollout_ref.actor.fsdp_config.{name}={format_value(actor)}); "
                         "set the actor's key to this value or drop this one")


@special("actor_rollout_ref.ref.strategy", [], f"accepted and ignored when it is the actor's strategy; otherwise refused")
def _reference_strategy(item: Item, context: Context) -> Outcome:
    actor = context.value("actor_rollout_ref.actor.strategy", default="fsdp")
    if fsdp_engine(item.value) == fsdp_engine(actor):
        return ignored(item, REFERENCE_FOLLOWS_ACTOR)
    return refused(item, f"{REFERENCE_FOLLOWS_ACTOR} (strategy {actor})")


equal_only("actor_rollout_ref.ref.ulysses_sequence_parallel_size", 1, "no sequence parallelism, as in rlplat", "rlplat has no sequence parallelism")
for _key in ("use_torch_compile", "entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size", "entropy_checkpointing",
             "pad_to_length"):
    ignore(f"actor_rollout_ref.ref.{_key}", SPEED_ONLY)
ignore("actor_rollout_ref.ref.rollout_n", VERL_INTERNAL + " from rollout.n")
for _key in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size", "entropy_checkpointing", "pad_to_length"):
    ignore(f"actor_rollout_ref.actor.{_key}", SPEED_ONLY)
for _node in ("actor_rollout_ref.actor", "critic"):
    equal_only(f"{_node}.ulysses_sequence_parallel_size", 1, "no sequence parallelism, as in rlplat", "rlplat has no sequence parallelism")
    equal_only(f"{_node}.shuffle", False, "rlplat takes mini-batches in rollout order, as false asks", "rlplat does not shuffle mini-batches")
    ignore(f"{_node}.data_loader_seed", "verl reads it only to shuffle mini-batches, which rlplat does not do")
    only(f"{_node}.checkpoint.save_contents", lambda value: set(value or []) <= {"model", "optimizer", "extra"}, "model, optimizer, extra",
         "rlplat's checkpoints always hold the model, the optimizer and the trainer state",
         "rlplat's checkpoints hold no Hugging Face copy of the model")
    ignore(f"{_node}.checkpoint.load_contents", "rlplat loads every part of a checkpoint")
    off_only(f"{_node}.checkpoint.async_save", "off", "rlplat saves checkpoints synchronously")
    equal_only(f"{_node}.checkpoint.strict", True, "rlplat loads checkpoints strictly", "rlplat loads checkpoints strictly")
for _node in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic", "reward_model"):
    gated(f"{_node}.profiler", "enable", "rlplat has no profiler integration")
for _node in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
    refuse(f"{_node}.megatron.*", "rlplat's megatron engine (strategy=megatron -> actor.engine=megatron) takes its own keys "
                                  "under engine_config (tensor_parallel_size, pipeline_parallel_size, ...: rlplat config "
                                  "explain actor.engine_config)")
for _node in ("actor_rollout_ref.actor", "actor_rollout_ref.ref"):
    gated(f"{_node}.router_replay", "mode", "rlplat has no MoE router replay", lambda value: value not in (None, "disabled"),
          "other than disabled")
    gated(f"{_node}.qat", "enable", "rlplat has no quantization-aware training")


# -- critic ---------------------------------------------------------------------------------------------


@special("critic.model.path", [], "accepted and ignored when it is the policy's path; otherwise refused")
def _critic_path(item: Item, context: Context) -> Outcome:
    policy = context.value("actor_rollout_ref.model.path", "model.path")
    if item.value == policy:
        return ignored(item, "rlplat's critic starts from model.path, the policy's weights, as this asks")
    return refused(item, f"rlplat's critic starts from the policy's weights (model.path={policy})")


rename("critic.model.enable_gradient_checkpointing", "critic.engine_config.enable_gradient_checkpointing")
rename("critic.model.trust_remote_code", "critic.engine_config.trust_remote_code")
rename("critic.cliprange_value", "critic.loss.cliprange_value")
rename("critic.loss_agg_mode", "critic.loss.loss_agg_mode")
rename("critic.loss_scale_factor", "critic.loss.loss_scale_factor")
rename("critic.grad_clip", "critic.optim.grad_clip", "verl's deprecated spelling of optim.clip_grad")
ignore("critic.rollout_n", VERL_INTERNAL + " from rollout.n")


@special("critic.model.tokenizer_path", [], "accepted and ignored when unset or the policy's; otherwise refused")
def _critic_tokenizer(item: Item, context: Context) -> Outcome:
    policy = context.value("actor_rollout_ref.model.tokenizer_path", "model.tokenizer_path") or context.value(
        "actor_rollout_ref.model.path", "model.path")
    if item.value is None or item.value == policy:
        return ignored(item, "rlplat's critic reads the policy's tokens")
    return refused(item, "rlplat's critic reads the policy's tokens, so it must share the policy's tokenizer")


rename("critic.model.use_remove_padding", "critic.engine_config.use_remove_padding",
       "sequence packing in the fsdp2 engine (same values, no compute on padding)")
for _key in ("use_shm", "use_liger", "use_fused_kernels", "fused_kernel_options.impl_backend"):
    ignore(f"critic.model.{_key}", SPEED_ONLY)
for _key, _why in (("hf_config_path", "rlplat reads config.json from the critic's model path"),
                   ("custom_chat_template", "the critic reads the policy's tokens"),
                   ("external_lib", "rlplat imports no extra module for the model"),
                   ("override_config", "rlplat builds the model from its config.json as it is"),
                   ("enable_activation_offload", "rlplat has no activation offloading"),
                   ("lora_rank", "rlplat's LoRA adapters are the actor's (actor.lora); its critic trains every parameter"),
                   ("lora_adapter_path", "rlplat's LoRA adapters are the actor's (actor.lora.adapter_path)")):
    off_only(f"critic.model.{_key}", "off or unset, as in rlplat", _why)
for _key in ("lora_alpha", "target_modules", "exclude_modules"):
    ignore(f"critic.model.{_key}", "verl reads it only with lora_rank > 0, which rlplat refuses")
refuse("critic.model.override_config.*", "rlplat builds the model from its config.json as it is")
gated("critic.model.lora", "rank", "rlplat's LoRA adapters are the actor's (actor.lora); its critic trains every parameter")
gated("critic.model.tiled_mlp", "enabled", "rlplat has no tiled MLP")
gated("critic.model.mtp", "enable", "rlplat has no multi-token prediction")


# -- actor_rollout_ref.rollout ----------------------------------------------------------------------------

rename("actor_rollout_ref.rollout.name", "rollout.name")
rename("actor_rollout_ref.rollout.n", "rollout.n")
rename("actor_rollout_ref.rollout.temperature", "rollout.temperature")
rename("actor_rollout_ref.rollout.top_p", "rollout.top_p")
rename("actor_rollout_ref.rollout.response_length", "rollout.response_length", "same meaning: most new tokens per response")
rename("actor_rollout_ref.rollout.free_cache_engine", "rollout.free_between_phases",
       "same meaning: put the rollout to sleep between generations")


@special("actor_rollout_ref.rollout.top_k", ["rollout.top_k"], "-1 (off) -> 0 (off); other values the same")
def _top_k(item: Item, context: Context) -> Outcome:
    if item.value is not None and int(item.value) < 0:
        return converted(item, "rollout.top_k", 0, "verl's -1 and rlplat's 0 both turn the top-k filter off")
    return mapped(item, "rollout.top_k")


@special("actor_rollout_ref.rollout.prompt_length", [], "accepted and ignored when it equals `data.max_prompt_length` "
         "(verl's default); otherwise refused")
def _prompt_length(item: Item, context: Context) -> Outcome:
    prompt = context.setting("data.max_prompt_length")
    if item.value == prompt:
        return ignored(item, f"rlplat's rollout takes prompts of up to data.max_prompt_length={prompt}")
    return refused(item, f"rlplat's prompt limit is data.max_prompt_length ({prompt}); set that instead")


equal_only("actor_rollout_ref.rollout.do_sample", True, "rlplat samples its training responses",
           "rlplat samples its training responses; greedy training rollouts are not available")
equal_only("actor_rollout_ref.rollout.mode", "async", "the only mode verl has; rlplat generates the same samples",
           "verl itself accepts only async")
off_only("actor_rollout_ref.rollout.ignore_eos", "off", "rlplat's rollouts stop at EOS")
ignore("actor_rollout_ref.rollout.load_format", "rlplat's rollout receives the actor's weights before its first "
       "generation, as verl's dummy format does; how it loads its own copy only costs time")
ignore("actor_rollout_ref.rollout.layered_summon", "how verl gathers LoRA weights for the rollout, layer by layer; rlplat's "
       "actor.lora.sync says what reaches it (merged weights or the adapter)")
ignore("actor_rollout_ref.rollout.calculate_log_probs", "rlplat's rollouts always return rollout_log_probs (the log-prob "
       "mismatch metrics and algorithm.rollout_correction read them)")
equal_only("actor_rollout_ref.rollout.logprobs_mode", "processed_logprobs", "rlplat's rollout_log_probs are those of the "
           "distribution sampled from (after temperature, top-k, top-p), as this asks", "rlplat's rollouts return the "
           "log-probs of the distribution sampled from (processed_logprobs), which the log-prob mismatch metrics and "
           "algorithm.rollout_correction read")
ignore("actor_rollout_ref.rollout.disable_log_stats", "verl's rollout logging")
ignore("actor_rollout_ref.rollout.skip_tokenizer_init", "rlplat's rollouts take and return token ids")
ignore("actor_rollout_ref.rollout.multi_stage_wake_up", "rlplat's rollouts always wake up in stages (weights, then KV cache)")
equal_only("actor_rollout_ref.rollout.scheduling_policy", "fcfs", "the order requests are served in", "rlplat's rollouts serve requests first come, first served")
off_only("actor_rollout_ref.rollout.over_sample_rate", "0", "rlplat waits for every sample")
off_only("actor_rollout_ref.rollout.cudagraph_capture_sizes", "unset", "rlplat sets no CUDA-graph sizes; use rollout.config.engine_kwargs")
off_only("actor_rollout_ref.rollout.quantization", "unset", "rlplat's rollouts run unquantized")
off_only("actor_rollout_ref.rollout.quantization_config_file", "unset", "rlplat's rollouts run unquantized")
off_only("actor_rollout_ref.rollout.full_determinism", "off", "rlplat has no deterministic-kernel switch")
off_only("actor_rollout_ref.rollout.enable_rollout_routing_replay", "off", "rlplat has no MoE routing replay")
off_only("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", "0", "rlplat logs no MoE load-balance metrics")
off_only("actor_rollout_ref.rollout.router_config_path", "unset", "rlplat runs no rollout router")
off_only("actor_rollout_ref.rollout.skip_rollout", "off", "rlplat has no rollout replay")
ignore("actor_rollout_ref.rollout.skip_dump_dir", "verl reads it only with skip_rollout")
off_only("actor_rollout_ref.rollout.mtp", "unset", "rlplat has no multi-token prediction")
gated("actor_rollout_ref.rollout.mtp", "enable", "rlplat has no multi-token prediction")
off_only("actor_rollout_ref.rollout.qat", "unset", "rlplat has no quantization-aware training")
gated("actor_rollout_ref.rollout.qat", "enable", "rlplat has no quantization-aware training")


@special("actor_rollout_ref.rollout.nnodes", ["roles.rollout.placement", "roles.rollout.nnodes"], "0 (the rollout "
         "shares the actor's processes) ignored; above 0 -> `roles.rollout.placement=separate` and `roles.rollout.nnodes`")
def _rollout_nodes(item: Item, context: Context) -> Outcome:
    if is_off(item.value):
        return ignored(item, "0: the rollout runs in the actor's processes, rlplat's default (roles.rollout.placement=colocated)")
    return Outcome([("roles.rollout.placement", "separate"), ("roles.rollout.nnodes", int(item.value))],
                   f"verl key {show(item)} -> roles.rollout.placement=separate, roles.rollout.nnodes={int(item.value)} "
                   "(the rollout gets a resource pool of its own, fed the actor's weights after each update)")


@special("actor_rollout_ref.rollout.n_gpus_per_node", ["roles.rollout.devices_per_node"], "-> "
         "`roles.rollout.devices_per_node` when `actor_rollout_ref.rollout.nnodes` is above 0; ignored otherwise")
def _rollout_gpus(item: Item, context: Context) -> Outcome:
    if is_off(context.value("actor_rollout_ref.rollout.nnodes")):
        return ignored(item, "verl reads it only for a rollout on machines of its own (actor_rollout_ref.rollout.nnodes > 0)")
    return mapped(item, "roles.rollout.devices_per_node")


for _key in ("data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size"):
    equal_only(f"actor_rollout_ref.rollout.{_key}", 1, "no such parallelism, as in rlplat",
               "rlplat runs one rollout engine per worker process, without data, expert or pipeline parallelism")
gated("actor_rollout_ref.rollout.disaggregation", "enabled", "rlplat has no prefill/decode disaggregation")
gated("actor_rollout_ref.rollout.prometheus", "enable", "rlplat exports no Prometheus metrics")
gated("actor_rollout_ref.rollout.trace", "backend", "rlplat has no rollout tracing")
equal_only("actor_rollout_ref.rollout.checkpoint_engine.backend", "naive", "rlplat syncs weights in process",
           "rlplat syncs weights through its rollout's update_weights only")
ignore("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", "the size of verl's weight-sync buckets")
off_only("actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs", "unset", "rlplat's weight sync has no settings")
off_only("actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module", "unset", "rlplat's weight sync has no backends")



# -- multi-turn rollouts, tools and agent loops -> agent.* -----------------------------------------------

MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
TOOL_LOOP = "agent.loops.tool"
VERL_TRUNCATION_SIDES = {"left": "right", "right": "left", "middle": "middle"}
"""verl names the side it keeps (``left``: the start), rlplat the side it cuts (``left``: keeps the end)."""


@special(f"{MULTI_TURN}.enable", [], "accepted and ignored: a row's loop comes from its `agent_name` column (verl's "
         "`tool_agent` is rlplat's `tool`), else `agent.loop` (verl's `rollout.agent.default_agent_loop`), in verl too")
def _multi_turn(item: Item, context: Context) -> Outcome:
    return ignored(item, "rlplat runs each row's agent loop by its agent_name column (verl's tool_agent is rlplat's tool "
                         "loop), else agent.loop (verl's actor_rollout_ref.rollout.agent.default_agent_loop), as verl's agent "
                         "loops do; multi-turn loops train on the sampled tokens only (response_mask)")


optional_rename(f"{MULTI_TURN}.tool_config_path", "agent.tools_config", "same meaning: the tools file (verl's shape; "
                "`class_name` may name a tool written for verl); null ignored")
optional_rename(f"{MULTI_TURN}.format", "agent.tool_parser", "same meaning: the tool-call format (kind `tool_parser`: "
                "`hermes`)")
optional_rename(f"{MULTI_TURN}.max_parallel_calls", f"{TOOL_LOOP}.max_parallel_calls", "same meaning: calls run from one "
                "model turn (verl's default 1, rlplat's 4)")
optional_rename(f"{MULTI_TURN}.max_tool_response_length", f"{TOOL_LOOP}.max_tool_response_length", "same meaning: "
                "characters of a tool response the model sees (verl's default 256, rlplat's 1024)")


@special(f"{MULTI_TURN}.tool_response_truncate_side", [f"{TOOL_LOOP}.truncate_side"], "verl's `left` (keep the start) -> "
         "`right`, `right` (keep the end) -> `left`, `middle` -> `middle`")
def _truncate_side(item: Item, context: Context) -> Outcome:
    side = VERL_TRUNCATION_SIDES.get(str(item.value))
    if side is None:
        return refused(item, "rlplat cuts long tool responses on the left, right or middle (agent.loops.tool.truncate_side)")
    if side == item.value:
        return mapped(item, f"{TOOL_LOOP}.truncate_side")
    return converted(item, f"{TOOL_LOOP}.truncate_side", side, f"verl's {item.value} names the side kept, rlplat's "
                     f"{side} the side cut: both keep the {'start' if item.value == 'left' else 'end'}")


def turn_limits(context: Context) -> tuple[int | None, int | None]:
    """verl's (max_assistant_turns, max_user_turns), None where unset."""
    values = (context.value(f"{MULTI_TURN}.max_assistant_turns"), context.value(f"{MULTI_TURN}.max_user_turns"))
    return tuple(None if is_off(value) else int(value) for value in values)  # type: ignore[return-value]


@special(f"{MULTI_TURN}.max_assistant_turns", [f"{TOOL_LOOP}.max_turns"], "-> `agent.loops.tool.max_turns` (model "
         "turns), unless `max_user_turns` stops the conversation first; null ignored")
def _assistant_turns(item: Item, context: Context) -> Outcome:
    assistant, user = turn_limits(context)
    if assistant is None:
        return ignored(item, "unset: verl limits the conversation by the response length only; rlplat's tool loop also "
                             "stops after agent.loops.tool.max_turns (default 5) model turns")
    if user is not None and user + 1 < assistant:
        return ignored(item, f"max_user_turns={user} ends the conversation after {user + 1} model turns, first")
    return mapped(item, f"{TOOL_LOOP}.max_turns")


@special(f"{MULTI_TURN}.max_user_turns", [f"{TOOL_LOOP}.max_turns"], "tool rounds: N -> `agent.loops.tool.max_turns=N+1` "
         "when that stops the conversation before `max_assistant_turns`; null ignored")
def _user_turns(item: Item, context: Context) -> Outcome:
    assistant, user = turn_limits(context)
    if user is None:
        return ignored(item, "unset: no limit on tool rounds but the model turns'")
    if assistant is not None and assistant <= user + 1:
        return ignored(item, f"max_assistant_turns={assistant} ends the conversation first")
    return converted(item, f"{TOOL_LOOP}.max_turns", user + 1, "verl counts the rounds of tool responses; after N of them "
                     "the model's turn that reads the last is the N+1st")


equal_only(f"{MULTI_TURN}.use_inference_chat_template", False, "rlplat trains on the tokens the model sampled, as false asks",
           "rlplat appends the model's sampled tokens verbatim and trains on them; it does not re-render its turns with "
           "the chat template")
ignore(f"{MULTI_TURN}.tokenization_sanity_check_mode", "rlplat appends sampled tokens verbatim and each other message as "
       "the template's delta (rlplat check-template checks a template once)")
off_only(f"{MULTI_TURN}.function_tool_path", "unset", "rlplat loads no @function_tool file; list each tool in the tools "
         "file (agent.tools_config: class_name an rlplat Tool or a verl BaseTool-shaped class)")
off_only(f"{MULTI_TURN}.num_repeat_rollouts", "unset", "rlplat samples rollout.n conversations per prompt; it repeats none")
off_only(f"{MULTI_TURN}.interaction_config_path", "unset", "rlplat's multi-turn feedback comes from an environment "
         "(agent.loop=env with agent.environment, kind environment); verl's interaction classes do not load")
refuse(f"{MULTI_TURN}.*", "rlplat's tool loop has no such setting (agent.loops.tool: max_turns, max_tokens_per_turn, "
       "max_parallel_calls, tool_timeout_s, max_tool_response_length, truncate_side)")

AGENT = "actor_rollout_ref.rollout.agent"


@special(f"{AGENT}.default_agent_loop", ["agent.loop"], "`single_turn_agent` ignored (rows without `agent_name` are "
         "generated in one turn either way); `tool_agent` -> `agent.loop=tool`; another name -> `agent.loop` (a "
         "registered agent loop)")
def _default_agent_loop(item: Item, context: Context) -> Outcome:
    if item.value in (None, "single_turn_agent"):
        return ignored(item, "rows without agent_name get one response per prompt from rlplat's batched generate, as "
                             "verl's single_turn_agent gives")
    name = str(item.value)
    loop = VERL_LOOP_NAMES.get(name, name)
    if loop == name:
        return mapped(item, "agent.loop")
    return converted(item, "agent.loop", loop, f"verl's {name} is rlplat's {loop} loop")


ignore(f"{AGENT}.num_workers", "how many agent-loop workers verl runs; rlplat runs the loops in each rollout worker "
       "(agent.max_concurrency conversations at once)")
off_only(f"{AGENT}.agent_loop_config_path", "unset", "rlplat's agent loops are registered plugins (kind agent_loop, hook "
         "register_agent_loops), configured under agent.loops.<name>; verl's list of _target_ classes does not load")
gated(f"{AGENT}.custom_async_server", "path", "rlplat's rollout engines are registered plugins (kind rollout): register "
      "one instead of a custom server class")

NOT_PASSED_TO_SGLANG = ("ignore", "verl does not pass it to SGLang either")
NO_ENGINE_POOL = ("ignore", "the hf rollout allocates per batch; it has no memory pool, scheduler or CUDA graphs to size")
per_rollout("actor_rollout_ref.rollout.dtype", "same meaning, in `rollout.config`",
            {"hf": "rollout.config.dtype", "vllm": "rollout.config.dtype", "sglang": "rollout.config.dtype"})
per_rollout("actor_rollout_ref.rollout.seed", "same meaning, in `rollout.config`",
            {"hf": "rollout.config.seed", "vllm": "rollout.config.seed", "sglang": "rollout.config.seed"})
per_rollout("actor_rollout_ref.rollout.gpu_memory_utilization", "vllm: same key; sglang: `mem_fraction_static` (verl "
            "passes it so); hf: ignored (no memory pool)",
            {"vllm": "rollout.config.gpu_memory_utilization", "sglang": "rollout.config.mem_fraction_static", "hf": NO_ENGINE_POOL})
per_rollout("actor_rollout_ref.rollout.enforce_eager", "vllm: same key; sglang: `disable_cuda_graph` (verl passes it so); "
            "hf: ignored (no CUDA graphs)",
            {"vllm": "rollout.config.enforce_eager", "sglang": "rollout.config.disable_cuda_graph", "hf": NO_ENGINE_POOL})
per_rollout("actor_rollout_ref.rollout.max_num_seqs", "vllm: same key; sglang: `max_running_requests` (verl passes it "
            "so); hf: `max_batch_rows`",
            {"vllm": "rollout.config.max_num_seqs", "sglang": "rollout.config.max_running_requests", "hf": "rollout.config.max_batch_rows"})
per_rollout("actor_rollout_ref.rollout.max_num_batched_tokens", "vllm: same key; sglang, hf: ignored",
            {"vllm": "rollout.config.max_num_batched_tokens", "sglang": NOT_PASSED_TO_SGLANG, "hf": NO_ENGINE_POOL})
per_rollout("actor_rollout_ref.rollout.max_model_len", "vllm: same key; sglang, hf: ignored",
            {"vllm": "rollout.config.max_model_len", "sglang": NOT_PASSED_TO_SGLANG, "hf": NO_ENGINE_POOL})
per_rollout("actor_rollout_ref.rollout.enable_prefix_caching", "vllm: same key; sglang, hf: ignored",
            {"vllm": "rollout.config.enable_prefix_caching", "sglang": NOT_PASSED_TO_SGLANG, "hf": NO_ENGINE_POOL})
per_rollout("actor_rollout_ref.rollout.enable_chunked_prefill", "vllm: `engine_kwargs.enable_chunked_prefill`; sglang, hf: ignored",
            {"vllm": "rollout.config.engine_kwargs.enable_chunked_prefill", "sglang": NOT_PASSED_TO_SGLANG, "hf": NO_ENGINE_POOL})


@special("actor_rollout_ref.rollout.tensor_model_parallel_size", [Target("rollout.config.tensor_parallel_size", "vllm"),
         Target("rollout.config.tp_size", "sglang")], "1 -> vllm `tensor_parallel_size`, sglang `tp_size` (hf: ignored); "
         "larger refused")
def _tensor_parallel(item: Item, context: Context) -> Outcome:
    name = context.rollout_name()
    if int(item.value) != 1:
        return refused(item, "rlplat runs one rollout engine per GPU worker, without tensor parallelism "
                             "(SGLang's server mode takes rollout.config.tp_size)")
    targets = {"vllm": "rollout.config.tensor_parallel_size", "sglang": "rollout.config.tp_size"}
    return mapped(item, targets[name]) if name in targets else ignored(item, f"rollout {name} runs on one device")


@special("actor_rollout_ref.rollout.engine_kwargs.*", [Target("rollout.config.engine_kwargs", "vllm"),
         Target("rollout.config.engine_kwargs", "sglang")], "`engine_kwargs.<rollout>.X` -> `rollout.config.engine_kwargs.X` "
         "for that rollout; another rollout's ignored, as verl does")
def _engine_kwargs(item: Item, context: Context) -> Outcome:
    parts = item.key.split(".")
    backend, rest = parts[3], ".".join(parts[4:])
    name = context.rollout_name()
    if backend != name:
        return ignored(item, f"verl passes it only to the {backend} rollout, and this run's is {name}")
    if name not in ("vllm", "sglang"):
        return refused(item, f"rlplat's {name} rollout takes no engine arguments")
    if not rest:
        return ignored(item, "empty") if is_off(item.value) else converted(item, "rollout.config.engine_kwargs", item.value, "same arguments")
    return mapped(item, f"rollout.config.engine_kwargs.{rest}")


VALIDATION = "actor_rollout_ref.rollout.val_kwargs"


@special(f"{VALIDATION}.*", ["rollout.val_greedy"], "`do_sample` -> `rollout.val_greedy` (negated); `n` 1, `top_p` 1, "
         "`top_k` off and a `temperature` equal to the training one (when sampling) are accepted; others refused")
def _validation(item: Item, context: Context) -> Outcome:
    name = item.key[len(VALIDATION) + 1:]
    sampling = bool(context.value(f"{VALIDATION}.do_sample", default=False))
    if name == "do_sample":
        return converted(item, "rollout.val_greedy", not item.value, "rlplat's flag says greedy, verl's says sample")
    if name == "n":
        return ignored(item, "one response per validation prompt, as in rlplat") if int(item.value) == 1 else refused(
            item, "rlplat validates with one response per prompt")
    if name == "top_p":
        return ignored(item, "rlplat validates without a top-p filter") if float(item.value) == 1.0 else refused(
            item, "rlplat validates without a top-p filter")
    if name == "top_k":
        return ignored(item, "rlplat validates without a top-k filter") if int(item.value) <= 0 else refused(
            item, "rlplat validates without a top-k filter")
    if name == "temperature":
        if not sampling:
            return ignored(item, "verl validates greedily (do_sample false), where the temperature plays no part")
        training = context.setting("rollout.temperature", "actor_rollout_ref.rollout.temperature")
        if float(item.value) == float(training):
            return ignored(item, f"rlplat samples validation responses at rollout.temperature={training}")
        return refused(item, f"rlplat samples validation responses at the training temperature ({training})")
    return refused(item, "no such validation setting in rlplat")


# -- data -----------------------------------------------------------------------------------------------

for _key in ("train_files", "val_files"):

    @special(f"data.{_key}", [f"data.{_key}"], "rlplat's key; one path becomes a one-item list", verl_only=False)
    def _files(item: Item, context: Context) -> Outcome:
        if isinstance(item.value, str):
            return converted(item, item.key, [item.value], "rlplat's key takes a list of files")
        return unchanged(item)


@special("data.max_response_length", ["rollout.response_length"], "-> `rollout.response_length`, unless "
         "`actor_rollout_ref.rollout.response_length` is given (verl's rollout reads that one)")
def _max_response_length(item: Item, context: Context) -> Outcome:
    if context.given("actor_rollout_ref.rollout.response_length"):
        return ignored(item, "actor_rollout_ref.rollout.response_length is given, and verl's rollout reads that one")
    return mapped(item, "rollout.response_length")


@special("data.filter_overlong_prompts", ["data.truncation"], "true -> `data.truncation=filter`; false ignored "
         "(`data.truncation` decides)")
def _filter_overlong(item: Item, context: Context) -> Outcome:
    if item.value:
        return converted(item, "data.truncation", "filter", "rlplat's truncation=filter drops overlong prompts at load")
    return ignored(item, "data.truncation decides, as in verl")


@special("data.truncation", ["data.truncation"], "rlplat's key; dropped when `data.filter_overlong_prompts=true` "
         "(no prompt is left for it to cut)", verl_only=False)
def _truncation(item: Item, context: Context) -> Outcome:
    if context.value("data.filter_overlong_prompts"):
        return ignored(item, "data.filter_overlong_prompts=true drops every overlong prompt first, so it never applies")
    return unchanged(item)


@special("data.seed", ["data.seed"], "rlplat's key; null (verl: an unseeded shuffle) ignored", verl_only=False)
def _data_seed(item: Item, context: Context) -> Outcome:
    if item.value is None:
        return ignored(item, "rlplat always seeds its shuffle (data.seed, default 0)")
    return unchanged(item)


@special("data.gen_batch_size", [], "accepted and ignored when unset or `data.train_batch_size`; otherwise refused")
def _gen_batch_size(item: Item, context: Context) -> Outcome:
    prompts = context.setting("data.train_batch_size")
    if item.value is None or item.value == prompts:
        return ignored(item, f"rlplat generates data.train_batch_size={prompts} prompts per round")
    return refused(item, "rlplat generates data.train_batch_size prompts per generation round")


ignore("data.return_raw_chat", "rlplat always keeps the prompt's messages (raw_prompt)")
ignore("data.return_raw_input_ids", "rlplat keeps each row's messages (raw_prompt): a reward model with a tokenizer of its "
       "own re-renders the conversation with it (reward.model.retokenize=auto)")
off_only("data.return_full_prompt", "off", "rlplat's reward functions receive data_source, solution_str, ground_truth and "
         "extra_info; the judge reads the row's messages (raw_prompt); none reads the rendered prompt")
ignore("data.dataloader_num_workers", "rlplat tokenizes the prompts once, when it loads them")
ignore("data.filter_overlong_prompts_workers", "rlplat tokenizes the prompts once, when it loads them")
ignore("data.use_shm", "verl copies files to /dev/shm to load them faster")
off_only("data.tokenizer", "unset", "rlplat tokenizes with model.tokenizer_path (default model.path)")
for _key in ("train_max_samples", "val_max_samples"):
    only(f"data.{_key}", lambda value: value is None or int(value) < 0, "-1", "every row, as in rlplat", "rlplat reads every row of the files")
equal_only("data.reward_fn_key", "data_source", "rlplat hands each row's data_source to the scorer, as this asks",
           "rlplat hands the data_source column to the scorer; no other column takes its place")
off_only("data.validation_shuffle", "off", "rlplat walks the validation set in file order")
off_only("data.trust_remote_code", "off", "rlplat loads the tokenizer without remote code")
for _key in ("tool_config_path", "function_tool_path"):

    @special(f"data.{_key}", [], f"accepted and ignored when unset or equal to `{MULTI_TURN}.{_key}` (verl's default); "
             "otherwise refused")
    def _data_tools(item: Item, context: Context, key: str = _key) -> Outcome:
        offered = context.value(f"{MULTI_TURN}.{key}")
        if is_off(item.value) or item.value == offered:
            return ignored(item, "verl's data loader measures prompts with the tools they are offered; rlplat measures each "
                                 "rendered prompt against agent.max_prompt_length (default data.max_prompt_length)")
        return refused(item, f"rlplat offers the tools of {MULTI_TURN}.{key}"
                             + (" (-> agent.tools_config)" if key == "tool_config_path" else "")
                             + "; a different file for the data loader has no rlplat equivalent")
for _key in ("image_key", "video_key", "audio_key"):
    refuse(f"data.{_key}", f"{TEXT_ONLY}; it reads no image, video or audio column")
for _key in ("image_patch_size", "return_multi_modal_inputs", "mm_processor_kwargs"):
    ignore(f"data.{_key}", f"verl reads it only for multimodal data; {TEXT_ONLY}")
gated("data.custom_cls", "path", "rlplat reads parquet files in verl's schema with its own dataset")
gated("data.sampler", "class_path", "rlplat's sampler is its seeded shuffle")
gated("data.datagen", "path", "rlplat has no dynamic data generation")


# -- rewards --------------------------------------------------------------------------------------------

for _node in ("custom_reward_function", "reward.custom_reward_function"):
    rename(f"{_node}.path", "reward.custom_function.path")
    optional_rename(f"{_node}.name", "reward.custom_function.name")
    off_only(f"{_node}.reward_kwargs", "none", "rlplat calls the function with its four arguments only")
for _key in ("reward_model.reward_manager", "reward_manager.name", "reward.reward_manager.name"):
    optional_rename(_key, "reward.manager")
for _key in ("reward_model.reward_loop_source", "reward.reward_manager.source", "reward_manager.source"):
    only(_key, lambda value: value in (None, "register"), "register or unset", "a registered manager, as rlplat's",
         "rlplat's reward managers are registered plugins")
for _key in ("reward_model.reward_loop_module_path", "reward_model.reward_loop_class_name"):
    off_only(_key, "unset", "rlplat's reward managers are registered plugins")
gated("reward_manager.module", "path", "rlplat's reward managers are registered plugins")
gated("reward.reward_manager.module", "path", "rlplat's reward managers are registered plugins")
for _key in ("reward_model.num_workers", "reward.num_workers"):
    ignore(_key, "how many reward workers verl runs")
ignore("reward_model.launch_reward_fn_async", "when verl computes the reward, not what it is")
ignore("reward_model.use_reward_loop", "selects verl's reward implementation")
for _node in ("reward_model.sandbox_fusion", "reward.sandbox_fusion", "sandbox_fusion"):
    gated(_node, "url", "rlplat calls no remote sandbox service; its python tool (agent.tools_config, name: python) runs "
          "code in a local sandbox, and a reward function (reward.custom_function) may call any service")


# -- the reward model -> reward.model.* ----------------------------------------------------------------------
# verl has two spellings: its legacy node `reward_model` (model.path; in verl <= 0.7 served by an FSDP worker with
# micro-batches, max_length, ...) and verl 0.9's `reward.reward_model` (model_path; served by a rollout server).
# rlplat's reward model is a one-label sequence classifier served by a training engine's forward pass.

REWARD_MODEL_NODES = {"reward_model": "reward_model.model.path", "reward.reward_model": "reward.reward_model.model_path"}
CUSTOM_FUNCTION_PATHS = ("custom_reward_function.path", "reward.custom_reward_function.path", "reward.custom_function.path")
REWARD_MODEL_SERVER = ("verl serves the reward model with a rollout server; rlplat with a training engine's forward pass "
                       "(reward.model.engine, default fsdp2), which this server setting does not apply to")


def reward_model_on(context: Context) -> bool:
    return any(context.value(f"{node}.enable") is True for node in REWARD_MODEL_NODES)


def reward_model_pool(context: Context) -> bool:
    return any(context.value(f"{node}.enable_resource_pool") is True for node in REWARD_MODEL_NODES)


def reward_model_rule(node: str, path_key: str) -> None:
    @special(f"{node}.enable", [], "true accepted when the model path is given (`reward.model.path` turns rlplat's "
             "reward model on); refused with a custom reward function (verl's generative reward model: rlplat's is "
             "`reward.manager=judge`)")
    def _enable(item: Item, context: Context) -> Outcome:
        if item.value is not True:
            return ignored(item, "off: no reward model, as in rlplat without reward.model.path")
        if context.value(*CUSTOM_FUNCTION_PATHS) is not None:
            return refused(item, "with a custom reward function verl serves this model for the function to query (a "
                                 "generative reward model); rlplat's is reward.manager=judge (the judge role, "
                                 "roles.judge); rlplat's reward.model is a one-label sequence classifier")
        if context.value(*REWARD_MODEL_NODES.values(), "reward.model.path") is None:
            return refused(item, f"rlplat's reward model is on when reward.model.path is set: give {path_key}")
        return ignored(item, f"reward.model.path (from {path_key}) turns rlplat's reward model on")

    @special(path_key, ["reward.model.path"], f"-> `reward.model.path` when `{node}.enable` is true; ignored otherwise")
    def _path(item: Item, context: Context) -> Outcome:
        if context.value(f"{node}.enable") is not True or item.value is None:
            return ignored(item, f"verl reads it only with {node}.enable=true")
        return mapped(item, "reward.model.path")

    @special(f"{node}.enable_resource_pool", ["reward.model.placement"], "true -> `reward.model.placement=separate`; "
             "false (the actor's processes) ignored")
    def _pool(item: Item, context: Context) -> Outcome:
        if item.value is not True or not reward_model_on(context):
            return ignored(item, "the reward model runs in the actor's processes, rlplat's default (reward.model.placement="
                                 "colocated)" if reward_model_on(context) else "verl reads it only with the reward model on")
        return converted(item, "reward.model.placement", "separate", "the reward model gets a resource pool of its own")

    for key, target in (("nnodes", "reward.model.nnodes"), ("n_gpus_per_node", "reward.model.devices_per_node")):

        @special(f"{node}.{key}", [target], f"-> `{target}` with `enable_resource_pool=true`; ignored otherwise")
        def _pool_size(item: Item, context: Context, target: str = target) -> Outcome:
            if not (reward_model_on(context) and reward_model_pool(context)) or is_off(item.value):
                return ignored(item, "verl reads it only for a reward model with a resource pool of its own")
            return mapped(item, target)

    @special(f"{node}.rollout.*", ["reward.model.engine_config.dtype"], "`dtype` -> `reward.model.engine_config.dtype`; "
             "the rest sizes verl's reward-model server: ignored")
    def _server(item: Item, context: Context) -> Outcome:
        if not reward_model_on(context):
            return ignored(item, "verl reads it only with the reward model on")
        if item.key.endswith(".rollout.dtype") and item.value is not None:
            dtype = DTYPES.get(str(item.value))
            if dtype is None:
                return refused(item, f"rlplat's engine dtypes are {', '.join(sorted(set(DTYPES.values())))}")
            return converted(item, "reward.model.engine_config.dtype", dtype, "the reward model's engine runs in this dtype")
        return ignored(item, REWARD_MODEL_SERVER)

    @special(f"{node}.*", [], "read only with the reward model on; then refused: rlplat's `reward.model` has no such setting")
    def _other(item: Item, context: Context) -> Outcome:
        if not reward_model_on(context):
            return ignored(item, f"verl reads it only with {node}.enable=true")
        return refused(item, "rlplat's reward model has no such setting (rlplat config explain reward.model lists its keys)")


for _node, _path_key in REWARD_MODEL_NODES.items():
    reward_model_rule(_node, _path_key)


def when_reward_model(key: str, target: str, summary: str = "same meaning") -> Rule:
    """A legacy ``reward_model`` key -> ``target`` when the reward model is on (ignored otherwise and when null)."""

    def handle(item: Item, context: Context) -> Outcome:
        if not reward_model_on(context) or item.value is None:
            return ignored(item, "verl reads it only with the reward model on" if item.value is not None else "unset")
        return mapped(item, target)

    return add(Rule(key, (Target(target),), summary + "; read only with the reward model on", handle))


when_reward_model("reward_model.micro_batch_size_per_gpu", "reward.model.micro_batch_size_per_gpu",
                  "same meaning: rows per forward micro-batch per worker process")
when_reward_model("reward_model.use_dynamic_bsz", "reward.model.use_dynamic_bsz")
when_reward_model("reward_model.forward_max_token_len_per_gpu", "reward.model.max_token_len_per_gpu",
                  "same meaning: the token budget of a micro-batch with dynamic batch sizes")
when_reward_model("reward_model.model.use_remove_padding", "reward.model.engine_config.use_remove_padding",
                  "sequence packing in the reward model's engine")
for _key in ("param_offload", "reshard_after_forward"):
    when_reward_model(f"reward_model.model.fsdp_config.{_key}", f"reward.model.engine_config.{_key}")


@special("reward_model.micro_batch_size", ["reward.model.micro_batch_size_per_gpu"], "divided by the worker processes "
         "-> `reward.model.micro_batch_size_per_gpu`; read only with the reward model on")
def _reward_micro_batch(item: Item, context: Context) -> Outcome:
    if not reward_model_on(context):
        return ignored(item, "verl reads it only with the reward model on")
    return per_gpu(item, context, "reward.model.micro_batch_size_per_gpu")


@special("reward_model.max_length", ["reward.model.max_length"], "-> `reward.model.max_length` (rlplat keeps the last "
         "tokens, where the score is read); read only with the reward model on")
def _reward_max_length(item: Item, context: Context) -> Outcome:
    if not reward_model_on(context) or item.value is None:
        return ignored(item, "unset: no limit" if item.value is None else "verl reads it only with the reward model on")
    return Outcome([("reward.model.max_length", VERBATIM)], f"verl key {item.key} -> reward.model.max_length (a longer "
                   "conversation keeps its last tokens, where the score is read; verl's truncation=right keeps its first)")


@special("reward_model.truncation", [], "`left` accepted (rlplat keeps the last tokens); other sides refused when "
         "`reward_model.max_length` is set; ignored otherwise")
def _reward_truncation(item: Item, context: Context) -> Outcome:
    if not reward_model_on(context) or context.value("reward_model.max_length") is None or item.value == "left":
        return ignored(item, "rlplat cuts an overlong conversation on the left (keeps the last reward.model.max_length "
                             "tokens, where the score is read)")
    return refused(item, "rlplat cuts an overlong conversation on the left, keeping the last reward.model.max_length tokens "
                         "(where the score is read); give reward_model.truncation=left or drop reward_model.max_length")


@special("reward_model.strategy", ["reward.model.engine"], "`fsdp`/`fsdp2` -> `fsdp2`, `megatron` -> `megatron`; others "
         "refused; read only with the reward model on")
def _reward_strategy(item: Item, context: Context) -> Outcome:
    if not reward_model_on(context):
        return ignored(item, "verl reads it only with the reward model on")
    engine = fsdp_engine(item.value)
    if engine is None:
        return refused(item, "rlplat's training engines are fsdp2 (and megatron where installed)")
    return converted(item, "reward.model.engine", engine, "the training engine that serves the reward model's forward pass")


ignore("reward_model.model.input_tokenizer", "rlplat compares the reward model's tokenizer with the policy's itself and "
       "re-renders each conversation with the reward model's chat template when they differ (reward.model.retokenize=auto)")
only("reward_model.model.trust_remote_code", lambda value: value in (None, False), "false or unset",
     "rlplat loads the reward model without remote code",
     "rlplat loads the reward model with transformers' own classes, without remote code")
off_only("reward_model.model.external_lib", "unset", "rlplat imports no extra module for the reward model")
off_only("reward_model.model.override_config", "no override", "rlplat builds the reward model from its config.json as it is")
refuse("reward_model.model.override_config.*", "rlplat builds the reward model from its config.json as it is")
for _key in ("use_shm", "use_fused_kernels", "use_liger"):
    ignore(f"reward_model.model.{_key}", SPEED_ONLY)
equal_only("reward_model.model.fsdp_config.fsdp_size", -1, "rlplat shards over every process of the reward model's pool, "
           "as -1 asks", "rlplat has no hybrid sharding (HSDP)")
for _key in ("forward_prefetch", "wrap_policy.min_num_params"):
    ignore(f"reward_model.model.fsdp_config.{_key}", SPEED_ONLY)
equal_only("reward_model.ulysses_sequence_parallel_size", 1, "no sequence parallelism, as in rlplat",
           "rlplat has no sequence parallelism")

OVERLONG = "overlong_buffer_cfg"


for _node in ("reward_model.reward_kwargs", "reward.reward_kwargs"):

    @special(f"{_node}.*", ["reward.config.max_resp_len", "reward.config.overlong_buffer.enable",
             "reward.config.overlong_buffer.len", "reward.config.overlong_buffer.penalty_factor",
             "reward.config.overlong_buffer.log"], "`max_resp_len` and `overlong_buffer_cfg.*` -> `reward.config.max_resp_len` "
             "and `reward.config.overlong_buffer.*`; others refused")
    def _reward_kwargs(item: Item, context: Context, node: str = _node) -> Outcome:
        name = item.key[len(node) + 1:]
        if name == "max_resp_len":
            return mapped(item, "reward.config.max_resp_len")
        if name.startswith(f"{OVERLONG}.") and name[len(OVERLONG) + 1:] in ("enable", "len", "penalty_factor", "log"):
            return mapped(item, f"reward.config.overlong_buffer.{name[len(OVERLONG) + 1:]}")
        return refused(item, "rlplat's reward managers take no such argument")


# -- algorithm --------------------------------------------------------------------------------------------


@special("algorithm.adv_estimator", ["algorithm.name"], "rlplat's key; on a verl command line without `--algo` or "
         "`algorithm.name`, `gae`, `rloo`, `reinforce_plus_plus` and `remax` also select that rlplat algorithm", verl_only=False)
def _adv_estimator(item: Item, context: Context) -> Outcome:
    name = implied_algorithm(context)
    if name and name == ESTIMATOR_ALGORITHMS.get(str(item.value)):
        return Outcome([(item.key, VERBATIM), ("algorithm.name", name)],
                       f"verl key {show(item)} also sets algorithm.name={name} (rlplat's algorithm brings the critic, "
                       "reference and hooks verl derives from the estimator)")
    return unchanged(item)


@special("algorithm.filter_groups.enable", ["algorithm.name"], "rlplat's key; true on a verl command line without "
         "`--algo` or `algorithm.name` also selects the `dapo` algorithm", verl_only=False)
def _filter_groups(item: Item, context: Context) -> Outcome:
    if implied_algorithm(context) == "dapo":
        return Outcome([(item.key, VERBATIM), ("algorithm.name", "dapo")],
                       f"verl key {show(item)} also sets algorithm.name=dapo (rlplat's group filter is the dapo algorithm's)")
    return unchanged(item)


equal_only("algorithm.filter_groups.max_inflight_gen_batches", 1, "one generation round at a time, as in rlplat",
           "rlplat runs one generation round at a time")
off_only("algorithm.use_pf_ppo", "off", "rlplat has no preference-feedback PPO reweighting")
ignore("algorithm.pf_ppo.*", "verl reads it only with use_pf_ppo")


@special("algorithm.rollout_correction.*", [], "rlplat's node has verl's keys: taken as they are; a key verl's "
         "`RolloutCorrectionConfig` has and rlplat's lacks is refused")
def _rollout_correction(item: Item, context: Context) -> Outcome:
    import dataclasses

    from rlplat.losses.rollout_correction import RolloutCorrectionConfig

    name = item.key[len("algorithm.rollout_correction."):]
    if name in {field.name for field in dataclasses.fields(RolloutCorrectionConfig)}:
        return unchanged(item)
    return refused(item, "rlplat's algorithm.rollout_correction has no such key (see rlplat config explain algorithm.rollout_correction)")


# -- trainer ----------------------------------------------------------------------------------------------

rename("trainer.nnodes", "cluster.nnodes")
rename("trainer.default_local_dir", "trainer.output_dir", "the run directory; rlplat puts checkpoints in its checkpoints/")


CPU_WORKERS = ("verl runs one worker per GPU; rlplat's cluster.use_gpu=auto (the default) places these workers on GPUs when "
               "CUDA devices are visible and runs them as CPU processes on Ray otherwise (cluster.backend=ray, the "
               "default); cluster.backend=local runs one process: give trainer.n_gpus_per_node=1 with it")


@special("trainer.n_gpus_per_node", ["cluster.devices_per_node"], "-> `cluster.devices_per_node`: worker processes per "
         "machine, on GPUs when CUDA devices are visible (`cluster.use_gpu=auto`), else CPU processes on Ray")
def _gpus_per_node(item: Item, context: Context) -> Outcome:
    if context.given("cluster.use_gpu", "trainer.device"):
        return mapped(item, "cluster.devices_per_node")
    return Outcome([("cluster.devices_per_node", VERBATIM)], f"verl key {item.key} -> cluster.devices_per_node ({CPU_WORKERS})")


@special("trainer.device", ["cluster.use_gpu"], "`cuda` -> `cluster.use_gpu=true`, `cpu` -> false; others refused")
def _device(item: Item, context: Context) -> Outcome:
    if item.value in ("cuda", "cpu"):
        return converted(item, "cluster.use_gpu", item.value == "cuda", "rlplat places workers on GPUs or CPUs")
    return refused(item, "rlplat places workers on CUDA GPUs or CPUs")


@special("trainer.resume_mode", ["trainer.resume"], "`auto`, `disable` -> `trainer.resume`; `resume_path` -> "
         "`trainer.resume=<trainer.resume_from_path>`")
def _resume_mode(item: Item, context: Context) -> Outcome:
    if item.value in ("auto", "disable"):
        return mapped(item, "trainer.resume")
    path = context.value("trainer.resume_from_path")
    if item.value == "resume_path" and path:
        return converted(item, "trainer.resume", path, "the checkpoint of trainer.resume_from_path (an rlplat checkpoint)")
    return refused(item, "rlplat resumes auto, disable, or from a checkpoint path (resume_path with trainer.resume_from_path)")


@special("trainer.resume_from_path", [], "read with `trainer.resume_mode=resume_path`; ignored otherwise")
def _resume_from_path(item: Item, context: Context) -> Outcome:
    if context.value("trainer.resume_mode") == "resume_path":
        return ignored(item, "trainer.resume_mode=resume_path carries it into trainer.resume")
    return ignored(item, "verl reads it only with trainer.resume_mode=resume_path")


for _key, _meaning in (("save_freq", "saves no checkpoint"), ("test_freq", "never validates during training")):

    @special(f"trainer.{_key}", [f"trainer.{_key}"], f"rlplat's key; verl's -1 ({_meaning}) -> 0", verl_only=False)
    def _frequency(item: Item, context: Context, meaning: str = _meaning) -> Outcome:
        if item.value is not None and int(item.value) < 0:
            why = "rlplat's 0 saves only at the end and on Ctrl-C" if "save" in item.key else "rlplat's 0 never validates during training"
            return converted(item, item.key, 0, f"verl's -1 {meaning}; {why}")
        return unchanged(item)


TRACKERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "file": "jsonl", "jsonl": "jsonl"}


@special("trainer.logger", ["trainer.logger"], "rlplat's key; verl's `file` -> `jsonl`, one name -> a list; "
         "mlflow, swanlab, clearml, trackio, vemlp_wandb refused", verl_only=False)
def _logger(item: Item, context: Context) -> Outcome:
    names = [item.value] if isinstance(item.value, str) else list(item.value or [])
    missing = [name for name in names if name not in TRACKERS]
    if missing:
        return refused(item, f"rlplat logs to {', '.join(sorted(set(TRACKERS.values())))}; not to {', '.join(map(str, missing))}")
    loggers = list(dict.fromkeys(TRACKERS[name] for name in names))
    if loggers == item.value:
        return unchanged(item)
    return converted(item, "trainer.logger", loggers, "verl's file logger is rlplat's metrics.jsonl in the run directory"
                     if "file" in names else "rlplat's key takes a list")


@special("trainer.max_actor_ckpt_to_keep", ["trainer.keep_last"], "-> `trainer.keep_last`; null (keep all) ignored")
def _keep_actor(item: Item, context: Context) -> Outcome:
    if item.value is None:
        return ignored(item, "rlplat keeps trainer.keep_last checkpoints (3 by default); older ones do not change training")
    return mapped(item, "trainer.keep_last")


@special("trainer.max_critic_ckpt_to_keep", ["trainer.keep_last"], "-> `trainer.keep_last` when the actor's is not "
         "given; equal to it ignored; different refused (one checkpoint holds both)")
def _keep_critic(item: Item, context: Context) -> Outcome:
    actor = context.value("trainer.max_actor_ckpt_to_keep")
    if item.value is None or item.value == actor:
        return ignored(item, "an rlplat checkpoint holds the actor and the critic, kept per trainer.keep_last")
    if actor is None:
        return mapped(item, "trainer.keep_last")
    return refused(item, "an rlplat checkpoint holds the actor and the critic; give one number (trainer.max_actor_ckpt_to_keep)")


equal_only("trainer.critic_warmup", 0, "rlplat updates the actor from the first step, as 0 asks",
           "rlplat updates the actor from the first step; it has no critic warm-up")
@special("trainer.balance_batch", ["trainer.balance_batch"], "rlplat's key, same meaning: rows ordered so every "
         "data-parallel rank gets about the same tokens", verl_only=False)
def _balance_batch(item: Item, context: Context) -> Outcome:
    return unchanged(item)
off_only("trainer.log_val_generations", "0", "rlplat logs no sample generations")
off_only("trainer.rollout_data_dir", "unset", "rlplat does not dump rollouts")
off_only("trainer.validation_data_dir", "unset", "rlplat does not dump validation generations")
off_only("trainer.val_only", "off", "rlplat has no validate-only run")
off_only("trainer.default_hdfs_dir", "unset", "rlplat writes checkpoints to trainer.output_dir only")
off_only("trainer.del_local_ckpt_after_load", "off", "rlplat keeps the checkpoints it resumes from")
off_only("trainer.checkpoint_callback_class", "unset", "rlplat has no checkpoint callbacks")
ignore("trainer.esi_redundant_time", "verl's saving before an ESI instance expires")
ignore("trainer.ray_wait_register_center_timeout", "a timeout of verl's worker start-up")
ignore("trainer.use_legacy_worker_impl", "selects verl's worker implementation")
ignore("trainer.use_v1", "selects verl's trainer implementation")


# -- trainer.v1: verl 0.9's trainer modes -> trainer.mode and its staleness bound ---------------------------------

TRAINER_MODES = ("sync", "colocate_async", "separate_async")


def verl_trainer_mode(context: Context) -> str:
    return str(context.value("trainer.v1.trainer_mode", "trainer.mode", default="sync"))


@special("trainer.v1.trainer_mode", ["trainer.mode"], "same modes: `sync`, `colocate_async` (the rollout generates ahead "
         "in the actor's processes), `separate_async` (a rollout pool of its own); others refused")
def _trainer_mode(item: Item, context: Context) -> Outcome:
    if item.value not in TRAINER_MODES:
        return refused(item, f"rlplat's trainer modes are {', '.join(TRAINER_MODES)} (trainer.mode)")
    return mapped(item, "trainer.mode")


ignore("trainer.v1.sync", "the sync mode has no settings")
for _mode in ("colocate_async", "separate_async"):

    @special(f"trainer.v1.{_mode}.num_warmup_batches", ["trainer.rollout_ahead"], f"with `trainer_mode={_mode}`: N "
             "whole batches -> `trainer.rollout_ahead=N+1`; fractions refused; ignored in other modes")
    def _warmup_batches(item: Item, context: Context, mode: str = _mode) -> Outcome:
        if verl_trainer_mode(context) != mode:
            return ignored(item, f"verl reads it only with trainer.v1.trainer_mode={mode}")
        value = float(item.value)
        if value != int(value) or value < 0:
            return refused(item, "rlplat generates whole batches ahead: give a whole number (trainer.rollout_ahead counts "
                                 "the batches in flight)")
        return converted(item, "trainer.rollout_ahead", int(value) + 1, "verl generates this many batches beyond the one "
                         "being trained; rlplat's rollout_ahead counts that one too")


@special("trainer.v1.separate_async.parameter_sync_step", [], "accepted and ignored when it is `data.train_batch_size / "
         "ppo_mini_batch_size` (verl requires that; rlplat's step makes that many optimizer steps, then syncs); refused "
         "otherwise")
def _parameter_sync_step(item: Item, context: Context) -> Outcome:
    if verl_trainer_mode(context) != "separate_async":
        return ignored(item, "verl reads it only with trainer.v1.trainer_mode=separate_async")
    prompts = int(context.setting("data.train_batch_size"))
    mini = int(context.setting("actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"))
    steps = max(1, prompts // max(1, mini))
    if int(item.value) == steps:
        return ignored(item, f"rlplat's step makes data.train_batch_size / ppo_mini_batch_size = {prompts} / {mini} = {steps} "
                             "optimizer steps, then sends the weights to the rollout, as this asks")
    return refused(item, f"verl requires data.train_batch_size = parameter_sync_step x ppo_mini_batch_size ({steps} mini-"
                         "batches here); rlplat syncs the rollout after every step, one optimizer step per mini-batch")


@special("trainer.v1.separate_async.hybrid_rollout.*", [], "`enable_switch` on refused (rlplat does not lend the "
         "trainer's devices to the rollout); the rest read only with it")
def _hybrid_rollout(item: Item, context: Context) -> Outcome:
    if item.key.endswith(".enable_switch") and item.value:
        return refused(item, "rlplat does not lend the trainer's devices to the rollout; size the rollout's own pool "
                             "(actor_rollout_ref.rollout.nnodes, n_gpus_per_node -> roles.rollout.*)")
    return ignored(item, "verl reads it only with hybrid_rollout.enable_switch on")


@special("trainer.v1.sampler.max_off_policy_threshold", ["trainer.max_staleness"], "asynchronous modes: N policy "
         "versions a trajectory may span -> `trainer.max_staleness=N-1` (updates it may lag); null refused; ignored in sync")
def _off_policy_threshold(item: Item, context: Context) -> Outcome:
    if verl_trainer_mode(context) == "sync":
        return ignored(item, "verl reads it only in its asynchronous modes; sync trains on-policy")
    if item.value is None:
        return refused(item, "rlplat always bounds staleness: give a number of versions (-> trainer.max_staleness)")
    if int(item.value) < 1:
        return refused(item, "a trajectory spans at least one policy version")
    return converted(item, "trainer.max_staleness", int(item.value) - 1, "verl counts the versions a trajectory spans, "
                     "rlplat the updates it lags behind the weights it trains: one less")


@special("trainer.v1.sampler.max_off_policy_strategy", ["trainer.staleness_policy"], "asynchronous modes: `drop`, `wait` "
         "-> `trainer.staleness_policy`, same meaning; ignored in sync")
def _off_policy_strategy(item: Item, context: Context) -> Outcome:
    if verl_trainer_mode(context) == "sync":
        return ignored(item, "verl reads it only in its asynchronous modes")
    if item.value not in ("drop", "wait"):
        return refused(item, "rlplat's staleness policies are drop and wait (trainer.staleness_policy)")
    return mapped(item, "trainer.staleness_policy")


off_only("trainer.v1.sampler.sync_refill_failed_groups", "off", "rlplat has no failed groups to refill: a generation that "
         "fails stops the run with the worker's error")
gated("trainer.v1.sampler.custom_sampler", "path", "rlplat's sampler is its seeded shuffle (data.seed)")
off_only("trainer.v1.sampler.sampler_kwargs", "none", "rlplat's sampler is its seeded shuffle (data.seed)")
refuse("trainer.v1.*", "rlplat's trainer has no such setting (trainer.mode, max_staleness, staleness_policy, rollout_ahead, "
       "rollout_dispatch: rlplat config explain trainer)")


# -- whole nodes only verl has ------------------------------------------------------------------------------

gated("global_profiler", "tool", "rlplat has no profiler integration")
gated("transfer_queue", "enable", "rlplat has no transfer queue")
gated("distillation", "enabled", "rlplat has no distillation")
off_only("ray_kwargs.ray_init.num_cpus", "unset", "rlplat starts its local Ray cluster itself; use cluster.address to join one")
off_only("ray_kwargs.ray_init.runtime_env.py_executable", "unset", "rlplat's workers run the driver's Python")
off_only("ray_kwargs.timeline_json_file", "unset", "rlplat writes no Ray timeline")
ignore("hydra.*", "hydra's own settings; rlplat does not run hydra")


@special("skip.*", [], "every `enable` off accepted (the rest is read only with it); on refused")
def _skip(item: Item, context: Context) -> Outcome:
    if item.key.endswith(".enable"):
        return refused(item, "rlplat has no rollout replay") if item.value else ignored(item, "off, as in rlplat")
    return ignored(item, "verl reads it only with its enable switch on")


RULES: tuple[Rule, ...] = tuple(RULES_BUILT)
EXACT = {rule.key: rule for rule in RULES if not rule.key.endswith(".*")}
PREFIXES = sorted((rule for rule in RULES if rule.key.endswith(".*")), key=lambda rule: -len(rule.key))


def find_rule(key: str) -> Rule | None:
    """The rule of ``key``: its own, else the longest node rule above it."""
    if key in EXACT:
        return EXACT[key]
    return next((rule for rule in PREFIXES if key.startswith(rule.key[:-1])), None)


# -- translation -------------------------------------------------------------------------------------------


def parse_argument(argument: str, refusals: list[str]) -> Item | None:
    """One command-line argument -> an Item (None: not ``key=value``; it passes as written)."""
    key, sep, raw = argument.partition("=")
    if key.startswith("~"):
        refusals.append(f"{argument}: hydra's ~ deletes a key; rlplat's config has no deletion: leave the key out")
        return None
    if not sep:
        return None
    stripped = key.lstrip("+")
    return Item(stripped, parse_value(raw), raw, "overrides", key[: len(key) - len(stripped)])


def flatten(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves of a nested mapping as (dotted key, value); empty mappings and lists are leaves."""
    leaves = []
    for key, value in node.items():
        if isinstance(value, Mapping) and value:
            leaves.extend(flatten(value, f"{prefix}{key}."))
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves


def translate_items(items: Sequence[Item], algo: str | None, rollout: str | None,
                    notes: list[str], refusals: list[str]) -> list[list[tuple[str, Any]]]:
    """Each item's rlplat settings, in order; notes and refusals are appended to the lists given."""
    context = Context(items, algo, rollout)
    settings = []
    for item in items:
        rule = find_rule(item.key)
        if rule is not None:
            try:
                outcome = rule.handle(item, context)
            except (TypeError, ValueError) as error:
                outcome = refused(item, f"not a value this key takes ({error})")
        elif item.key.split(".")[0] in VERL_ONLY_ROOTS:
            outcome = refused(item, "no rlplat equivalent")
        else:
            outcome = unchanged(item)
        if outcome.refusal:
            refusals.append(outcome.refusal)
        if item.prefix:
            notes.append(f"hydra prefix '{item.prefix}' dropped from {item.prefix}{item.key}: every rlplat key exists, "
                         "so nothing is added")
        if outcome.note:
            notes.append(outcome.note)
        settings.append(outcome.settings)
    return settings


def raise_refusals(refusals: Sequence[str]) -> None:
    """One :class:`rlplat.config.ConfigError` listing every refusal, one per line."""
    if not refusals:
        return
    # rlplat.config pulls in torch (through rlplat.data): imported only to raise the error its callers catch
    from rlplat.config import ConfigError

    lines = "\n".join(f"  {refusal}" for refusal in refusals)
    raise ConfigError(f"{len(refusals)} verl key(s) with no rlplat equivalent; remove them (docs/coming-from-verl.md "
                      f"says why):\n{lines}")


def translate_overrides(arguments: Sequence[str], *, algo: str | None = None, rollout: str | None = None) -> tuple[list[str], list[str]]:
    """Dotted ``key=value`` arguments, some in verl's keys, -> (the same in rlplat's keys, one note per
    translation). ``algo`` and ``rollout`` are the CLI's ``--algo`` and ``--rollout`` (some keys depend on
    them). Raises :class:`rlplat.config.ConfigError` listing every key rlplat has no equivalent for."""
    _, translated, notes = translate_command_line(None, arguments, algo=algo, rollout=rollout)
    return translated, notes


def translate_mapping(mapping: Mapping[str, Any], *, algo: str | None = None, rollout: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """A nested config in verl's layout (top-level ``actor_rollout_ref``, ...) -> (rlplat's nested config,
    notes). Same rules and errors as :func:`translate_overrides`; hydra's ``_target_`` keys are dropped
    and a value ``???`` (verl's "required") counts as not given."""
    notes: list[str] = []
    refusals: list[str] = []
    items = file_items(mapping, notes, refusals)
    settings = translate_items(items, algo, rollout, notes, refusals)
    raise_refusals(refusals)
    return nest(items, settings), notes


def file_items(mapping: Mapping[str, Any], notes: list[str], refusals: list[str]) -> list[Item]:
    if "defaults" in mapping:
        refusals.append("defaults: hydra's defaults list composes other files, which rlplat does not; write the keys out")
    leaves = [(key, value) for key, value in flatten(mapping) if key != "defaults"]
    targets = [key for key, _ in leaves if key.split(".")[-1] == "_target_"]
    if targets:
        notes.append(f"dropped {len(targets)} _target_ key(s): verl's class paths mean nothing to rlplat")
    return [Item(key, value, None, "file") for key, value in leaves if key not in targets and value != "???"]


def nest(items: Sequence[Item], settings: Sequence[Sequence[tuple[str, Any]]]) -> dict[str, Any]:
    node = OmegaConf.create({})
    for item, pairs in zip(items, settings):
        for key, value in pairs:
            OmegaConf.update(node, key, item.value if value is VERBATIM else value, merge=True)
    return OmegaConf.to_container(node)


def translate_command_line(
    config_file: str | os.PathLike | None, overrides: Sequence[str], *, algo: str | None = None, rollout: str | None = None,
) -> tuple[str | None, list[str], list[str]]:
    """What ``rlplat run`` and ``rlplat config show`` do before ``load_config``: the overrides and the
    ``--config`` file translated together (a key may depend on another in either place). Returns
    (config file to load, overrides, notes): the file as given when nothing in it changes, else its
    translation written to the temporary directory, which a note names. Raises
    :class:`rlplat.config.ConfigError` listing every refused key of both."""
    notes: list[str] = []
    refusals: list[str] = []
    parsed = [(argument, parse_argument(argument, refusals)) for argument in overrides]
    file_node = read_yaml(config_file)
    file_part = file_items(file_node, notes, refusals) if file_node is not None else []
    items = file_part + [item for _, item in parsed if item is not None]
    settings = translate_items(items, algo, rollout, notes, refusals)
    raise_refusals(refusals)
    file_settings, override_settings = settings[: len(file_part)], iter(settings[len(file_part):])
    if any(pairs != [(item.key, VERBATIM)] for item, pairs in zip(file_part, file_settings)):
        handle, path = tempfile.mkstemp(prefix=f"{Path(config_file).stem}.rlplat-", suffix=".yaml")
        with os.fdopen(handle, "w") as stream:
            stream.write(OmegaConf.to_yaml(OmegaConf.create(nest(file_part, file_settings))))
        notes.append(f"--config {config_file} has verl keys: its rlplat translation is {path}")
        config_file = path
    arguments: list[str] = []
    for argument, item in parsed:
        if item is None:
            arguments.append(argument)
            continue
        for key, value in next(override_settings):
            arguments.append(f"{key}={item.raw if value is VERBATIM else format_value(value)}")
    return (None if config_file is None else str(config_file)), arguments, notes


def read_yaml(config_file: str | os.PathLike | None) -> dict[str, Any] | None:
    """The file's mapping, interpolations resolved where they can be; None when there is no file or it is
    not a YAML mapping (``load_config`` reports that)."""
    if config_file is None or not Path(config_file).is_file():
        return None
    try:
        node = OmegaConf.load(config_file)
    except Exception:
        return None
    if not OmegaConf.is_dict(node):
        return None
    try:
        return OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    except Exception:
        return OmegaConf.to_container(node, resolve=False)


# -- the table, for docs/coming-from-verl.md --------------------------------------------------------------


def markdown_table() -> str:
    """The rules as a Markdown table: verl key, rlplat key(s), how."""
    lines = ["| verl key | rlplat key | how |", "| --- | --- | --- |"]
    for rule in RULES:
        targets = ", ".join(str(target) for target in rule.targets) or "—"
        lines.append(f"| `{rule.key}` | {targets} | {rule.summary.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
