"""The memory kit: the helpers an engine's or a rollout's memory estimate computes with (bytes of a dtype, the
training state's items, a rollout's fraction-of-device or host KV cache), on the memory-plan types of the
contracts (:mod:`rlplat.contracts.memory`: :class:`MemoryContext`, :class:`MemoryEstimate`, :class:`MemoryItem`,
:class:`ModelShape`, importable from here too). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Optional

# The types live in the contracts (rlplat.contracts.memory); the helpers below compute with them.
from rlplat.contracts.memory import CALLS, MemoryContext, MemoryEstimate, MemoryItem, ModelShape  # noqa: F401

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}

GIB = 1 << 30


def dtype_bytes(name: str, where: str = "") -> int:
    """Bytes of one element of the dtype called ``name`` (``float32``, ``bfloat16``, ...)."""
    try:
        return DTYPE_BYTES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"{where or 'dtype'}: unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}") from None


def human_bytes(value: float) -> str:
    """``1536 -> '1.5 KiB'``, binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value} B"


def fraction_rollout_estimate(name: str, shape: ModelShape, dtype: str, fraction: float, fraction_key: str,
                              context: MemoryContext, batched_tokens: int, sequences: int,
                              sleeps: bool) -> MemoryEstimate:
    """What a rollout that takes ``fraction`` of the device (vLLM's ``gpu_memory_utilization``, SGLang's
    ``mem_fraction_static``) holds: its weights, the activation reserve its start-up profile sets aside
    (``batched_tokens`` tokens through a layer's MLP and residual stream, ``sequences`` rows of float32
    logits), and a KV cache filling the rest of the fraction. Unknown device memory: the KV cache this
    step's sequences need instead. ``sleeps``: it frees all of it between generations."""
    b = dtype_bytes(dtype, f"rollout.config.dtype of {name}")
    parameters = shape.parameters("lm")
    held = ("generate", "wake_up") if sleeps else ("resident",)
    weights = MemoryItem("weights", parameters * b, held, f"{parameters:,} x {b} B ({dtype})")
    reserve_bytes = batched_tokens * b * (4 * shape.hidden_size + 3 * shape.active_intermediate()) + sequences * shape.vocab_size * 4 * 2
    reserve = MemoryItem("activation reserve", reserve_bytes, held,
                         f"{batched_tokens:,} batched tokens through a layer + logits of {sequences} sequences")
    per_token = shape.kv_cache_bytes_per_token(b)
    needed_tokens = max(context.sequences_per_process, 1) * context.sequence_length
    formula = f"2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} x {b} B"
    bucket = MemoryItem("weight-update buffer", context.weight_bucket_bytes, ("wake_up",), "one bucket of the weight sync")
    if context.device_memory is None:
        kv = MemoryItem("KV cache", per_token * needed_tokens, held, f"{formula} x {needed_tokens:,} tokens (this step's sequences)")
        note = (f"{name} takes {fraction_key}={fraction} of the device; with its memory unknown the plan counts the "
                "KV cache this step's sequences need",)
        return MemoryEstimate((weights, reserve, kv, bucket), note)
    budget = int(fraction * context.device_memory)
    left = budget - weights.bytes - reserve_bytes
    tokens = max(left, 0) // per_token
    kv = MemoryItem("KV cache", tokens * per_token, held,
                    f"{formula} x {tokens:,} tokens: what {fraction_key}={fraction} x {human_bytes(context.device_memory)} leaves")
    problems, notes = (), ()
    if left <= 0:
        problems = (f"{name}: {fraction_key}={fraction} of {human_bytes(context.device_memory)} is {human_bytes(budget)}, "
                    f"which the weights ({human_bytes(weights.bytes)}) and the activation reserve "
                    f"({human_bytes(reserve_bytes)}) fill: no room for a KV cache; raise {fraction_key}",)
    elif tokens < context.sequence_length:
        problems = (f"{name}: the KV cache holds {tokens:,} tokens, less than one sequence "
                    f"({context.sequence_length}); raise {fraction_key}",)
    elif tokens < needed_tokens:
        notes = (f"{name}: the KV cache holds {tokens:,} tokens, this step's sequences need {needed_tokens:,}: "
                 "they are decoded in turns",)
    return MemoryEstimate((weights, reserve, kv, bucket), notes, problems)


def host_rollout_estimate(name: str, shape: ModelShape, dtype: str, kv_cache_gib: float, kv_key: str, context: MemoryContext,
                          batched_tokens: int, sequences: int) -> MemoryEstimate:
    """What a rollout on CPUs holds in host memory (vLLM's CPU backend, SGLang's CPU engine): its weights, the
    activation reserve of one scheduler step (``batched_tokens`` through a layer, ``sequences`` rows of float32
    logits), a KV cache of a fixed ``kv_cache_gib`` (the setting ``kv_key``), one bucket of the weight sync; all
    resident (neither frees memory between phases on CPUs)."""
    b = dtype_bytes(dtype, f"rollout.config.dtype of {name}")
    parameters = shape.parameters("lm")
    reserve = batched_tokens * b * (4 * shape.hidden_size + 3 * shape.active_intermediate()) + sequences * shape.vocab_size * 4 * 2
    kv_bytes = int(kv_cache_gib * GIB)
    held = int(kv_bytes // shape.kv_cache_bytes_per_token(b))
    items = (
        MemoryItem("weights", parameters * b, ("resident",), f"{parameters:,} x {b} B ({dtype})"),
        MemoryItem("activation reserve", reserve, ("resident",), f"{batched_tokens:,} batched tokens through a layer + logits of {sequences} sequences"),
        MemoryItem("KV cache", kv_bytes, ("resident",), f"{kv_key}={kv_cache_gib}: {held:,} tokens"),
        MemoryItem("weight-update buffer", context.weight_bucket_bytes, ("wake_up",), "one bucket of the weight sync"),
    )
    problems: tuple[str, ...] = ()
    if held < context.sequence_length:
        problems = (f"{name}: {kv_key}={kv_cache_gib} holds {held:,} tokens, less than one sequence ({context.sequence_length}); raise it",)
    notes = (f"{name} on CPU: the KV cache is {kv_key.rsplit('.', 1)[-1]} of host memory; nothing is freed between phases",)
    return MemoryEstimate(items, notes, problems)


def training_state_items(parameters: int, *, trainable: Optional[int] = None, data_parallel: int = 1, tensor_parallel: int = 1,
                         pipeline_parallel: int = 1, weight_dtype: str = "bfloat16", master_dtype: Optional[str] = "float32",
                         gradient_dtype: str = "float32", optimizer_bytes_per_parameter: int = 8,
                         shard_master_and_optimizer: bool = True, shard_weights_and_gradients: bool = False,
                         calls: tuple[str, ...] = ("resident",)) -> tuple[MemoryItem, ...]:
    """Weights, gradients, master weights and optimizer states of one device of a model split over
    ``tensor_parallel x pipeline_parallel`` (every device holds ``1 / (TP x PP)`` of the parameters) and
    replicated or sharded over ``data_parallel``: ``shard_master_and_optimizer`` (ZeRO-1 / a distributed
    optimizer) divides the master weights and optimizer states by DP, ``shard_weights_and_gradients``
    (ZeRO-3 / FSDP) the weights and gradients too. ``master_dtype`` None: the weights are the master copy.
    AdamW keeps ``optimizer_bytes_per_parameter`` = 8 (two float32 moments). For an engine with tensor or
    pipeline parallelism (Megatron) to build its :class:`MemoryEstimate` from."""
    trainable = parameters if trainable is None else trainable
    model_split = tensor_parallel * pipeline_parallel
    local, local_trainable = -(-parameters // model_split), -(-trainable // model_split)
    weights_shards = data_parallel if shard_weights_and_gradients else 1
    state_shards = data_parallel if shard_master_and_optimizer or shard_weights_and_gradients else 1
    where = f"/ (TP {tensor_parallel} x PP {pipeline_parallel})"

    def item(name: str, count: int, element: str, shards: int, extra: str = "") -> MemoryItem:
        size = dtype_bytes(element) if element != "optimizer" else optimizer_bytes_per_parameter
        label = element if element != "optimizer" else f"{optimizer_bytes_per_parameter} B"
        detail = f"{count * model_split:,} {where} x {size} B ({label})" + (f" / DP {shards}" if shards > 1 else "") + extra
        return MemoryItem(name, -(-count * size // shards), calls, detail)

    items = [item("parameters", local, weight_dtype, weights_shards),
             item("gradients", local_trainable, gradient_dtype, weights_shards)]
    if master_dtype is not None:
        items.append(item("master weights", local_trainable, master_dtype, state_shards))
    items.append(item("optimizer states", local_trainable, "optimizer", state_shards))
    return tuple(items)
