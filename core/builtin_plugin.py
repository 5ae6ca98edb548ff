"""What rlplat itself registers, through the same hooks as any plugin: the dispatch modes, the worker
roles, the default reward scorer, the ``async`` and ``judge`` reward managers, the judge parsers and the
``rlplat`` commands.

It is loaded first by every :class:`rlplat.registry.Registry` (it cannot be disabled by the plugin
switches, since worker groups and the CLI need it) and listed as plugin ``rlplat``.
"""

from rlplat.hookspecs import hookimpl

DISPATCH_MODES = {
    "ONE_TO_ALL": ("OneToAll", "every worker gets the same arguments; returns the list of outputs"),
    "ALL_TO_ALL": ("AllToAll", "argument i of each sequence goes to worker i; returns the list of outputs"),
    "DP_COMPUTE_PROTO": ("DataParallelProto", "DataProto split over all workers with padding; outputs concatenated"),
    "RANK_ZERO": ("RankZero", "only rank 0 runs; returns its output"),
    "DP_MESH": ("DataParallelMesh", "DataProto split over declared data-parallel ranks; one output per DP group"),
}

COMMANDS = {
    "run": ("rlplat.cli.run:run", "Train a policy (no arguments: the built-in demo)."),
    "plan": ("rlplat.cli.plan:plan", "Predict a run's memory per device and phase, and its placement, from config.json alone."),
    "sft": ("rlplat.cli.sft:sft", "Supervised fine-tuning on the same engines; its export is `rlplat run`'s model.path."),
    "config": ("rlplat.cli.config:app", "Inspect the resolved run config and what its keys mean."),
    "plugins": ("rlplat.cli.plugins:app", "List the installed plugins and what they register."),
    "plot": ("rlplat.cli.plot:plot", "Write a run's metrics as PNG charts."),
    "export": ("rlplat.cli.export:export", "Write a run's checkpoint as a Hugging Face model (LoRA merged) or its adapter."),
    "check-template": ("rlplat.cli.check_template:check_template",
                       "Check that a chat template only appends across turns (multi-turn training needs it)."),
    "doctor": ("rlplat.cli.doctor:doctor", "Versions, devices, plugins and known-bad version combinations (exit 1 on one)."),
}

ROLES = {
    "actor": "the policy's engine, its reference model and (colocated) its rollout",
    "rollout": "the rollout in a resource pool of its own (roles.rollout.placement=separate)",
    "critic": "the value model (PPO, or critic.enable=true)",
    "judge": "the judge model's rollout (reward.manager=judge), colocated or in a pool of its own",
    "reward_model": "the reward model scoring each response (reward.model.path), colocated or in a pool of its own",
}

ROLE_TARGETS = {"judge": "rlplat.judge:role", "reward_model": "rlplat.workers.reward_model:reward_model"}


@hookimpl
def register_dispatch_modes(register):
    for name, (attribute, description) in DISPATCH_MODES.items():
        register(name, f"rlplat.controller.dispatch:{attribute}", description=description)


@hookimpl
def register_roles(register):
    for name, description in ROLES.items():
        register(name, ROLE_TARGETS.get(name, f"rlplat.workers.roles:{name}"), description=description,
                 config_schema="rlplat.contracts.role:RoleConfig")


@hookimpl
def register_reward_scorers(register):
    register("exact_match", "rlplat.scorers:exact_match",
             description="1 when the response equals the ground truth (whitespace stripped), else 0; the default.")
    register("tool_demo", "rlplat.demo.tools:score", metadata={"data_sources": ["arith_tools", "arith_chat"]},
             description="the tool demo's tasks: the answer after the last tool response or feedback equals the ground truth.")


REWARD_MANAGERS = {
    "async": ("rlplat.reward_loop:AsyncRewardManager", "rlplat.reward_loop:RewardLoopConfig",
              "per-sample scoring with a concurrency bound, a timeout, retries and a default score; overlaps with agent loops"),
    "judge": ("rlplat.judge:JudgeRewardManager", "rlplat.judge:JudgeConfig",
              "asks a judge model (the judge role's rollout) with a prompt template and parses its score"),
}


@hookimpl
def register_reward_managers(register):
    for name, (target, schema, description) in REWARD_MANAGERS.items():
        register(name, target, config_schema=schema, description=description)


JUDGE_PARSERS = {
    "number": ("NumberParser", "NumberParserConfig", "the last (or first) number of the answer, optionally within [min, max]"),
    "tagged": ("TaggedParser", "TaggedParserConfig", "the number inside <score>...</score> (or a configured pattern's group)"),
    "yes_no": ("YesNoParser", "YesNoParserConfig", "a verdict word: yes -> 1, no -> 0 (words and scores configurable)"),
}


@hookimpl
def register_judge_parsers(register):
    for name, (parser, schema, description) in JUDGE_PARSERS.items():
        register(name, f"rlplat.judge_parsers:{parser}", config_schema=f"rlplat.judge_parsers:{schema}",
                 description=description)


@hookimpl
def register_commands(register):
    for name, (target, description) in COMMANDS.items():
        register(name, target, description=description)


AGENT_LOOPS = {
    "single_turn": ("SingleTurnLoop", "AgentLoopConfig", "one model turn after the prompt (the distribution of generate)"),
    "tool": ("ToolLoop", "ToolLoopConfig", "model turns with tool calls run concurrently and their results appended"),
    "env": ("EnvLoop", "EnvLoopConfig", "model turns against a gym-style environment (agent.environment)"),
}


@hookimpl
def register_agent_loops(register):
    for name, (loop, schema, description) in AGENT_LOOPS.items():
        module = "rlplat.contracts.agent" if schema == "AgentLoopConfig" else "rlplat.agent.loops"
        register(name, f"rlplat.agent.loops:{loop}", description=description, config_schema=f"{module}:{schema}")


@hookimpl
def register_tools(register):
    register("calculator", "rlplat.agent.tools:CalculatorTool", config_schema="rlplat.contracts.agent:ToolConfig",
             description="arithmetic on an expression, by parsing (never eval)")
    register("python", "rlplat.agent.tools:PythonTool", config_schema="rlplat.agent.tools:PythonToolConfig",
             description="runs Python code in a sandboxed child process (limits, timeout, no survivors)")


@hookimpl
def register_tool_parsers(register):
    register("hermes", "rlplat.agent.parsers:HermesParser",
             description="<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Qwen2.5-style templates)")


@hookimpl
def register_environments(register):
    register("retry", "rlplat.agent.environments:RetryEnvironment",
             config_schema="rlplat.agent.environments:RetryConfig",
             description="the row's scorer judges each answer; a wrong one gets 'wrong, try again'")
