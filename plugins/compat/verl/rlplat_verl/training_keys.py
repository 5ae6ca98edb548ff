"""The verl key table, training side: ``actor_rollout_ref.model``, ``actor_rollout_ref.actor`` and
``actor_rollout_ref.ref``, the batching keys verl counts over all GPUs, the optimizers, ``fsdp_config`` and
``critic``. Importing this module adds its rules to :data:`rlplat_verl.rules.RULES_BUILT`."""

from __future__ import annotations

from typing import Any

from rlplat_verl.rules import (REFERENCE_FOLLOWS_ACTOR, SPEED_ONLY, TEXT_ONLY, VERL_INTERNAL, Context, Item, Outcome,
                               converted, equal_only, format_value, gated, ignore, ignored, is_off, mapped, off_only,
                               only, optional_rename, refuse, refused, rename, special, unchanged, verl_drops_the_ppo_loss)


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
for _loss_key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_loss_coef", "kl_loss_type"):
    rename(f"actor_rollout_ref.actor.{_loss_key}", f"actor.loss.{_loss_key}")
for _loss_key in ("entropy_coeff", "use_kl_loss"):

    @special(f"actor_rollout_ref.actor.{_loss_key}", [f"actor.loss.{_loss_key}"], "same meaning; ignored in verl's pure "
             "distillation (`distillation.distillation_loss.use_task_rewards=false`), which drops it with the PPO loss")
    def _ppo_loss_part(item: Item, context: Context, key: str = _loss_key) -> Outcome:
        if verl_drops_the_ppo_loss(context):
            return ignored(item, "distillation.distillation_loss.use_task_rewards=false: verl multiplies its whole PPO loss, "
                                 "this included, by 0 (distillation.enabled writes rlplat's off where rlplat's default is on)")
        return mapped(item, f"actor.loss.{key}")
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


def ulysses(key: str, role: str) -> None:
    """verl's Ulysses sequence-parallel size: 1 (its default) accepted and ignored, above 1 the fsdp2 engine's key."""
    target = f"{role}.engine_config.ulysses_sequence_parallel_size"

    @special(key, [target], f"1 (verl's default): accepted and ignored; above 1 -> `{target}` (the fsdp2 engine's Ulysses "
             "sequence parallelism)")
    def _ulysses(item: Item, context: Context) -> Outcome:
        if item.value in (None, 1):
            return ignored(item, "no sequence parallelism, the engine's default")
        return mapped(item, target)


def actor_sequence_parallel(context: Context) -> Any:
    """The actor's Ulysses size as the verl config gives it (its fsdp_config's key, else the actor's own, else 1)."""
    given = context.value("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", default=None)
    return given if given is not None else context.value("actor_rollout_ref.actor.ulysses_sequence_parallel_size", default=1)


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
        ulysses(f"{_node}.ulysses_sequence_parallel_size", _role)
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
    if name == "ulysses_sequence_parallel_size":
        actor = actor_sequence_parallel(context)
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


@special("actor_rollout_ref.ref.ulysses_sequence_parallel_size", [], f"accepted and ignored when equal to the actor's: "
         f"{REFERENCE_FOLLOWS_ACTOR}; otherwise refused")
def _reference_ulysses(item: Item, context: Context) -> Outcome:
    actor = actor_sequence_parallel(context)
    if item.value == actor:
        return ignored(item, f"{REFERENCE_FOLLOWS_ACTOR}, and the actor's Ulysses size is {format_value(actor)}")
    return refused(item, f"{REFERENCE_FOLLOWS_ACTOR} (its Ulysses size is {format_value(actor)}); set the actor's to this value "
                         "or drop this one")


for _key in ("use_torch_compile", "entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size", "entropy_checkpointing",
             "pad_to_length"):
    ignore(f"actor_rollout_ref.ref.{_key}", SPEED_ONLY)
ignore("actor_rollout_ref.ref.rollout_n", VERL_INTERNAL + " from rollout.n")
for _key in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size", "entropy_checkpointing", "pad_to_length"):
    ignore(f"actor_rollout_ref.actor.{_key}", SPEED_ONLY)
for _node in ("actor_rollout_ref.actor", "critic"):
    ulysses(f"{_node}.ulysses_sequence_parallel_size", "actor" if _node.startswith("actor_rollout_ref") else "critic")
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
    gated(f"{_node}.qat", "enable", "rlplat has no quantization-aware training")

ROUTER_REPLAY_MODES = {"disabled": "off", "R2": "r2", "R3": "r3"}


@special("actor_rollout_ref.actor.router_replay.mode", ["actor.moe.router_replay"], "disabled -> off, R2 -> r2, R3 -> r3")
def _router_replay(item: Item, context: Context) -> Outcome:
    value = "disabled" if item.value is None else str(item.value)
    if value not in ROUTER_REPLAY_MODES:
        return refused(item, f"verl's modes are {', '.join(ROUTER_REPLAY_MODES)}")
    return converted(item, "actor.moe.router_replay", ROUTER_REPLAY_MODES[value],
                     "the same replay: R2 the old-log-prob forward's routes, R3 the rollout's")


@special("actor_rollout_ref.ref.router_replay.mode", [], "accepted and ignored when disabled or the actor's mode; otherwise refused")
def _ref_router_replay(item: Item, context: Context) -> Outcome:
    actor = context.value("actor_rollout_ref.actor.router_replay.mode")
    if item.value in (None, "disabled", actor):
        return ignored(item, "rlplat's reference forward replays as the actor's engine does (actor.moe.router_replay)")
    return refused(item, f"rlplat's reference replays as the actor does ({actor or 'disabled'})")


for _node in ("actor_rollout_ref.actor", "actor_rollout_ref.ref"):
    for _key in ("record_file", "replay_file"):
        off_only(f"{_node}.router_replay.{_key}", "unset", "rlplat's routes travel in the batch, never through files")


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


