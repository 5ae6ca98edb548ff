"""Tool trajectories of the shipped tool-demo model through the real hf rollout: the masks, log-probs and
gradients a trainer relies on, and the demo presets run end to end for a few steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlplat_agents.config import AgentConfig
from rlplat_agents.manager import AgentLoopManager, EngineClient, agent_metrics
from rlplat_agents.tools import read_tools_file
from rlplat.contracts.rollout import SamplingParams
from rlplat.data import RLDataset, collate
from rlplat_demo import tools as tool_demo
from rlplat.protocol import DataProto

PROMPTS, SAMPLES, RESPONSE_LENGTH = 8, 8, 40


class CountingClient(EngineClient):
    """The engine as a client, counting the tokens it sampled."""

    def __init__(self, engine):
        super().__init__(engine)
        self.sampled = 0

    async def generate(self, prompt_ids, sampling):
        output = await super().generate(prompt_ids, sampling)
        self.sampled += len(output.token_ids)
        return output


@pytest.fixture(scope="module")
def demo_run():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlplat_rollout_hf.rollout import HFRollout

    model_dir = str(tool_demo.model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = CountingClient(HFRollout({"model_path": model_dir}))
    tools = {tool.name: tool for tool in (spec.build() for spec in read_tools_file(tool_demo.tools_config_file()))}
    manager = AgentLoopManager([client], tokenizer, AgentConfig(loop="tool", loops={"tool": {"max_turns": 2}}),
                               pad_token_id=tokenizer.pad_token_id, max_prompt_length=32, tools=tools)
    dataset = RLDataset([str(tool_demo.data_file("val"))], tokenizer, max_prompt_length=32)
    prompts = collate([dataset[i] for i in range(PROMPTS)], tokenizer.pad_token_id)
    batch = manager.generate(prompts, SamplingParams(n=SAMPLES, temperature=1.0, seed=3), RESPONSE_LENGTH)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return batch, client, model, tokenizer


def response_log_probs(model, batch: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, R] of the responses under ``model``, entropy [B, R]) from one padded forward."""
    prompt_width = batch.batch["prompts"].shape[1]
    logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                   position_ids=batch.batch["position_ids"]).logits.float()
    logits = logits[:, prompt_width - 1:-1]
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, batch.batch["responses"][..., None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def test_64_tool_trajectories_mask_exactly_the_sampled_tokens(demo_run):
    batch, client, _, _ = demo_run
    assert len(batch) == PROMPTS * SAMPLES == 64
    metrics = agent_metrics(batch)
    assert metrics["agent/tool_call_rate"] > 0 and metrics["agent/turns/max"] == 2, metrics  # multi-turn ones exist
    mask = batch.batch["response_mask"]
    assert int(mask.sum()) == client.sampled
    assert int(batch.batch["attention_mask"][:, 32:].sum()) > int(mask.sum())  # tool tokens are in, masked


def test_rollout_log_probs_equal_recomputed_log_probs_at_sampled_positions(demo_run):
    batch, _, model, _ = demo_run
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch)
    mask = batch.batch["response_mask"].bool()
    difference = (log_probs - batch.batch["rollout_log_probs"]).abs()[mask]
    assert float(difference.max()) < 1e-5, float(difference.max())
    assert bool((batch.batch["rollout_log_probs"][~mask] == 0).all())


def test_the_gradient_at_masked_positions_is_exactly_zero(demo_run):
    from rlplat.losses import ActorLoss

    batch, _, model, _ = demo_run
    log_probs, entropy = response_log_probs(model, batch)
    log_probs.retain_grad()
    entropy.retain_grad()
    mask = batch.batch["response_mask"]
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(len(batch), 1, generator=generator) * mask
    micro_batch = DataProto.from_dict({"response_mask": mask, "old_log_probs": batch.batch["rollout_log_probs"],
                                       "advantages": advantages})
    loss, _ = ActorLoss({"entropy_coeff": 0.01})({"log_probs": log_probs, "entropy": entropy}, micro_batch)
    loss.backward()
    masked = ~mask.bool()
    assert bool((log_probs.grad[masked] == 0).all()) and bool((entropy.grad[masked] == 0).all())
    assert float(log_probs.grad[mask.bool()].abs().sum()) > 0


def test_the_scorer_reads_the_answer_after_the_tool_response(demo_run):
    batch, _, _, tokenizer = demo_run
    texts = tokenizer.batch_decode(batch.batch["responses"] * batch.batch["attention_mask"][:, 32:] +
                                   tokenizer.pad_token_id * (1 - batch.batch["attention_mask"][:, 32:]),
                                   skip_special_tokens=True)
    truths = [row["ground_truth"] for row in batch.non_tensor_batch["reward_model"]]
    scores = [tool_demo.score("arith_tools", text, truth)["score"] for text, truth in zip(texts, truths)]
    called = np.asarray(batch.non_tensor_batch["agent/tool_calls"]) > 0
    assert np.mean([s for s, c in zip(scores, called) if c]) > np.mean([s for s, c in zip(scores, called) if not c] or [0])


@pytest.mark.slow
@pytest.mark.parametrize("demo", ["tools", "retry"])
def test_the_demo_presets_train_through_the_agent_loops(demo, tmp_path):
    from rlplat.cli.command_line import resolved_config
    from rlplat.trainer import Trainer

    config = resolved_config(None, [f"trainer.output_dir={tmp_path}", "trainer.total_training_steps=2", "trainer.test_freq=2",
                                    "trainer.val_before_train=false"], algo=None, engine=None, rollout=None, demo=demo)
    trainer = Trainer(config)
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    assert metrics["agent/turns/mean"] >= 1 and any(key.startswith("val/") for key in metrics)
    assert metrics["perf/throughput"] > 0
