"""Reward models: the ``reward.model`` node, and how a model's score joins the rule score.

A reward model is a sequence classifier with one label (Hugging Face's
``AutoModelForSequenceClassification``) served by a training engine's forward path
(``EngineBuildConfig.reward_model``) in the worker group of the ``reward_model`` role
(:mod:`rlplat_reward_model.worker`). The run has one when ``reward.model.path`` is set. Each step the
trainer asks the group for ``rm_scores`` (one float per response) and :func:`combine` joins them with the
reward manager's token-level scores:

``sum``
    ``weight * model + rule_weight * rule``; ``rule_weight: 0`` rewards by the model alone (the reward
    manager is then not called in training; validation still calls it for its accuracy).
``normalized``
    each component standardised over the batch first (``(x - mean) / std``; a component with no spread
    counts 0), then weighted and summed: neither scale dominates by accident.

This module imports no torch at import time (the config reads it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional

COMBINE_MODES = ("sum", "normalized")
RETOKENIZE_MODES = ("auto", "always", "never")


@dataclasses.dataclass
class RewardModelConfig:
    """The ``reward.model`` node: a scoring model, where it runs and how its score counts."""

    path: Optional[str] = None
    """Local Hugging Face directory of the reward model (a ``*ForSequenceClassification`` checkpoint with
    one label, or a causal LM, which gets a fresh score head). None: no reward model."""
    tokenizer_path: Optional[str] = None
    """Directory of the reward model's tokenizer (None: ``path``)."""
    retokenize: str = "auto"
    """``auto``: when the reward model's tokenizer differs from the policy's (vocabulary, special tokens or
    chat template), render each conversation as text (the row's chat messages, the response as the
    assistant's turn) with the reward model's chat template and tokenise it with its tokenizer; otherwise
    score the policy's tokens as they are. ``always`` / ``never`` force either."""
    max_length: Optional[int] = None
    """Longest re-tokenised conversation; a longer one keeps its last ``max_length`` tokens (where the
    score is read) and is counted in ``reward/model/truncated``. None: no limit."""
    engine: str = "fsdp2"
    """Registered training engine (kind ``engine``) that serves the model's forward pass."""
    engine_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's own keys (checked against its schema), e.g. ``dtype``, ``use_remove_padding``."""
    micro_batch_size_per_gpu: int = 8
    """Rows per forward micro-batch."""
    use_dynamic_bsz: bool = False
    """Micro-batches by a token budget (``max_token_len_per_gpu``) instead of a row count."""
    max_token_len_per_gpu: int = 16384
    """The token budget of one micro-batch with ``use_dynamic_bsz``."""
    placement: str = "colocated"
    """``colocated``: in the actor's processes, its parameters moved off the accelerator between scoring
    calls (``sleep``); ``separate``: a resource pool of its own (Ray only), sized by ``nnodes`` x
    ``devices_per_node``."""
    nnodes: Optional[int] = None
    """``separate`` only: machines of its pool (None: ``cluster.nnodes``)."""
    devices_per_node: Optional[int] = None
    """``separate`` only: processes per machine of its pool (None: ``cluster.devices_per_node``)."""
    sleep: bool = True
    """Offload the reward model's parameters after each scoring call (woken by the next); on CPU there is
    nothing to move."""
    combine: str = "sum"
    """How the model's score joins the rule score: ``sum`` (``weight * model + rule_weight * rule``) or
    ``normalized`` (each standardised over the batch first, ``(x - mean) / std``, then weighted and summed)."""
    weight: float = 1.0
    """Weight of the model's score."""
    rule_weight: float = 1.0
    """Weight of the reward manager's (rule) score; 0 rewards by the model alone."""

    def __post_init__(self) -> None:
        problems = []
        if self.retokenize not in RETOKENIZE_MODES:
            problems.append(f"retokenize must be one of {', '.join(RETOKENIZE_MODES)}, got {self.retokenize!r}")
        if self.combine not in COMBINE_MODES:
            problems.append(f"combine must be one of {', '.join(COMBINE_MODES)}, got {self.combine!r}")
        for name in ("weight", "rule_weight"):
            if not math.isfinite(getattr(self, name)):
                problems.append(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.weight == 0:
            problems.append("weight is 0: the model's score would count for nothing (remove reward.model.path instead)")
        for name in ("micro_batch_size_per_gpu", "max_token_len_per_gpu"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length is not None and self.max_length < 2:
            problems.append(f"max_length must be >= 2 or null, got {self.max_length}")
        if self.placement not in ("colocated", "separate"):
            problems.append(f"placement must be colocated or separate, got {self.placement!r}")
        if self.placement == "colocated" and (self.nnodes is not None or self.devices_per_node is not None):
            problems.append("nnodes and devices_per_node apply to placement=separate only")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def enabled(self) -> bool:
        return self.path is not None


def read_reward_model(config: Any) -> RewardModelConfig:
    """The ``reward.model`` node of a run config, typed and checked."""
    from omegaconf import OmegaConf

    from rlplat.config_node import read_config_node

    node = OmegaConf.select(config, "reward.model", default=None)
    return read_config_node(node, RewardModelConfig, "reward.model")


def engine_node(config: Any, settings: RewardModelConfig) -> dict[str, Any]:
    """What the reward model's engine factory receives: the build keys, then ``reward.model.engine_config``."""
    from omegaconf import OmegaConf

    build = {
        "model_path": settings.path, "seed": int(config.trainer.seed), "reward_model": True,
        "micro_batch_size_per_gpu": settings.micro_batch_size_per_gpu, "use_dynamic_bsz": settings.use_dynamic_bsz,
        "max_token_len_per_gpu": settings.max_token_len_per_gpu,
    }
    own = settings.engine_config
    if not isinstance(own, dict):
        own = OmegaConf.to_container(own, resolve=True)
    return {**build, **own}


def reward_model_nodes(config: Any) -> list:
    """The run config's plugin nodes (:class:`rlplat.config.PluginNode`) of the reward model: its engine's
    node when ``reward.model.path`` names one, after the checks that need the whole config."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from rlplat.config import ConfigError, PluginNode, entry_schema

    settings = read_reward_model(config)
    if not settings.enabled:
        return []
    path = Path(settings.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"reward.model.path: {settings.path} is not a local Hugging Face model directory (no config.json there).")
    tokenizer = Path(settings.tokenizer_path or settings.path)
    if not tokenizer.is_dir():
        raise ConfigError(f"reward.model.tokenizer_path: {tokenizer} is not a directory.")
    if settings.placement == "separate" and config.cluster.backend == "local":
        raise ConfigError("reward.model.placement=separate needs cluster.backend=ray (the local backend is one process).")
    metric = OmegaConf.select(config, "algorithm.filter_groups.metric", default=None)
    if (settings.rule_weight == 0 and OmegaConf.select(config, "algorithm.filter_groups.enable", default=False)
            and metric not in (None, "seq_reward", "seq_final_reward")):
        raise ConfigError(f"algorithm.filter_groups.metric={metric!r} is a column the reward manager returns, and with "
                          "reward.model.rule_weight=0 the manager is not called in training; filter by seq_reward or "
                          "give the rule a weight.")
    schema, owner = entry_schema("engine", settings.engine, "reward.model.engine")
    build = {"model_path": "reward.model.path", "seed": "trainer.seed", "reward_model": "(set by the reward-model role)",
             "micro_batch_size_per_gpu": "reward.model.micro_batch_size_per_gpu",
             "use_dynamic_bsz": "reward.model.use_dynamic_bsz", "max_token_len_per_gpu": "reward.model.max_token_len_per_gpu"}
    return [PluginNode("reward.model.engine_config", owner, schema, engine_node(config, settings), build,
                       tuple(settings.engine_config))]


def standardised(values: Any) -> Any:
    """``(values - mean) / std`` over the batch (population std); zeros when the values do not vary."""
    centred = values - values.mean()
    spread = values.std(unbiased=False)
    return centred / spread if float(spread) > 1e-12 else centred * 0.0


def combine(rule_scores: Any, model_scores: Any, response_mask: Any, settings: RewardModelConfig) -> tuple[Any, dict[str, float]]:
    """Token-level scores ``[B, R]`` of the run: the rule's (``rule_scores``, token-level, may be shaped
    over several tokens) and the model's (``model_scores`` [B], placed at each row's last valid response
    token), joined per ``settings.combine``. Returns them and the ``reward/model/*`` metrics."""
    import torch

    from rlplat.kits.reward import last_tokens

    model_scores = model_scores.to(torch.float32)
    last = torch.tensor(last_tokens(response_mask), dtype=torch.long)
    has_response = last >= 0
    metrics = {"reward/model/mean": float(model_scores.mean()), "reward/model/min": float(model_scores.min()),
               "reward/model/max": float(model_scores.max())}
    if settings.combine == "normalized":
        rule_sequence = rule_scores.sum(-1)
        parts = settings.weight * standardised(model_scores) + settings.rule_weight * standardised(rule_sequence)
        combined = torch.zeros_like(rule_scores, dtype=torch.float32)
        rows = has_response.nonzero().squeeze(1)
        combined[rows, last[rows]] = parts[rows].to(torch.float32)
        return combined, metrics
    combined = rule_scores.to(torch.float32) * settings.rule_weight
    rows = has_response.nonzero().squeeze(1)
    combined[rows, last[rows]] += settings.weight * model_scores[rows]
    return combined, metrics


def check(settings: RewardModelConfig, config: Any) -> None:
    """The ``reward.model`` node's check (kind ``config_node``): done by :func:`reward_model_nodes`, which
    the config's node loop runs first."""


def plan(config: Any, gpu: bool) -> list:
    """The reward model's component of ``rlplat plan`` (the ``reward_model`` role's ``metadata["plan"]``)."""
    from rlplat.contracts.memory import PlannedComponent

    settings = read_reward_model(config)
    if not settings.enabled:
        return []
    return [PlannedComponent("engine", settings.engine, "reward_model", settings.placement, settings.nnodes,
                             settings.devices_per_node, "reward.model", engine_node(config, settings), settings.path,
                             "reward_model", ("reward_model",) if settings.sleep and gpu else None)]
