"""The megatron engine's memory on one device, predicted from its config and the model's ``config.json``
(:meth:`MegatronEngine.estimate_memory`, read by ``rlplat plan`` and the check of ``rlplat run``), and the
layout check that needs the world size and the model (:func:`layout_problems`). Imports no torch (nor
megatron): the registration names :func:`estimate` (``metadata["estimate_memory"]``), so the plan reads it
without importing the engine.

What one rank holds, as :mod:`rlplat_engine_megatron.engine` allocates it (DP = processes / (TP x CP x PP)):

* **training state** (:func:`rlplat.kits.memory.training_state_items`): the rank's parameters in the
  compute dtype, the float32 gradient buffer of megatron's DDP (``grad_reduce_in_fp32``), float32 master
  weights when computing in bfloat16, AdamW's two float32 moments; master weights and moments divided by
  DP with ``use_distributed_optimizer``. The rank's parameters are counted exactly for the largest
  pipeline stage: its decoder layers split by TP except the two norms, the vocabulary-parallel embedding
  on the first stage, the final norm and the output layer (vocabulary-parallel; with tied embeddings and
  PP > 1 the last stage holds its own copy) on the last. The gradient buffer and master weights exist
  from the build on (the reference, built the same way, holds them too); the moments from the first
  optimizer step (the reference never steps).
* **activations** (update): megatron's local layer spec keeps, per token and layer, the two norms'
  inputs and outputs (``4h``), the fused QKV output and the query and key after RoPE (with grouped-query
  attention the key and value repeated to every head instead), the softmax probabilities
  (``heads / TP x sequence`` per token), the attention output and the MLP's fused gate/up output, its
  activation and product (``4i / TP``), all in the compute dtype. ``full`` recompute keeps each layer's
  input and recomputes one layer at a time; ``selective`` drops the attention core's probabilities.
  A pipeline stage runs ``layers / PP`` layers and, under 1F1B, the first stage holds ``PP`` micro-batches
  in flight (stage ``r``: ``PP - r``; the interleaved schedule ``2 (PP - 1) + (VPP - 1) PP + 1`` chunk
  micro-batches of ``layers / (PP x VPP)`` layers), never more than the mini-batch has. The last stage
  adds the final norm and the logits of the micro-batch: the whole sequence's ``V / TP`` logits in the
  compute dtype (megatron's model returns them for every position) and, for the response positions, the
  gathered logits and their float32 scaled, shifted and exponentiated copies; where those float32 response
  logits would exceed 16 MiB, the output layer runs ``logprob_chunk_size`` tokens at a time instead (the
  final hidden states, and one chunk's logits and copies; modelled, not measured yet). The plan takes the larger
  of the first and the last stage. megatron's global buffer for the attention scores (rows x heads/TP x
  sequence x sequence) stays allocated after the first call.
* **context parallelism** (``context_parallel_size`` CP > 1): a rank holds ``1 / CP`` of each padded row's
  tokens, and its attention scores are its queries against the whole sequence; unless the attention core is
  recomputed (``selective``), each layer also keeps the whole sequence's keys and values its attention
  all-gathered (repeated to every head with grouped-query attention). The response logits are the busiest
  rank's: megatron's layout gives rank ``r`` chunks ``r`` and ``2 CP - 1 - r``, so the rank holding the
  last chunk computes most of the response positions.
* **forward** (log-probs, values; no gradients): the largest transient of a layer (the MLP's ``i / TP``
  tensors, the residual stream, the scores and probabilities) and the logits of the micro-batch.
* **export** (the weight sync, actor): ``named_weights`` gathers one parameter at a time: its TP shards,
  the merged tensor and its Hugging Face pieces (the largest parameter, three times), beside the bucket
  being filled (compute dtype) and the rank's own shards.

On CPU ``optimizer_offload`` moves nothing; on a GPU it keeps the moments and
master weights off the device outside the step. Sequences are taken at their full length
(``data.max_prompt_length + rollout.response_length``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlplat.contracts.memory import MemoryContext, MemoryEstimate, MemoryItem, ModelShape

from rlplat.kits.memory import dtype_bytes, human_bytes

from rlplat.kits.memory import training_state_items
from rlplat_engine_megatron.config import MegatronEngineConfig, read_engine_config

#: vocab_parallel.KEEP_FLOAT32_BYTES (this module imports no torch): larger response logits are chunked.
KEEP_FLOAT32_BYTES = 16 << 20

#: role of the plan -> the node of the run config its engine_config lives in.
ROLE_KEYS = {"actor": "actor", "reference": "actor", "critic": "critic", "reward_model": "reward.model"}


def layout_problems(config: MegatronEngineConfig, world_size: int, model_config: Mapping[str, Any], key: str = "") -> list[str]:
    """Every size of ``config`` that does not fit ``world_size`` ranks or the model ``model_config`` (a
    ``config.json`` dict) describes, named as ``<key>.tensor_parallel_size=...`` with the numbers."""
    prefix = f"{key}." if key else ""
    tp, pp, ep, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.expert_model_parallel_size, config.context_parallel_size
    vpp = config.virtual_pipeline_parallel_size or 1
    tp_key, pp_key = f"{prefix}tensor_parallel_size={tp}", f"{prefix}pipeline_parallel_size={pp}"
    ep_key, cp_key = f"{prefix}expert_model_parallel_size={ep}", f"{prefix}context_parallel_size={cp}"
    model = dict(model_config.get("text_config") or model_config)
    problems = []
    replica, replica_keys = tp * cp * pp, f"{tp_key} x {cp_key} x {pp_key}" if cp > 1 else f"{tp_key} x {pp_key}"
    if world_size % replica:
        problems.append(
            f"world size {world_size} is not divisible by {replica_keys} = {replica} "
            f"(a run needs cluster.backend=ray and cluster.devices_per_node a multiple of {replica})"
        )
    experts = int(model.get("num_experts") or model.get("num_local_experts") or 0)
    if ep > 1 and not experts:
        problems.append(f"{ep_key} needs a mixture-of-experts model; this one has no experts")
    elif ep > 1:
        if experts % ep:
            problems.append(f"the model's {experts} experts are not divisible by {ep_key}")
        if world_size % (tp * ep * pp):
            problems.append(f"world size {world_size} is not divisible by {tp_key} x {ep_key} x {pp_key} = {tp * ep * pp}")
    heads = int(model["num_attention_heads"])
    groups = int(model.get("num_key_value_heads") or heads)
    if heads % tp:
        problems.append(f"the model's {heads} attention heads are not divisible by {tp_key}")
    if groups % tp:
        problems.append(f"the model's {groups} key/value heads are not divisible by {tp_key}")
    layers = int(model["num_hidden_layers"])
    if layers % (pp * vpp):
        problems.append(f"the model's {layers} layers are not divisible by {pp_key} x {prefix}virtual_pipeline_parallel_size={vpp}")
    vocabulary = int(model["vocab_size"])
    if vocabulary % tp:
        problems.append(f"the model's vocabulary of {vocabulary} tokens is not divisible by {tp_key}")
    return problems


def stage_parameters(shape: ModelShape, head: str, tp: int, pp: int, ep: int = 1) -> tuple[int, int]:
    """``(parameters of one rank of the largest pipeline stage, that stage's index)``: layers split by TP
    except their norms (and a MoE layer's router and shared-expert gate), a MoE layer's routed experts split by
    TP x EP (expert tensor parallelism is TP), embedding and output layer vocabulary-parallel (a value head
    whole)."""
    h = shape.hidden_size
    if shape.moe_layers:
        experts = shape.num_experts * 3 * h * shape.expert_intermediate_size
        router = shape.num_experts * h + (h if shape.shared_expert_intermediate_size else 0)
        rest = shape.layer_parameters(True) - experts - router - 2 * h
        layer = rest // tp + 2 * h + router + experts // (tp * ep)
    else:
        layer = (shape.layer_parameters() - 2 * h) // tp + 2 * h
    layers = shape.num_layers // pp * layer
    embedding = shape.embedding_parameters() // tp
    if head == "lm":
        output = shape.vocab_size * h // tp if (not shape.tie_word_embeddings or pp > 1) else 0
    else:
        output = shape.head_parameters(head)
    if pp == 1:
        return layers + embedding + h + output, 0
    first, last = layers + embedding, layers + h + output
    return (last, pp - 1) if last >= first else (first, 0)


def layer_activation_elements(shape: ModelShape, tp: int, sequence: int, recompute: Any, ep: int = 1) -> int:
    """Elements autograd keeps per token for one decoder layer of megatron's local spec (module docstring); a
    MoE layer's MLP is its k experts' and the shared expert's (``active_intermediate``) plus the dispatcher's:
    the router's probabilities over the experts, the token's hidden state gathered from each of the EP ranks
    (the all-gather dispatcher) and its k permuted copies in and out of the experts (``2 k h``)."""
    h, q, kv, i = shape.hidden_size, shape.q_size, shape.kv_size, shape.active_intermediate()
    probabilities = shape.num_heads // tp * sequence
    grouped = shape.num_kv_heads < shape.num_heads
    if grouped and recompute != "selective":
        attention = 4 * q // tp  # query after RoPE, key and value repeated to every head, the attention output
    else:
        attention = (q + kv + (q + 2 * kv) + q) // tp  # query and key after RoPE, the fused QKV (value's view), the output
    kept = 4 * h + attention + 4 * i // tp
    if shape.moe_layers:
        kept += shape.num_experts + ep * h + 2 * max(shape.experts_per_token, 1) * h
    return kept + (0 if recompute == "selective" else probabilities)


def busiest_response_share(sequence: int, response: int, cp: int) -> int:
    """Response positions (the ``response`` positions before the last of a ``sequence``-token row, a multiple of
    ``2 x cp``) on the context-parallel rank holding the most of them: its chunks ``r`` and ``2 cp - 1 - r``."""
    chunk, first = sequence // (2 * cp), sequence - response - 1
    def count(start: int) -> int:
        return max(0, min(start + chunk, sequence - 1) - max(start, first))
    return max(count(rank * chunk) + count((2 * cp - 1 - rank) * chunk) for rank in range(cp))


def gathered_key_value_bytes(shape: ModelShape, tp: int, cp: int, rows: int, sequence: int, recompute: Any, b: int) -> int:
    """What context parallelism adds to a layer's kept activations: the whole sequence's keys and values its
    attention all-gathers (repeated to every head with grouped-query attention), beyond this rank's share
    :func:`layer_activation_elements` counts; none under selective recompute (the attention core is rerun)."""
    if cp == 1 or recompute == "selective":
        return 0
    if shape.num_kv_heads < shape.num_heads:
        return rows * (sequence - sequence // cp) * 2 * shape.q_size // tp * b
    return rows * sequence * 2 * shape.kv_size // tp * b


def in_flight(pp: int, vpp: int, micro_batches: int) -> tuple[int, int]:
    """``(micro-batches whose activations the first stage holds at once, layers-per-stage divisor)``."""
    if pp == 1:
        return 1, 1
    if vpp > 1:
        chunks = min(2 * (pp - 1) + (vpp - 1) * pp + 1, micro_batches * vpp)
        return chunks, vpp
    return min(pp, micro_batches), 1


def estimate(config: Any, model_config: Mapping[str, Any], context: MemoryContext) -> MemoryEstimate:
    """The items of the largest rank of a megatron engine in ``context.role`` (see the module docstring).
    Raises ``ValueError`` naming the keys when the layout does not fit the processes or the model."""
    engine = read_engine_config(config)
    key = f"{ROLE_KEYS.get(context.role, context.role)}.engine_config"
    world = max(context.processes, 1)
    problems = layout_problems(engine, world, model_config, key)
    if problems:
        raise ValueError(f"megatron engine layout on the role's {world} process(es): " + "; ".join(problems))
    shape = ModelShape.from_config(model_config, f"{context.role}: config.json")
    gpu = context.device == "cuda"
    compute = engine.dtype if engine.dtype != "auto" else ("bfloat16" if gpu else "float32")
    b = dtype_bytes(compute)
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    vpp = engine.virtual_pipeline_parallel_size or 1
    cp = engine.context_parallel_size
    dp = world // (tp * cp * pp)
    head = "value" if engine.value_model else "lm"
    ep = engine.expert_model_parallel_size
    local, stage = stage_parameters(shape, head, tp, pp, ep)
    trains = context.role in ("actor", "critic")
    state = training_state_items(local * tp * pp, data_parallel=dp, tensor_parallel=tp, pipeline_parallel=pp, weight_dtype=compute,
                                 master_dtype=None if compute == "float32" else "float32", gradient_dtype="float32",
                                 shard_master_and_optimizer=engine.use_distributed_optimizer, calls=("resident",))
    offloads = gpu and engine.optimizer_offload
    items, notes = [], []
    total = shape.parameters(head)
    split = f"{local * tp * pp:,} / (TP {tp} x PP {pp})"
    for item in state:
        if item.name == "optimizer states" and not trains:
            continue
        if tp * pp > 1:  # the count is the largest stage's rank's, not the model's over TP x PP
            item = dataclasses.replace(item, detail=item.detail.replace(split, f"{local:,} (stage {stage}'s rank; the model's {total:,} over TP {tp} x PP {pp})"))
        if offloads and item.name in ("optimizer states", "master weights"):
            item = MemoryItem(item.name, item.bytes, ("update",), item.detail + ", offloaded outside the step")
        items.append(item)
    grid = f"TP {tp} x CP {cp} x PP {pp} x DP {dp}" if cp > 1 else f"TP {tp} x PP {pp} x DP {dp}"
    notes.append(f"{grid}: the figures are the largest pipeline stage's (stage {stage}, "
                 f"{local:,} parameters on a rank of the model's {total:,})")
    if shape.moe_layers:
        notes.append(f"{shape.expert_parameters():,} of the model's parameters are the experts and routers of {shape.moe_layers} MoE "
                     f"layers ({shape.num_experts} experts, {shape.experts_per_token} per token); each rank holds "
                     f"{shape.num_experts // ep} experts per layer (EP {ep}), split by TP {tp}; the distributed optimizer "
                     "shards the experts' state over the expert data-parallel ranks, counted here as over DP")
    if not trains:
        notes.append("the gradient buffer (and master weights) exist from the build; AdamW's moments only after a step")
    if not gpu and engine.optimizer_offload:
        notes.append("optimizer_offload moves nothing on CPU")
    sequence, response = context.sequence_length, context.response_length
    per_process = max(context.sequences_per_process, 1) * tp * cp * pp  # a replica's rows: its TP x CP x PP ranks get the same rows
    for call, rows_key in (("update", "micro_batch_size_per_gpu"), ("forward", "forward_micro_batch_size_per_gpu")):
        if call == "update" and not trains:
            continue
        rows = getattr(engine, rows_key) or engine.micro_batch_size_per_gpu
        mini_batch = per_process
        if call == "update" and engine.ppo_mini_batch_size:
            mini_batch = min(max(engine.ppo_mini_batch_size // dp, 1), per_process)
        rows = min(rows, mini_batch)
        if engine.use_dynamic_bsz:
            rows = max(min(engine.max_token_len_per_gpu * cp, mini_batch * sequence) // sequence, 1)
        micro_batches = -(-mini_batch // rows)
        items.append(activation_item(shape, engine, call, b, compute, rows, sequence, response, micro_batches, head))
    if context.role == "actor":
        items.append(export_item(shape, b, compute, tp, context.weight_bucket_bytes))
    return MemoryEstimate(tuple(items), tuple(notes))


def activation_item(shape: ModelShape, engine: MegatronEngineConfig, call: str, b: int, compute: str, rows: int, sequence: int,
                    response: int, micro_batches: int, head: str) -> MemoryItem:
    h, i, vocab = shape.hidden_size, shape.active_intermediate(), shape.vocab_size
    tp, pp, cp = engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.context_parallel_size
    vpp = engine.virtual_pipeline_parallel_size or 1
    chunked = head == "lm" and rows * response * (vocab // tp) * 4 > KEEP_FLOAT32_BYTES  # the engine decides on the whole rows
    if cp > 1:  # this rank's positions of the padded rows; its queries meet every key (rlplat_engine_megatron.context_parallel)
        sequence = -(-sequence // (2 * cp)) * 2 * cp
        local, response = sequence // cp, busiest_response_share(sequence, response, cp)
    else:
        local = sequence
    tokens, response_tokens = rows * local, rows * response
    span = f"{local} of {sequence} tokens (CP {cp})" if cp > 1 else f"{sequence} tokens"
    scores = rows * (shape.num_heads // tp) * local * sequence * b  # megatron's global buffer, then the scores themselves
    gathered = gathered_key_value_bytes(shape, tp, cp, rows, sequence, engine.recompute_granularity, b)
    if chunked:
        # the chunked output layer (vocab_parallel.ChunkedOutput): the final hidden states, and one chunk's
        # logits with their float32 scaled, shifted and exponentiated copies, never the whole sequence's
        chunk = min(engine.logprob_chunk_size, response_tokens)
        logits = tokens * h * b + chunk * (vocab // tp) * (b + 12)
    elif head == "lm":
        full = tokens * (vocab // tp) * b
        picked = response_tokens * (vocab // tp) * (b + 12)
        logits = full + max(full, picked)
    else:
        logits = tokens * 4
    if call == "forward":
        transient = tokens * b * (2 * h + 4 * i // tp) + 2 * scores + (rows * sequence * 2 * shape.q_size // tp * b if cp > 1 else 0)
        return MemoryItem("forward activations", transient + logits, ("forward",),
                          f"{rows} rows x {span} per micro-batch, largest layer transient and the logits (V/TP = "
                          f"{vocab // tp:,}) of the last stage, no gradients")
    per_layer = layer_activation_elements(shape, tp, sequence, engine.recompute_granularity, engine.expert_model_parallel_size) * b
    layers = shape.num_layers // pp
    held, divisor = in_flight(pp, vpp, micro_batches)
    layers_per_hold = layers // divisor
    if engine.recompute_granularity == "full":
        first = tokens * held * (layers_per_hold * b * h) + tokens * per_layer + gathered
        how = f"full recompute: {layers_per_hold} layer inputs ({b * h} B/token) per micro-batch + 1 layer recomputed ({per_layer:,} B/token)"
    else:
        first = held * layers_per_hold * (tokens * per_layer + gathered)
        how = f"{layers_per_hold} layers x {per_layer:,} B/token" + (" (selective recompute)" if engine.recompute_granularity else "")
    if pp > 1:
        first += tokens * held * h * b  # stage outputs kept until their backward (deallocate_pipeline_outputs off)
        last_layers = layers * b * h if engine.recompute_granularity == "full" else layers * per_layer
        if engine.recompute_granularity == "full":
            last_layers += per_layer
        last = tokens * last_layers + (1 if engine.recompute_granularity == "full" else layers) * gathered + tokens * 2 * h * b + logits
        where = f"first stage: {held} micro-batch(es) in flight" if first >= last else "last stage: 1 micro-batch in flight + logits"
        kept = max(first, last)
    else:
        kept = first + tokens * 2 * h * b + logits
        where = "1 micro-batch in flight + logits"
    output_gradient = (vocab // tp if head == "lm" else 1) * h * b
    return MemoryItem("activations", kept + scores + output_gradient, ("update",),
                      f"{rows} rows x {span} per micro-batch in {compute}, {how}; {where} (V/TP = {vocab // tp:,}); "
                      "the output layer's weight gradient")


def export_item(shape: ModelShape, b: int, compute: str, tp: int, bucket_bytes: int) -> MemoryItem:
    h = shape.hidden_size
    largest = max(shape.vocab_size * h, 2 * shape.active_intermediate() * h, (shape.q_size + 2 * shape.kv_size) * h)
    total = shape.parameters("lm") * b
    bucket = min(max(bucket_bytes, largest * b), total)
    return MemoryItem("weight-sync bucket", bucket + 3 * largest * b, ("export",),
                      f"full {compute} tensors gathered one parameter at a time over TP {tp} and the pipeline: a bucket "
                      f"({human_bytes(bucket_bytes)}) + the largest parameter ({largest:,}) as shards, merged and converted")
