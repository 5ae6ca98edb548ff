"""The hf rollout's memory on one device, predicted from its config and the model's ``config.json``
(:meth:`HFRollout.estimate_memory`, read by ``rlplat plan``). Imports no torch: the registration names
:func:`estimate` (``metadata["estimate_memory"]``), so the plan reads it without importing the rollout.

``generate`` samples ``max_batch_rows`` rows at a time with a ``DynamicCache``; a slice of ``rows``
prompts of ``P`` tokens holds, at its peak:

* **weights**: every parameter in ``dtype`` (none of its own when it reads the actor's in place);
* **KV cache**: ``2 x layers x KV heads x head dim x bytes`` per token, for ``rows x (P + R)`` tokens
  at the end of the slice, ``rows x P`` during the prefill;
* **prefill**: the prefill's largest transient, ``rows x P`` tokens through the MLP (its activation,
  up projection and their product, ``3i``) beside the residual stream (``4h``), or the logits of every
  prompt position (``V``, Hugging Face computes them all), kept until the first decoding step returns.

Measured on CPU (:class:`rlplat.testing.memory.TensorMemoryMeter`) the prefill's MLP sets the peak of a
small vocabulary, the logits that of a large one.
"""

from __future__ import annotations

from typing import Any, Mapping

from rlplat.config_node import read_config_node
from rlplat.contracts.memory import MemoryContext, MemoryEstimate, MemoryItem, ModelShape
from rlplat.kits.memory import dtype_bytes
from rlplat_rollout_hf.config import HFRolloutConfig


def estimate(config: Any, model_config: Mapping[str, Any], context: MemoryContext) -> MemoryEstimate:
    rollout = read_config_node(config, HFRolloutConfig, "rollout.config")
    shape = ModelShape.from_config(model_config, "rollout: config.json")
    b = dtype_bytes(rollout.dtype, "rollout.config.dtype")
    parameters = shape.parameters("lm")
    held = ("generate", "wake_up") if context.free_between_phases else ("resident",)
    if context.shares_actor_weights:
        weights = MemoryItem("weights", 0, held, "views of the actor's parameters (rollout.share_weights)")
    else:
        weights = MemoryItem("weights", parameters * b, held, f"{parameters:,} x {b} B ({rollout.dtype})")
    rows = min(max(context.sequences_per_process, 1), rollout.max_batch_rows)
    prompt, total = context.prompt_length, context.sequence_length
    per_token = shape.kv_cache_bytes_per_token(b)
    kv_full = per_token * rows * total
    h, i, vocab = shape.hidden_size, shape.active_intermediate(), shape.vocab_size
    prefill_mlp = per_token * rows * prompt + rows * prompt * b * (4 * h + 3 * i)
    prefill_logits = per_token * rows * (prompt + 1) + rows * prompt * b * vocab
    decode_end = kv_full + per_token * rows * total // (2 * shape.num_layers) + rows * vocab * 4 * 3
    peak = max(prefill_mlp, prefill_logits, decode_end)
    kv = MemoryItem("KV cache", kv_full, ("generate",),
                    f"2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} x {b} B x "
                    f"{rows * total:,} tokens ({rows} rows x {total})")
    transient = MemoryItem("generation transient", peak - kv_full, ("generate",),
                           "prefill of " + f"{rows * prompt:,} prompt tokens: "
                           + ("the MLP" if peak == prefill_mlp else "logits of every position" if peak == prefill_logits
                              else "the last decoding step") + " beyond the final KV cache")
    notes = ()
    if context.sequences_per_process > rollout.max_batch_rows:
        notes = (f"{context.sequences_per_process} sequences per process are sampled {rollout.max_batch_rows} "
                 "rows at a time (rollout.config.max_batch_rows)",)
    return MemoryEstimate((weights, kv, transient), notes)
