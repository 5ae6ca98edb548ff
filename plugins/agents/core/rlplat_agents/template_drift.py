"""The chat template checked on the trajectories a run plays (``agent.template_check``).

``rlplat check-template`` checks a template on synthetic conversations before a run; this checks it on a
sample of the run's own multi-turn trajectories, whose messages (reasoning, tool calls as the model wrote
them, tool results) are the ones that occur. The manager gives each conversation's loop a
:class:`RecordingRenderer`, which remembers the messages the loop renders (its prompt, and what it appends
between model turns); a finished trajectory's conversation is rebuilt from them and from its sampled
turns (:func:`played_conversation`) and compared with the template's rendering by
:func:`rlplat_agents.chat.check_played_conversation`, the comparison of ``check-template``'s agent-loop path.

A drift is reported, never raised: one ``template`` :class:`~rlplat.contracts.health.HealthEvent` per batch
with a drift, in ``meta_info["health_events"]`` (the run's sentinel warns or stops), and the per-row columns
:data:`CHECKED_COLUMN` and :data:`DRIFTED_COLUMN` (1.0 or 0.0), which
:func:`rlplat_agents.manager.agent_metrics` sums into ``agent/template_checked`` and ``agent/template_drifted``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from rlplat.contracts.agent import Trajectory
from rlplat.contracts.health import HealthEvent
from rlplat_agents.chat import MODEL_SAMPLE, TOOL_ROLES, ChatRenderer, Divergence, TemplateError, check_played_conversation
from rlplat_agents.config import TemplateCheckConfig

CHECKED_COLUMN = "agent_template_checked"
"""Per row: 1.0 when its trajectory was checked against the template."""
DRIFTED_COLUMN = "agent_template_drifted"
"""Per row: 1.0 when its trajectory was checked and the template's rendering differs from its tokens."""
NONCANONICAL_COLUMN = "agent_template_noncanonical"
"""Per row: 1.0 when its trajectory was checked and differs only where the model sampled a turn the template
would write otherwise (:data:`~rlplat_agents.chat.MODEL_SAMPLE`): the model's formatting, not drift."""
EXCERPT_CHARACTERS = 200

Messages = Sequence[Mapping[str, Any]]
Tools = Optional[Sequence[Mapping[str, Any]]]


class RecordingRenderer:
    """One conversation's view of the manager's shared :class:`ChatRenderer`: the same answers, and a
    record of what the loop rendered: ``prompts`` and ``deltas``, each ``(messages, tools, ids)`` in
    call order."""

    def __init__(self, renderer: ChatRenderer):
        self.renderer = renderer
        self.prompts: list[tuple[list, Optional[list], list[int]]] = []
        self.deltas: list[tuple[list, Optional[list], list[int]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.renderer, name)

    def prompt_ids(self, messages: Messages, tools: Tools = None) -> list[int]:
        ids = self.renderer.prompt_ids(messages, tools)
        self.prompts.append((list(messages), None if tools is None else list(tools), ids))
        return ids

    def delta_ids(self, messages: Messages, tools: Tools = None) -> list[int]:
        ids = self.renderer.delta_ids(messages, tools)
        self.deltas.append((list(messages), None if tools is None else list(tools), ids))
        return ids


@dataclasses.dataclass
class PlayedConversation:
    """A finished trajectory as :func:`~rlplat_agents.chat.check_played_conversation` takes it."""

    messages: list[dict]
    tools: Optional[list]
    ids: list[int]
    turn_starts: list[int]
    sampled: list[bool]


def multi_turn(trajectory: Trajectory) -> bool:
    """Two model turns or more, or tokens appended after a model turn (a tool result, feedback)."""
    return trajectory.num_turns >= 2 or 0 in trajectory.response_mask


def mask_runs(mask: Sequence[int]) -> list[tuple[bool, int, int]]:
    """``(sampled, start, end)`` of each run of equal ``mask`` values."""
    runs, start = [], 0
    for position in range(1, len(mask) + 1):
        if position == len(mask) or mask[position] != mask[start]:
            runs.append((bool(mask[start]), start, position))
            start = position
    return runs


def assistant_message(text: str, parser: Any, offers_tools: bool) -> dict:
    """A model turn's text as the assistant message a chat server would keep: with its tool calls split
    out by ``parser`` when the conversation offers tools and every call parses, else the text as it is."""
    if offers_tools and parser is not None:
        parsed = parser.parse(text)
        if parsed.calls and not parsed.errors:
            return {"role": "assistant", "content": parsed.content, "tool_calls": [
                {"type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}
                for call in parsed.calls]}
    return {"role": "assistant", "content": text}


def played_conversation(trajectory: Trajectory, record: RecordingRenderer, row: Mapping[str, Any],
                        loader_prompt_ids: Sequence[int], parser: Any,
                        stop_token_ids: Sequence[int]) -> Optional[PlayedConversation]:
    """The conversation ``trajectory`` played, rebuilt: the prompt's messages (those the loop rendered its
    prompt from, else the row's ``raw_prompt`` when the prompt is the data loader's), each sampled turn as
    an assistant message (decoded without its trailing stop tokens, as the loops read it; see
    :func:`assistant_message`) and the messages the loop appended after it. None when the tokens cannot
    be matched to what the loop rendered (a loop that makes its tokens some other way)."""
    renderer = record.renderer
    prompt_ids = list(trajectory.prompt_ids)
    prompt = next(((messages, tools) for messages, tools, ids in record.prompts if ids == prompt_ids), None)
    if prompt is None:
        raw = row.get("raw_prompt")
        if raw is None or prompt_ids != list(loader_prompt_ids):
            return None
        prompt = (list(raw), None)
    messages, tools = list(prompt[0]), prompt[1]
    offers_tools = tools is not None or any(message.get("role") in TOOL_ROLES
                                            for delta, _, _ in record.deltas for message in delta)
    deltas = iter(record.deltas)
    offset, turn_starts, previous = len(trajectory.prompt_ids), [], None
    stops = set(stop_token_ids)
    for sampled, start, end in mask_runs(trajectory.response_mask):
        piece = list(trajectory.response_ids[start:end])
        if sampled:
            turn_starts.append(offset + start)
            kept = piece
            while kept and kept[-1] in stops:
                kept = kept[:-1]
            text = renderer.tokenizer.decode(kept, skip_special_tokens=False)
            messages.append(assistant_message(text, parser, offers_tools))
            previous = piece
            continue
        delta = next(deltas, None)
        if previous is None or delta is None or piece != list(renderer.closing_ids(previous)) + list(delta[2]):
            return None
        messages.extend(delta[0])
        previous = None
    return PlayedConversation(messages, tools, prompt_ids + list(trajectory.response_ids), turn_starts,
                              [False] * offset + [bool(keep) for keep in trajectory.response_mask])


class TemplateDriftCheck:
    """The check of one agent-loop manager (one rollout worker): which trajectories, and what a batch
    reports. Until it has checked one, the first multi-turn trajectory of each batch is checked."""

    def __init__(self, config: TemplateCheckConfig, renderer: ChatRenderer, parser: Any, stop_token_ids: Sequence[int]):
        self.config, self.renderer, self.parser = config, renderer, parser
        self.stop_token_ids = tuple(stop_token_ids)
        self.checked_any = False

    @property
    def enabled(self) -> bool:
        return self.config.sample_rate > 0 and self.renderer.has_chat_template

    def chosen(self, seed: Optional[int], uid: Any, index: int) -> bool:
        """Whether row ``index`` (``uid``) of a batch sampled with ``seed`` is in the sample: a hash, not
        Python's ``hash`` (salted per process), so every run and worker draws the same."""
        key = f"{seed}/{uid}/{index}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0 ** 64
        return draw < self.config.sample_rate

    def check(self, rows: Sequence[Mapping[str, Any]], trajectories: Sequence[Trajectory],
              records: Sequence[Optional[RecordingRenderer]], loader_prompts: Sequence[Sequence[int]],
              seed: Optional[int]) -> tuple[dict[str, np.ndarray], list[dict]]:
        """The batch's columns (:data:`CHECKED_COLUMN`, :data:`DRIFTED_COLUMN`) and its health events
        (none, or one naming the first drifted row)."""
        checked, drifted = np.zeros(len(trajectories)), np.zeros(len(trajectories))
        noncanonical = np.zeros(len(trajectories))
        variations: list[tuple[int, Any]] = []
        drifts: list[tuple[int, Any]] = []
        for index, (trajectory, record) in enumerate(zip(trajectories, records)):
            if not self.enabled or record is None or not multi_turn(trajectory):
                continue
            if self.checked_any and not self.chosen(seed, rows[index].get("uid"), index):
                continue
            played = played_conversation(trajectory, record, rows[index], loader_prompts[index], self.parser,
                                         self.stop_token_ids)
            if played is None:
                continue
            try:
                found: Any = check_played_conversation(self.renderer, played.messages, played.tools, played.ids,
                                                       played.turn_starts, played.sampled)
            except TemplateError as error:  # the template refuses the conversation its own deltas built
                found = error
            checked[index], self.checked_any = 1.0, True
            if isinstance(found, Divergence) and found.check == MODEL_SAMPLE:
                noncanonical[index] = 1.0
                variations.append((index, found))
            elif found is not None:
                drifted[index] = 1.0
                drifts.append((index, found))
        if variations and len(variations) >= self.config.noncanonical_share * checked.sum():
            drifts.extend(variations)  # systematic: the template writes its messages otherwise than it teaches
            drifted[[index for index, _ in variations]] = 1.0
        events = [self.event(rows, drifts, int(checked.sum()))] if drifts else []
        return {CHECKED_COLUMN: checked, DRIFTED_COLUMN: drifted, NONCANONICAL_COLUMN: noncanonical}, events

    def event(self, rows: Sequence[Mapping[str, Any]], drifts: Sequence[tuple[int, Any]], checked: int) -> dict:
        """The batch's ``template`` health event, as a dict: the counts and the first drifted row."""
        index, found = drifts[0]
        uid = rows[index].get("uid")
        figures: dict[str, Any] = {"checked": checked, "drifted": len(drifts), "uid": None if uid is None else str(uid),
                                   "row": index, "first_divergence_token": None}
        if isinstance(found, Divergence):
            figures.update(first_divergence_token=found.token, message_index=found.message_index, role=found.role,
                           expected=found.expected[:EXCERPT_CHARACTERS], rendered=found.rendered[:EXCERPT_CHARACTERS])
            where = (f"at token {found.token} of its prompt and response, in message {found.message_index} "
                     f"({found.role}): {found.detail}")
        else:
            where = f"the template cannot render its conversation: {found}"
        message = (f"the chat template renders {len(drifts)} of {checked} checked multi-turn trajectories otherwise than "
                   f"the tokens the agent loop fed and sampled (training on them differs from what the template gives "
                   f"the model when it serves); the first, batch row {index} (uid {figures['uid']!r}), {where}. "
                   f"`rlplat check-template MODEL_DIR` shows where the template stops only appending.")
        return HealthEvent("template", message, role="rollout", figures=figures).as_dict()
