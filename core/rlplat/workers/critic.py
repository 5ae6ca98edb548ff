"""The critic worker: a value model on a training engine, trained with the algorithm's critic loss."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlplat.controller.decorator import Dispatch, register
from rlplat.controller.worker import Worker, without_padding_weight
from rlplat.protocol import DataProto
from rlplat.registry import EngineRegistry
from rlplat.config_node import read_config_node
from rlplat.workers.config import CriticConfig


class CriticWorker(Worker):
    def __init__(self, config: Any):
        super().__init__()
        self.config: CriticConfig = read_config_node(config, CriticConfig, "critic worker config")
        self.engine = None
        self.loss = None

    def require_engine(self, method: str) -> Any:
        if self.engine is None:
            raise RuntimeError(f"CriticWorker.{method}() needs the model: call init_model() first")
        return self.engine

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from rlplat import registry

        engine_config = {**dict(self.config.engine_config), "value_model": True}
        self.engine = EngineRegistry("engine").build(self.config.engine, engine_config)
        self.engine.init_model()
        self.set_dispatch_info(*self.engine.data_parallel_info())
        algorithm = registry.get("algorithm", self.config.algorithm)()
        node = self.config.critic if self.config.critic is not None else algorithm.default_nodes().get("critic", {}).get("loss")
        self.loss = algorithm.build_loss("critic", node)

    @register(Dispatch.DP_MESH)
    def compute_values(self, batch: DataProto) -> DataProto:
        """``values`` [B, R]: the value model's prediction at each response token."""
        outputs = self.require_engine("compute_values").forward(batch)
        return DataProto.from_dict({"values": outputs.batch["values"]})

    @register(Dispatch.DP_MESH)
    def update_critic(self, batch: DataProto, loss_fn: Any = None) -> DataProto:
        """One critic update (reads ``values``, ``returns``, ``response_mask`` and the model inputs) with
        ``loss_fn`` shipped from the driver (None: the algorithm's critic loss); returns no rows and
        ``meta_info["metrics"]``."""
        started = time.perf_counter()
        batch = without_padding_weight(batch, self.padding_rows)
        metrics = self.require_engine("update_critic").train_batch(batch, loss_fn if loss_fn is not None else self.loss)
        metrics = {f"critic/{k}" if "/" not in k else k: v for k, v in metrics.items()}
        metrics["timing_s/update_critic_worker"] = time.perf_counter() - started
        return DataProto(meta_info={"metrics": metrics})

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.require_engine("save_checkpoint").save(str(Path(path) / "critic"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.require_engine("load_checkpoint").load(str(Path(path) / "critic"))
