"""``SFTWorker``: a training engine trained on supervised batches, through the engine contract only.

Training calls the engine's ``train_batch`` with :class:`rlplat_sft.loss.NLLLoss`; validation calls its
``forward`` and sums the negative log-likelihood of the trained tokens per example. Nothing here knows
which engine it drives, so any registered engine trains SFT unchanged. Checkpoints go to ``<path>/actor``
as the RL actor's do, so the layout of a run directory is the same for both commands.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict

import torch

from rlplat.config_node import read_config_node
from rlplat.controller.decorator import Dispatch, register
from rlplat.controller.worker import Worker, without_padding_weight
from rlplat.protocol import DataProto
from rlplat.registry import EngineRegistry

ACTOR_FOLDER = "actor"


@dataclasses.dataclass
class SFTWorkerConfig:
    """What the driver builds an :class:`SFTWorker` with."""

    engine: str = "fsdp2"
    """Registered training engine."""
    engine_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's build config (:func:`rlplat_sft.config.sft_engine_node`)."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the NLL loss (:class:`rlplat_sft.loss.NLLLoss`)."""


class SFTWorker(Worker):
    def __init__(self, config: Any):
        super().__init__()
        self.config = read_config_node(config, SFTWorkerConfig, "sft worker config")
        self.engine = None
        self.loss = None

    def require_engine(self, method: str) -> Any:
        if self.engine is None:
            raise RuntimeError(f"SFTWorker.{method}() needs the model: call init_model() first")
        return self.engine

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from rlplat_sft.loss import NLLLoss

        self.engine = EngineRegistry("engine").build(self.config.engine, dict(self.config.engine_config))
        self.engine.init_model()
        self.set_dispatch_info(*self.engine.data_parallel_info())
        self.loss = NLLLoss(self.config.loss_agg_mode)

    @register(Dispatch.DP_MESH)
    def train_step(self, batch: DataProto) -> DataProto:
        """One training step on ``batch`` (``input_ids``, ``attention_mask``, ``position_ids``,
        ``responses``, ``response_mask``): the engine's optimizer steps over its mini-batches. Returns no
        rows; ``meta_info["metrics"]`` holds the engine's and the loss's metrics."""
        engine = self.require_engine("train_step")
        batch = without_padding_weight(batch, self.padding_rows)
        meta = {**batch.meta_info, "temperature": 1.0, "ppo_epochs": 1, "calculate_entropy": False}
        metrics = engine.train_batch(batch.with_meta_info(meta), self.loss)
        return DataProto(meta_info={"metrics": metrics})

    @register(Dispatch.DP_MESH)
    def evaluate(self, batch: DataProto) -> DataProto:
        """``nll_sum`` [B] (float64): each example's summed negative log-likelihood of its trained tokens,
        and ``tokens`` [B]: how many there are."""
        outputs = self.require_engine("evaluate").forward(batch, temperature=1.0)
        mask = batch.batch["response_mask"].to(torch.float64)
        log_probs = outputs.batch["log_probs"].to(torch.float64)
        nll = -(torch.where(mask.bool(), log_probs, torch.zeros_like(log_probs))).sum(-1)
        return DataProto.from_dict({"nll_sum": nll, "tokens": mask.sum(-1)})

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The engine's resumable checkpoint under ``path/actor``."""
        self.require_engine("save_checkpoint").save(str(Path(path) / ACTOR_FOLDER))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.require_engine("load_checkpoint").load(str(Path(path) / ACTOR_FOLDER))

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """The model (LoRA adapters merged in) as a Hugging Face folder at ``path``."""
        self.require_engine("export_hf").export_hf(path)

    @register(Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights in Hugging Face naming (adapters merged in), from rank 0 (every rank takes part
        in gathering them): what an evaluation in the driver loads into a model of its own."""
        weights = {}
        for bucket in self.require_engine("full_weights").named_weights():
            weights.update({name: tensor.cpu().clone() for name, tensor in bucket})
        return weights if self.rank == 0 else None
