"""What rlplat-agents registers: the ``agent`` config node, the ``agent_loops`` rollout driver, the agent
loops, the ``calculator`` tool, the ``hermes`` tool-call parser, the ``retry`` environment and the
``check-template`` command."""

from rlplat.hookspecs import hookimpl

RLPLAT_PLUGIN_API = ">=1.2,<2"

AGENT_LOOPS = {
    "single_turn": ("SingleTurnLoop", "rlplat.contracts.agent:AgentLoopConfig",
                    "one model turn after the prompt (the distribution of generate)"),
    "tool": ("ToolLoop", "rlplat_agents.loops:ToolLoopConfig", "model turns with tool calls run concurrently and their results appended"),
    "env": ("EnvLoop", "rlplat_agents.loops:EnvLoopConfig", "model turns against a gym-style environment (agent.environment)"),
}
BLACKBOX = ("BlackBoxLoop", "rlplat_agents.blackbox:BlackBoxConfig",
            "a user's agent function or command against the worker's OpenAI-compatible gateway, its tokens recorded")


@hookimpl
def register_config_nodes(register):
    register("agent", "rlplat_agents.config:check", config_schema="rlplat_agents.config:AgentConfig",
             metadata={"nodes": "rlplat_agents.config:nodes"},
             description="multi-turn rollouts through agent loops, tools and environments")


@hookimpl
def register_rollout_drivers(register):
    register("agent_loops", "rlplat_agents.driver:agent_loop_driver",
             metadata={"config_key": "agent.loop", "column": "agent_name", "config_node": "agent",
                       "batch_metrics": "rlplat_agents.manager:agent_metrics"},
             description="agent loops (agent.loop, or the rows' agent_name): tools, environments, several turns")


@hookimpl
def register_agent_loops(register):
    for name, (loop, schema, description) in AGENT_LOOPS.items():
        register(name, f"rlplat_agents.loops:{loop}", description=description, config_schema=schema)
    loop, schema, description = BLACKBOX
    register("blackbox", f"rlplat_agents.blackbox:{loop}", description=description, config_schema=schema)


@hookimpl
def register_tools(register):
    register("calculator", "rlplat_agents.tools:CalculatorTool", config_schema="rlplat.contracts.agent:ToolConfig",
             description="arithmetic on an expression, by parsing (never eval)")


@hookimpl
def register_tool_parsers(register):
    register("hermes", "rlplat_agents.parsers:HermesParser",
             description="<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Qwen2.5-style templates)")


@hookimpl
def register_environments(register):
    register("retry", "rlplat_agents.environments:RetryEnvironment", config_schema="rlplat_agents.environments:RetryConfig",
             description="the row's scorer judges each answer; a wrong one gets 'wrong, try again'")


@hookimpl
def register_commands(register):
    register("check-template", "rlplat_agents.check_template:check_template",
             description="Check that a chat template only appends across turns (multi-turn training needs it).")
