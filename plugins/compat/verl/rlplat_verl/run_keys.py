"""The verl key table, the rest of a run: ``data``, rewards and the reward model (-> ``reward.*``),
``algorithm``, ``trainer`` (and verl 0.9's ``trainer.v1`` modes), and the nodes only verl has. Importing
this module adds its rules to :data:`rlplat_verl.rules.RULES_BUILT`."""

from __future__ import annotations

import dataclasses

from rlplat_verl.rules import (ESTIMATOR_ALGORITHMS, SPEED_ONLY, TEXT_ONLY, VERBATIM, Context, Item, Outcome, Rule,
                               Target, add, converted, equal_only, gated, ignore, ignored, implied_algorithm, is_off,
                               mapped, off_only, only, optional_rename, refuse, refused, rename, show, special,
                               unchanged)
from rlplat_verl.rollout_keys import MULTI_TURN
from rlplat_verl.training_keys import DTYPES, fsdp_engine, per_gpu


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
equal_only("reward_model.ulysses_sequence_parallel_size", 1, "no sequence parallelism, as in rlplat's reward-model role",
           "rlplat's reward-model role runs without sequence parallelism (its actor and critic have it: "
           "engine_config.ulysses_sequence_parallel_size)")

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
@special("trainer.rollout_data_dir", ["trainer.rollout_dump_dir"], "each step's rollouts dumped to that directory: "
         "rlplat writes one parquet file per step with the token ids, masks, log-probs, policy versions and scores "
         "(trainer.replay_rollouts trains on them), not verl's JSONL of texts")
def _rollout_data_dir(item: Item, context: Context) -> Outcome:
    if is_off(item.value):
        return ignored(item, "unset: nothing is dumped")
    outcome = mapped(item, "trainer.rollout_dump_dir")
    return dataclasses.replace(outcome, note=outcome.note + " (one parquet file per step with token ids, masks, log-probs, "
                               "policy versions and scores, not verl's JSONL of texts)")
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
off_only("ray_kwargs.ray_init.num_cpus", "unset", "rlplat starts its local Ray cluster itself; use cluster.address to join one")
off_only("ray_kwargs.ray_init.runtime_env.py_executable", "unset", "rlplat's workers run the driver's Python")
off_only("ray_kwargs.timeline_json_file", "unset", "rlplat writes no Ray timeline")
ignore("hydra.*", "hydra's own settings; rlplat does not run hydra")


@special("skip.*", [], "every `enable` off accepted (the rest is read only with it); on refused")
def _skip(item: Item, context: Context) -> Outcome:
    if item.key.endswith(".enable"):
        return refused(item, "rlplat has no rollout replay") if item.value else ignored(item, "off, as in rlplat")
    return ignored(item, "verl reads it only with its enable switch on")


