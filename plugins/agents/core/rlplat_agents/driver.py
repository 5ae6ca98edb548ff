"""The ``agent_loops`` rollout driver (kind ``rollout_driver``): a rollout worker's batches go through agent
loops when ``agent.loop`` is set or the rows name their loops (``agent_name``)."""

from __future__ import annotations

from typing import Any

from rlplat.contracts.rollout import RolloutDriver, RolloutDriverContext, SamplingParams
from rlplat.protocol import DataProto


class AgentLoopDriver(RolloutDriver):
    """An :class:`~rlplat_agents.manager.AgentLoopManager` over the worker's rollout engines, its tools built
    once from ``agent.tools_config``; each trajectory scored as it finishes when the run's reward manager
    offers a trajectory scorer (``reward.manager=async`` with ``reward.config.overlap``)."""

    def __init__(self, context: RolloutDriverContext):
        from transformers import AutoTokenizer

        from rlplat.config_node import read_config_node
        from rlplat.kits.data import pad_token_id_of
        from rlplat_agents.config import AgentConfig
        from rlplat_agents.manager import AgentLoopManager, EngineClient
        from rlplat_agents.tools import read_tools_file

        self.config = read_config_node(dict(context.node), AgentConfig, "agent")
        if context.tokenizer_path is None:
            raise RuntimeError("agent loops need the tokenizer: the worker config has no tokenizer_path (model.path)")
        tokenizer = AutoTokenizer.from_pretrained(context.tokenizer_path)
        tools = {}
        if self.config.tools_config is not None:
            for spec in read_tools_file(self.config.tools_config):
                tool = spec.build()
                tools[tool.name] = tool
        self.manager = AgentLoopManager(
            [EngineClient(engine) for engine in context.engines], tokenizer, self.config,
            pad_token_id=pad_token_id_of(tokenizer), max_prompt_length=self.config.max_prompt_length or context.prompt_length,
            template_kwargs=context.template_kwargs, tools=tools, reward_loop=context.trajectory_scorer,
            policy_version=getattr(context, "policy_version", None))

    def handles(self, prompts: DataProto) -> bool:
        """``agent.loop`` is set, or the rows name their loops."""
        return self.config.loop is not None or "agent_name" in prompts.non_tensor_batch

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        return self.manager.generate(prompts, sampling, sampling.max_new_tokens)

    def close(self) -> None:
        self.manager.close()


def agent_loop_driver(context: RolloutDriverContext) -> Any:
    return AgentLoopDriver(context)
