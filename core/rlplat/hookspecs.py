"""Every extension point of rlplat, one hook per kind of plugin.

A plugin is a module (or any object) named in the ``rlplat`` entry-point group of its distribution::

    [project.entry-points.rlplat]
    my-reward = "my_package.plugin"

and implements some of the hooks below with ``@rlplat.hookimpl``. Every hook receives a ``register``
callback owned by core; the hook calls it once per thing it provides and returns nothing. Its signature::

    register(name, factory, *, description="", requires=(), install_hint=None,
             config_schema=None, metadata=None)

``name``
    Unique within the kind (``"fsdp2"``, ``"grpo"``, ``"gsm8k"``). A second plugin registering the same
    name makes the name unusable until one is removed; the error names both distributions.
``factory``
    The object itself, or a dotted path ``"package.module:attribute"`` resolved only when the entry is
    used, so that listing plugins imports nothing heavy. Prefer the dotted path.
``description``
    One line shown by ``rlplat plugins list`` and ``--help``.
``requires``
    Import names of optional dependencies (``("vllm",)``). If one cannot be found the entry is listed
    as ``unavailable: vllm is not installed`` and using it raises that message with ``install_hint``.
``install_hint``
    What to run to install them, e.g. ``"pip install rlplat-rollout-vllm[vllm]"``.
``config_schema``
    A structured-config dataclass (or its dotted path) describing the entry's config node.
``metadata``
    Anything else a consumer of this kind documents (e.g. an algorithm's ``needs_critic``; a rollout's
    ``needs_gpu``, checked against ``cluster.use_gpu`` when a run's config is validated: a bool, or the
    ``"module:function"`` path of a function of no argument that answers without importing the backend).

Hooks are called once per plugin, in load order; none of them returns a value, so no answer "wins".
New arguments may be added to a hook later; an implementation may accept any subset of them.

The plugin module declares the plugin API versions it is written for, ``RLPLAT_PLUGIN_API = ">=1.1,<2"``
(:mod:`rlplat.api_version`; ``docs/plugin_api.md``): outside that range none of its hooks is called and
``rlplat plugins list`` shows it as failed with the reason. Without a declaration it is taken as API 1.x.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "rlplat"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_engines(register):
    """Register training engines (kind ``engine``).

    The factory builds a :class:`rlplat.contracts.engine.TrainingEngine` from ``(config, **kwargs)``;
    ``config`` maps the :class:`rlplat.contracts.engine.EngineBuildConfig` keys and the role's
    ``engine_config`` node. ``config_schema`` extends ``EngineBuildConfig`` with the engine's own keys.
    ``metadata={"estimate_memory": "package.memory:estimate"}`` names the engine's memory estimate (the
    signature of ``TrainingEngine.estimate_memory``) in a module that imports no torch: ``rlplat plan``
    and ``rlplat run``'s check then do not import the engine's class.
    """


@hookspec
def register_rollouts(register):
    """Register rollout engines (kind ``rollout``).

    The factory builds a :class:`rlplat.contracts.rollout.RolloutEngine` from ``(config, **kwargs)``;
    ``config`` maps the :class:`rlplat.contracts.rollout.RolloutBuildConfig` keys and ``rollout.config``.
    ``config_schema`` extends ``RolloutBuildConfig``. ``metadata={"needs_gpu": True}`` makes a run on CPUs
    a config error (``"module:function"`` instead of True: asked when the config is validated); ``metadata={"estimate_memory": "package.memory:estimate"}`` names the rollout's memory
    estimate without its class, as for engines.
    """


@hookspec
def register_reward_managers(register):
    """Register reward managers (kind ``reward_manager``).

    The factory builds a :class:`rlplat.contracts.reward.RewardManager` from ``(scorer, tokenizer, config)``:
    the scorer ``reward.scorer`` / ``reward.custom_function`` selects, the policy's tokenizer, and the
    ``reward.config`` node, typed by ``config_schema``.
    """


@hookspec
def register_reward_scorers(register):
    """Register rule-based reward functions (kind ``reward_scorer``).

    The factory *is* the scorer: a callable following :class:`rlplat.contracts.reward.RewardScorer`,
    ``score(data_source, solution_str, ground_truth, extra_info) -> float | dict``.
    """


@hookspec
def register_advantage_estimators(register):
    """Register advantage estimators (kind ``advantage_estimator``).

    The factory *is* the estimator, following :class:`rlplat.contracts.algorithm.AdvantageEstimator`,
    ``fn(token_level_rewards, response_mask, index, values=None, config=None, **extra) -> (advantages, returns)``.
    """


@hookspec
def register_policy_losses(register):
    """Register policy losses (kind ``policy_loss``).

    The factory *is* the loss, following :class:`rlplat.contracts.algorithm.PolicyLoss`,
    ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config) -> (loss, metrics)``.
    ``config_schema`` types the loss's own knobs in the ``actor.loss.policy_loss`` node (declaring
    ``loss_mode``, which rlplat sets there, is optional). ``metadata={"loss_agg_modes": [...]}`` lists the
    aggregation modes the loss supports (default: those of the plugin API version its plugin declares);
    a run in another mode is refused when its config loads.
    """


@hookspec
def register_algorithms(register):
    """Register whole algorithms (kind ``algorithm``).

    The factory returns an :class:`rlplat.contracts.algorithm.Algorithm`: which estimator and loss it
    uses, whether it needs a critic or a reference model, its default config, losses and loop hooks.
    The factory takes no arguments. ``config_schema`` types the ``algorithm`` node (default:
    :class:`rlplat.contracts.algorithm.AlgorithmConfig`, which a schema with more keys extends; a schema
    that lists only the algorithm's own keys is read together with AlgorithmConfig).
    """


@hookspec
def register_dispatch_modes(register):
    """Register dispatch modes for worker-group calls (kind ``dispatch_mode``).

    The factory returns the mode object that splits a driver call's arguments over workers and merges
    their results; ``@register(dispatch_mode="name")`` on a worker method selects it by name.
    """


@hookspec
def register_commands(register):
    """Register ``rlplat`` sub-commands (kind ``command``).

    The factory returns a ``typer.Typer`` (mounted as ``rlplat NAME ...``) or a plain function (mounted
    as the single command ``rlplat NAME``). Keep the module that holds it light: the CLI resolves
    command factories at start-up. A command that writes run directories ``rlplat export`` can read says
    so in its metadata: ``{"run_config": "module:attribute", "engine_node": "module:function"}`` (the
    dataclass of the resolved config the run writes, or a function of no arguments returning its defaults;
    and ``function(config, total_steps)`` returning the actor engine's build config).
    """


@hookspec
def register_roles(register):
    """Register worker roles (kind ``role``): the worker groups a run builds and where they go.

    The factory takes no arguments and returns a :class:`rlplat.contracts.role.Role`. ``config_schema``
    (a subclass of :class:`rlplat.contracts.role.RoleConfig`) types the role's ``roles.<name>`` node.
    rlplat registers its own roles (``actor``, ``rollout``, ``critic``) through this hook.
    ``metadata={"check": "package.module:function"}`` names a light check of the run config, called at
    validation as ``function(run)`` (a :class:`rlplat.contracts.role.RunContext`) for every run; it raises
    :class:`rlplat.config_node.ConfigError` for a setting the role cannot serve.
    """


@hookspec
def register_agent_loops(register):
    """Register agent loops (kind ``agent_loop``): what drives one multi-turn conversation.

    The factory takes the loop's config node (``agent.loops.<name>``, read with ``config_schema``, a
    subclass of :class:`rlplat.contracts.agent.AgentLoopConfig`) and returns an
    :class:`rlplat.contracts.agent.AgentLoop`. A dataset row picks its loop in its ``agent_name``
    column; ``agent.loop`` is the default. rlplat registers ``single_turn``, ``tool`` and ``env``.
    """


@hookspec
def register_tools(register):
    """Register tools (kind ``tool``) an agent loop offers the model.

    The factory is called as ``factory(config, schema=...)`` with the tool's node of the tools file
    (``config_schema``, a subclass of :class:`rlplat.contracts.agent.ToolConfig`) and returns an
    :class:`rlplat.contracts.agent.Tool`. rlplat registers ``calculator`` and ``python``.
    """


@hookspec
def register_tool_parsers(register):
    """Register tool-call parsers (kind ``tool_parser``): how tool calls are written in a model's
    chat format. The factory takes the parser's config and returns an
    :class:`rlplat.contracts.agent.ToolCallParser`; ``agent.tool_parser`` picks one. rlplat registers
    ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen2.5-style templates).
    """


@hookspec
def register_environments(register):
    """Register environments (kind ``environment``) for the ``env`` agent loop: gym-style multi-turn
    tasks without tools. The factory takes ``agent.environment_config`` (read with ``config_schema``)
    and returns a new :class:`rlplat.contracts.agent.Environment` per conversation. rlplat registers
    ``retry`` (the row's scorer judges each answer; a wrong one gets "wrong, try again").
    """


@hookspec
def register_judge_parsers(register):
    """Register judge parsers (kind ``judge_parser``): how the ``judge`` reward manager reads the score a
    judge model wrote. The factory takes the parser's config (``reward.config.parser_config``, read with
    ``config_schema``) and returns a :class:`rlplat.contracts.reward.JudgeParser`;
    ``reward.config.parser`` picks one. rlplat registers ``number``, ``tagged`` and ``yes_no``.
    """


@hookspec
def register_presets(register):
    """Register run presets (kind ``preset``): what ``rlplat run --demo NAME`` (and ``plan``, ``config``)
    put before the user's own overrides. The factory takes no arguments and returns the preset's dotted
    overrides (a list of strings; the user's come after them and win). ``metadata={"algorithm": "grpo"}``
    is the algorithm the preset implies when ``--algo`` is not given; ``metadata={"default": True}`` marks
    the preset used when neither ``model.path`` nor ``--config`` is given (one at most).
    """


@hookspec
def register_config_translators(register):
    """Register config translators (kind ``config_translator``): readers of another framework's keys
    (e.g. verl's ``actor_rollout_ref.actor.optim.lr``) on a run's command line and YAML file. The factory
    is called as ``factory(config_path, arguments, algo=..., rollout=...)`` and returns
    ``(config_path, arguments, notes)``: the (possibly rewritten) YAML path, rlplat's dotted overrides and
    one note per translated key, printed to the user. Translators run in name order, each on the
    previous one's output; one raises :class:`rlplat.config_node.ConfigError` for a key it recognises
    but cannot translate.
    """


@hookspec
def register_config_nodes(register):
    """Register run-config nodes a plugin owns (kind ``config_node``), named by their dotted path
    (``"agent"``, ``"reward.model"``). ``config_schema`` (required) is the node's dataclass: its defaults
    join the run config at load, and the node is read and checked with it. The factory is the node's
    check, called as ``factory(node, config)`` once the whole config has been checked (``node`` the schema
    instance, ``config`` the run's ``DictConfig``), raising :class:`rlplat.config_node.ConfigError`.
    ``metadata={"nodes": "package.module:function"}`` names a function of the run config returning the
    plugin-owned nodes inside this one (``rlplat.config.PluginNode``s: an agent loop's node, the reward
    model's engine node), checked and explained like core's. Without the plugin, setting a key of its node
    is an unknown key.
    """


@hookspec
def register_rollout_drivers(register):
    """Register rollout drivers (kind ``rollout_driver``): what turns a batch of prompts into trajectories
    through a rollout worker's engines (agent loops, a gateway). The factory takes a
    :class:`rlplat.contracts.rollout.RolloutDriverContext` and returns a
    :class:`rlplat.contracts.rollout.RolloutDriver`. ``rollout.driver`` names the run's; when unset, a
    driver is chosen by its metadata: ``{"config_key": "agent.loop"}`` (the key is set) or
    ``{"column": "agent_name"}`` (the data has the column). ``metadata={"config_node": "agent"}`` is the node
    its context carries; ``metadata={"batch_metrics": "package.module:function"}`` a function
    ``(batch, prefix) -> dict`` the trainer calls on each trained and validation batch.
    """


@hookspec
def register_step_observers(register):
    """Register step observers (kind ``step_observer``): what watches a run's steps without changing what
    they train (a monitor, a logger of samples, a profiler). The factory is called with the run
    (:class:`rlplat.contracts.observer.ObservedRun`) and returns a
    :class:`rlplat.contracts.observer.StepObserver`, or None when the run does not use it; the driver tells
    it each stage of each step, in the observers' ``order``.
    """
