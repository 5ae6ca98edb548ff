"""The megatron engine's typed config, ``MegatronEngineConfig``, set under ``actor.engine_config`` /
``critic.engine_config``. It extends :class:`rlplat.contracts.engine.EngineBuildConfig` with the
parallel layout (tensor, pipeline, virtual pipeline sizes; the data-parallel size follows from the world
size), the distributed optimizer, activation recompute and precision.

What can be checked without the model is checked here (values and choices; the keys every engine config
shares, by core's :func:`rlplat.kits.engine.engine_config_problems`); what needs the world size or
the model's shape (world size divisible by TP x PP, heads and query groups by TP, layers by PP x VPP, the
vocabulary by TP) is checked at load by the engine's memory estimate, which ``rlplat run`` computes before
any worker starts (:func:`rlplat_engine_megatron.memory.layout_problems`), and again by
:func:`check_layout` when the engine is built. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from rlplat.config_node import read_config_node
from rlplat.contracts.engine import EngineBuildConfig
from rlplat.kits.engine import engine_config_problems

DTYPES = ("auto", "float32", "bfloat16")
RECOMPUTE = (None, "full", "selective")


@dataclasses.dataclass
class MegatronEngineConfig(EngineBuildConfig):
    """Everything :class:`rlplat_engine_megatron.engine.MegatronEngine` reads. Give exactly one of
    ``model_path`` and ``model_config``."""

    model_path: Optional[str] = None
    """Local Hugging Face directory (``config.json`` and safetensors) of a Qwen2 or Llama-family causal
    LM; converted to megatron-core's GPT model by mbridge."""
    model_config: Optional[Dict[str, Any]] = None
    """A Hugging Face config as a dict with ``model_type`` (``qwen2`` or ``llama``): the model gets fresh
    weights drawn under ``seed`` by transformers (so the same seed gives the same weights as the fsdp2
    engine), then converted like a checkpoint."""
    tokenizer_path: Optional[str] = None
    """Directory of the tokenizer for ``export_hf``; defaults to ``model_path`` when that holds one."""
    seed: int = 1
    """Seeds weight initialisation (``model_config``, a value head) and megatron's RNG states."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per model replica (megatron's column/row-parallel linears and
    vocabulary-parallel embedding and output layer). Must divide the attention heads and query groups."""
    expert_model_parallel_size: int = 1
    """Ranks a mixture-of-experts model's routed experts are split over (expert parallelism; each rank holds
    ``experts / EP`` of every MoE layer, tokens reach them through megatron's token dispatcher: all-gather on
    CPU, all-to-all on GPU). Must divide the experts; the world size must be divisible by TP x EP x PP.
    1 for a dense model."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (decoder layers split evenly over them; 1F1B schedule). Must divide the layers."""
    context_parallel_size: int = 1
    """Ranks each sequence's tokens are split over (context parallelism, megatron's load-balanced layout of
    ``2 x CP`` chunks; :mod:`rlplat_engine_megatron.context_parallel`): every rank of a context-parallel group
    gets the same rows, runs its share of their positions, and all-gathers keys and values for attention, so
    activations and logits per rank shrink by about CP. The world size must be divisible by TP x CP x PP;
    ``max_token_len_per_gpu`` counts one rank's share."""
    virtual_pipeline_parallel_size: Optional[int] = None
    """Model chunks per pipeline stage (interleaved schedule); None for one. Needs
    ``pipeline_parallel_size`` > 1 and the layers divisible by stages x chunks."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state and float32 master weights over the data-parallel ranks (megatron's
    ``DistributedOptimizer``)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: None (keep activations), ``full`` (recompute each whole decoder layer in
    backward) or ``selective`` (recompute the core attention only)."""
    dtype: str = "auto"
    """Parameter and compute dtype: ``auto`` is bfloat16 on GPU and float32 on CPU. With bfloat16 the
    optimizer keeps float32 master weights. Log-probs, entropy and values are float32 either way."""
    eps: float = 1e-8
    """AdamW epsilon."""
    forward_micro_batch_size_per_gpu: Optional[int] = None
    """Rows per micro-batch in ``forward`` (None: ``micro_batch_size_per_gpu``)."""
    logprob_chunk_size: int = 4096
    """Tokens (rows x positions) whose logits and float32 vocabulary-parallel log-softmax are computed at once
    where a micro-batch's float32 logits of the response positions (``[rows, response, V/TP]``) would exceed 16
    MiB: the last stage's output layer then runs on the final hidden states that many tokens at a time, each
    chunk recomputed in backward, so the whole logits never exist (smaller logits are computed whole)."""
    optimizer_offload: bool = False
    """GPU only: keep the optimizer state in CPU memory between updates (megatron's hybrid CPU/GPU
    optimizer; needs ``use_distributed_optimizer``)."""

    def __post_init__(self) -> None:
        problems = engine_config_problems(
            self, DTYPES, counts=("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                                  "logprob_chunk_size"),
            optional_counts=("forward_micro_batch_size_per_gpu", "virtual_pipeline_parallel_size"),
        )
        if self.reward_model:
            problems.append("reward_model is not supported by the megatron engine (use the fsdp2 engine for a reward model)")
        if self.lora is not None:
            problems.append("lora is not supported by the megatron engine (use the fsdp2 engine for LoRA)")
        if self.moe is not None:
            from rlplat.config.moe import read_moe

            moe = read_moe(self.moe, "moe")
            if self.recompute_granularity == "full" and (moe.router_replay != "off" or moe.aux_loss_coef or moe.z_loss_coef):
                problems.append("recompute_granularity='full' with moe's router replay or router losses: megatron recomputes each "
                                "layer's routing in backward, outside the micro-batch's forward where they apply; use "
                                "recompute_granularity='selective' or None")
        if self.recompute_granularity not in RECOMPUTE:
            problems.append(f"recompute_granularity {self.recompute_granularity!r} is not one of {list(RECOMPUTE)}")
        if self.virtual_pipeline_parallel_size not in (None, 1) and self.pipeline_parallel_size < 2:
            problems.append("virtual_pipeline_parallel_size needs pipeline_parallel_size >= 2")
        if self.optimizer_offload and not self.use_distributed_optimizer:
            problems.append("optimizer_offload needs use_distributed_optimizer (megatron offloads the sharded optimizer)")
        if problems:
            raise ValueError("invalid megatron engine config: " + "; ".join(problems))


def read_engine_config(config: Any) -> MegatronEngineConfig:
    """``config`` (a :class:`MegatronEngineConfig`, a Mapping or an OmegaConf DictConfig) -> the dataclass;
    raises :class:`rlplat.config_node.ConfigError` naming an unknown key and the closest known one."""
    if config is None:
        raise ValueError("the megatron engine needs a config with model_path or model_config")
    return read_config_node(config, MegatronEngineConfig, "megatron engine config")


def check_layout(config: MegatronEngineConfig, world_size: int, hf_config: Any) -> int:
    """The data-parallel size of ``config`` on ``world_size`` ranks for the model ``hf_config`` describes;
    raises ``ValueError`` listing every size that does not fit."""
    from rlplat_engine_megatron.memory import layout_problems

    sizes = {"num_attention_heads": hf_config.num_attention_heads, "num_hidden_layers": hf_config.num_hidden_layers,
             "vocab_size": hf_config.vocab_size, "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None),
             "num_experts": getattr(hf_config, "num_experts", None), "num_local_experts": getattr(hf_config, "num_local_experts", None)}
    problems = layout_problems(config, world_size, sizes)
    if problems:
        raise ValueError("megatron engine layout: " + "; ".join(problems))
    return world_size // (config.tensor_parallel_size * config.context_parallel_size * config.pipeline_parallel_size)
