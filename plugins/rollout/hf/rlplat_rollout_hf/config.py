"""Configuration of the ``hf`` rollout: the ``rollout.config`` node, read with core's one config reader."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlplat.contracts.rollout import RolloutBuildConfig


@dataclasses.dataclass
class HFRolloutConfig(RolloutBuildConfig):
    model_path: str | None = None
    """Local Hugging Face directory to build the model from (its weights are loaded unless
    ``load_weights`` is False, e.g. when the training engine syncs them in)."""

    model_config: Any = None
    """A model config (a ``transformers`` ``PretrainedConfig``, or its dict with ``model_type``) used
    instead of ``model_path``."""

    load_weights: bool = True
    """Load the weights found in ``model_path``; otherwise the weights come from ``update_weights``."""

    dtype: str = "float32"
    """Parameter dtype: ``float32``, ``bfloat16`` or ``float16``."""

    device: str = "auto"
    """``auto`` (the worker's GPU if it has one, else CPU), ``cpu`` or ``cuda:N``."""

    pad_token_id: int | None = None
    """Token written after a response ends; defaults to the model config's pad (or EOS) token."""

    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end a response (kept, with mask 1); None: the model config's EOS token(s); empty: none
    (every response runs to ``max_new_tokens`` unless a stop token of the call ends it)."""

    max_batch_rows: int = 256
    """Rows sampled together in one pass: ``generate`` processes larger batches in slices of this size,
    and at most this many concurrent ``generate_tokens`` requests decode together (more wait in a queue
    and join the running batch as rows finish)."""

    seed: int = 0
    """Seed of the sampling generator used when a call's ``SamplingParams.seed`` is None."""
