"""The engine's typed config, ``FSDP2EngineConfig``, with verl's key names where verl has them.

It extends :class:`rlplat.contracts.engine.EngineBuildConfig` (the keys every engine receives from the
run config) with the engine's own, which users set under ``actor.engine_config`` / ``critic.engine_config``.
:func:`read_engine_config` reads it with core's one config reader (strict, typed); the checks of the keys
every engine config shares are core's (:func:`rlplat.kits.engine.engine_config_problems`), the rest are here.

:func:`read_engine_config` accepts the dataclass, a plain ``Mapping`` or an OmegaConf ``DictConfig``.
Unlike the algorithm plugin's readers it rejects keys it does not know: the node is the engine's own,
so an unknown key is a misspelling, and the error names the closest field. This module imports no
torch, so the registry can point at the class as a config schema cheaply.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from rlplat.config_node import read_config_node
from rlplat.contracts.engine import EngineBuildConfig
from rlplat.kits.engine import engine_config_problems

DTYPES = ("auto", "float32", "bfloat16", "float16")
OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
DATA_PARALLEL_MODES = ("shard", "replicate")
#: Packed attention kernels (``packed_attention``; :mod:`rlplat_engine_fsdp2.packing`).
PACKED_KERNELS = ("auto", "grouped", "varlen", "flex")
REDUCE_BUCKET_BYTES = 64 << 20
"""Most bytes one gradient all-reduce (``data_parallel: replicate``) or start-up broadcast carries."""


@dataclasses.dataclass
class FSDP2EngineConfig(EngineBuildConfig):
    """Everything :class:`rlplat_engine_fsdp2.engine.FSDP2Engine` reads. Give exactly one of
    ``model_path`` and ``model_config``."""

    model_path: Optional[str] = None
    """Local Hugging Face directory of the model (``config.json`` and weights); loaded with
    ``AutoModelForCausalLM`` (or ``AutoModelForTokenClassification`` for a value model)."""
    model_config: Optional[Dict[str, Any]] = None
    """A Hugging Face config as a dict with ``model_type`` (``{"model_type": "qwen2", "vocab_size": 16, ...}``):
    the model is built from it with fresh weights, under ``seed``."""
    tokenizer_path: Optional[str] = None
    """Directory of the tokenizer; defaults to ``model_path`` when that holds one. Only ``export_hf`` uses it."""
    value_model: bool = False
    """Build a critic: the transformer with a scalar value head (``AutoModelForTokenClassification``,
    one label, as verl does); ``forward`` then returns ``values`` instead of log-probs."""
    reward_model: bool = False
    """Build a reward model: ``AutoModelForSequenceClassification`` with one label (a causal-LM checkpoint
    gets a fresh score head, drawn under ``seed``); ``forward`` then returns ``rm_scores`` [B], the head's
    output at each row's last attended token, and needs no ``responses``."""
    trust_remote_code: bool = False
    """Passed to the Hugging Face ``Auto*`` loaders."""
    attn_implementation: str = "sdpa"
    """Attention kernel of the Hugging Face model (``sdpa``, ``eager``, ``flash_attention_2`` on GPU)."""
    seed: int = 1
    """Seeds model initialisation (the same on every rank) and the RNGs the engine owns."""
    dtype: str = "auto"
    """Parameter dtype during forward and backward (FSDP2 ``MixedPrecisionPolicy.param_dtype``):
    ``auto`` is bfloat16 on GPU and float32 on CPU. Master weights and optimizer state stay float32."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter (``MixedPrecisionPolicy.reduce_dtype``)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer_implementation: str = "fused"
    """AdamW's kernel (PyTorch's ``fused`` / ``foreach`` / for-loop): ``fused`` updates every parameter in
    one kernel per dtype and device (measured on CPU, the demo's model: 6x faster than ``for-loop`` over
    FSDP2's DTensors, 3x over plain tensors); its float32 rounding differs from the others' by a few ulps
    per step. ``foreach`` gives bit for bit what ``for-loop`` (PyTorch's default on CPU) gives, 3x faster
    over DTensors, 1.2x over plain tensors. The optimizer state is the same tensors with each, so a
    checkpoint resumes with another."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 (step ``s < warmup`` uses ``lr * s / warmup``, verl's rule)."""
    lr_scheduler_type: str = "constant"
    """After warm-up: ``constant``, or ``cosine`` decay to ``min_lr_ratio * lr`` at ``total_training_steps``."""
    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm to this value (None: no clipping; the norm is reported either way).
    A step whose gradient norm is not finite is skipped: no update, and the LR schedule and step count
    do not advance (Megatron's rule)."""
    ppo_mini_batch_size: Optional[int] = None
    """Rows of the *global* batch per optimizer step (each rank takes ``ppo_mini_batch_size / dp``, which
    must be whole); ``meta_info["ppo_mini_batch_size"]`` of a batch overrides it; None takes the whole
    batch as one step. A batch whose rows do not fill the last mini-batch (its row count may vary from
    call to call) gets a last, smaller step; one smaller than a mini-batch is one step."""
    forward_micro_batch_size_per_gpu: Optional[int] = None
    """Rows per micro-batch in ``forward`` (None: ``micro_batch_size_per_gpu``)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget (``max_token_len_per_gpu``) instead of a row count, with a
    balanced partition of the rows by their ``attention_mask`` token counts."""
    use_remove_padding: bool = True
    """Sequence packing: run each micro-batch as one row of only its valid tokens (``attention_mask == 1``),
    attention kept within each sequence, logits computed only where they predict a response token;
    outputs are scattered back to ``[B, R]``. The same log-probs, entropy, values and gradients as padded
    rows at every valid response position, without the compute spent on padding; at response positions
    that are padding the outputs are 0 (padded rows give whatever the model computes from padding).
    Pairs with ``use_dynamic_bsz``, whose token budget then bounds the pack's length. With ``sdpa`` or
    ``eager`` the model gets a packing attention function that calls the configured kernel for unpacked
    calls; ``flash_attention_2`` uses its own varlen path. A model that does not use Hugging Face's
    attention interface runs padded, with a warning. Measured on CPU (train_batch): 4x faster on a
    long-tail batch (bench/packing.py); on the demo's batch (256 rows of 7 + 4 tokens) as fast within
    noise with no padding, 5% faster with 4% padding, 15-20% faster with 17%."""
    packed_attention: str = "auto"
    """Attention of packed micro-batches (``use_remove_padding``) with ``sdpa`` or ``eager``: ``grouped`` gathers
    sequences of similar length into padded sub-batches, one ``scaled_dot_product_attention`` each (any device);
    ``varlen`` runs torch's flash-attention varlen kernel over the whole pack (``torch.nn.attention.varlen``: torch
    2.10 on, CUDA, bf16 / fp16 compute; no padding, one kernel a layer); ``flex`` runs flex attention with a
    document-causal block mask (compiled; CUDA only, as flex attention has no backward on CPU). ``auto``: ``varlen``
    where it runs, else ``grouped``. Sequence parallelism runs ``grouped``; ``flash_attention_2`` uses its own varlen
    path. The same attention to float rounding: flex's forward equals grouped's within 1e-5 in float32 on CPU
    (tests/test_packing.py); varlen and flex against grouped, forward and gradients, are gpu-marked tests."""
    logprob_chunk_size: int = 4096
    """Tokens (rows x positions) whose logits and float32 log-softmax are computed at once. Where a
    micro-batch's whole float32 logits would exceed 16 MiB, the model's output layer itself runs on the hidden
    states of that many tokens at a time (inside the model's forward), so the ``[batch, response, vocab]``
    logits never exist; with gradients each chunk is recomputed in backward (``rlplat_engine_fsdp2.modeling``)."""
    logprob_vocab_chunk_size: Optional[int] = None
    """Rows of the output layer's weight (vocabulary entries) taken at a time within a chunk of tokens, with
    a running log-sum-exp and the chunk's gradient formed in place: a step then holds about
    ``2 x logprob_chunk_size x logprob_vocab_chunk_size x 4`` bytes of logits (None: the whole vocabulary,
    ``2 x chunk x vocab x 4``). For an output layer that is a plain ``nn.Linear`` (not LoRA-wrapped) and
    calls without ``top_k``."""
    fused_head: bool = True
    """Where the output layer runs a chunk of tokens at a time (see ``logprob_chunk_size``) and is a plain ``nn.Linear``:
    compute each chunk's log-probs and entropy with the fused head (a running log-sum-exp over the vocabulary and its
    own backward, which recomputes the logits to form their gradient in place; nothing of the chunk's logits is kept).
    False: the layer's own forward and a log-softmax per chunk under activation checkpointing (recomputed in backward).
    The same values within float rounding (tested to 1e-5 in float32)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism (verl's key): groups of this many consecutive ranks share each micro-batch,
    each running a contiguous ``1/size`` of its pack's tokens, with an all-to-all over attention heads around
    every attention (:mod:`rlplat_engine_fsdp2.ulysses`); activations per rank shrink by the size. The batch
    splits over ``world / size`` data-parallel groups (the ranks of a group get the same rows, one answers).
    Needs ``use_remove_padding`` and a model packing supports; the size must divide the world size and the
    attention heads (key/value heads divide it or are divided by it). Parameters stay sharded over every rank."""
    enable_gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (activation checkpointing)."""
    param_offload: bool = False
    """GPU only: keep parameters in CPU memory between phases (moved in for each call, out after)."""
    optimizer_offload: bool = False
    """GPU only: keep optimizer state in CPU memory between optimizer steps."""
    shard_one_rank: bool = False
    """One rank trains without FSDP2 (its all-gather and reduce-scatter over one rank only copy, and every optimizer and
    clipping op would go through DTensor): in float32 the plain module (7% of the demo's update on CPU,
    bench/update_step.py), in bfloat16 / float16 the plain float32 module through compute-dtype copies of its weights
    made for each call, gradients accumulated in float32 (``data_parallel.ComputeCopies``; a whole bf16 copy of the
    weights during a call, 2 B a parameter; LoRA and parameter offload keep FSDP2, whose layer-by-layer gathers hold
    less). Either way the same steps as ``fully_shard`` bit for bit; measured at the GPU check's 24-layer structure on
    CPU (bench/host_overhead.py): in bf16 17% fewer aten operators a step, 41% less host time. True wraps it in
    ``fully_shard`` anyway.
    Checkpoints are the same DCP format either way and load at any world size."""
    data_parallel: str = "shard"
    """How the data-parallel ranks hold the model. ``shard``: FSDP2 (``fully_shard`` per decoder layer),
    parameters, gradients and AdamW state split over the ranks, gathered layer by layer. ``replicate``:
    every rank holds the whole model and its optimizer state (DDP's memory: 16 bytes a parameter on each
    rank), the gradients are all-reduced once per optimizer step in flat buckets and the optimizer runs
    on plain tensors; the same updates as ``shard`` to float32 rounding. For models whose state fits
    every rank many times over, where FSDP2's per-layer collectives and DTensor dispatch cost more than
    the arithmetic (the demo's 0.5M model on 2 CPU processes: bench/trl_vs_rlplat.py), and it lets a
    colocated rollout share each rank's weights instead of gathering them at every sync. float32
    compute and reduction only."""
    compile: bool = False
    """``torch.compile`` each decoder layer's forward (the attention of packed calls stays eager, outside the compiled
    graph): fewer kernel launches and host operators per step, the same numerics to float rounding. The first calls
    of each new shape compile (tens of seconds on a GPU, ~12 s on CPU); a packed micro-batch's length varies, so
    from the second length on the layers compile with dynamic shapes, once."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters of a layer after its forward (re-gathered in backward)."""
    gradient_sync_every_micro_batch: bool = True
    """Reduce-scatter gradients after every micro-batch's backward (least memory). False keeps unsharded
    gradients until the mini-batch's last micro-batch and reduces once: fewer collectives (faster over
    gloo or a slow network), a full gradient's memory on every rank. Same gradient either way."""

    def __post_init__(self) -> None:
        problems = engine_config_problems(self, DTYPES, counts=("logprob_chunk_size", "ulysses_sequence_parallel_size"),
                                          optional_counts=("forward_micro_batch_size_per_gpu", "logprob_vocab_chunk_size"))
        if self.value_model and self.reward_model:
            problems.append("value_model and reward_model are exclusive (a critic or a reward model)")
        if self.reduce_dtype not in DTYPES[1:]:
            problems.append(f"reduce_dtype {self.reduce_dtype!r} is not one of {list(DTYPES[1:])}")
        if self.optimizer_implementation not in OPTIMIZER_IMPLEMENTATIONS:
            problems.append(f"optimizer_implementation {self.optimizer_implementation!r} is not one of {list(OPTIMIZER_IMPLEMENTATIONS)}")
        if self.packed_attention not in PACKED_KERNELS:
            problems.append(f"packed_attention {self.packed_attention!r} is not one of {list(PACKED_KERNELS)}")
        elif self.packed_attention != "auto" and self.ulysses_sequence_parallel_size > 1 and self.packed_attention != "grouped":
            problems.append(f"packed_attention {self.packed_attention!r}: Ulysses sequence parallelism runs its packs' "
                            "attention grouped; set packed_attention: grouped (or auto)")
        if self.ulysses_sequence_parallel_size > 1 and not self.use_remove_padding:
            problems.append(f"ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} splits packed micro-batches: "
                            "it needs use_remove_padding=True")
        if self.data_parallel not in DATA_PARALLEL_MODES:
            problems.append(f"data_parallel must be one of {list(DATA_PARALLEL_MODES)}, got {self.data_parallel!r}")
        elif self.data_parallel == "replicate":
            if (self.dtype not in ("auto", "float32")) or self.reduce_dtype != "float32":
                problems.append(f"data_parallel 'replicate' computes and reduces in float32; got dtype={self.dtype!r}, "
                                f"reduce_dtype={self.reduce_dtype!r} (use data_parallel 'shard' for mixed precision)")
            if self.shard_one_rank:
                problems.append("shard_one_rank wraps the model in fully_shard; data_parallel 'replicate' never does")
        if self.lora is not None:
            problems += lora_problems(self)
        if self.moe is not None:
            from rlplat.config.moe import read_moe

            try:
                read_moe(self.moe, "moe")
            except (ValueError, TypeError) as error:
                problems.append(str(error))
        if problems:
            raise ValueError("invalid fsdp2 engine config: " + "; ".join(problems))


def lora_problems(config: FSDP2EngineConfig) -> list[str]:
    """What is wrong with ``lora`` (an ``actor.lora`` node, :class:`rlplat.lora.LoraConfig`) in ``config``."""
    from rlplat.lora import read_lora

    try:
        lora = read_lora(config.lora, "lora")
    except (ValueError, TypeError) as error:
        return [str(error)]
    if not lora.enabled:
        return ["lora is given with rank 0; leave it out (None) to train full weights"]
    if config.value_model or config.reward_model:
        return ["lora trains a policy's adapters: a value model or reward model cannot take it"]
    return []


def read_engine_config(config: Any) -> FSDP2EngineConfig:
    """``config`` (an :class:`FSDP2EngineConfig`, a Mapping or an OmegaConf DictConfig) -> the dataclass.

    Raises :class:`rlplat.config_node.ConfigError` naming an unknown key and the closest known one, a
    value of the wrong type, or an inconsistent setting.
    """
    if config is None:
        raise ValueError("the fsdp2 engine needs a config with model_path or model_config")
    return read_config_node(config, FSDP2EngineConfig, "fsdp2 engine config")
