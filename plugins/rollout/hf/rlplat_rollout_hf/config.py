"""Configuration of the ``hf`` rollout."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass
class HFRolloutConfig:
    model_path: str | None = None
    """Local Hugging Face directory to build the model from (its weights are loaded unless
    ``load_weights`` is False, e.g. when the training engine syncs them in)."""

    model_config: Mapping[str, Any] | None = None
    """A model config (``transformers`` ``PretrainedConfig`` or its dict) used instead of ``model_path``."""

    load_weights: bool = True
    """Load the weights found in ``model_path``; otherwise the weights come from ``update_weights``."""

    dtype: str = "float32"
    """Parameter dtype: ``float32``, ``bfloat16`` or ``float16``."""

    device: str = "auto"
    """``auto`` (the worker's GPU if it has one, else CPU), ``cpu`` or ``cuda:N``."""

    pad_token_id: int | None = None
    """Token written after a response ends; defaults to the model config's pad (or EOS) token."""

    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end a response (kept, with mask 1); defaults to the model config's EOS token(s)."""

    max_batch_rows: int = 256
    """Rows sampled together in one pass; larger batches are processed in slices of this size."""

    seed: int = 0
    """Seed of the sampling generator used when a call's ``SamplingParams.seed`` is None."""

    @classmethod
    def from_any(cls, config: Any) -> "HFRolloutConfig":
        """Accept this dataclass, a mapping or an OmegaConf node (unknown keys are an error)."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if not isinstance(config, Mapping):
            try:
                from omegaconf import OmegaConf

                config = OmegaConf.to_container(config, resolve=True)
            except Exception as error:
                raise TypeError(f"hf rollout config must be a mapping or HFRolloutConfig, got {type(config).__name__}") from error
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(f"unknown hf rollout config key(s) {unknown}; known keys: {sorted(fields)}")
        values = dict(config)
        if values.get("eos_token_ids") is not None:
            values["eos_token_ids"] = tuple(values["eos_token_ids"])
        return cls(**values)
