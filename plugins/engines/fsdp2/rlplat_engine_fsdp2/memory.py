"""The fsdp2 engine's memory on one device, predicted from its config and the model's ``config.json``
(:meth:`FSDP2Engine.estimate_memory`, read by ``rlplat plan``). Imports no torch: the registration names
:func:`estimate` (``metadata["estimate_memory"]``), so the plan reads it without importing the engine.

What one process holds, as :mod:`rlplat_engine_fsdp2.engine` allocates it:

* **parameters**: float32 master weights, sharded evenly over the processes (FSDP2's ``fully_shard``;
  one process computing and reducing in float32 trains the plain module, all of it; with
  ``data_parallel: replicate`` every process holds all of it, and of its gradients and optimizer state,
  plus one flat all-reduce bucket during the update).
* **gradients** (actor, critic): float32, sharded like the parameters; ``zero_grad(set_to_none=True)``
  runs at the start of each optimizer step, so they stay allocated between updates. With one micro-batch
  per optimizer step the update never holds them with every activation (freed before its forward, made as
  backward frees the activations): its activations are counted less the gradients, so the update's total
  is the larger of the two; with several, later micro-batches run with them, and both count.
* **optimizer states**: AdamW's two float32 moments of every trainable parameter, sharded; allocated at
  the first step and kept.
* **gathered parameters**: FSDP2 all-gathers a layer in the compute dtype for its forward and backward;
  the root group (embeddings, final norm, head) stays gathered from the forward to the backward, and
  the next layer is prefetched: root + two layers. Backward's peak is at its start, where the output
  layer's unsharded gradient (the head, or the tied embedding) joins every activation; a layer's
  gradient comes as its activations go.
* **activations** (update): per token of a micro-batch and per decoder layer, what autograd keeps of a
  Llama-style layer: the layer input and the residual (``2h``), the query, key and value after RoPE,
  the attention output and the output projection's input (``3q + 2kv``), the MLP's gate, activation,
  up and product (``4i``), all in the compute dtype, plus two RMSNorms that keep a float32 copy
  (``4h`` bytes) below float32 and two compute-dtype tensors each. With activation checkpointing each
  layer keeps only its input, and one layer at a time is recomputed. The head keeps the response
  positions' logits in the compute dtype and their float32 log-softmax input, and backward holds
  their gradients: ``(2 b + 8) V`` bytes per response token.
* **forward** (log-probs, values, scores; no gradients): the largest transient of a layer (the MLP's
  three ``i``-wide tensors and the residual) and the logits of the micro-batch.
* **export** (the weight sync): ``named_weights`` gathers full float32 tensors one bucket at a time.
* **Ulysses sequence parallelism** (``ulysses_sequence_parallel_size`` ``sp``): a data-parallel group of ``sp``
  processes shares its rows (``sp`` times a process's share of the sequences), each process holding ``1/sp`` of
  a micro-batch's tokens; the all-to-alls give attention the whole sequence for ``1/sp`` of the heads, the same
  bytes per token (key and value heads counted as repeated where they do not divide by ``sp``). A process's
  response positions, whose logits it computes, are at most its tokens. Parameters stay sharded over every
  process. A layout that does not divide (the processes or the heads by ``sp``) is refused.

On CPU ``param_offload`` and ``optimizer_offload`` move nothing (the engine's rule); on a GPU they take
the parameters off the device between calls and the optimizer states off it outside the step.
Sequences are taken at their full length (``data.max_prompt_length + rollout.response_length``), the
worst case a packed micro-batch can reach.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import dataclasses

from rlplat.contracts.memory import MemoryContext, MemoryEstimate, MemoryItem, ModelShape

from rlplat.kits.memory import dtype_bytes, human_bytes
from rlplat_engine_fsdp2.config import REDUCE_BUCKET_BYTES, read_engine_config

#: modeling.KEEP_FLOAT32_BYTES: logits up to this size are kept whole for backward, not chunked.
KEEP_FLOAT32_BYTES = 16 << 20
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_parameters(shape: ModelShape, rank: int, targets: Any) -> int:
    """Adapter parameters: ``rank x (in + out)`` per targeted linear of every layer."""
    h, q, kv, i = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
             "up_proj": (h, i), "down_proj": (i, h)}
    names = [targets] if isinstance(targets, str) else list(targets or ["all-linear"])
    chosen = ALL_LINEAR if "all-linear" in names else [name for name in ALL_LINEAR if name in names]
    return shape.num_layers * sum(rank * sum(sizes[name]) for name in chosen)


def layer_activation_bytes(shape: ModelShape, compute_bytes: int, sparse: bool = False) -> int:
    """Bytes autograd keeps per token for one decoder layer (see the module docstring); a ``sparse`` (MoE)
    layer's MLP is its k experts' and the shared expert's, plus what dispatching keeps: each of the token's k
    copies gathered in expert order and each expert's output before its routing weight (``2 k h``), and the
    router's logits and float32 softmax (``E x (b + 4)``)."""
    b, h = compute_bytes, shape.hidden_size
    norm = 2 * b * h + (4 * h if b != 4 else 0)
    if sparse:
        k = max(shape.experts_per_token, 1)
        mlp = b * (4 * shape.active_intermediate() + 2 * k * h) + shape.num_experts * (b + 4)
    else:
        mlp = b * 4 * shape.intermediate_size
    return b * (2 * h + 3 * shape.q_size + 2 * shape.kv_size) + mlp + 2 * norm


def estimate(config: Any, model_config: Mapping[str, Any], context: MemoryContext) -> MemoryEstimate:
    """The items of one process of an fsdp2 engine in ``context.role`` (see the module docstring)."""
    engine = read_engine_config(config)
    shape = ModelShape.from_config(model_config, f"{context.role}: config.json")
    sp = engine.ulysses_sequence_parallel_size
    world = max(context.processes, 1)
    problems = sequence_parallel_problems(sp, world, shape)
    if problems:
        key = {"actor": "actor", "reference": "actor", "critic": "critic"}.get(context.role, context.role)
        raise ValueError(f"fsdp2 engine: {key}.engine_config.ulysses_sequence_parallel_size={sp} on the role's {world} "
                         "process(es): " + "; ".join(problems))
    gpu = context.device == "cuda"
    compute = engine.dtype if engine.dtype != "auto" else ("bfloat16" if gpu else "float32")
    b = dtype_bytes(compute)
    head = "score" if engine.reward_model else ("value" if engine.value_model else "lm")
    parameters = shape.parameters(head)
    low_precision = (compute, engine.reduce_dtype) != ("float32", "float32")
    copies_fit = not engine.lora and not (gpu and engine.param_offload)
    sharded = engine.data_parallel == "shard" and (world > 1 or engine.shard_one_rank or (low_precision and not copies_fit))
    # one rank computing in bf16 / fp16 without FSDP2: a compute-dtype copy of every weight during each call
    copies = not sharded and low_precision
    shards = world if sharded else 1
    trains = context.role in ("actor", "critic")
    lora = engine.lora if context.role in ("actor", "reference") else None
    adapter = lora_parameters(shape, int(lora["rank"]), lora.get("target_modules")) if lora else 0
    trainable = adapter if lora else parameters
    split = f" / {shards} shards (FSDP)" if shards > 1 else ""
    offloads_parameters = gpu and engine.param_offload
    offloads_optimizer = gpu and engine.optimizer_offload
    calls = ("forward", "update", "export") if trains else ("forward",)
    on_device = calls if offloads_parameters else ("resident",)
    items = [MemoryItem("parameters", math.ceil((parameters + adapter) * 4 / shards), on_device,
                        f"{parameters + adapter:,} x 4 B (float32 master weights){split}"
                        + (", offloaded between calls" if offloads_parameters else "")
                        + (f"; {shape.expert_parameters():,} of them the experts and routers of {shape.moe_layers} MoE "
                           f"layers ({shape.num_experts} experts, {shape.experts_per_token} per token), sharded with the "
                           "rest (no expert parallelism)" if shape.moe_layers else ""))]
    notes = []
    if not gpu and (engine.param_offload or engine.optimizer_offload):
        notes.append("param_offload and optimizer_offload move nothing on CPU")
    if trains:
        items.append(MemoryItem("gradients", math.ceil(trainable * 4 / shards), ("resident",),
                                f"{trainable:,} trainable x 4 B (float32){split}, kept between updates"))
        items.append(MemoryItem("optimizer states", math.ceil(trainable * 8 / shards),
                                ("update",) if offloads_optimizer else ("resident",),
                                f"AdamW: 2 x {trainable:,} x 4 B (float32){split}"
                                + (", offloaded outside the step" if offloads_optimizer else "")))
    if sharded:
        root = shape.embedding_parameters() + shape.hidden_size + shape.head_parameters(head)
        layer = shape.layer_parameters()
        items.append(MemoryItem("gathered parameters", (root + 2 * layer) * b, tuple(call for call in calls if call != "export"),
                                f"FSDP all-gather in {compute}: root group ({root:,}) + 2 layers ({layer:,} each)"))
        if trains:
            output = shape.head_parameters(head) or shape.embedding_parameters()
            items.append(MemoryItem("unsharded gradients", output * b, ("update",),
                                    f"the output layer's ({output:,}) in {compute}, made first in backward, while every "
                                    "activation is still held"))
    if copies:
        items.append(MemoryItem("compute copies", (parameters + adapter) * b, tuple(call for call in calls if call != "export"),
                                f"{parameters + adapter:,} x {b} B: every weight cast to {compute} for the call (one rank, no FSDP2)"))
        if trains:
            items.append(MemoryItem("compute-dtype gradients", shape.layer_parameters() * b + (shape.head_parameters(head) or shape.embedding_parameters()) * b,
                                    ("update",), f"a layer's and the output layer's gradients in {compute} before they are "
                                    "added to the float32 ones"))
    sequence, response = context.sequence_length, context.response_length
    groups = world // sp  # data-parallel groups: each sp processes share their rows
    per_process = max(context.sequences_per_process, 1) * sp
    attention_shape = dataclasses.replace(shape, num_kv_heads=shape.num_kv_heads * (sp // math.gcd(shape.num_kv_heads, sp)))
    for call, rows_key in (("update", "micro_batch_size_per_gpu"), ("forward", "forward_micro_batch_size_per_gpu")):
        if call == "update" and not trains:
            continue
        rows = getattr(engine, rows_key) or engine.micro_batch_size_per_gpu
        if call == "update" and engine.ppo_mini_batch_size:
            rows = min(rows, max(engine.ppo_mini_batch_size // groups, 1))
        rows = min(rows, per_process)
        tokens = rows * sequence
        if engine.use_dynamic_bsz:
            tokens = min(max(engine.max_token_len_per_gpu * sp, sequence), per_process * sequence)
            rows = max(tokens // sequence, 1)
        response_tokens = rows * response
        if sp > 1:  # this process's slice of the pack, and at most that many response positions
            tokens = -(-tokens // sp)
            response_tokens = min(response_tokens, tokens)
        item = activation_item(attention_shape if sp > 1 else shape, engine, call, b, tokens, response_tokens, head, compute,
                               sp)
        if call == "update" and micro_batches_per_step(engine, groups, per_process, rows, sequence, sp) == 1:
            # the step's zero_grad frees the gradients before its one forward, and backward makes them as the
            # activations go: the update holds the larger of the two, not their sum
            gradients = math.ceil(trainable * 4 / shards)
            item = MemoryItem(item.name, max(item.bytes - gradients, 0), item.calls,
                              f"{item.detail}; less the gradients ({human_bytes(gradients)}), freed as the step starts and "
                              "made as these go (one micro-batch per optimizer step)")
        items.append(item)
    if trains and not sharded and world > 1:
        items.append(MemoryItem("all-reduce bucket", min(trainable * 4, REDUCE_BUCKET_BYTES), ("update",),
                                f"data_parallel replicate: the gradients flattened into buckets of at most "
                                f"{human_bytes(REDUCE_BUCKET_BYTES)} for their all-reduce"))
    if context.role == "actor" and sharded:
        bucket = min(context.weight_bucket_bytes, parameters * 4)
        items.append(MemoryItem("weight-sync bucket", bucket, ("export",),
                                f"full float32 tensors gathered one bucket ({human_bytes(context.weight_bucket_bytes)}) at a time"))
    return MemoryEstimate(tuple(items), tuple(notes))


def sequence_parallel_problems(sp: int, world: int, shape: ModelShape) -> list[str]:
    """What keeps ``sp`` processes per Ulysses group from fitting ``world`` processes and the model's heads
    (``ulysses.check_heads``' and ``ulysses.new_groups``' rules)."""
    problems = []
    if sp > 1:
        if world % sp:
            problems.append(f"it does not divide the {world} processes")
        if shape.num_heads % sp:
            problems.append(f"it does not divide the model's {shape.num_heads} attention heads")
        if shape.num_kv_heads % sp and sp % shape.num_kv_heads:
            problems.append(f"the model's {shape.num_kv_heads} key/value heads neither divide by it nor divide it")
    return problems


def micro_batches_per_step(engine: Any, groups: int, per_process: int, rows: int, sequence: int, sp: int = 1) -> int:
    """Micro-batches of one optimizer step on one process: its rows of a mini-batch (over ``groups``
    data-parallel groups) over the rows (or, with ``use_dynamic_bsz``, the tokens) of a micro-batch."""
    step_rows = min(max(engine.ppo_mini_batch_size // groups, 1), per_process) if engine.ppo_mini_batch_size else per_process
    if engine.use_dynamic_bsz:
        return max(math.ceil(step_rows * sequence / max(engine.max_token_len_per_gpu * sp, sequence)), 1)
    return max(math.ceil(step_rows / max(rows, 1)), 1)


def activation_item(shape: ModelShape, engine: Any, call: str, b: int, tokens: int, response_tokens: int, head: str,
                    compute: str, sp: int = 1) -> MemoryItem:
    h, layers, vocab = shape.hidden_size, shape.num_layers, shape.vocab_size
    if chunked_head(response_tokens, vocab, head):
        # the chunked output layer (modeling.ChunkedHead, FusedHeadScores): a chunk's float32 logits and, beside
        # them, their exponentials (forward) or their gradient being formed (backward); never the whole logits
        chunk = min(engine.logprob_chunk_size, response_tokens)
        logits = 2 * chunk * min(engine.logprob_vocab_chunk_size or vocab, vocab) * 4
    elif head == "lm":
        logits_per_token = (2 * b + 8) if call == "update" else (b + 4)
        logits = response_tokens * vocab * b + response_tokens * vocab * (logits_per_token - b)
    else:
        logits = tokens * 4
    if call == "forward":
        mlp = 3 * shape.intermediate_size
        if shape.moe_layers:  # the experts' transients and the k dispatched copies; a dense layer's where wider
            sparse_mlp = 3 * shape.active_intermediate() + 2 * max(shape.experts_per_token, 1) * h
            mlp = sparse_mlp if shape.moe_layers == layers else max(sparse_mlp, mlp)
        layer = tokens * b * (2 * h + mlp)
        # the chunked output layer runs after the last layer's transients are gone: the larger of the two
        held = max(layer, logits) if chunked_head(response_tokens, vocab, head) else layer + logits
        where = f" (1/{sp} of a micro-batch's pack: Ulysses)" if sp > 1 else " per micro-batch"
        return MemoryItem("forward activations", held, ("forward",),
                          f"{tokens:,} tokens{where}, largest layer transient + logits of {response_tokens:,} response tokens "
                          f"({logits_how(engine, response_tokens, vocab)}), no gradients")
    sparse, dense = shape.moe_layers, layers - shape.moe_layers
    per_layer = layer_activation_bytes(shape, b, sparse=sparse > 0)  # the largest layer (recomputation holds one)
    all_layers = sparse * per_layer + dense * layer_activation_bytes(shape, b) if sparse else layers * per_layer
    final_norm = b * h + 2 * b * h + (4 * h if b != 4 else 0)
    if engine.enable_gradient_checkpointing:
        kept = tokens * (layers * b * h + per_layer)
        how = f"recomputation on: {layers} layer inputs ({b * h} B/token) + 1 layer recomputed ({per_layer:,} B/token)"
    else:
        kept = tokens * all_layers
        how = (f"{sparse} MoE layers x {per_layer:,} B/token + {dense} dense x {layer_activation_bytes(shape, b):,}" if sparse
               else f"{layers} layers x {per_layer:,} B/token")
    where = f" (1/{sp} of a micro-batch's pack: Ulysses)" if sp > 1 else " per micro-batch"
    return MemoryItem("activations", kept + tokens * final_norm + logits, ("update",),
                      f"{tokens:,} tokens{where} in {compute}, {how}; logits of {response_tokens:,} response tokens "
                      f"({logits_how(engine, response_tokens, vocab)})")


def chunked_head(response_tokens: int, vocab: int, head: str) -> bool:
    """Whether the engine applies the output layer a chunk of tokens at a time (``modeling.chunks_the_head``)."""
    return head == "lm" and response_tokens * vocab * 4 > KEEP_FLOAT32_BYTES


def logits_how(engine: Any, response_tokens: int, vocab: int) -> str:
    if response_tokens * vocab * 4 <= KEEP_FLOAT32_BYTES:
        return "whole, kept"
    vocabulary = min(engine.logprob_vocab_chunk_size or vocab, vocab)
    return f"the output layer {min(engine.logprob_chunk_size, response_tokens):,} tokens x {vocabulary:,} vocabulary entries at a time"
