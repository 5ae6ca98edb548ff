"""The sglang rollout's memory on one GPU, predicted from its config and the model's ``config.json``
(:meth:`SGLangRollout.estimate_memory`, read by ``rlplat plan``); imports neither torch nor sglang. The
registration names :func:`estimate` (``metadata["estimate_memory"]``): the plan does not import the rollout.

SGLang takes ``mem_fraction_static`` of the memory free when it starts for its weights and KV cache
(the plan takes the whole device as free: an upper bound when the training engine started first), and
keeps room for the activations of a chunked prefill (``chunked_prefill_size`` tokens) and the logits of
``max_running_requests`` sequences (:func:`rlplat.kits.memory.fraction_rollout_estimate`). With
``rollout.free_between_phases`` and ``enable_memory_saver`` it frees all of it between generations.

On SGLang's CPU engine (``context.device`` ``cpu``: a run without ``cluster.use_gpu``) the KV cache is a fixed
``cpu_kv_cache_gib`` of host memory and nothing is freed between phases (no memory saver there).
"""

from __future__ import annotations

from typing import Any, Mapping

from rlplat.config_node import read_config_node
from rlplat.contracts.memory import MemoryContext, MemoryEstimate, ModelShape
from rlplat.kits.memory import fraction_rollout_estimate, host_rollout_estimate
from rlplat_rollout_sglang.config import SGLangRolloutConfig
from rlplat_rollout_sglang.translate import memory_saver

#: SGLang 0.5's defaults: chunked prefill size, running requests, and the fraction it picks on a large GPU.
DEFAULT_PREFILL_TOKENS, DEFAULT_SEQUENCES, DEFAULT_FRACTION = 8192, 256, 0.88


def estimate(config: Any, model_config: Mapping[str, Any], context: MemoryContext) -> MemoryEstimate:
    rollout = read_config_node(config, SGLangRolloutConfig, "rollout.config")
    shape = ModelShape.from_config(model_config, "rollout: config.json")
    dtype = rollout.dtype if rollout.dtype != "auto" else str(model_config.get("torch_dtype") or "bfloat16")
    extra = dict(rollout.engine_kwargs or {})
    tokens = int(extra.get("chunked_prefill_size") or DEFAULT_PREFILL_TOKENS)
    if context.device == "cpu":
        return host_rollout_estimate("sglang", shape, dtype, rollout.cpu_kv_cache_gib, "rollout.config.cpu_kv_cache_gib", context,
                                     tokens, rollout.max_running_requests or DEFAULT_SEQUENCES)
    fraction = rollout.mem_fraction_static if rollout.mem_fraction_static is not None else DEFAULT_FRACTION
    return fraction_rollout_estimate("sglang", shape, dtype, fraction, "rollout.config.mem_fraction_static", context, tokens,
                                     rollout.max_running_requests or DEFAULT_SEQUENCES,
                                     context.free_between_phases and memory_saver(rollout, cpu=False))
