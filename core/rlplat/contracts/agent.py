"""The agent contracts: multi-turn rollouts over token-in-token-out generation.

An :class:`AgentLoop` drives one conversation from one dataset row: it asks a :class:`TokenClient` (a
rollout replica's :meth:`~rlplat.contracts.rollout.RolloutEngine.generate_tokens`) for the model's
turns, parses tool calls out of them with a :class:`ToolCallParser`, runs :class:`Tool` s or steps an
:class:`Environment`, and appends what comes back as the tokens the chat template adds for it. Sampled
tokens are appended verbatim, never re-rendered, so the tokens trained on are the tokens sampled. The
result is a :class:`Trajectory`; the manager (:mod:`rlplat_agents.manager` (rlplat-agents)) turns a batch of them into
the keys :meth:`RolloutEngine.generate` returns, so estimators, losses and the trainer see no difference
except ``response_mask``, which is 0 on every token the model did not sample.

Kinds: ``agent_loop`` (:class:`AgentLoop`), ``tool`` (:class:`Tool`), ``tool_parser``
(:class:`ToolCallParser`), ``environment`` (:class:`Environment`); each registry factory is called as
``factory(config)`` with its node of the run config, read with the entry's ``config_schema``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Protocol, Sequence

from rlplat.deprecation import Deprecated, deprecated_names

if TYPE_CHECKING:
    from rlplat.contracts.rollout import SamplingParams, TokenOutput


# -- generation ---------------------------------------------------------------------------------------

class TokenClient(Protocol):
    """One rollout replica as an agent loop sees it; a conversation keeps its client (prefix cache)."""

    async def generate(self, prompt_ids: Sequence[int], sampling: "SamplingParams") -> "TokenOutput":
        """The model's next turn after ``prompt_ids`` (one sample)."""


# -- tool calls ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the model asked for: a tool's ``name`` and its JSON ``arguments``."""

    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn split by a :class:`ToolCallParser`: the text outside calls, the well-formed calls in
    order, and one message per malformed call (returned to the model as a tool error)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


class ToolCallParser(abc.ABC):
    """Finds tool calls in the text of a model turn, in one chat format (``hermes``: the
    ``<tool_call>{json}</tool_call>`` of Qwen2.5-style templates)."""

    def __init__(self, config: Any = None):
        self.config = config

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """Split ``text`` (decoded with special tokens kept, end-of-turn token removed). Never raises
        on malformed model output: each bad call becomes an entry of ``errors``."""

    @abc.abstractmethod
    def format(self, calls: Sequence[ToolCall], content: str = "") -> str:
        """The text a model writes for ``content`` followed by ``calls`` in this format;
        ``parse(format(calls, content))`` gives them back."""


# -- tools --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ToolConfig:
    """The keys every tool's config node may hold (``tools[i].config`` of the tools file); a tool's
    ``config_schema`` extends it."""


@dataclasses.dataclass
class ToolResult:
    """What a tool call returns: ``text`` for the model (a ``tool`` message), whether it failed
    (``error``: the call was malformed, the tool raised, or it ``timed_out``), an optional step
    ``reward`` (a verl tool's ``execute`` reward), and numeric ``metrics``. The ``tool`` loop reports the
    rewards' sum per trajectory as the metric ``tool_reward``; the trajectory is still rewarded by the
    reward manager, as verl does with tool rewards."""

    text: str
    error: bool = False
    timed_out: bool = False
    reward: Optional[float] = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class Tool(abc.ABC):
    """A function the model may call. One instance serves every conversation of a worker
    concurrently; per-conversation state comes from :meth:`open` and goes back in :meth:`close`.

    Built as ``factory(config, schema=...)``: ``schema`` is the OpenAI function schema offered to the
    model (``{"type": "function", "function": {"name", "description", "parameters"}}``), from the tools
    file or, when it gives none, :meth:`default_schema`.
    """

    def __init__(self, config: Any = None, schema: Mapping[str, Any] | None = None):
        self.config = config
        self.schema = dict(schema) if schema is not None else self.default_schema()
        check_tool_schema(self.schema, type(self).__name__)

    @property
    def name(self) -> str:
        """The name the model calls (the schema's ``function.name``)."""
        return self.schema["function"]["name"]

    @classmethod
    @abc.abstractmethod
    def default_schema(cls) -> dict[str, Any]:
        """The OpenAI function schema used when the tools file gives none."""

    async def open(self, row_kwargs: Mapping[str, Any]) -> Any:
        """Per-conversation state from the row's arguments (``extra_info.tools_kwargs[name]``, verl's
        ``create_kwargs`` unwrapped). The default keeps the arguments."""
        return dict(row_kwargs)

    @abc.abstractmethod
    async def call(self, arguments: Mapping[str, Any], state: Any) -> ToolResult:
        """Run one call. Bad arguments give ``ToolResult(error=True)`` with a message for the model;
        an exception is also turned into one by the loop, and the time limit is the loop's."""

    async def close(self, state: Any) -> None:
        """Release what :meth:`open` made (also after a timeout or an error)."""


def check_tool_schema(schema: Any, owner: str) -> None:
    """:class:`ValueError` unless ``schema`` is an OpenAI function schema with a name."""
    function = schema.get("function") if isinstance(schema, Mapping) else None
    if not isinstance(function, Mapping) or schema.get("type", "function") != "function":
        raise ValueError(f"{owner}: a tool schema is {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, "
                         f"got {schema!r:.120}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{owner}: the tool schema's function has no name: {schema!r:.120}")
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, Mapping):
        raise ValueError(f"{owner}: tool {name!r}: 'parameters' must be a JSON schema object, got {parameters!r:.80}")


# -- environments -------------------------------------------------------------------------------------

@dataclasses.dataclass
class EnvStep:
    """An environment's answer to one model turn: the ``observation`` appended as a ``role`` message
    when the episode goes on, the ``reward`` of this step, whether the episode is ``done``, and
    numeric ``metrics``."""

    observation: Optional[str]
    reward: float = 0.0
    done: bool = False
    role: str = "user"
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """A gym-style multi-turn task without tools: one instance per conversation, built as
    ``factory(config)``. The trajectory's reward is the sum of the steps' rewards."""

    def __init__(self, config: Any = None):
        self.config = config

    @abc.abstractmethod
    async def reset(self, row: Mapping[str, Any]) -> Optional[list[dict[str, Any]]]:
        """Start an episode for ``row`` (its columns: ``raw_prompt``, ``reward_model``, ``extra_info``,
        ...). Returns the conversation's first messages, or None to use the row's prompt."""

    @abc.abstractmethod
    async def step(self, response: str) -> EnvStep:
        """React to the model's turn (its text, end-of-turn token removed)."""

    async def close(self) -> None:
        """Release the episode's resources."""


# -- trajectories --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Trajectory:
    """One conversation as tokens. ``response_ids`` interleaves the model's turns with the tokens the
    template adds for tool and environment messages; ``response_mask`` is 1 exactly on the sampled
    tokens and ``rollout_log_probs`` holds their log-probs (0 elsewhere). ``reward_score``, when set,
    is the trajectory's reward (an environment's); else the reward manager scores the decoded
    response with the row's scorer. ``extra`` holds anything else the reward needs (joins the batch
    as non-tensor columns). ``finish_reason``: ``stop`` (the model answered), ``length`` (the token
    budget ran out), ``max_turns``, or ``done`` (the environment ended it)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_log_probs: list[float]
    num_turns: int
    finish_reason: str = "stop"
    turn_metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    reward_score: Optional[float] = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    policy_versions: Optional[list[int]] = None
    """Per response token, the policy version that sampled it (-1 on tokens not sampled); None: the rollout
    worker stamps the version it sampled from on every token."""

    def check(self, response_length: int | None = None, where: str = "trajectory") -> None:
        """:class:`ValueError` naming ``where`` unless the lists line up and the masks are right."""
        problems = []
        lengths = {len(self.response_ids), len(self.response_mask), len(self.rollout_log_probs)}
        if len(lengths) != 1:
            problems.append(f"response_ids, response_mask and rollout_log_probs have lengths {len(self.response_ids)}, "
                            f"{len(self.response_mask)}, {len(self.rollout_log_probs)}")
        if not self.prompt_ids:
            problems.append("prompt_ids is empty")
        if not set(self.response_mask) <= {0, 1}:
            problems.append("response_mask holds values other than 0 and 1")
        if 0 in self.response_mask and any(value != 0.0 for value, keep in zip(self.rollout_log_probs, self.response_mask) if not keep):
            problems.append("rollout_log_probs is not 0 where response_mask is 0")
        if not all(map(math.isfinite, self.rollout_log_probs)):
            problems.append("rollout_log_probs holds a non-finite value")
        if response_length is not None and len(self.response_ids) > response_length:
            problems.append(f"{len(self.response_ids)} response tokens, more than the budget {response_length}")
        if self.policy_versions is not None and len(self.policy_versions) != len(self.response_ids):
            problems.append(f"policy_versions has {len(self.policy_versions)} entries for {len(self.response_ids)} response tokens")
        if self.num_turns < 0:
            problems.append(f"num_turns is {self.num_turns}")
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))


# -- agent loops ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class AgentLoopConfig:
    """The keys every agent loop's node (``agent.loops.<name>``) may hold; a loop's ``config_schema``
    extends it."""

    max_turns: int = 1
    """Most model turns in one conversation."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")


@dataclasses.dataclass
class AgentContext:
    """What a loop gets besides its row and client: the tokenizer and the chat-template
    ``renderer`` (:class:`rlplat_agents.chat.ChatRenderer` (rlplat-agents)), the sampling settings of every turn
    (``max_new_tokens`` is the loop's to set per turn), the response token budget, the row's
    prompt as the data loader tokenised it, the tools offered to this row (name -> (tool, state
    arguments)), the tool-call parser, and the stop tokens that end an assistant turn."""

    tokenizer: Any
    renderer: Any
    sampling: "SamplingParams"
    response_length: int
    prompt_ids: list[int]
    tools: Mapping[str, tuple[Tool, Mapping[str, Any]]] = dataclasses.field(default_factory=dict)
    parser: Optional[ToolCallParser] = None
    stop_token_ids: tuple[int, ...] = ()
    environment: Any = None
    """A factory of :class:`Environment` (``agent.environment``), for loops that step one."""
    gateway: Any = None
    """The worker's OpenAI-compatible gateway (:class:`rlplat_agents.gateway.Gateway` (rlplat-agents)), for loops
    that run agents against an endpoint; it starts serving when a loop first asks for a ``base_url``."""


class AgentLoop(abc.ABC):
    """Drives one conversation. Built once per worker as ``factory(config)`` with its
    ``agent.loops.<name>`` node; :meth:`run` is called concurrently for many rows."""

    uses_tools: ClassVar[Optional[bool]] = None
    """Whether the loop offers the tools of ``agent.tools_config`` (``AgentContext.tools``) to the model:
    a run whose tools file no loop of its reads is refused at load. None (not declared): not checked."""

    def __init__(self, config: Any = None):
        self.config = config

    @abc.abstractmethod
    async def run(self, row: Mapping[str, Any], client: TokenClient, context: AgentContext) -> Trajectory:
        """The conversation of ``row`` (its non-tensor columns: ``raw_prompt``, ``data_source``,
        ``reward_model``, ``extra_info``, ``agent_name``, ...)."""


#: Moved to the agent kit (rlplat.kits.agent) at plugin API 1.3: a helper for agent loops, not a contract.
__getattr__ = deprecated_names(__name__, {"TrajectoryBuilder": Deprecated("rlplat.kits.agent:TrajectoryBuilder", "1.4")})

