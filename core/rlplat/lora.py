"""LoRA: low-rank adapters on the actor's training engine (``actor.lora.*``).

With ``actor.lora.rank > 0`` the actor's engine wraps its model with ``peft`` adapters on the
``target_modules`` (less ``exclude_modules``) and trains only them: the optimizer holds the adapter
parameters alone. The reference policy is the same model with the adapter switched off
(:meth:`rlplat.contracts.engine.TrainingEngine.adapter_disabled`), so no second copy of the base weights
is built. Weights reach the rollout as ``sync``: ``merged`` (full weights with the adapter merged in,
for any rollout: :meth:`TrainingEngine.named_weights`) or ``adapter`` (the adapter tensors alone,
:meth:`TrainingEngine.adapter_weights`, for a rollout that loads adapters:
:meth:`rlplat.contracts.rollout.RolloutEngine.load_adapter`). Checkpoints hold the adapter and its
optimizer state only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, List, Mapping, Optional, Union

SYNC_MODES = ("merged", "adapter")
ADAPTER_NAME_SEGMENT = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.weight$")
"""The adapter name in peft's full state-dict names (``...q_proj.lora_A.default.weight``)."""


def without_adapter_name(name: str) -> str:
    """A peft tensor name as adapter folders store it (``<module>.lora_A.weight``): rollouts that load
    adapters (vLLM, SGLang) parse that form."""
    return ADAPTER_NAME_SEGMENT.sub(r".\1.weight", name)


def json_value(value: Any) -> Any:
    """A peft config value as JSON (sets become sorted lists, enums their value)."""
    if isinstance(value, Mapping):
        return {str(key): json_value(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(json_value(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return getattr(value, "value", str(value))  # an enum (peft_type, task_type)


@dataclasses.dataclass
class LoraConfig:
    """The ``actor.lora`` node."""

    rank: int = 0
    """Adapter rank ``r`` (0: no LoRA, full fine-tuning)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's update is ``(alpha / rank) * B @ A``."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training."""
    target_modules: List[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: ``[all-linear]`` (every linear layer but the output head) or module-name
    suffixes (``[q_proj, v_proj]``); a plain string is read as a one-item list."""
    exclude_modules: List[str] = dataclasses.field(default_factory=list)
    """Module-name suffixes left without adapters."""
    adapter_path: Optional[str] = None
    """A ``peft`` adapter folder to start from (``adapter_config.json`` and weights) instead of a fresh one."""
    sync: str = "merged"
    """How weights reach the rollout: ``merged`` (full weights, adapter merged in; any rollout) or
    ``adapter`` (adapter tensors only; a rollout that loads adapters: hf, vllm, sglang)."""

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        self.target_modules = list(self.target_modules)
        problems = []
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            problems.append(f"rank must be an int >= 0 (0: off), got {self.rank!r}")
        if not self.alpha > 0:
            problems.append(f"alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            problems.append("target_modules is an empty list: no module would get an adapter")
        elif "all-linear" in self.target_modules and len(self.target_modules) > 1:
            problems.append(f"target_modules: all-linear stands alone, got {self.target_modules}")
        if self.sync not in SYNC_MODES:
            problems.append(f"sync must be merged or adapter, got {self.sync!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def peft_target_modules(self) -> Union[str, List[str]]:
        """``target_modules`` as ``peft.LoraConfig`` takes it (the string ``all-linear`` or names)."""
        return "all-linear" if self.target_modules == ["all-linear"] else list(self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0


def read_lora(node: Any, where: str = "actor.lora") -> LoraConfig:
    """The node typed (defaults when None)."""
    from rlplat.config_node import read_config_node

    values = dict(node) if node is not None else {}
    if isinstance(values.get("target_modules"), str):  # ``target_modules: q_proj`` in YAML: a one-item list
        values["target_modules"] = [values["target_modules"]]
    return read_config_node(values, LoraConfig, where)


def check_lora(config: Any) -> None:
    """Load-time checks of ``actor.lora`` against the rest of the run; raises :class:`ConfigError`."""
    from pathlib import Path

    from rlplat import registry
    from omegaconf import OmegaConf

    from rlplat.config_node import ConfigError, resolve_schema

    node = OmegaConf.select(config, "actor.lora")
    try:
        lora = read_lora(OmegaConf.to_container(node, resolve=True) if node is not None else None)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error) if "actor.lora" in str(error) else f"actor.lora: {error}") from None
    if not lora.enabled:
        return
    engine = registry.get("engine", config.actor.engine)
    if not getattr(engine, "supports_lora", False):
        raise ConfigError(f"actor.lora.rank={lora.rank}: engine {config.actor.engine!r} has no LoRA adapters "
                          "(TrainingEngine.supports_lora); use the fsdp2 engine or actor.lora.rank=0.")
    if lora.adapter_path is not None and not (Path(lora.adapter_path) / "adapter_config.json").is_file():
        raise ConfigError(f"actor.lora.adapter_path: {lora.adapter_path} has no adapter_config.json (a peft adapter folder is expected).")
    if lora.sync == "adapter":
        separate = config.trainer.mode == "separate_async" or ((config.get("roles") or {}).get("rollout") or {}).get("placement") == "separate"
        if separate and config.rollout.free_between_phases:
            raise ConfigError("actor.lora.sync=adapter with a rollout in its own pool and rollout.free_between_phases: a "
                              "rollout that frees its weights needs the base weights again, which only a colocated one can "
                              "take from the actor; set rollout.free_between_phases=false or actor.lora.sync=merged.")
        rollout = registry.get("rollout", config.rollout.name)
        if not getattr(rollout, "supports_adapters", False):
            raise ConfigError(f"actor.lora.sync=adapter: rollout {config.rollout.name!r} cannot load adapters "
                              "(RolloutEngine.supports_adapters); use actor.lora.sync=merged.")
        schema = registry.entry("rollout", config.rollout.name).config_schema
        fields = set(getattr(resolve_schema(schema), "__dataclass_fields__", {}))
        if "max_lora_rank" in fields:  # an engine that reserves adapter memory up front (vllm, sglang)
            reserved = (OmegaConf.to_container(config.rollout.config, resolve=True) or {}).get("max_lora_rank") or 0
            if reserved < lora.rank:
                raise ConfigError(f"actor.lora.sync=adapter: rollout {config.rollout.name!r} serves adapters up to "
                                  f"rollout.config.max_lora_rank={reserved}, below actor.lora.rank={lora.rank}; set "
                                  f"rollout.config.max_lora_rank to at least {lora.rank} (the rollout's own sizes apply).")
