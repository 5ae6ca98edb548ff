"""From a batch of prompts to a batch of conversations: the agent-loop manager.

:class:`AgentLoopManager` runs one conversation per (prompt, sample) with the loop its row names
(``agent_name``, verl's column; ``agent.loop`` otherwise), at most ``agent.max_concurrency`` at once,
over one or more rollout replicas (:class:`~rlplat.contracts.agent.TokenClient`). A conversation is
placed on the replica with the fewest requests in flight when it starts and stays there (its prefix
stays in that replica's cache). :meth:`AgentLoopManager.generate` returns the keys of
:meth:`RolloutEngine.generate` (``prompts`` left padded to ``agent.max_prompt_length``, ``responses``
right padded to ``rollout.response_length``, ``response_mask`` 1 on sampled tokens only, ...) plus
non-tensor columns: ``agent_reward`` (an environment's reward, NaN when the reward manager scores the
row), ``agent_finish``, one ``agent/<metric>`` column per trajectory metric, and the template check's
``agent_template_checked`` and ``agent_template_drifted`` (:mod:`rlplat_agents.template_drift`: a sample of
the multi-turn trajectories re-rendered with the chat template; a drift is a ``template`` health event in
``meta_info["health_events"]``, not an error).

With a ``reward_loop`` (the run's reward manager's trajectory scorer, e.g. :class:`rlplat_rewards.reward_loop.RewardLoop`), each trajectory is scored as soon as it
finishes, while the others still generate, and :meth:`AgentLoopManager.generate` returns once every
score is in, with the columns of :data:`rlplat_rewards.reward_loop.LOOP_COLUMNS` added
(:func:`rlplat_rewards.reward_loop.precomputed_scores` reads them). Rows with an environment's reward are scored
too: which reward a row gets is the trainer's choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from rlplat_agents.config import AgentConfig
from rlplat.contracts.agent import AgentContext, AgentLoop, TokenClient, Trajectory
from rlplat.contracts.health import HEALTH_EVENTS
from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.kits.aio import run_async  # noqa: F401 (the manager's callers import it from here too)
from rlplat.protocol import DataProto

METRIC_PREFIX = "agent/"


class EngineClient:
    """A rollout engine in this process as a :class:`TokenClient`."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        return await self.engine.generate_tokens(prompt_ids, sampling)


class Replicas:
    """Places each conversation on the replica with the fewest requests in flight and keeps it there."""

    def __init__(self, clients: Sequence[TokenClient]):
        if not clients:
            raise ValueError("the agent-loop manager needs at least one rollout replica")
        self.clients = list(clients)
        self.in_flight = [0] * len(self.clients)
        self.conversations = [0] * len(self.clients)

    def sticky(self) -> "StickyClient":
        return StickyClient(self)

    def least_loaded(self) -> int:
        return min(range(len(self.clients)), key=lambda index: (self.in_flight[index], self.conversations[index]))


class StickyClient:
    """One conversation's client: the first request picks the least-loaded replica, later ones reuse it."""

    def __init__(self, replicas: Replicas):
        self.replicas, self.index = replicas, None

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        replicas = self.replicas
        if self.index is None:
            self.index = replicas.least_loaded()
            replicas.conversations[self.index] += 1
        replicas.in_flight[self.index] += 1
        try:
            return await replicas.clients[self.index].generate(prompt_ids, sampling)
        finally:
            replicas.in_flight[self.index] -= 1

    def release(self) -> None:
        if self.index is not None:
            self.replicas.conversations[self.index] -= 1


class AgentLoopManager:
    """See the module docstring. ``loops`` maps names to built loops (missing ones are built from the
    registry on first use with ``config.loops[name]``); ``tools`` are built tools by name;
    ``reward_loop`` scores each trajectory as it finishes (None: the batch leaves unscored)."""

    def __init__(self, clients: Sequence[TokenClient], tokenizer: Any, config: AgentConfig, *,
                 pad_token_id: int, max_prompt_length: int, template_kwargs: Mapping[str, Any] | None = None,
                 tools: Mapping[str, Any] | None = None, loops: Mapping[str, AgentLoop] | None = None,
                 reward_loop: Any = None, policy_version: Callable[[], int] | None = None):
        from rlplat import registry
        from rlplat_agents.chat import ChatRenderer
        from rlplat_agents.template_drift import TemplateDriftCheck

        self.replicas = Replicas(clients)
        self.tokenizer, self.config = tokenizer, config
        self.pad_token_id, self.max_prompt_length = pad_token_id, max_prompt_length
        self.renderer = ChatRenderer(tokenizer, template_kwargs)
        self.tools = dict(tools or {})
        self.loops: dict[str, AgentLoop] = dict(loops or {})
        self.parser = registry.get("tool_parser", config.tool_parser)(None)
        self.reward_loop = reward_loop
        self.environment = None
        if config.environment is not None:
            factory = registry.get("environment", config.environment)
            node = dict(config.environment_config)
            self.environment = lambda: factory(node)
        eos = tokenizer.eos_token_id
        self.stop_token_ids = (tuple(self.renderer.stop_token_ids) if self.renderer.has_chat_template
                               else ((int(eos),) if eos is not None else ()))
        self.template_check = TemplateDriftCheck(config.template_check, self.renderer, self.parser, self.stop_token_ids)
        self.policy_version = policy_version
        self.gateway: Any = None

    def gateway_for(self, sampling: SamplingParams, response_length: int) -> Any:
        """The worker's gateway (:mod:`rlplat_agents.gateway`), built on first use; it serves once a loop asks
        for a ``base_url``. Requests of unattributed sessions sample with this batch's settings."""
        from rlplat_agents.gateway import Gateway

        if self.gateway is None:
            self.gateway = Gateway(self.config.gateway, self.tokenizer, self.renderer, self.parser, self.stop_token_ids,
                                   self.replicas.sticky, sampling, response_length, self.max_prompt_length,
                                   policy_version=self.policy_version)
        self.gateway.default_sampling, self.gateway.response_length = sampling, response_length
        return self.gateway

    def close(self) -> None:
        """Stop the gateway, if it serves."""
        if self.gateway is not None:
            self.gateway.stop()

    def loop(self, name: str) -> AgentLoop:
        from rlplat_agents.config import loop_name

        name = loop_name(self.config, name)
        if name not in self.loops:
            from rlplat import registry

            loop = registry.get("agent_loop", name)(dict(self.config.loops.get(name) or {}))
            if not isinstance(loop, AgentLoop):
                raise TypeError(f"agent_loop {name!r} built a {type(loop).__name__}, not an rlplat.contracts.agent.AgentLoop")
            self.loops[name] = loop
        return self.loops[name]

    def loop_name(self, row: Mapping[str, Any], where: str) -> str:
        name = row.get("agent_name")
        if name is None or (isinstance(name, float) and math.isnan(name)):
            name = self.config.loop
        if not name:
            raise ValueError(f"{where}: the row has no agent_name and agent.loop is not set")
        return str(name)

    # -- one batch --------------------------------------------------------------------------------------

    def generate(self, prompts: DataProto, sampling: SamplingParams, response_length: int) -> DataProto:
        """``len(prompts) * sampling.n`` conversations (the samples of a prompt adjacent), as a batch."""
        from rlplat.kits.rollout_batch import prompt_token_lists

        repeated = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        prompt_lists = prompt_token_lists(repeated, "agent")
        rows = [{key: values[index] for key, values in repeated.non_tensor_batch.items()} for index in range(len(repeated))]
        records = [None] * len(rows) if self.template_check.enabled else None
        scores: dict[str, np.ndarray] = {}
        if self.reward_loop is None:
            trajectories = run_async(self.run_all(rows, prompt_lists, sampling, response_length, records=records))
        else:
            trajectories, scores = run_async(self.run_and_score(rows, prompt_lists, sampling, response_length, records))
        columns, events = self.template_check.check(rows, trajectories, records or [None] * len(rows), prompt_lists,
                                                    sampling.seed)
        meta_info = dict(prompts.meta_info)
        if events:
            meta_info[HEALTH_EVENTS] = [*(meta_info.get(HEALTH_EVENTS) or ()), *events]
        return self.assemble(repeated, trajectories, response_length, meta_info, {**scores, **columns})

    async def run_all(self, rows: Sequence[Mapping[str, Any]], prompt_lists: Sequence[list[int]],
                      sampling: SamplingParams, response_length: int,
                      finished: Callable[[int, Trajectory], None] | None = None,
                      records: list | None = None) -> list[Trajectory]:
        """Every row's conversation; ``finished(index, trajectory)`` is called as each one ends; with
        ``records``, each conversation's :class:`~rlplat_agents.template_drift.RecordingRenderer` at its index."""
        limit = asyncio.Semaphore(self.config.max_concurrency)
        sampling = sampling if sampling.n == 1 else dataclasses.replace(sampling, n=1)

        async def one(index: int) -> Trajectory:
            async with limit:
                trajectory = await self.run_one(index, rows[index], prompt_lists[index], sampling, response_length,
                                                records)
            if finished is not None:
                finished(index, trajectory)
            return trajectory

        return list(await asyncio.gather(*(one(index) for index in range(len(rows)))))

    async def run_and_score(self, rows: Sequence[Mapping[str, Any]], prompt_lists: Sequence[list[int]],
                            sampling: SamplingParams, response_length: int,
                            records: list | None = None) -> tuple[list[Trajectory], dict[str, np.ndarray]]:
        """:meth:`run_all`, each trajectory handed to the reward loop as it finishes; returns once every
        score is in, with the scores as columns (:data:`rlplat_rewards.reward_loop.LOOP_COLUMNS`)."""
        scoring = self.reward_loop.round()

        def finished(index: int, trajectory: Trajectory) -> None:
            scoring.submit(index, self.reward_loop.sample(rows[index], trajectory.response_ids, trajectory.response_mask))

        try:
            trajectories = await self.run_all(rows, prompt_lists, sampling, response_length, finished, records)
        except BaseException:
            scoring.cancel()
            raise
        scoring.generation_finished()
        await scoring.wait()
        return trajectories, scoring.columns()

    async def run_one(self, index: int, row: Mapping[str, Any], prompt_ids: list[int], sampling: SamplingParams,
                      response_length: int, records: list | None = None) -> Trajectory:
        from rlplat_agents.template_drift import RecordingRenderer
        from rlplat_agents.tools import row_tools

        where = f"agent batch row {index} (uid {row.get('uid')!r})"
        name = self.loop_name(row, where)
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=int(sampling.seed) + 104_729 * index)
        renderer = self.renderer
        if records is not None:
            renderer = records[index] = RecordingRenderer(self.renderer)
        context = AgentContext(
            tokenizer=self.tokenizer, renderer=renderer, sampling=sampling, response_length=response_length,
            prompt_ids=list(prompt_ids), tools=row_tools(self.tools, row.get("extra_info"), where),
            parser=self.parser, stop_token_ids=self.stop_token_ids, environment=self.environment,
            gateway=self.gateway_for(sampling, response_length),
        )
        client = self.replicas.sticky()
        try:
            trajectory = await self.loop(name).run(row, client, context)
        finally:
            client.release()
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"{where}: agent loop {name!r} returned {type(trajectory).__name__}, not a Trajectory")
        trajectory.check(response_length, f"{where}, agent loop {name!r}")
        if len(trajectory.prompt_ids) > self.max_prompt_length:
            raise ValueError(
                f"{where}: agent loop {name!r} made a prompt of {len(trajectory.prompt_ids)} tokens, more than "
                f"agent.max_prompt_length={self.max_prompt_length} (tools rendered into the prompt make it longer "
                "than the data loader's); raise agent.max_prompt_length")
        return trajectory

    def assemble(self, repeated: DataProto, trajectories: Sequence[Trajectory], response_length: int,
                 meta_info: Mapping[str, Any], scores: Mapping[str, np.ndarray] | None = None) -> DataProto:
        rows, width = len(trajectories), self.max_prompt_length
        prompts = np.full((rows, width), self.pad_token_id, dtype=np.int64)
        prompt_mask = np.zeros((rows, width), dtype=np.int64)
        responses = np.full((rows, response_length), self.pad_token_id, dtype=np.int64)
        response_mask = np.zeros((rows, response_length), dtype=np.int64)
        response_attention = np.zeros((rows, response_length), dtype=np.int64)
        log_probs = np.zeros((rows, response_length), dtype=np.float32)
        versions = (np.full((rows, response_length), -1, dtype=np.int64)
                    if any(t.policy_versions is not None for t in trajectories) else None)
        for row, trajectory in enumerate(trajectories):
            prompt, length = trajectory.prompt_ids, len(trajectory.response_ids)
            prompts[row, width - len(prompt):] = prompt
            prompt_mask[row, width - len(prompt):] = 1
            responses[row, :length] = trajectory.response_ids
            response_mask[row, :length] = trajectory.response_mask
            response_attention[row, :length] = 1
            log_probs[row, :length] = trajectory.rollout_log_probs
            if versions is not None and trajectory.policy_versions is not None:
                versions[row, :length] = trajectory.policy_versions
        prompts, prompt_mask, responses, response_mask, response_attention, log_probs = (
            torch.from_numpy(array) for array in (prompts, prompt_mask, responses, response_mask, response_attention, log_probs))
        attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        non_tensors = dict(repeated.non_tensor_batch)
        non_tensors["agent_reward"] = np.array([float("nan") if t.reward_score is None else float(t.reward_score)
                                                for t in trajectories], dtype=np.float64)
        non_tensors["agent_finish"] = np.array([t.finish_reason for t in trajectories], dtype=object)
        names = sorted({name for t in trajectories for name in t.metrics})
        for name in names:
            non_tensors[METRIC_PREFIX + name] = np.array([float(t.metrics.get(name, float("nan"))) for t in trajectories])
        extra_keys = sorted({key for t in trajectories for key in t.extra})
        for key in extra_keys:
            values = np.empty(rows, dtype=object)
            values[:] = [t.extra.get(key) for t in trajectories]
            non_tensors[key] = values
        non_tensors.update(scores or {})
        tensors = {"prompts": prompts, "responses": responses, "response_mask": response_mask,
                   "rollout_log_probs": log_probs, "input_ids": torch.cat([prompts, responses], dim=1),
                   "attention_mask": attention_mask, "position_ids": position_ids}
        if versions is not None:
            tensors["policy_version"] = torch.from_numpy(versions)
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info))


def agent_metrics(batch: DataProto, prefix: str = "") -> dict[str, float]:
    """Means (and maxima of turns) of the per-trajectory agent columns of ``batch``; rates of tool
    errors and timeouts per call; the tool-call rate (share of trajectories with a call); tool latency
    per call; model vs context tokens; the counts of trajectories checked against the chat template and
    found drifting (``agent/template_checked``, ``agent/template_drifted``), and of those whose only difference
    is a turn the model formatted otherwise than the template would (``agent/template_noncanonical``)."""
    from rlplat_agents.template_drift import CHECKED_COLUMN, DRIFTED_COLUMN, NONCANONICAL_COLUMN

    columns = {key[len(METRIC_PREFIX):]: np.asarray(values, dtype=np.float64)
               for key, values in batch.non_tensor_batch.items() if key.startswith(METRIC_PREFIX)}
    metrics: dict[str, float] = {}
    for column, name in ((CHECKED_COLUMN, "template_checked"), (DRIFTED_COLUMN, "template_drifted"),
                         (NONCANONICAL_COLUMN, "template_noncanonical")):
        if column in batch.non_tensor_batch:
            metrics[f"{prefix}agent/{name}"] = float(np.sum(np.asarray(batch.non_tensor_batch[column], dtype=np.float64)))
    if not columns:
        return metrics
    for name, values in columns.items():
        metrics[f"{prefix}agent/{name}/mean"] = float(np.nanmean(values)) if len(values) else 0.0
    if "turns" in columns:
        metrics[f"{prefix}agent/turns/max"] = float(np.nanmax(columns["turns"]))
    calls = columns.get("tool_calls")
    if calls is not None:
        total = float(np.nansum(calls))
        metrics[f"{prefix}agent/tool_call_rate"] = float(np.mean(calls > 0))
        for name, rate in (("tool_errors", "tool_error_rate"), ("tool_timeouts", "tool_timeout_rate")):
            if name in columns:
                metrics[f"{prefix}agent/{rate}"] = float(np.nansum(columns[name]) / total) if total else 0.0
        if "tool_latency_s" in columns:
            metrics[f"{prefix}agent/tool_latency_s/per_call"] = float(np.nansum(columns["tool_latency_s"]) / total) if total else 0.0
    if "agent_finish" in batch.non_tensor_batch:
        finishes = np.asarray(batch.non_tensor_batch["agent_finish"])
        for reason in ("stop", "length", "max_turns", "done"):
            metrics[f"{prefix}agent/finish_{reason}"] = float(np.mean(finishes == reason))
    return metrics
