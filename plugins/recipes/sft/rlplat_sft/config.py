"""The config of ``rlplat sft``: typed OmegaConf structured configs, validated before any worker starts.

Its own nodes are ``data`` (:class:`rlplat_sft.data.SFTDataConfig`: the conversations and how they are
batched) and ``loss`` (:class:`SFTLossConfig`). The others carry the keys of ``rlplat run`` under the same
names and meanings, so a setting moves between the two commands unchanged: ``model`` (the run's
:class:`~rlplat.config.ModelConfig`), ``actor`` (the engine, ``actor.optim``, micro-batches, token-budget
micro-batches, ``actor.lora`` and ``actor.engine_config``: the part of the run's actor node that trains),
``trainer`` (steps, checkpoints, resume, validation frequency, loggers) and ``cluster`` (the run's
:class:`~rlplat.config.ClusterConfig`: Ray or in process, processes per machine).

``load_sft_config(config_file, overrides, engine=...)`` merges the defaults, the YAML file, ``--engine``
and the dotted overrides, then :func:`validate_sft_config` checks them: unknown or mistyped keys, the
engine and its ``engine_config`` against the schema it registers (core's one reader), LoRA against the
engine, batch sizes against the worker processes, missing model or data, loggers. Malformed data rows are
found when the trainer reads the data, also before a worker starts.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from rlplat.config import (ClusterConfig, ModelConfig, OptimConfig, PluginNode, check_cluster, entry_schema, merge_checked,
                           read_sources, resolve_use_gpu)
from rlplat.config.components import ENGINE_BUILD_SOURCES, optimizer_build
from rlplat.config_node import ConfigError, did_you_mean, read_config_node
from rlplat.lora import LoraConfig, read_lora
from rlplat.losses.config import LOSS_AGG_MODES
from rlplat.config.trainer import SharedTrainerConfig
from rlplat_sft.data import SFTDataConfig

__all__ = ["SFTConfig", "SFTLossConfig", "load_sft_config", "validate_sft_config", "sft_engine_node",
           "optimizer_steps", "training_steps"]


@dataclasses.dataclass
class SFTLossConfig:
    """The ``loss`` node: how the negative log-likelihood of the trained tokens is aggregated."""

    loss_agg_mode: str = "token-mean"
    """``token-mean`` (mean NLL per trained token of the optimizer step: Hugging Face's and TRL's), or another
    mode of :func:`rlplat.losses.aggregate_loss` (``seq-mean-token-mean``: each example weighs the same)."""

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}"
                             f"{did_you_mean(self.loss_agg_mode, LOSS_AGG_MODES)}")


@dataclasses.dataclass
class SFTActorConfig:
    """The model being trained: the engine, its optimizer and how a step's batch is cut (the keys of
    ``rlplat run``'s ``actor`` node that training uses)."""

    engine: str = "fsdp2"
    """Registered training engine (kind ``engine``)."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule (``actor.optim.lr``, ``warmup_steps``, ``lr_scheduler_type``, ...)."""
    ppo_mini_batch_size: Optional[int] = None
    """Examples per optimizer step (the name ``rlplat run`` uses); None: ``data.train_batch_size``, one
    optimizer step per training step."""
    micro_batch_size_per_gpu: int = 8
    """Examples per micro-batch when ``use_dynamic_bsz`` is off (gradients accumulate over them)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget instead of an example count."""
    max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch under ``use_dynamic_bsz``."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA adapters (:mod:`rlplat.lora`), for engines that have them; rank 0: full fine-tuning. The
    export at the end merges them into the model."""
    engine_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's own keys (``use_remove_padding`` for packing, ``enable_gradient_checkpointing``,
    ...), checked against the schema the engine registers."""


@dataclasses.dataclass
class SFTTrainerConfig(SharedTrainerConfig):
    """The run: its length, validation, checkpoints and metrics (the keys of ``rlplat run``'s ``trainer``
    node that mean the same here come from :class:`~rlplat.config.trainer.SharedTrainerConfig`)."""

    test_freq: int = 0
    """Validation loss and perplexity every this many steps (0: at the end only, when a validation set is given)."""
    output_dir: str = "runs/sft"
    """Run directory: resolved config, metrics (JSONL, TensorBoard), checkpoints and the exported model."""
    export_dir: Optional[str] = None
    """Where the Hugging Face model is written at the end (``rlplat run model.path=...`` takes it); None:
    ``<output_dir>/hf_model``."""
    seed: int = 0
    """Seed of the engine's initialisation and RNGs."""


@dataclasses.dataclass
class SFTConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: SFTDataConfig = dataclasses.field(default_factory=SFTDataConfig)
    loss: SFTLossConfig = dataclasses.field(default_factory=SFTLossConfig)
    actor: SFTActorConfig = dataclasses.field(default_factory=SFTActorConfig)
    trainer: SFTTrainerConfig = dataclasses.field(default_factory=SFTTrainerConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)


def load_sft_config(config_file: str | Path | None = None, overrides: Sequence[str] = (), *, engine: str | None = None,
                    validate: bool = True) -> DictConfig:
    """The resolved, validated config of ``rlplat sft``: defaults, then the YAML file, then ``--engine``,
    then the dotted overrides; :class:`ConfigError` for the first problem."""
    file_node, override_node = read_sources(config_file, overrides, example="actor.optim.lr=1e-5")
    config = OmegaConf.structured(SFTConfig)
    if file_node is not None:
        config = merge_checked(config, file_node, f"--config {config_file}")
    if engine:
        config = merge_checked(config, {"actor": {"engine": engine}}, "command line")
    config = merge_checked(config, override_node, "overrides")
    resolve_use_gpu(config)
    if validate:
        validate_sft_config(config)
    return config


def processes(config: DictConfig) -> int:
    cluster = config.cluster
    return 1 if cluster.backend == "local" else cluster.nnodes * cluster.devices_per_node


def mini_batch_size(config: DictConfig) -> int:
    return config.actor.ppo_mini_batch_size or config.data.train_batch_size


def optimizer_steps(config: DictConfig, steps: int) -> int:
    """Optimizer steps of ``steps`` training steps (the LR schedule's unit)."""
    return steps * math.ceil(config.data.train_batch_size / mini_batch_size(config))


def training_steps(config: DictConfig, rows_per_epoch: int) -> int:
    """``trainer.total_training_steps``, or ``trainer.total_epochs`` passes over ``rows_per_epoch`` examples."""
    if config.trainer.total_training_steps:
        return int(config.trainer.total_training_steps)
    per_epoch = rows_per_epoch / config.data.train_batch_size
    return int(per_epoch if config.data.drop_last else math.ceil(per_epoch)) * config.trainer.total_epochs


#: EngineBuildConfig key -> the ``rlplat sft`` key it comes from: ``rlplat run``'s actor sources, but for
#: what SFT fixes.
SFT_ENGINE_SOURCES = {
    **{key: source.format(role="actor") for key, source in ENGINE_BUILD_SOURCES.items()},
    "ppo_epochs": "one pass per step", "value_model": "false (a causal LM)", "reward_model": "false (a causal LM)",
}


def sft_engine_node(config: DictConfig, total_steps: int) -> dict[str, Any]:
    """What the engine factory receives: the :class:`~rlplat.contracts.engine.EngineBuildConfig` keys
    from this config, then ``actor.engine_config``."""
    actor = config.actor
    build = {
        **optimizer_build(config, actor.optim),
        "total_training_steps": optimizer_steps(config, total_steps), "ppo_mini_batch_size": mini_batch_size(config),
        "ppo_epochs": 1, "micro_batch_size_per_gpu": actor.micro_batch_size_per_gpu,
        "use_dynamic_bsz": actor.use_dynamic_bsz, "max_token_len_per_gpu": actor.max_token_len_per_gpu,
    }
    lora = OmegaConf.to_container(actor.lora, resolve=True)
    if lora.get("rank"):
        build["lora"] = lora
    return {**build, **OmegaConf.to_container(actor.engine_config, resolve=True)}


def validate_sft_config(config: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first problem that needs no worker and no data read."""
    from rlplat import registry
    from rlplat.contracts.engine import EngineBuildConfig
    from rlplat.trainer.tracking import BACKENDS

    schema, owner = entry_schema("engine", config.actor.engine, "actor.engine")
    if config.model.path is None:
        raise ConfigError("model.path is not set: give a local Hugging Face directory (model.path=/path/to/model).")
    if not Path(config.model.path).is_dir():
        raise ConfigError(f"model.path: {config.model.path} is not a directory (a local Hugging Face model folder is expected).")
    data = read_config_node(config.data, SFTDataConfig, "data")
    read_config_node(config.loss, SFTLossConfig, "loss")
    if not data.train_files:
        raise ConfigError("data.train_files is empty: give one or more parquet files (data.train_files=[a.parquet]).")
    for key in ("train_files", "val_files"):
        for path in getattr(data, key):
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: {path} does not exist.")
    lora = read_lora(OmegaConf.to_container(config.actor.lora, resolve=True))
    if lora.enabled and not getattr(registry.get("engine", config.actor.engine), "supports_lora", False):
        raise ConfigError(f"actor.lora.rank={lora.rank}: engine {config.actor.engine!r} has no LoRA adapters "
                          "(TrainingEngine.supports_lora); use the fsdp2 engine or actor.lora.rank=0.")
    check_cluster(config)
    world = processes(config)
    mini = mini_batch_size(config)
    if mini < 1 or mini > config.data.train_batch_size:
        raise ConfigError(f"actor.ppo_mini_batch_size={mini} must be between 1 and data.train_batch_size="
                          f"{config.data.train_batch_size} (examples per optimizer step).")
    for key, rows in (("data.train_batch_size", config.data.train_batch_size), ("actor.ppo_mini_batch_size", mini)):
        if rows % world:
            raise ConfigError(f"{key}={rows} examples do not split over the {world} worker processes "
                              "(cluster.nnodes x cluster.devices_per_node); make it a multiple of them.")
    rows = 0
    import pyarrow.parquet as pq

    for path in data.train_files:
        try:
            rows += pq.ParquetFile(path).metadata.num_rows
        except Exception as error:
            raise ConfigError(f"data.train_files: {path} is not a readable parquet file ({error}).") from None
    total = training_steps(config, rows)
    if total < 1:
        raise ConfigError(f"the training data has {rows} examples, fewer than data.train_batch_size="
                          f"{config.data.train_batch_size}: no step would run; lower the batch size or set data.drop_last=false.")
    core_keys = {field.name: SFT_ENGINE_SOURCES.get(field.name, field.name) for field in dataclasses.fields(EngineBuildConfig)}
    PluginNode("actor.engine_config", owner, schema, sft_engine_node(config, total), core_keys,
               tuple(OmegaConf.to_container(config.actor.engine_config, resolve=True))).check()
    for name in config.trainer.logger:
        if name not in BACKENDS:
            raise ConfigError(f"trainer.logger: unknown logging backend {name!r}; the backends are {', '.join(BACKENDS)}."
                              f"{did_you_mean(name, BACKENDS)}")
    if config.trainer.resume not in ("auto", "disable") and not Path(config.trainer.resume).exists():
        raise ConfigError(f"trainer.resume: {config.trainer.resume} is neither auto, disable nor an existing checkpoint.")
