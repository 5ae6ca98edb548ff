"""The ``reward_model`` role: a worker group that scores responses with a sequence-classification model.

:class:`RewardModelWorker` builds the model through a training engine's forward path
(``EngineBuildConfig.reward_model``: fsdp2 today, any engine that implements it) and answers
``compute_rm_score(batch) -> rm_scores [B]``. When the reward model's tokenizer is the policy's (same
vocabulary, special tokens and chat template) it scores the policy's tokens as they are; otherwise
(``reward.model.retokenize``) each row becomes text again, the row's chat messages (``raw_prompt``) with
the response as the assistant's turn, rendered with the reward model's chat template and tokenised with its
tokenizer. A tokenizer without a chat template gets the decoded prompt and response as plain text (its
EOS appended when the policy finished the response with its own).

Placement (``reward.model.placement``): ``colocated``, a worker object in each of the actor's processes
whose parameters are moved off the accelerator after each call (``reward.model.sleep``) and back for the
next; or ``separate``, a resource pool of its own.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from rlplat.contracts.role import Role, RoleConfig, RunContext
from rlplat.controller.decorator import Dispatch, register
from rlplat.controller.host import WorkerSpec
from rlplat.controller.worker import Worker
from rlplat.protocol import DataProto
from rlplat.kits.reward import last_tokens


@dataclasses.dataclass
class RewardModelWorkerConfig:
    """What :class:`RewardModelWorker` builds in its process."""

    engine: str = "fsdp2"
    engine_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's node; the worker adds ``reward_model: true``."""
    policy_tokenizer_path: Optional[str] = None
    """The policy's tokenizer (``model.tokenizer_path`` or ``model.path``): what the batch's ids mean."""
    tokenizer_path: Optional[str] = None
    """The reward model's tokenizer (``reward.model.tokenizer_path`` or its ``path``)."""
    retokenize: str = "auto"
    max_length: Optional[int] = None
    sleep: bool = True
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """``data.apply_chat_template_kwargs``, for the reward model's chat template too."""


def same_tokenizer(first: Any, second: Any) -> bool:
    """Whether two tokenizers turn the same conversation into the same ids: vocabulary, special tokens and
    chat template all equal."""
    specials = ("bos_token_id", "eos_token_id", "pad_token_id")
    return (first.get_vocab() == second.get_vocab()
            and all(getattr(first, name, None) == getattr(second, name, None) for name in specials)
            and getattr(first, "chat_template", None) == getattr(second, "chat_template", None))


class Retokenizer:
    """Turns a batch of the policy's ids into the reward model's (see the module docstring)."""

    def __init__(self, policy: Any, reward: Any, *, max_length: Optional[int], template_kwargs: Mapping[str, Any]):
        self.policy, self.reward = policy, reward
        self.max_length = max_length
        self.template_kwargs = dict(template_kwargs)
        self.pad_id = reward.pad_token_id if reward.pad_token_id is not None else (reward.eos_token_id or 0)

    def row_ids(self, messages: Any, prompt_ids: list[int], response_ids: list[int]) -> list[int]:
        finished = bool(response_ids) and response_ids[-1] == self.policy.eos_token_id
        response = self.policy.decode(response_ids, skip_special_tokens=True)
        chat = isinstance(messages, (list, tuple)) and all(isinstance(m, Mapping) and "role" in m for m in messages)
        if getattr(self.reward, "chat_template", None) and chat:
            conversation = [dict(message) for message in messages] + [{"role": "assistant", "content": response}]
            text = self.reward.apply_chat_template(conversation, tokenize=False, **self.template_kwargs)
            return list(self.reward(text, add_special_tokens=False)["input_ids"])
        prompt = self.policy.decode(prompt_ids, skip_special_tokens=True)
        ids = list(self.reward(prompt + response)["input_ids"])
        if finished and self.reward.eos_token_id is not None:
            ids.append(self.reward.eos_token_id)
        return ids

    def __call__(self, batch: DataProto) -> tuple[DataProto, int]:
        """The reward model's ``input_ids``, ``attention_mask``, ``position_ids`` (left padded) and the
        number of rows cut to ``max_length``."""
        from rlplat.kits.data import left_padded

        tensors = batch.batch
        prompts, responses = tensors["prompts"], tensors["responses"]
        width = prompts.shape[1]
        prompt_mask = tensors["attention_mask"][:, :width].bool()
        response_mask = tensors["response_mask"] if "response_mask" in tensors.keys() else tensors["attention_mask"][:, width:]
        messages = batch.non_tensor_batch.get("raw_prompt")
        rows, truncated = [], 0
        for row, last in enumerate(last_tokens(response_mask)):
            ids = self.row_ids(None if messages is None else messages[row], prompts[row][prompt_mask[row]].tolist(),
                               responses[row, : last + 1].tolist())
            if self.max_length is not None and len(ids) > self.max_length:
                ids, truncated = ids[-self.max_length:], truncated + 1
            rows.append(ids)
        return DataProto.from_dict(left_padded(rows, self.pad_id)), truncated


class RewardModelWorker(Worker):
    def __init__(self, config: Any):
        from rlplat.config_node import read_config_node

        super().__init__()
        self.config: RewardModelWorkerConfig = read_config_node(config, RewardModelWorkerConfig, "reward model worker config")
        self.engine = None
        self.retokenizer: Optional[Retokenizer] = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Build the engine and decide whether rows are re-tokenised; returns ``{"retokenize": bool}``."""
        from transformers import AutoTokenizer

        from rlplat.registry import EngineRegistry

        config = self.config
        self.engine = EngineRegistry("engine").build(config.engine, {**dict(config.engine_config), "reward_model": True})
        self.engine.init_model()
        self.set_dispatch_info(*self.engine.data_parallel_info())
        retokenize = config.retokenize == "always"
        if config.retokenize == "auto":
            if config.policy_tokenizer_path is None or config.tokenizer_path is None:
                raise ValueError("reward model worker: retokenize=auto needs both tokenizer paths")
            policy = AutoTokenizer.from_pretrained(config.policy_tokenizer_path)
            reward = AutoTokenizer.from_pretrained(config.tokenizer_path)
            retokenize = not same_tokenizer(policy, reward)
        if retokenize:
            policy = AutoTokenizer.from_pretrained(config.policy_tokenizer_path)
            reward = AutoTokenizer.from_pretrained(config.tokenizer_path)
            self.retokenizer = Retokenizer(policy, reward, max_length=config.max_length, template_kwargs=config.template_kwargs)
        if config.sleep:
            self.engine.offload()
        return {"retokenize": retokenize}

    @register(Dispatch.DP_MESH)
    def compute_rm_score(self, batch: DataProto) -> DataProto:
        """``rm_scores`` [B] float32 of each row's whole sequence, read at its last token; per-row
        ``reward/model/truncated`` (0 or 1) when rows were re-tokenised."""
        import torch

        if self.engine is None:
            raise RuntimeError("RewardModelWorker.compute_rm_score() needs the model: call init_model() first")
        started = time.perf_counter()
        truncated = 0
        if self.retokenizer is not None:
            inputs, truncated = self.retokenizer(batch)
        else:
            inputs = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"], meta_info_keys=[])
        scores = self.engine.forward(inputs).batch["rm_scores"].to(torch.float32)
        if self.config.sleep:
            self.engine.offload()
        return DataProto.from_dict({"rm_scores": scores},
                                   meta_info={"metrics": {"reward/model/truncated": float(truncated),
                                                          "timing_s/reward_model_worker": time.perf_counter() - started}})


class RewardModelRole(Role):
    """The reward model's worker group, when ``reward.model.path`` is set; placed by ``reward.model.placement``."""

    run_settings: Any = None
    """The run's ``reward.model`` settings, read when the run asks whether it needs the role."""

    def enabled(self, run: RunContext) -> bool:
        from rlplat_reward_model.config import read_reward_model

        self.run_settings = read_reward_model(run.config)
        return self.run_settings.enabled

    def settings(self, run: RunContext, name: str) -> RoleConfig:
        from rlplat_reward_model.config import read_reward_model

        settings = read_reward_model(run.config)
        return RoleConfig(settings.placement, settings.nnodes, settings.devices_per_node)

    def rule_scores_needed(self, run: RunContext, validation: bool) -> bool:
        """With ``reward.model.rule_weight=0`` the manager is called in validation only (for its accuracy)."""
        from rlplat_reward_model.config import read_reward_model

        return validation or read_reward_model(run.config).rule_weight != 0

    def join_scores(self, group: Any, batch: DataProto, scored: DataProto, *, validation: bool,
                    timing: dict[str, float] | None = None) -> DataProto:
        """The model's ``rm_scores`` joined to the manager's per ``reward.model.combine``
        (:func:`rlplat_reward_model.config.combine`); validation sums (``normalized`` would make a score
        that depends on the batch) and reports ``val/reward/model/mean``."""
        import numpy as np

        from rlplat_reward_model.config import combine

        started = time.perf_counter()
        settings = self.run_settings
        model = group.compute_rm_score(batch)
        if validation and settings.combine == "normalized":  # a validation score comparable across steps
            settings = dataclasses.replace(settings, combine="sum")
        scores, metrics = combine(scored.batch["token_level_scores"], model.batch["rm_scores"], batch.batch["response_mask"],
                                  settings)
        if timing is not None:
            timing["timing_s/reward_model"] = timing.get("timing_s/reward_model", 0.0) + time.perf_counter() - started
        worker = model.meta_info.get("metrics", {})
        metrics["reward/model/truncated"] = float(np.sum(worker.get("reward/model/truncated", [0.0])))
        scored.batch["token_level_scores"] = scores
        values = model.batch["rm_scores"].numpy().astype(np.float64)
        scored.non_tensor_batch["rm_score"] = values
        scored.meta_info["reward_metrics"] = {**scored.meta_info.get("reward_metrics", {}), **metrics}
        if validation:
            scored.meta_info["validation_values"] = {**scored.meta_info.get("validation_values", {}),
                                                     "val/reward/model/mean": values.tolist()}
        return scored

    def worker(self, run: RunContext) -> WorkerSpec:
        from omegaconf import OmegaConf

        from rlplat_reward_model.config import engine_node, read_reward_model

        self.run_settings = read_reward_model(run.config)

        config = run.config
        settings = read_reward_model(config)
        # absolute, so a worker in a pool of its own (another working directory) finds them
        absolute = lambda path: None if path is None else str(Path(path).resolve())  # noqa: E731
        settings = dataclasses.replace(settings, path=absolute(settings.path),
                                       tokenizer_path=absolute(settings.tokenizer_path or settings.path))
        return WorkerSpec(RewardModelWorker, {
            "engine": settings.engine, "engine_config": engine_node(config, settings),
            "policy_tokenizer_path": absolute(config.model.tokenizer_path or config.model.path),
            "tokenizer_path": settings.tokenizer_path,
            "retokenize": settings.retokenize, "max_length": settings.max_length,
            "sleep": settings.sleep and settings.placement == "colocated",
            "template_kwargs": OmegaConf.to_container(config.data.apply_chat_template_kwargs, resolve=True) or {},
        })


def reward_model() -> Role:
    return RewardModelRole()
