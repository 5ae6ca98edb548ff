"""The ``agent`` node of the run config (light: the driver reads it without torch)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Optional

from rlplat.kits.rollout_server import is_loopback

VERL_LOOP_NAMES = {"single_turn_agent": "single_turn", "tool_agent": "tool"}
"""verl's ``agent_name`` values, read as rlplat's loop names."""


@dataclasses.dataclass
class TemplateCheckConfig:
    """``agent.template_check``: finished multi-turn trajectories (two model turns or more, or any
    message appended between turns) re-rendered with the chat template and compared with the tokens
    the loop fed and sampled (:mod:`rlplat_agents.template_drift`). A drift becomes a ``template``
    health event in the batch (the run's sentinel warns or stops per ``trainer.sentinel.policy``),
    never an error in the rollout; metrics ``agent/template_checked`` and ``agent/template_drifted``."""

    sample_rate: float = 0.05
    """Fraction of the multi-turn trajectories checked, in [0, 1]; 0 turns the check off. Which ones is
    a hash of the sampling seed, the row's uid and its position in the batch, so a run checks the same
    ones when repeated. With a rate above 0, a rollout worker also checks the first multi-turn
    trajectory of each batch until it has checked one, so a drifting template shows in the first step
    (in validation's, when the run validates first)."""
    noncanonical_share: float = 0.5
    """A checked trajectory that differs only where the model wrote a turn otherwise than the template writes
    that message (a tool call with other spacing, a turn ended by EOS) counts in ``agent/template_noncanonical``.
    When at least this share of a batch's checked trajectories do, the template's serialisation and the format
    its prompt teaches disagree, and it is reported as drift; fewer are the model's own variations."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:  # NaN fails too
            raise ValueError(f"sample_rate must be a fraction in [0, 1] (0 turns the check off), got {self.sample_rate}")
        if not 0.0 < self.noncanonical_share <= 1.0:
            raise ValueError(f"noncanonical_share must be a fraction in (0, 1], got {self.noncanonical_share}")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
PREFIX_BREAK_POLICIES = ("split", "error")


@dataclasses.dataclass
class GatewayConfig:
    """``agent.gateway``: the OpenAI-compatible endpoint each rollout worker serves to black-box agents
    (the ``blackbox`` loop; :mod:`rlplat_agents.gateway`), started when a loop first needs it."""

    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback needs ``api_key``."""
    port: int = 0
    """TCP port; 0 takes a free one (each worker its own; the loop hands agents the address)."""
    api_key: Optional[str] = None
    """Bearer key every request must carry (``Authorization: Bearer <key>``); required beyond loopback.
    None on loopback: no key is checked."""
    on_prefix_break: str = "split"
    """When a session's request resends a history that is not what the gateway returned (a tool call
    re-serialised, an assistant turn edited): ``split`` starts a new trajectory segment (counted in
    ``agent/prefix_breaks``), ``error`` answers 400 (the agent's run then fails: a masked-out row)."""
    batch_window_ms: float = 5.0
    """Requests arriving within this many milliseconds of one another reach the rollout together (one
    admission into its running batch instead of one per request); 0 sends each at once."""
    request_sampling: bool = False
    """Whether a request's ``temperature``, ``top_p`` and ``seed`` apply. False: every call samples with
    the run's settings (``rollout.*``), the distribution the update assumes; ``max_tokens`` and ``stop``
    always apply."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be an address to bind, got {self.host!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0: a free port), got {self.port}")
        if not 0.0 <= self.batch_window_ms <= 1000.0:
            raise ValueError(f"batch_window_ms must be in [0, 1000], got {self.batch_window_ms}")
        if self.on_prefix_break not in PREFIX_BREAK_POLICIES:
            raise ValueError(f"on_prefix_break must be one of {PREFIX_BREAK_POLICIES}, got {self.on_prefix_break!r}")
        if self.api_key is not None and not str(self.api_key).strip():
            raise ValueError("api_key is empty: give a key, or null on loopback")
        if not is_loopback(self.host) and self.api_key is None:
            raise ValueError(f"host {self.host!r} is reachable beyond this machine: set agent.gateway.api_key "
                             f"(every request must then carry it), or bind 127.0.0.1")


@dataclasses.dataclass
class AgentConfig:
    """The ``agent`` node: multi-turn rollouts through agent loops. With no ``agent.loop`` and no
    ``agent_name`` column in the data, generation is the rollout's batched ``generate``."""

    loop: Optional[str] = None
    """Agent loop (kind ``agent_loop``: ``single_turn``, ``tool``, ``env``, a plugin's) for rows without an
    ``agent_name``. None: rows must name theirs, or the run generates without agent loops."""
    loops: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Each loop's own node: ``agent.loops.tool.max_turns=4``, checked against the loop's schema."""
    loop_names: Dict[str, str] = dataclasses.field(default_factory=dict)
    """The data's ``agent_name`` values read as other loops: ``{tool: blackbox}`` runs rows that name the
    ``tool`` loop through ``blackbox`` (verl's ``tool_agent``/``single_turn_agent`` are always read as
    ``tool``/``single_turn`` first)."""
    tools_config: Optional[str] = None
    """YAML file of the tools offered (see :mod:`rlplat_agents.tools`)."""
    tool_parser: str = "hermes"
    """How the model writes tool calls (kind ``tool_parser``)."""
    environment: Optional[str] = None
    """Environment of the ``env`` loop (kind ``environment``: ``retry``, a plugin's)."""
    environment_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The environment's own node."""
    max_concurrency: int = 256
    """Conversations in flight at once per worker."""
    max_prompt_length: Optional[int] = None
    """Width of the prompts of agent batches (a prompt rendered with its tools is longer than the data
    loader's). None: ``data.max_prompt_length``. A longer prompt is an error naming the row."""
    template_check: TemplateCheckConfig = dataclasses.field(default_factory=TemplateCheckConfig)
    """The chat template checked on a sample of the run's multi-turn trajectories."""
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway of the ``blackbox`` loop."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or null, got {self.max_prompt_length}")

    def enabled(self, has_agent_names: bool = False) -> bool:
        """Whether generation goes through agent loops: a default loop is set, or the rows name theirs."""
        return self.loop is not None or has_agent_names


def check_tools_read(agent: AgentConfig, loops: Iterable[str]) -> None:
    """:class:`~rlplat.config_node.ConfigError` when ``agent.tools_config`` is set but no agent loop of the
    run offers its tools: ``loops`` (the loops the run uses: ``agent.loop`` and the data's ``agent_name``
    values, rlplat's names) is empty, so generation is single-turn, or every one of them declares
    ``uses_tools = False``. A loop that does not declare it is trusted to read them."""
    if agent.tools_config is None:
        return
    from rlplat import registry
    from rlplat.config_node import ConfigError

    loops = sorted(set(loops))
    fix = ("set agent.loop=tool (verl: actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent), give the rows "
           "an agent_name column naming a loop that offers tools (verl's tool_agent), or drop agent.tools_config")
    if not loops:
        raise ConfigError(f"agent.tools_config={agent.tools_config} is read by no agent loop: agent.loop is not set and "
                          f"the data names no loop (no agent_name values), so generation is single-turn and the tools "
                          f"are never offered; {fix}.")
    if all(getattr(registry.get("agent_loop", name), "uses_tools", None) is False for name in loops):
        raise ConfigError(f"agent.tools_config={agent.tools_config} is read by no agent loop of this run: "
                          f"{', '.join(loops)} offer{'s' if len(loops) == 1 else ''} no tools; {fix}.")


# -- the node's checks (kind config_node) ------------------------------------------------------------------

def data_agent_names(files: Iterable[str]) -> set[str]:
    """The ``agent_name`` values (nulls left out) of the parquet files that have the column."""
    import pyarrow.parquet as pq

    names: set[str] = set()
    for path in files:
        if "agent_name" in pq.read_schema(path).names:
            names.update(value for value in pq.read_table(path, columns=["agent_name"]).column(0).to_pylist() if value)
    return names


def check(agent: AgentConfig, config: Any) -> None:
    """The ``agent`` node against the registries, the tools file and the data's ``agent_name`` values."""
    from rlplat.config import ConfigError, entry_schema

    entry_schema("tool_parser", agent.tool_parser, "agent.tool_parser")
    used = {agent.loop} if agent.loop else set()
    for key in ("train_files", "val_files"):
        for name in data_agent_names(config.data[key]):
            name = loop_name(agent, name)
            used.add(name)
            entry_schema("agent_loop", name, f"the agent_name {name!r} in data.{key}")
    if agent.loop:
        entry_schema("agent_loop", agent.loop, "agent.loop")
    for source, target in agent.loop_names.items():
        entry_schema("agent_loop", target, f"agent.loop_names.{source}")
    loops = {VERL_LOOP_NAMES.get(name, name) for name in used}
    if "blackbox" in loops:
        check_blackbox(agent)
    if "env" in loops and agent.environment is None:
        raise ConfigError("the env agent loop needs an environment: set agent.environment (e.g. retry).")
    if "tool" in loops and agent.tools_config is None:
        raise ConfigError("the tool agent loop offers the tools of agent.tools_config, which is not set: give a tools file.")
    check_tools_read(agent, loops)
    if agent.tools_config is not None:
        from rlplat_agents.tools import read_tools_file

        read_tools_file(agent.tools_config)
    if loops - {"single_turn"}:
        check_chat_template(config)


def loop_name(agent: AgentConfig, name: str) -> str:
    """The loop that runs rows whose ``agent_name`` is ``name``: verl's names read as rlplat's, then
    ``agent.loop_names``."""
    name = VERL_LOOP_NAMES.get(name, name)
    return agent.loop_names.get(name, name)


def check_blackbox(agent: AgentConfig) -> None:
    """The ``blackbox`` loop's agent at load: set, importable, callable; a command's program found."""
    import shutil

    from rlplat.config import ConfigError

    node = dict(agent.loops.get("blackbox") or {})
    if not node.get("agent") and not node.get("command"):
        raise ConfigError("the blackbox agent loop runs an agent the run names: set agent.loops.blackbox.agent="
                          "pkg.module:function (called as function(task, base_url, api_key, **agent_kwargs)) or "
                          "agent.loops.blackbox.command=[program, args...].")
    if node.get("agent"):
        from rlplat_agents.blackbox import load_function

        try:
            load_function(str(node["agent"]))
        except ValueError as error:
            raise ConfigError(str(error)) from None
    elif node.get("command") and isinstance(node["command"], (list, tuple)) and node["command"]:
        program = str(node["command"][0])
        if shutil.which(program) is None:
            raise ConfigError(f"agent.loops.blackbox.command: the program {program!r} is not found (not on PATH, or "
                              f"not an executable file).")


def check_chat_template(config: Any) -> None:
    """Multi-turn loops append messages through the chat template: the tokenizer must have one."""
    from transformers import AutoTokenizer

    from rlplat.config import ConfigError

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
    except Exception as error:
        raise ConfigError(f"model.path: the tokenizer in {config.model.path} cannot be loaded for the agent loops: {error}") from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"agent loops with several turns render messages with the tokenizer's chat template, and the "
                          f"tokenizer in {config.model.path} has none (only the single_turn loop works without one).")


def nodes(config: Any) -> list:
    """The plugin-owned nodes under ``agent``: each loop's ``agent.loops.<name>`` and the environment's
    ``agent.environment_config``."""
    from omegaconf import OmegaConf

    from rlplat.config import ConfigError, PluginNode, entry_schema
    from rlplat.contracts.agent import AgentLoopConfig

    agent = config.agent
    found = []
    for name, node in OmegaConf.to_container(agent.loops, resolve=True).items():
        schema, owner = entry_schema("agent_loop", name, f"agent.loops.{name}")
        found.append(PluginNode(f"agent.loops.{name}", owner, schema or AgentLoopConfig, node or {}))
    if agent.environment is not None:
        schema, owner = entry_schema("environment", agent.environment, "agent.environment")
        found.append(PluginNode("agent.environment_config", owner, schema,
                                OmegaConf.to_container(agent.environment_config, resolve=True)))
    elif agent.environment_config:
        raise ConfigError("agent.environment_config is set but agent.environment is not: name the environment.")
    return found
