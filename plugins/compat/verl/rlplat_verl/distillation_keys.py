"""The verl key table, on-policy distillation: verl 0.9's ``distillation`` node -> rlplat-distill's
``distillation.teachers``, ``roles.teacher`` and one entry of ``actor.loss.terms``. Importing this module adds
its rules to :data:`rlplat_verl.rules.RULES_BUILT`.

``distillation`` is rlplat's node too: its own keys (``teachers.*``, ``top_k``, ``unrouted``, ``sleep``) have no
rule here and pass unchanged; ``teacher_key`` means the same in both. verl's loss is one node of several keys
(``distillation_loss.*``) and becomes one term of rlplat's actor loss, so ``distillation.enabled=true`` writes
the term (from the keys given and verl's defaults for the others) and each loss key's note says what it
became in it.
"""

from __future__ import annotations

from typing import Any

from rlplat_verl.rules import (RLPLAT_DEFAULTS, Context, Item, Outcome, Target, format_value, ignored, mapped,
                               refused, show, special, unchanged, verl_drops_the_ppo_loss)
from rlplat_verl.training_keys import DTYPES

NODE, LOSS, TEACHERS = "distillation", "distillation.distillation_loss", "distillation.teacher_models"
DEFAULT_TEACHER = "teacher_model"
#: verl 0.9's distillation.yaml: what its loss reads for a key not given (its dataclass defaults differ; the YAML's apply)
VERL_LOSS = {
    "loss_mode": "k3", "topk": 32, "use_task_rewards": True, "distillation_loss_coef": 1.0, "loss_max_clamp": None,
    "log_prob_min_clamp": None, "use_policy_gradient": False, "policy_loss_mode": "vanilla", "clip_ratio": 0.2,
    "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
}
#: verl's single-sample reverse-KL estimators, each an ``estimator`` of rlplat's ``reverse_kl`` of the same name
SAMPLED_MODES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
TOPK_MODES = ("forward_kl_topk",)
#: rlplat's keys the translation of verl's loss writes; given beside it, they are refused
WRITTEN = ("actor.loss.terms", "actor.loss.policy_loss_coef", "distillation.top_k")
#: rlplat's core defaults of ``actor.loss`` where the run's algorithm sets none
CORE_ACTOR_LOSS = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "use_kl_loss": False, "entropy_coeff": 0.0}

OFF = f"verl reads it only with {NODE}.enabled=true"
TEACHER_SERVER = ("verl serves each teacher with a rollout server; rlplat's teachers score with a training engine's forward "
                  "pass (distillation.teachers.<name>.engine, the actor's engine by default), which this server setting "
                  "does not apply to")


# -- what the rules read ------------------------------------------------------------------------------------


def distilling(context: Context) -> bool:
    return context.value(f"{NODE}.enabled") is True


def loss(context: Context, name: str) -> Any:
    """verl's ``distillation_loss.<name>``: given, else its YAML default."""
    return context.value(f"{LOSS}.{name}", default=VERL_LOSS[name])


def loss_mode(context: Context) -> str:
    return str(loss(context, "loss_mode"))


def policy_gradient(context: Context) -> bool:
    """verl trains the sampled-token loss with its policy gradient (the PPO-clipped form)."""
    return loss(context, "use_policy_gradient") is True and loss_mode(context) in SAMPLED_MODES


def teacher_names(context: Context) -> list[str]:
    """The teachers verl keeps: the entries of ``teacher_models`` (its default entry ``teacher_model`` is always
    there), the default entry dropped when others are named (verl's ``_resolve_teacher_models``)."""
    names = [DEFAULT_TEACHER]
    for layer in (context.file, context.overrides):
        for key in layer:
            if key.startswith(f"{TEACHERS}."):
                name = key[len(TEACHERS) + 1:].split(".")[0]
                if name not in names:
                    names.append(name)
    return names[1:] if len(names) > 1 else names


def has_teacher(context: Context) -> bool:
    """A teacher model is named: by a teacher verl keeps, or under rlplat's ``distillation.teachers``."""
    verl = any(context.value(f"{TEACHERS}.{name}.model_path") is not None for name in teacher_names(context))
    rlplat = any(key.startswith(f"{NODE}.teachers.") and key.endswith(".model_path") and value is not None
                 for layer in (context.overrides, context.file) for key, value in layer.items())
    return verl or rlplat


def actor_loss(context: Context, name: str, *, verl_key: bool = True) -> Any:
    """The value of ``actor.loss.<name>`` rlplat will run with: given (verl's key, unless ``verl_key`` is false, or
    rlplat's), else the run algorithm's default, else core's."""
    from rlplat import registry

    algorithm = context.algorithm_name() or RLPLAT_DEFAULTS["algorithm.name"]
    defaults = dict(CORE_ACTOR_LOSS)
    if algorithm in registry.names("algorithm"):
        defaults.update(registry.get("algorithm", algorithm)().default_nodes()["actor"]["loss"])
    keys = ([f"actor_rollout_ref.actor.{name}"] if verl_key else []) + [f"actor.loss.{name}"]
    return context.value(*keys, default=defaults.get(name))


def clip_sides(context: Context) -> list[tuple[str, float, str, float]]:
    """Per side (``low``, ``high``): verl's clip ratio of the distillation loss, the key it comes from, and the
    actor's clip ratio in rlplat (which rlplat's ``reverse_kl`` clips with)."""
    sides = []
    for side in ("low", "high"):
        source = f"{LOSS}.clip_ratio_{side}" if loss(context, f"clip_ratio_{side}") is not None else f"{LOSS}.clip_ratio"
        distillation = float(context.value(source, default=VERL_LOSS[source.rsplit(".", 1)[1]]))
        actor = actor_loss(context, f"clip_ratio_{side}")
        sides.append((side, distillation, source, float(actor if actor is not None else actor_loss(context, "clip_ratio"))))
    return sides


def clip_mismatch(context: Context, sides: list[tuple[str, float, str, float]]) -> str:
    differ = "; ".join(f"clip_ratio_{side} {distillation} for the distillation loss"
                       f"{' (from its clip_ratio)' if source.endswith('.clip_ratio') else ''}, {actor} for the actor's"
                       for side, distillation, source, actor in sides)
    fix = ("with use_task_rewards=false verl does not use the actor's, so set actor_rollout_ref.actor.clip_ratio_low/high "
           "to the distillation loss's" if verl_drops_the_ppo_loss(context) else
           "give verl's distillation_loss and the actor the same clip ratios")
    return (f"rlplat's reverse_kl clips its policy gradient with the actor's clip ratios (actor.loss.clip_ratio_low/high), "
            f"and verl's differ: {differ}; {fix}")


def distillation_term(context: Context) -> dict[str, Any] | None:
    """The entry of ``actor.loss.terms`` verl's ``distillation_loss`` describes (None: a loss mode rlplat lacks)."""
    mode = loss_mode(context)
    coef = float(loss(context, "distillation_loss_coef")) if loss(context, "use_task_rewards") else 1.0
    if mode in SAMPLED_MODES:
        term = {"loss_mode": "reverse_kl", "coef": coef, "estimator": mode,
                "use_policy_gradient": loss(context, "use_policy_gradient") is True}
    elif mode in TOPK_MODES:
        term = {"loss_mode": "forward_kl_topk", "coef": coef, "renormalize": False}
    else:
        return None
    clamp = loss(context, "loss_max_clamp")
    if clamp is not None:
        term["loss_max_clamp"] = float(clamp)
    return term


# -- the node's switch: it writes the whole loss -----------------------------------------------------------------


@special(f"{NODE}.enabled", [*WRITTEN, "actor.loss.use_kl_loss", "actor.loss.entropy_coeff"], "true writes verl's loss "
         "as rlplat's: `actor.loss.terms` (one term from `distillation_loss.*`, verl's defaults for the keys not given), "
         "`actor.loss.policy_loss_coef`, `distillation.top_k` for forward_kl_topk, and with `use_task_rewards=false` "
         "the KL loss and entropy bonus off (verl drops them with the PPO loss); refused without a teacher's "
         "`model_path`, beside rlplat's own `actor.loss.terms`, `policy_loss_coef` or `distillation.top_k`, and with a "
         "rollout temperature other than 1 (verl's teacher scores at 1, rlplat's at the rollout's); false: every other "
         "verl key of the node ignored")
def _enabled(item: Item, context: Context) -> Outcome:
    if item.source == "file" and item.key in context.overrides:
        return ignored(item, "the command line's distillation.enabled decides")
    if not distilling(context):
        return ignored(item, "off: no teachers, as in rlplat without distillation.teachers")
    given = [key for key in WRITTEN if context.given(key)]
    if given:
        return refused(item, f"verl's distillation node writes {', '.join(WRITTEN)}, and {', '.join(given)} is given too: "
                             "write the loss one way, verl's distillation.distillation_loss.* or rlplat's keys (then "
                             "leave distillation.enabled out)")
    if not has_teacher(context):
        return refused(item, f"no teacher: give {TEACHERS}.{DEFAULT_TEACHER}.model_path (a local Hugging Face directory)")
    temperature = float(context.setting("rollout.temperature", "actor_rollout_ref.rollout.temperature"))
    if temperature != 1.0:
        return refused(item, f"verl scores the teacher at temperature 1 and the student at the rollout's ({temperature}); "
                             "rlplat's teacher scores at the rollout's temperature too, so the two losses differ: "
                             "distil with actor_rollout_ref.rollout.temperature=1.0")
    term = distillation_term(context)
    if term is None:
        return Outcome([], None)  # the loss mode's own rule refuses it
    coef = 1.0 if loss(context, "use_task_rewards") else 0.0
    settings: list[tuple[str, Any]] = [("actor.loss.terms", [term]), ("actor.loss.policy_loss_coef", coef)]
    if term["loss_mode"] in TOPK_MODES:
        settings.append(("distillation.top_k", int(loss(context, "topk"))))
    if verl_drops_the_ppo_loss(context):  # verl's keys of these two are ignored then; rlplat's decide
        if not context.given("actor.loss.use_kl_loss") and actor_loss(context, "use_kl_loss", verl_key=False) is True:
            settings.append(("actor.loss.use_kl_loss", False))
        if not context.given("actor.loss.entropy_coeff") and float(actor_loss(context, "entropy_coeff", verl_key=False) or 0):
            settings.append(("actor.loss.entropy_coeff", 0.0))
    written = ", ".join(f"{key}={format_value(value)}" for key, value in settings)
    why = ("verl's distillation loss as a term of rlplat's actor loss, from distillation.distillation_loss.* and verl's "
           "defaults for the keys not given")
    if verl_drops_the_ppo_loss(context):
        why += "; use_task_rewards=false: verl multiplies its whole PPO loss, KL loss and entropy bonus included, by 0"
    return Outcome(settings, f"verl key {show(item)} -> {written} ({why})")


@special(f"{NODE}.teacher_key", [f"{NODE}.teacher_key"], "rlplat's key, same meaning: the row field whose value routes a "
         "row to a teacher", verl_only=False)
def _teacher_key(item: Item, context: Context) -> Outcome:
    return unchanged(item)


# -- the teachers' pool ---------------------------------------------------------------------------------------------


@special(f"{NODE}.nnodes", ["roles.teacher.placement", "roles.teacher.nnodes"], "above 0 -> `roles.teacher.nnodes` with "
         "`roles.teacher.placement=separate` (a pool of its own, as verl's); 0 ignored (rlplat's teachers then run in the "
         "actor's processes, `placement=colocated`)")
def _nnodes(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if not item.value:
        return ignored(item, "no pool of its own: rlplat's teachers run in the actor's processes (roles.teacher.placement="
                             "colocated, the default)")
    return mapped(item, "roles.teacher.nnodes", [("roles.teacher.placement", "separate",
                                                  "the teachers get a resource pool of their own, as in verl")])


@special(f"{NODE}.n_gpus_per_node", ["roles.teacher.devices_per_node"], "-> `roles.teacher.devices_per_node` with "
         "`distillation.nnodes` above 0; ignored otherwise")
def _devices(item: Item, context: Context) -> Outcome:
    if not distilling(context) or not context.value(f"{NODE}.nnodes"):
        return ignored(item, f"verl reads it only for a teacher pool of its own ({NODE}.nnodes above 0)")
    return mapped(item, "roles.teacher.devices_per_node")


# -- the teachers -----------------------------------------------------------------------------------------------------


@special(f"{TEACHERS}.*", [Target("distillation.teachers.<name>.model_path"), Target("distillation.teachers.<name>.data_sources"),
         Target("distillation.teachers.<name>.engine_config.dtype")], "`<name>.model_path` -> `distillation.teachers.<name>."
         "model_path`; `<name>.key` -> `data_sources=[key]` with several teachers (a lone teacher scores every row, as in "
         "verl: rlplat's default teacher); `inference.dtype` -> `engine_config.dtype`; `num_replicas` and the rest of "
         "`inference.*` (verl's teacher server) ignored; the entry `teacher_model` ignored when other teachers are named "
         "(verl drops it); other keys refused")
def _teacher(item: Item, context: Context) -> Outcome:
    name, _, setting = item.key[len(TEACHERS) + 1:].partition(".")
    if not distilling(context):
        return ignored(item, OFF)
    names = teacher_names(context)
    if name not in names:
        return ignored(item, f"verl drops its default entry {DEFAULT_TEACHER} when other teachers are named; name every "
                             "teacher (teacher_model1, ...) to keep it")
    where, entry = f"distillation.teachers.{name}", f"{TEACHERS}.{name}"
    if setting == "model_path":
        if item.value is None:
            return ignored(item, "unset")
        if len(names) > 1 and context.value(f"{entry}.key") is None:
            return refused(item, f"verl routes rows among several teachers by their key: give {entry}.key (the "
                                 f"{context.value(f'{NODE}.teacher_key', default='data_source')} of the rows it scores)")
        return mapped(item, f"{where}.model_path")
    if setting == "key":
        if len(names) == 1:
            return ignored(item, "verl sends every row to a lone teacher whatever its key: rlplat's default teacher "
                                 "(data_sources null) does the same")
        if item.value is None:
            return ignored(item, "unset")
        if context.value(f"{entry}.model_path") is None:
            return refused(item, f"a teacher needs its model: give {entry}.model_path")
        route = context.value(f"{NODE}.teacher_key", default="data_source")
        return Outcome([(f"{where}.data_sources", [str(item.value)])], f"verl key {show(item)} -> {where}.data_sources="
                       f"{format_value([str(item.value)])} (the rows whose {route} is {item.value} go to this teacher)")
    if setting == "num_replicas":
        return ignored(item, "how many teacher servers verl starts; rlplat's teachers run on every process of their "
                             "placement (roles.teacher)")
    if setting == "inference.dtype":
        if item.value is None:
            return ignored(item, "unset: the teacher's engine runs in the actor's engine dtype")
        dtype = DTYPES.get(str(item.value))
        if dtype is None:
            return refused(item, f"rlplat's engine dtypes are {', '.join(sorted(set(DTYPES.values())))}")
        return Outcome([(f"{where}.engine_config.dtype", dtype)], f"verl key {show(item)} -> {where}.engine_config.dtype="
                       f"{dtype} (the teacher's engine scores in this dtype)")
    if setting.startswith("inference."):
        return ignored(item, TEACHER_SERVER)
    return refused(item, "verl's teacher entries have key, model_path, num_replicas and inference.*")


# -- the loss -> one term of actor.loss.terms -------------------------------------------------------------------------


def into_term(item: Item, written: str, why: str) -> Outcome:
    """A loss key's note: what it became in the settings ``distillation.enabled`` writes."""
    return Outcome([], f"verl key {show(item)} -> {written} ({why}; distillation.enabled writes it)")


@special(f"{LOSS}.loss_mode", ["actor.loss.terms"], "k1/kl, k2/mse, k3/low_var_kl, abs -> the term `{loss_mode: "
         "reverse_kl, estimator: <the same>}` (k1 without `use_policy_gradient=true` refused, as verl refuses it); `forward_kl_topk` -> `{loss_mode: forward_kl_topk, renormalize: false}` "
         "(verl's top-k KL is not renormalised; verl also clamps each position at 0, rlplat does not); others refused")
def _loss_mode(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if item.value in ("k1", "kl") and loss(context, "use_policy_gradient") is not True:
        return refused(item, "k1 differentiated directly (use_policy_gradient=false, verl's default) has a gradient that "
                             "does not depend on the teacher, and verl refuses it too: give "
                             "distillation.distillation_loss.use_policy_gradient=true, or loss_mode=k3")
    if item.value in SAMPLED_MODES:
        return into_term(item, f"actor.loss.terms: {{loss_mode: reverse_kl, estimator: {item.value}}}", "the same "
                         "single-sample estimate of the reverse KL on the sampled tokens")
    if item.value in TOPK_MODES:
        return into_term(item, "actor.loss.terms: {loss_mode: forward_kl_topk, renormalize: false}", "verl sums over the "
                         "teacher's top-k ids without renormalising; unlike rlplat, verl also clamps each position's value "
                         "at 0, which only bites where the student puts more mass on those ids than the teacher")
    return refused(item, f"rlplat's distillation losses take verl's {', '.join(SAMPLED_MODES + TOPK_MODES)} (and offer "
                         "reverse_kl_topk and jsd_topk through actor.loss.terms)")


@special(f"{LOSS}.topk", ["distillation.top_k"], "-> `distillation.top_k` with forward_kl_topk; ignored with the "
         "sampled-token losses")
def _topk(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if loss_mode(context) not in TOPK_MODES:
        return ignored(item, "verl reads it only with loss_mode=forward_kl_topk")
    return into_term(item, f"distillation.top_k={format_value(int(item.value))}", "the teacher's most likely tokens per "
                     "position")


@special(f"{LOSS}.use_task_rewards", ["actor.loss.policy_loss_coef"], "true -> `actor.loss.policy_loss_coef=1` and the "
         "term's `coef` = `distillation_loss_coef`; false -> `policy_loss_coef=0` (pure distillation) and `coef` 1")
def _use_task_rewards(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if item.value:
        return into_term(item, "actor.loss.policy_loss_coef=1.0", "the RL policy loss stays; the term's coef is "
                         "distillation_loss_coef")
    return into_term(item, "actor.loss.policy_loss_coef=0.0", "pure distillation: verl multiplies its whole PPO loss, KL "
                     "loss and entropy bonus included, by 0; the term's coef is 1")


@special(f"{LOSS}.distillation_loss_coef", ["actor.loss.terms"], "-> the term's `coef` with `use_task_rewards=true`; "
         "ignored otherwise (coef 1)")
def _coef(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if not loss(context, "use_task_rewards"):
        return ignored(item, "verl reads it only with use_task_rewards=true; the term's coef is 1")
    return into_term(item, f"actor.loss.terms: {{coef: {format_value(float(item.value))}}}", "the distillation term's "
                     "weight beside the RL policy loss")


@special(f"{LOSS}.loss_max_clamp", ["actor.loss.terms"], "-> the term's `loss_max_clamp` (each token's value clamped to "
         "[-c, c], as in verl); null ignored")
def _loss_max_clamp(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if item.value is None:
        return ignored(item, "unset: no clamp, as in rlplat")
    return into_term(item, f"actor.loss.terms: {{loss_max_clamp: {format_value(float(item.value))}}}", "each token's "
                     "value clamped to [-c, c], as in verl")


@special(f"{LOSS}.log_prob_min_clamp", [], "null accepted; ignored with the sampled-token losses (verl reads it only in "
         "forward_kl_topk); otherwise refused: rlplat's forward_kl_topk does not clamp the log-probs")
def _log_prob_min_clamp(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if item.value is None:
        return ignored(item, "unset: no clamp, as in rlplat")
    if loss_mode(context) not in TOPK_MODES:
        return ignored(item, "verl reads it only with loss_mode=forward_kl_topk")
    return refused(item, "rlplat's forward_kl_topk compares the teacher's and the student's log-probs as they are, without "
                         "a lower clamp: set it to null")


@special(f"{LOSS}.use_policy_gradient", ["actor.loss.terms"], "sampled-token losses: -> the term's `use_policy_gradient` "
         "(true: advantage minus the estimate, PPO-clipped with the actor's clip ratios, refused when verl's distillation "
         "clip ratios differ from them); forward_kl_topk: false ignored (rlplat "
         "differentiates the divergence), true refused")
def _use_policy_gradient(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if loss_mode(context) in TOPK_MODES:
        if item.value:
            return refused(item, "rlplat's forward_kl_topk differentiates the top-k divergence itself; verl's policy-gradient "
                                 "form (the divergence as the sampled token's advantage) has no rlplat loss: give false, "
                                 "which verl recommends for forward_kl_topk")
        return ignored(item, "rlplat's forward_kl_topk differentiates the divergence, as false asks")
    if loss_mode(context) not in SAMPLED_MODES:
        return ignored(item, "the loss mode's rule decides")
    if not item.value:
        return into_term(item, "actor.loss.terms: {use_policy_gradient: false}", "the estimate differentiated directly, "
                         "as in verl")
    unsourced = [side for side in clip_sides(context) if side[1] != side[3] and not context.given(side[2])]
    if unsourced:
        return refused(item, clip_mismatch(context, unsourced) + " (verl's defaults are 0.2)")
    return into_term(item, "actor.loss.terms: {use_policy_gradient: true}", "advantage minus the estimate, PPO-clipped "
                     "with actor.loss's clip ratios, which equal verl's distillation ones; verl also caps a token's loss "
                     "at 3 times its advantage (the dual clip), which only bites where the ratio passes 3")


@special(f"{LOSS}.policy_loss_mode", [], "`vanilla` accepted (the clipped surrogate of rlplat's reverse_kl); others "
         "refused, as verl refuses them")
def _policy_loss_mode(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    if item.value == "vanilla":
        return ignored(item, "rlplat's reverse_kl takes the vanilla clipped surrogate of its policy gradient, as this asks")
    return refused(item, "verl and rlplat take the vanilla clipped surrogate only for the distillation loss's policy gradient")


for _key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):

    @special(f"{LOSS}.{_key}", [], "read with `use_policy_gradient=true` (sampled-token losses): accepted when equal to "
             "the actor's clip ratio of that side (rlplat's reverse_kl clips with the actor's); otherwise refused")
    def _clip_ratio(item: Item, context: Context) -> Outcome:
        if not distilling(context):
            return ignored(item, OFF)
        if not policy_gradient(context):
            return ignored(item, "verl reads it only with use_policy_gradient=true and a sampled-token loss")
        sides = [side for side in clip_sides(context) if side[2] == item.key]
        if not sides:
            return ignored(item, "clip_ratio_low and clip_ratio_high are set, and they decide")
        differ = [side for side in sides if side[1] != side[3]]
        if differ:
            return refused(item, clip_mismatch(context, differ))
        return ignored(item, "rlplat's reverse_kl clips with actor.loss's clip ratios, which are the same here")


for _key in ("use_chunked_topk", "chunked_topk_chunk_size"):

    @special(f"{LOSS}.{_key}", [], "accepted and ignored: rlplat's fsdp2 engine gathers the student's log-probs at the "
             "teacher's ids a window of tokens at a time anyway (`actor.engine_config.logprob_chunk_size`)")
    def _chunked(item: Item, context: Context) -> Outcome:
        return ignored(item, "rlplat's fsdp2 engine gathers the student's log-probs at the teacher's ids a window of tokens "
                             "at a time anyway, recomputing each in backward (actor.engine_config.logprob_chunk_size)")


@special(f"{LOSS}.*", [], "other keys: ignored with the node off, refused with it on (verl's loss has no such setting "
         "that rlplat knows)")
def _other_loss_key(item: Item, context: Context) -> Outcome:
    if not distilling(context):
        return ignored(item, OFF)
    return refused(item, "rlplat knows no such key of verl's distillation_loss")
