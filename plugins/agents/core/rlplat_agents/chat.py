"""Chat templates for multi-turn rollouts: prompts, the tokens a template adds for non-model messages,
where an assistant turn ends, and a check that a template only appends across turns.

An agent loop generates token in, token out. The first prompt is rendered with the tokenizer's chat
template (:meth:`ChatRenderer.prompt_ids`); the model's tokens are appended verbatim, up to and
including the end-of-turn token it stopped on (:attr:`ChatRenderer.end_of_turn_ids`); every message
that is not the model's (tool results, user or environment feedback) is appended as the tokens the
template adds for it (:meth:`ChatRenderer.delta_ids`), which end with the next generation prompt. The
tokens trained on are then the tokens sampled, and they equal the template's rendering of the whole
conversation as long as the template is *append-only*: rendering more messages never changes the text
of earlier ones. Templates that drop the reasoning of earlier turns are not; :func:`check_append_only`
(``rlplat check-template``) finds out on synthetic conversations, and :func:`check_played_conversation`,
with the same comparison, on conversations a run played (:mod:`rlplat_agents.template_drift`).

Tokenization follows the data loader (:class:`rlplat.data.RLDataset`): a rendered template is encoded
without the tokenizer's special tokens (the template writes them), and without a template the message
contents are concatenated and encoded with them; so :meth:`ChatRenderer.prompt_ids` of a dataset row's
messages, without tools, equals the row's ``input_ids``. Messages follow the Hugging Face convention:
``{"role": "assistant", "content": str, "tool_calls": [{"type": "function", "function": {"name": str,
"arguments": dict}}]}``, ``{"role": "tool", "content": str, "name": str (optional)}``, ``"user"``,
``"system"``; tools are OpenAI function schemas, passed as ``tools=`` of ``apply_chat_template``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

TOOL_ROLES = ("tool", "ipython")
"""Roles of tool results; a delta starting with them follows an assistant turn that called tools."""
RESERVED_TEMPLATE_KEYWORDS = frozenset(
    {"conversation", "tools", "add_generation_prompt", "tokenize", "continue_final_message", "return_dict"}
)

# The fixed conversation deltas are computed against, and that locates the end of an assistant turn.
DUMMY_USER = "Hello."
DUMMY_REPLY = "Hello! How can I help?"
DUMMY_TOOL = "dummy_tool"
# Contexts tried in turn for a delta: a plain reply, then one with reasoning, for templates (Qwen3's)
# that render the last assistant turn with an empty <think> block unless it has reasoning of its own.
DUMMY_ASSISTANT_CONTENTS = (DUMMY_REPLY, f"<think>\nThe user greets me.\n</think>\n\n{DUMMY_REPLY}")
DELTA_CACHE_SIZE = 256
EXCERPT_BEFORE = 40
EXCERPT_AFTER = 60


class TemplateError(ValueError):
    """The chat template cannot give what a multi-turn rollout needs: a rendering, an end of turn, or
    the tokens it adds for new messages without changing earlier ones."""


class TemplateRenderError(TemplateError):
    """The chat template itself failed (raised) on a conversation."""


def describe_messages(messages: Sequence[Mapping[str, Any]], limit: int = 40) -> str:
    """``[0] tool 'get_weather': 'Sunny' ...``: each message's index, role, name and content, shortened."""
    parts = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else type(message).__name__
        name = f" {message['name']!r}" if isinstance(message, Mapping) and message.get("name") else ""
        content = message.get("content") if isinstance(message, Mapping) else message
        text = repr(content) if len(repr(content)) <= limit else repr(content)[: limit - 3] + "..."
        parts.append(f"[{index}] {role}{name}: {text}")
    return "messages " + ", ".join(parts)


def checked_messages(messages: Any, where: str) -> list[Mapping[str, Any]]:
    """``messages`` as a list, after checking it is a non-empty sequence of dicts with a string role."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        got = "an empty list" if isinstance(messages, Sequence) and not messages else f"{messages!r:.60}"
        raise ValueError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages, got {got}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {index} is {message!r:.80}, not a dict with a string 'role'")
    return list(messages)


def common_prefix_length(first: Sequence, second: Sequence) -> int:
    """How many leading items (characters, token ids) ``first`` and ``second`` share."""
    length = min(len(first), len(second))
    for index in range(length):
        if first[index] != second[index]:
            return index
    return length


def excerpt(text: str, position: int) -> str:
    """``text`` around ``position``, with ``...`` where it was cut."""
    start, end = max(0, position - EXCERPT_BEFORE), position + EXCERPT_AFTER
    return ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")


def tools_key(tools: Optional[Sequence[Mapping[str, Any]]]) -> Optional[str]:
    return None if tools is None else json.dumps(list(tools), sort_keys=True, default=str)


class ChatRenderer:
    """Renders and tokenizes the turns of one tokenizer's chat template for an agent loop.

    ``template_kwargs`` are passed to every ``apply_chat_template`` call (the data loader's
    ``data.apply_chat_template_kwargs``, e.g. ``{"enable_thinking": False}``). Safe to share between
    the conversations of one process; deltas' fixed contexts are cached per tool set.
    """

    def __init__(self, tokenizer: Any, template_kwargs: Optional[Mapping[str, Any]] = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KEYWORDS & set(self.template_kwargs))
        if reserved:
            raise ValueError(f"template_kwargs may not set {reserved}: the renderer passes them itself")
        self.has_chat_template = getattr(tokenizer, "chat_template", None) is not None
        self._delta_contexts: dict[tuple, tuple[str, int, list[int]]] = {}

    # -- rendering and tokenizing ---------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping[str, Any]]] = None,
               add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``; :class:`TemplateRenderError` if the template raises."""
        if not self.has_chat_template:
            raise TemplateError("the tokenizer has no chat template, so conversations cannot be rendered")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=None if tools is None else list(tools),
                add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs,
            )
        except Exception as error:
            raise TemplateRenderError(
                f"the chat template failed on {describe_messages(messages)}"
                f"{' with tools' if tools else ''}: {type(error).__name__}: {error}"
            ) from error

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` by the data loader's rule: no added special tokens under a template."""
        return list(self.tokenizer(text, add_special_tokens=not self.has_chat_template)["input_ids"])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode` and each token's ``(start, end)`` characters in ``text``."""
        try:
            encoded = self.tokenizer(text, add_special_tokens=not self.has_chat_template, return_offsets_mapping=True)
            return list(encoded["input_ids"]), [tuple(span) for span in encoded["offset_mapping"]]
        except (NotImplementedError, ValueError, TypeError, KeyError):
            # Tokenizers without offsets: each token ends where the decoded prefix through it ends.
            ids = self.encode(text)
            ends = [len(self.tokenizer.decode(ids[: index + 1], skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False)) for index in range(len(ids))]
            return ids, [(start, end) for start, end in zip([0, *ends[:-1]], ends)]

    # -- what an agent loop calls ---------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]],
                   tools: Optional[Sequence[Mapping[str, Any]]] = None) -> list[int]:
        """The first prompt: ``messages`` rendered with the generation prompt of the assistant's turn
        and the ``tools`` offered, then encoded. Without tools it equals the data loader's ids."""
        messages = checked_messages(messages, "prompt_ids")
        if not self.has_chat_template:
            if tools:
                raise TemplateError("tools are offered but the tokenizer has no chat template to describe them")
            return self.encode("".join(str(message.get("content") or "") for message in messages))
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def delta_ids(self, messages: Sequence[Mapping[str, Any]],
                  tools: Optional[Sequence[Mapping[str, Any]]] = None) -> list[int]:
        """The tokens to append after a model turn that ended with :attr:`end_of_turn_ids`, for the
        non-assistant ``messages`` that follow it (the results of its tool calls, or a user or
        environment message), through the generation prompt of the next assistant turn.

        It is what the template renders after the end-of-turn token once ``messages`` follow a fixed
        conversation (a user message and an assistant reply, which calls one tool per leading tool
        result), so it includes what the template writes after that token (ChatML's newline) and does
        not depend on earlier turns. :class:`TemplateError` when the template renders that fixed
        conversation differently once ``messages`` follow (it is not append-only there)."""
        messages = checked_messages(messages, "delta_ids")
        assistants = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        if assistants:
            raise ValueError(
                f"delta_ids: message {assistants[0]} is the assistant's; a delta holds only the messages between "
                f"model turns (the model's own tokens are appended as sampled)"
            )
        if not self.has_chat_template:
            raise TemplateError(f"cannot tokenize {describe_messages(messages)} as a turn: the tokenizer has no "
                                f"chat template")
        leading_tools = []
        for message in messages:
            if message["role"] not in TOOL_ROLES:
                break
            leading_tools.append(message)
        problems = []
        for variant in range(len(DUMMY_ASSISTANT_CONTENTS)):
            context, cut, context_ids = self._delta_context(variant, leading_tools, tools)
            full = self.render([*self._dummy_conversation(variant, leading_tools), *messages], tools,
                               add_generation_prompt=True)
            if full[:cut] != context[:cut]:
                position = common_prefix_length(full, context)
                problems.append(f"it renders {excerpt(context, position)!r} as {excerpt(full, position)!r}")
                continue
            full_ids = self.encode(full)
            if full_ids[: len(context_ids)] != context_ids:
                position = common_prefix_length(full_ids, context_ids)
                problems.append(f"the text is kept but its tokens change at token {position} "
                                f"({context_ids[position:position + 4]} -> {full_ids[position:position + 4]})")
                continue
            return full_ids[len(context_ids):]
        raise TemplateError(
            f"cannot compute the tokens the chat template adds for {describe_messages(messages)}: the template "
            f"renders the assistant turn before them differently once they follow ({'; '.join(problems)}); it is "
            f"not append-only there, so a multi-turn rollout's tokens would differ from the template's rendering "
            f"of the conversation. `rlplat check-template` shows where."
        )

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The tokens that close an assistant turn: what the template writes after an assistant's
        content, through its first special token (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama 3).
        A model turn that ends with them can take :meth:`delta_ids` next. :class:`TemplateError` when
        the template closes assistant turns without a special token."""
        return self._end_of_turn[0]

    @property
    def end_of_turn_text(self) -> str:
        """The text of :attr:`end_of_turn_ids` as the template writes it."""
        return self._end_of_turn[1]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens to stop sampling an assistant turn on (``SamplingParams.stop_token_ids``): the last of
        :attr:`end_of_turn_ids`, and the tokenizer's EOS token when it differs."""
        stops = [self.end_of_turn_ids[-1]]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos not in stops:
            stops.append(eos)
        return tuple(stops)

    def ends_turn(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` (a model turn) end with :attr:`end_of_turn_ids`."""
        end = self.end_of_turn_ids
        return len(token_ids) >= len(end) and tuple(token_ids[len(token_ids) - len(end):]) == end

    def closing_ids(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Tokens to append (not sampled) to a model turn so that it ends as the template ends a turn
        before :meth:`delta_ids`: none when it :meth:`ends_turn`, else :attr:`end_of_turn_ids` (a
        turn cut by the length limit, or stopped on another token)."""
        return () if self.ends_turn(token_ids) else self.end_of_turn_ids

    # -- internals ------------------------------------------------------------------------------------

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special tokens, added special tokens included."""
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        for index, token in getattr(self.tokenizer, "added_tokens_decoder", {}).items():
            if getattr(token, "special", False):
                special.add(index)
        return frozenset(special)

    @functools.cached_property
    def _end_of_turn(self) -> tuple[tuple[int, ...], str]:
        user = [{"role": "user", "content": DUMMY_USER}]
        prompt = self.render(user, add_generation_prompt=True)
        turn = self.render([*user, {"role": "assistant", "content": DUMMY_REPLY}])
        start = turn.find(DUMMY_REPLY, common_prefix_length(prompt, turn))
        if start < 0:
            raise TemplateError(f"the chat template does not write an assistant's content as it is: the reply "
                                f"{DUMMY_REPLY!r} is not in its rendering {turn!r}")
        content_end = start + len(DUMMY_REPLY)
        ids, spans = self.encode_with_offsets(turn)
        tail = [(token, span) for token, span in zip(ids, spans) if span[0] >= content_end]
        for index, (token, (_, end)) in enumerate(tail):
            if token in self.special_ids:
                return tuple(token for token, _ in tail[: index + 1]), turn[content_end:end]
        raise TemplateError(
            f"the chat template closes an assistant turn with {turn[content_end:]!r}, which holds no special token: "
            f"a rollout has no token to stop the turn on, so multi-turn rollouts cannot use this template"
        )

    def _dummy_conversation(self, variant: int, leading_tools: Sequence[Mapping[str, Any]]) -> list[dict]:
        reply: dict[str, Any] = {"role": "assistant", "content": DUMMY_ASSISTANT_CONTENTS[variant]}
        if leading_tools:
            reply["tool_calls"] = [
                {"type": "function", "function": {"name": message.get("name") or DUMMY_TOOL, "arguments": {}}}
                for message in leading_tools
            ]
        return [{"role": "user", "content": DUMMY_USER}, reply]

    def _delta_context(self, variant: int, leading_tools: Sequence[Mapping[str, Any]],
                       tools: Optional[Sequence[Mapping[str, Any]]]) -> tuple[str, int, list[int]]:
        """The fixed conversation's text, where its assistant turn's end-of-turn text ends in it, and
        the ids of the text up to there."""
        key = (variant, tuple(message.get("name") or DUMMY_TOOL for message in leading_tools), tools_key(tools))
        if key not in self._delta_contexts:
            context = self.render(self._dummy_conversation(variant, leading_tools), tools)
            end = context.rfind(self.end_of_turn_text)
            if end < 0:
                raise TemplateError(
                    f"the chat template does not close the assistant turn of {context!r} with "
                    f"{self.end_of_turn_text!r}, its end of turn elsewhere"
                )
            cut = end + len(self.end_of_turn_text)
            if len(self._delta_contexts) >= DELTA_CACHE_SIZE:
                self._delta_contexts.clear()
            self._delta_contexts[key] = (context, cut, self.encode(context[:cut]))
        return self._delta_contexts[key]


# -- the append-only check ----------------------------------------------------------------------------

APPEND_ONLY = "append-only"
DIVERGES = "diverges"
UNSUPPORTED = "unsupported"


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A conversation to check: ``messages`` (the first not the assistant's, at least one assistant
    turn, no two in a row: an agent loop always has a message between model turns) and the ``tools``
    offered."""

    name: str
    messages: tuple[Mapping[str, Any], ...]
    tools: Optional[tuple[Mapping[str, Any], ...]] = None

    def __post_init__(self) -> None:
        messages = checked_messages(self.messages, f"conversation {self.name!r}")
        roles = [message["role"] for message in messages]
        if roles[0] == "assistant":
            raise ValueError(f"conversation {self.name!r}: message 0 is the assistant's; a conversation starts "
                             f"with the prompt")
        if "assistant" not in roles:
            raise ValueError(f"conversation {self.name!r}: no assistant message, so there is no turn to check")
        for index in range(1, len(roles)):
            if roles[index] == roles[index - 1] == "assistant":
                raise ValueError(f"conversation {self.name!r}: messages {index - 1} and {index} are both the "
                                 f"assistant's; an agent loop puts a message between model turns")


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where a conversation's rendering first changes what came before.

    ``check`` says which comparison found it: ``turn by turn`` (the conversation up to one turn
    against the conversation up to the next), ``one pass`` (the last turn against the whole
    conversation rendered at once), ``agent loop`` (first prompt + sampled turns + :meth:`ChatRenderer.
    delta_ids` against the template's rendering) or ``delta`` (the delta could not be computed);
    ``level`` is ``text`` or ``tokens``. ``expected`` is the earlier rendering (what the model saw or
    sampled) around the divergence, ``rendered`` the later one at the same place. ``token`` is the
    position of the first differing token in the earlier token ids, when tokens were compared (on the
    ``agent loop`` path: in the loop's ids, prompt first)."""

    message_index: int
    role: str
    check: str
    level: str
    expected: str
    rendered: str
    detail: str
    token: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class ConversationCheck:
    """The result for one conversation: ``status`` is ``append-only``, ``diverges`` (with the first
    :class:`Divergence`) or ``unsupported`` (the template raised on it: ``error``; not checked)."""

    name: str
    messages: int
    status: str
    divergence: Optional[Divergence] = None
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class AppendOnlyReport:
    """What :func:`check_append_only` found. ``problem`` is a template-level failure (no end of turn
    to stop on): then no conversation was checked."""

    conversations: tuple[ConversationCheck, ...]
    end_of_turn: Optional[str] = None
    problem: Optional[str] = None

    @property
    def append_only(self) -> bool:
        """True when no conversation diverges and at least one was checked."""
        statuses = [check.status for check in self.conversations]
        return self.problem is None and APPEND_ONLY in statuses and DIVERGES not in statuses

    @property
    def diverging(self) -> tuple[ConversationCheck, ...]:
        return tuple(check for check in self.conversations if check.status == DIVERGES)

    def to_dict(self) -> dict[str, Any]:
        return {
            "append_only": self.append_only,
            "end_of_turn": self.end_of_turn,
            "problem": self.problem,
            "conversations": [dataclasses.asdict(check) for check in self.conversations],
        }


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example 3 * (4 + 5)."}},
            "required": ["expression"],
        },
    },
}
SYNTHETIC_TOOLS = (WEATHER_TOOL, CALCULATOR_TOOL)


def _system(content: str) -> dict:
    return {"role": "system", "content": content}


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def _assistant(content: str, *calls: tuple[str, dict]) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": arguments}}
                                 for name, arguments in calls]
    return message


def _tool(name: str, content: str) -> dict:
    return {"role": "tool", "name": name, "content": content}


def synthetic_conversations(reasoning: bool = False) -> tuple[Conversation, ...]:
    """The built-in conversations of :func:`check_append_only`: with and without a system message,
    follow-up user turns, tools offered and unused, single and parallel tool calls and their results,
    several tool turns, a conversation that ends on a tool result; with ``reasoning``, also assistant
    turns that open with ``<think>...</think>`` (for templates that handle reasoning)."""
    system = _system("You are a careful assistant.")
    weather_paris = ("get_weather", {"city": "Paris"})
    weather_rome = ("get_weather", {"city": "Rome", "unit": "celsius"})
    product = ("calculator", {"expression": "12 * 7"})
    conversations = [
        Conversation("single turn", (_user("What is 2 + 2?"), _assistant("2 + 2 = 4."))),
        Conversation("system message", (system, _user("What is 2 + 2?"), _assistant("4."))),
        Conversation("follow-ups", (
            _user("Name a prime number."), _assistant("7."), _user("A larger one?"), _assistant("11."),
            _user("Wrong, try again with one above 20."), _assistant("23."),
        )),
        Conversation("system + follow-up", (
            system, _user("Name a colour."), _assistant("Blue."), _user("Another one?"), _assistant("Green."),
        )),
        Conversation("tools offered, unused", (_user("Hi there."), _assistant("Hello!")), SYNTHETIC_TOOLS),
        Conversation("tool call", (
            _user("What is the weather in Paris?"), _assistant("", weather_paris),
            _tool("get_weather", "Sunny, 21 C."), _assistant("It is sunny and 21 C in Paris."),
        ), SYNTHETIC_TOOLS),
        Conversation("tool call after text + system", (
            system, _user("What is 12 * 7?"), _assistant("Let me compute that.", product),
            _tool("calculator", "84"), _assistant("12 * 7 = 84."),
        ), SYNTHETIC_TOOLS),
        Conversation("parallel tool calls", (
            _user("Compare the weather in Paris and Rome."), _assistant("", weather_paris, weather_rome),
            _tool("get_weather", "Sunny, 21 C."), _tool("get_weather", "Cloudy, 18 C."),
            _assistant("Paris is sunnier and warmer than Rome."),
        ), SYNTHETIC_TOOLS),
        Conversation("consecutive tool turns", (
            _user("What is 12 * 7, and the weather in Rome?"), _assistant("", product), _tool("calculator", "84"),
            _assistant("Now the weather.", weather_rome), _tool("get_weather", "Cloudy, 18 C."),
            _assistant("84, and it is cloudy and 18 C in Rome."),
        ), SYNTHETIC_TOOLS),
        Conversation("tool calls + follow-up", (
            system, _user("What is 12 * 7?"), _assistant("", product), _tool("calculator", "84"),
            _assistant("84."), _user("And the weather in Paris and Rome?"),
            _assistant("", weather_paris, weather_rome), _tool("get_weather", "Sunny, 21 C."),
            _tool("get_weather", "Cloudy, 18 C."), _assistant("Sunny in Paris, cloudy in Rome."),
        ), SYNTHETIC_TOOLS),
        Conversation("ends on a tool result", (
            _user("What is the weather in Paris?"), _assistant("", weather_paris), _tool("get_weather", "Sunny, 21 C."),
        ), SYNTHETIC_TOOLS),
    ]
    if reasoning:
        conversations += [
            Conversation("reasoning + follow-up", (
                _user("What is 3 * 4?"), _assistant("<think>\nThree fours are twelve.\n</think>\n\n12."),
                _user("And 3 * 5?"), _assistant("<think>\nThree fives are fifteen.\n</think>\n\n15."),
            )),
            Conversation("reasoning + tool calls", (
                _user("What is 12 * 7?"), _assistant("<think>\nI should use the calculator.\n</think>\n\n", product),
                _tool("calculator", "84"), _assistant("<think>\nThe tool says 84.\n</think>\n\n12 * 7 = 84."),
            ), SYNTHETIC_TOOLS),
            Conversation("reasoning + tools + follow-up", (
                _user("What is the weather in Paris?"),
                _assistant("<think>\nI need the weather tool.\n</think>\n\n", weather_paris),
                _tool("get_weather", "Sunny, 21 C."), _assistant("<think>\nSunny it is.\n</think>\n\nSunny, 21 C."),
                _user("And in Rome?"), _assistant("<think>\nThe same tool for Rome.\n</think>\n\n", weather_rome),
                _tool("get_weather", "Cloudy, 18 C."), _assistant("<think>\nCloudy.\n</think>\n\nCloudy, 18 C."),
            ), SYNTHETIC_TOOLS),
        ]
    return tuple(conversations)


def handles_reasoning(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template handles ``<think>`` reasoning (it mentions ``</think>``)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, Mapping) else [template]
    return any(isinstance(text, str) and "</think>" in text for text in texts)


def check_append_only(tokenizer: Any, conversations: Optional[Sequence[Conversation]] = None,
                      template_kwargs: Optional[Mapping[str, Any]] = None) -> AppendOnlyReport:
    """Render ``conversations`` (default: :func:`synthetic_conversations`, with reasoning when the
    template handles it) turn by turn and in one pass, and check the template only appends.

    Per conversation, the renderings at each turn boundary an agent loop sees, in order: the messages
    before each assistant turn with the generation prompt, then through that turn's end-of-turn token,
    and last the whole conversation at once; each must be a prefix of the next, as text and as token
    ids. Boundaries are turns, not single messages, because a loop appends all the messages between
    two model turns at once (ChatML templates group consecutive tool results in one turn). Then the
    agent loop's own path: :meth:`ChatRenderer.prompt_ids` + each assistant turn's tokens as the
    template renders them + :meth:`ChatRenderer.delta_ids` of the messages that follow must equal the
    ids of the template's rendering at every generation prompt. The first divergence is reported with
    the message it falls in. :class:`TemplateError` when the tokenizer has no chat template."""
    renderer = ChatRenderer(tokenizer, template_kwargs)
    if not renderer.has_chat_template:
        raise TemplateError("the tokenizer has no chat template: there is nothing to check")
    if conversations is None:
        conversations = synthetic_conversations(reasoning=handles_reasoning(tokenizer))
    try:
        end_of_turn = renderer.end_of_turn_text
    except TemplateError as error:
        return AppendOnlyReport(conversations=(), problem=str(error))
    return AppendOnlyReport(tuple(check_conversation(renderer, conversation) for conversation in conversations),
                            end_of_turn=end_of_turn)


@dataclasses.dataclass(frozen=True)
class _Rendering:
    """The text of the first ``count`` messages at one turn boundary, and the check it belongs to."""

    count: int
    text: str
    check: str


def check_conversation(renderer: ChatRenderer, conversation: Conversation) -> ConversationCheck:
    """One conversation of :func:`check_append_only`."""
    messages = list(conversation.messages)
    try:
        divergence = _first_divergence(renderer, messages, conversation.tools)
    except TemplateRenderError as error:
        return ConversationCheck(conversation.name, len(messages), UNSUPPORTED, error=str(error))
    status = APPEND_ONLY if divergence is None else DIVERGES
    return ConversationCheck(conversation.name, len(messages), status, divergence)


def _first_divergence(renderer: ChatRenderer, messages: list, tools: Optional[Sequence]) -> Optional[Divergence]:
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    end_text = renderer.end_of_turn_text
    renderings = []
    for turn in turns:
        prompt = renderer.render(messages[:turn], tools, add_generation_prompt=True)
        renderings.append(_Rendering(turn, prompt, "turn by turn"))
        through_turn = renderer.render(messages[:turn + 1], tools)
        end = through_turn.find(end_text, common_prefix_length(prompt, through_turn))
        cut = len(through_turn) if end < 0 else end + len(end_text)
        renderings.append(_Rendering(turn + 1, through_turn[:cut], "turn by turn"))
    ends_on_assistant = messages[-1]["role"] == "assistant"
    renderings.append(_Rendering(len(messages), renderer.render(messages, tools, not ends_on_assistant), "one pass"))

    encoded = [renderer.encode_with_offsets(rendering.text) for rendering in renderings]
    for number in range(len(renderings) - 1):
        earlier, later = renderings[number], renderings[number + 1]
        position = common_prefix_length(earlier.text, later.text)
        if position < len(earlier.text):
            return _divergence(renderer, messages, tools, earlier, position, later.check, "text",
                               excerpt(earlier.text, position), excerpt(later.text, position),
                               f"the first {later.count} messages render the first {earlier.count} differently")
        (earlier_ids, earlier_spans), (later_ids, _) = encoded[number], encoded[number + 1]
        token = common_prefix_length(earlier_ids, later_ids)
        if token < len(earlier_ids):
            return _divergence(renderer, messages, tools, earlier, earlier_spans[token][0], later.check, "tokens",
                               _token_excerpt(renderer, earlier_ids, token), _token_excerpt(renderer, later_ids, token),
                               f"the text is kept but token {token} changes once the first {later.count} messages "
                               f"are tokenized together", token)

    # The agent loop's path: renderings alternate prompt, turn (through its end of turn), ..., whole.
    ids = renderer.prompt_ids(messages[:turns[0]], tools)
    for number, turn in enumerate(turns):
        prompt_ids, turn_ids = encoded[2 * number][0], encoded[2 * number + 1][0]
        ids = ids + turn_ids[len(prompt_ids):]
        following = turns[number + 1] if number + 1 < len(turns) else len(messages)
        if following == turn + 1:
            break
        group = messages[turn + 1:following]
        try:
            ids = ids + renderer.delta_ids(group, tools)
        except TemplateRenderError:
            raise
        except TemplateError as error:
            return Divergence(turn + 1, group[0]["role"], "delta", "text", "", "", str(error))
        expected = renderings[2 * number + 2]
        divergence = _loop_divergence(renderer, messages, tools, ids, expected, *encoded[2 * number + 2],
                                      f"the template's rendering of the first {expected.count} messages")
        if divergence is not None:
            return divergence
    if ends_on_assistant:
        return _loop_divergence(renderer, messages, tools, ids, renderings[-1], *encoded[-1], "the whole conversation",
                                prefix=True)
    return None


def _loop_divergence(renderer: ChatRenderer, messages: list, tools: Optional[Sequence], ids: Sequence[int],
                     rendering: _Rendering, rendered_ids: Sequence[int], spans: Optional[Sequence[tuple[int, int]]],
                     of_what: str, prefix: bool = False,
                     message_of: Optional[Callable[[int], Optional[int]]] = None) -> Optional[Divergence]:
    """The agent loop's comparison: ``ids`` (what a loop fed the model: its prompt, the sampled turns and
    the tokens appended between them) against ``rendered_ids``, the template's ``rendering`` of the same
    messages, which must equal them or, with ``prefix``, start with them. ``expected`` shows the loop's
    tokens at the first difference, ``rendered`` the template's. ``spans`` (the rendered tokens'
    characters) are computed only when the ids differ, when None. The message is ``message_of(token)``
    when it answers, else the one holding the difference in the rendering."""
    if list(ids) == list(rendered_ids[: len(ids)] if prefix else rendered_ids):
        return None
    if spans is None:
        rendered_ids, spans = renderer.encode_with_offsets(rendering.text)
    token = common_prefix_length(ids, rendered_ids)
    position = spans[token][0] if token < len(spans) else len(rendering.text)
    index = message_of(token) if message_of is not None else None
    return _divergence(renderer, messages, tools, rendering, position, "agent loop", "tokens",
                       _token_excerpt(renderer, ids, token), _token_excerpt(renderer, rendered_ids, token),
                       f"prompt + sampled turns + deltas differ at token {token} from {of_what}", token, index)


def check_played_conversation(renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]],
                              tools: Optional[Sequence[Mapping[str, Any]]], ids: Sequence[int],
                              turn_starts: Sequence[int], sampled: Sequence[bool]) -> Optional[Divergence]:
    """A conversation an agent loop played, against the template: the comparison of
    :func:`check_append_only`'s agent-loop path on tokens the model really saw and sampled.

    ``messages`` are the conversation (the prompt's messages, each model turn as an assistant message,
    the messages appended between turns), ``tools`` those offered, ``ids`` its tokens (the prompt, then
    the response), ``turn_starts`` where each assistant turn's tokens start in ``ids`` and ``sampled``
    which of ``ids`` the model sampled. Before each assistant turn the template's rendering of the
    messages before it, with the generation prompt, must be the tokens the loop fed the model; the
    rendering of the whole conversation must start with ``ids``. A difference only in how the model
    split a sampled turn into tokens (the same text, other tokens than the tokenizer gives) is the
    model's, not the template's, and passes. None when consistent, else the first :class:`Divergence`.
    :class:`TemplateError` when the template cannot render the conversation."""
    messages = checked_messages(messages, "check_played_conversation")
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if len(turns) != len(turn_starts):
        raise ValueError(f"check_played_conversation: {len(turns)} assistant messages but {len(turn_starts)} turn starts")
    # Where each message's tokens start after the prompt: a sampled turn, then what follows it. The
    # template's own rendering cannot say: a template that is not append-only renders a turn otherwise
    # once more messages follow, which is the very difference found.
    regions = []
    for turn, start in zip(turns, turn_starts):
        end = start
        while end < len(sampled) and sampled[end]:
            end += 1
        regions += [(start, turn)] + ([(end, turn + 1)] if turn + 1 < len(messages) else [])

    def message_of(token: int) -> Optional[int]:
        return next((index for first, index in reversed(regions) if first <= token), None)

    boundaries = [(turn, start, True) for turn, start in zip(turns, turn_starts)]
    boundaries.append((len(messages), len(ids), messages[-1]["role"] != "assistant"))
    for count, end, generation_prompt in boundaries:
        whole = count == len(messages)
        rendering = _Rendering(count, renderer.render(messages[:count], tools, generation_prompt), "agent loop")
        fed = list(ids[:end])
        of_what = "the whole conversation" if whole else f"the template's rendering of the first {count} messages"
        divergence = _loop_divergence(renderer, messages, tools, fed, rendering, renderer.encode(rendering.text), None,
                                      of_what, whole, lambda token: message_of(token) if token < len(fed) else None)
        if divergence is None:
            continue
        if divergence.token < len(fed) and sampled[divergence.token]:
            text = renderer.tokenizer.decode(fed, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if rendering.text.startswith(text) if whole else rendering.text == text:
                continue
            noncanonical = _noncanonical_sample(renderer, messages, tools, ids, sampled, turns, turn_starts, divergence.token)
            if noncanonical is not None:
                return dataclasses.replace(divergence, check=MODEL_SAMPLE, detail=noncanonical)
        return divergence
    return None


MODEL_SAMPLE = "model sample"
"""The :class:`Divergence` check of a difference the model made, not the template: a sampled turn whose text is
not the template's own rendering of it (a tool call written with other spacing, a turn ended by EOS instead of
the end-of-turn token), so any re-rendering of the conversation differs there. Counted apart from drift."""


def _noncanonical_sample(renderer: ChatRenderer, messages: list, tools: Optional[Sequence], ids: Sequence[int],
                         sampled: Sequence[bool], turns: Sequence[int], turn_starts: Sequence[int], token: int) -> Optional[str]:
    """Why the sampled turn holding ``token`` is not the template's rendering of its own message (rendered as
    the conversation's last), or None when it is (then a difference there is the template's)."""
    starts = [(start, turn) for turn, start in zip(turns, turn_starts) if start <= token]
    if not starts:
        return None
    start, turn = starts[-1]
    end = start
    while end < len(sampled) and sampled[end]:
        end += 1
    sample = renderer.tokenizer.decode(list(ids[start:end]), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    before = renderer.render(messages[:turn], tools, True)
    with_turn = renderer.render(messages[:turn + 1], tools, False)
    if not with_turn.startswith(before):
        return None  # the template rewrites earlier messages here: its doing, whatever the sample
    canonical = with_turn[len(before):]
    if canonical.startswith(sample):
        return None
    return (f"the model's turn {turn} reads {sample[:80]!r}, which the template writes {canonical[:80]!r} when it "
            "renders that message: the model's formatting, not the template's drift")


def _divergence(renderer: ChatRenderer, messages: list, tools: Optional[Sequence], earlier: _Rendering,
                position: int, check: str, level: str, expected: str, rendered: str, detail: str,
                token: Optional[int] = None, index: Optional[int] = None) -> Divergence:
    if index is None:
        index = _message_at(renderer, messages, tools, earlier, position)
    return Divergence(index, messages[index]["role"], check, level, expected, rendered, detail, token)


def _message_at(renderer: ChatRenderer, messages: list, tools: Optional[Sequence], rendering: _Rendering,
                position: int) -> int:
    """The message whose text holds ``position`` of ``rendering``: the first message whose rendering,
    with those before it, reaches past it; past them all, the message after (its generation prompt)."""
    for count in range(1, rendering.count + 1):
        try:
            partial = renderer.render(messages[:count], tools)
        except TemplateRenderError:
            continue
        if common_prefix_length(partial, rendering.text) > position:
            return count - 1
    return min(rendering.count, len(messages) - 1)


def _token_excerpt(renderer: ChatRenderer, ids: Sequence[int], token: int) -> str:
    start = max(0, token - 6)
    pieces = [renderer.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
              for token_id in ids[start:token + 8]]
    return ("... " if start else "") + " | ".join(repr(piece) for piece in pieces) + (
        " ..." if token + 8 < len(ids) else "")
