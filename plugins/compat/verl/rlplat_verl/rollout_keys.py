"""The verl key table, rollout side: ``actor_rollout_ref.rollout`` (sampling, lengths, the inference
engines' settings, validation sampling) and its multi-turn, tool and agent-loop keys (-> ``agent.*``).
Importing this module adds its rules to :data:`rlplat_verl.rules.RULES_BUILT`."""

from __future__ import annotations

from rlplat_verl.rules import (VERL_LOOP_NAMES, Context, Item, Outcome, Target, converted, equal_only, gated, ignore,
                               ignored, is_off, mapped, off_only, optional_rename, per_rollout, refuse, refused, rename,
                               show, special)


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


