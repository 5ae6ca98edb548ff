"""Hugging Face <-> megatron-core: building the GPT model of a local HF checkpoint and naming its weights.

mbridge 0.15.1 (``mbridge.AutoBridge``) supplies the TransformerConfig of a Qwen2 or Llama checkpoint and
the weight mapping (fused ``linear_qkv`` / ``linear_fc1`` <-> ``q/k/v_proj`` / ``gate/up_proj``, splitting
and merging over tensor-parallel ranks). Adapted here (MEGATRON_NOTES.md):

* the model is built with megatron's *local* layer spec (``get_gpt_layer_local_spec``), not mbridge's
  Transformer Engine spec, which needs TE; on GPU with TE installed, TE's spec is used;
* the local spec keeps the pre-norms as modules of their own, so two mappings are added:
  ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight`` <-> HF ``input_layernorm`` /
  ``post_attention_layernorm``;
* mbridge's Qwen2 bridge rewrites its *class* mapping for tied embeddings; each bridge here gets its own
  copy, right for its checkpoint;
* transformers 5 keeps ``rope_theta`` in ``rope_parameters``; it is copied to where mbridge reads it (and
  Mixtral's ``head_dim=None`` is made the number it stands for);
* a mixture-of-experts model's experts are megatron's ``SequentialMLP`` (one local MLP per expert, no grouped
  GEMM), whose names :func:`expert_name` maps to mbridge's grouped ones with the expert made global;
* the config is made CPU-safe (CPU initialisation, fusions off, no sequence parallel, variable sequence
  lengths for pipeline p2p) and per-token loss accounting is switched on (the engine sums).

A value model (critic) replaces the last stage's output layer with :class:`ValueHead`, a scalar linear
head (weight and bias) replicated over tensor-parallel ranks, exported as HF's ``score`` of
``*ForTokenClassification``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

#: megatron-local names of the value head -> the HF names of ``*ForTokenClassification``.
VALUE_HEAD_NAMES = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` linear head standing in for GPTModel's output layer (same call signature:
    ``(hidden, weight=None, runtime_gather_output=None) -> (output, None)``)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **kwargs: Any):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def hf_config_of(config: Any) -> Any:
    """The Hugging Face config of the model ``config`` (a MegatronEngineConfig) describes."""
    from transformers import AutoConfig

    if config.model_path is not None:
        if not os.path.isfile(os.path.join(config.model_path, "config.json")):
            raise FileNotFoundError(
                f"model_path {config.model_path!r} is not a local Hugging Face model directory (no config.json there)"
            )
        hf_config = AutoConfig.from_pretrained(config.model_path)
    else:
        settings = dict(config.model_config)
        hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    if hf_config.model_type not in SUPPORTED:
        raise ValueError(
            f"the megatron engine converts {sorted(SUPPORTED)} checkpoints; {config.model_path or 'model_config'} "
            f"is a {hf_config.model_type!r} model"
        )
    if getattr(hf_config, "head_dim", None) is None:  # Mixtral's config holds head_dim=None; mbridge reads it as a number
        hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    if getattr(hf_config, "rope_theta", None) is None:
        parameters = getattr(hf_config, "rope_parameters", None) or {}
        hf_config.rope_theta = float(parameters.get("rope_theta", 10000.0))
    return hf_config


SUPPORTED = ("qwen2", "llama", "qwen2_moe", "qwen3_moe", "mixtral")


def materialise_model_config(config: Any, hf_config: Any, directory: str) -> str:
    """Write fresh weights for ``model_config`` (drawn by transformers under ``seed``, as the fsdp2 engine
    draws them) into ``directory`` as a HF checkpoint; returns the directory. Every rank writes its own copy:
    transformers' ``save_pretrained`` writes on rank 0 only once ``torch.distributed`` is initialised."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    state = model.state_dict()
    for name, target in (getattr(model, "all_tied_weights_keys", None) or {}).items():  # a tied copy is the tensor it ties to
        if name in state and target in state and state[name].data_ptr() == state[target].data_ptr():
            del state[name]
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    hf_config.to_json_file(os.path.join(directory, "config.json"))
    return directory


def make_bridge(hf_config: Any, dtype: torch.dtype, overrides: dict[str, Any]) -> Any:
    """An mbridge bridge for ``hf_config`` with the local-spec mappings and ``overrides`` on its
    TransformerConfig. megatron's parallel state must be initialised first."""
    from mbridge import AutoBridge

    bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    cls = type(bridge)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    direct = dict(cls._DIRECT_MAPPING)
    direct["output_layer.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    bridge._DIRECT_MAPPING = direct
    bridge._MLP_MAPPING = {
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        **cls._MLP_MAPPING,
    }
    bridge._OTHER_MAPPING = {
        **cls._OTHER_MAPPING,
        "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
    }
    bridge.set_extra_args(**overrides)
    return bridge


def layer_spec(config: Any, use_te: bool) -> Any:
    """The decoder layer's spec; a MoE model's experts are megatron's ``SequentialMLP`` of local MLPs (one
    module per expert, named ``mlp.experts.local_experts.<i>``) in both specs, as the engine sets
    ``moe_grouped_gemm`` off (:func:`expert_name` maps their names to mbridge's grouped ones)."""
    experts = config.num_moe_experts
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=config.qk_layernorm)


LOCAL_EXPERTS = ".mlp.experts.local_experts."


def expert_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A parameter name with its expert made global and in mbridge's grouped naming:
    ``...mlp.experts.local_experts.<i>.linear_fc1.weight`` of expert-parallel rank ``ep_rank`` (holding
    ``local_experts`` experts) -> ``...mlp.experts.linear_fc1.weight<ep_rank * local_experts + i>``; other
    names unchanged."""
    if LOCAL_EXPERTS not in name:
        return name
    prefix, rest = name.split(LOCAL_EXPERTS, 1)
    index, tail = rest.split(".", 1)
    module, kind = tail.rsplit(".", 1)
    return f"{prefix}.mlp.experts.{module}.{kind}{ep_rank * local_experts + int(index)}"


def is_expert(name: str) -> bool:
    """Whether ``name`` (local or mbridge's) is a routed expert's parameter (split over expert-parallel ranks)."""
    return LOCAL_EXPERTS in name or ".mlp.experts.linear_fc" in name


def build_chunks(bridge: Any, hf_config: Any, *, value_model: bool, use_te: bool, vpp: int,
                 context_parallel: bool = False) -> list[torch.nn.Module]:
    """The GPT model chunks of this pipeline rank (one per virtual stage), weights not yet loaded;
    ``context_parallel``: with :mod:`rlplat_engine_megatron.context_parallel`'s attention."""
    from rlplat_engine_megatron import context_parallel as cp

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = bridge.config
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_model
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=cp.use_in(layer_spec(config, use_te)) if context_parallel else layer_spec(config, use_te),
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=hf_config.rope_theta,
            vp_stage=vp_stage,
        )
        if value_model and post:
            model.output_layer = ValueHead(config.hidden_size, config.params_dtype)
        chunks.append(model)
    return chunks


def global_names(bridge: Any, chunk: torch.nn.Module, ep_rank: int = 0, ep_size: int = 1) -> dict[str, str]:
    """``{local megatron parameter name: its name in the whole model}`` of one model chunk: global layer
    numbers (pipeline and virtual stages) and global experts in mbridge's naming (:func:`expert_name`)."""
    local_to_global = bridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=False)
    experts = getattr(bridge.config, "num_moe_experts", None) or 0
    local_experts = experts // ep_size if experts else 0
    return {local: expert_name(name, ep_rank, local_experts) for local, name in local_to_global.items() if "_extra_state" not in local}


def hf_names_of(bridge: Any, chunk: torch.nn.Module, ep_rank: int = 0, ep_size: int = 1) -> dict[str, tuple[str, list[str]]]:
    """``{local megatron parameter name: (its global name, [HF names it holds])}`` of one model chunk
    (value head excluded)."""
    value_head = isinstance(getattr(chunk, "output_layer", None), ValueHead)
    return {
        local: (name, bridge._weight_name_mapping_mcore_to_hf(name))
        for local, name in global_names(bridge, chunk, ep_rank, ep_size).items()
        if not (value_head and local in VALUE_HEAD_NAMES)
    }


def load_hf_weights(bridge: Any, chunks: list[torch.nn.Module], path: str, *, tp_rank: int, tp_size: int, seed: int,
                    ep_rank: int = 0, ep_size: int = 1, etp_rank: int = 0, etp_size: int = 1) -> None:
    """Copy the HF checkpoint at ``path`` into ``chunks`` (each rank reads the tensors it holds, its experts
    among them, and takes its tensor-parallel slice: the expert-tensor-parallel one for an expert). A value
    head is read from ``score.*`` when the checkpoint has one, else drawn under ``seed`` (normal, std
    ``init_method_std``; bias 0)."""
    from mbridge.core.safetensor_io import SafeTensorIO

    reader = SafeTensorIO(path)
    available = checkpoint_keys(path)
    for chunk in chunks:
        mapping = hf_names_of(bridge, chunk, ep_rank, ep_size)
        wanted = sorted({name for _, names in mapping.values() for name in names})
        missing = [name for name in wanted if name not in available]
        if missing:
            raise ValueError(f"the checkpoint at {path} lacks {missing[:5]} (the megatron model needs them)")
        tensors = reader.load_some_hf_weight(wanted)
        state = chunk.state_dict()
        with torch.no_grad():
            for local, (name, names) in mapping.items():
                merged = bridge._weight_to_mcore_format(name, [tensors[hf_name] for hf_name in names])
                param = state[local]
                rank, size = (etp_rank, etp_size) if is_expert(name) else (tp_rank, tp_size)
                piece = bridge._weight_split_across_tp(name, merged, param, size)[rank]
                if piece.shape != param.shape:
                    raise ValueError(f"{names} from {path} has shape {tuple(piece.shape)} for {local} on this rank, expected {tuple(param.shape)}")
                param.copy_(piece.to(param.dtype))
            head = getattr(chunk, "output_layer", None)
            if isinstance(head, ValueHead):
                if "score.weight" in available:
                    scores = reader.load_some_hf_weight(["score.weight"] + (["score.bias"] if "score.bias" in available else []))
                    head.weight.copy_(scores["score.weight"])
                    if "score.bias" in scores:
                        head.bias.copy_(scores["score.bias"])
                else:
                    generator = torch.Generator().manual_seed(seed)
                    head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * bridge.config.init_method_std)
                    head.bias.zero_()


def checkpoint_keys(path: str) -> set[str]:
    """Names of every tensor in the safetensors files of ``path``."""
    import glob

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file; the megatron engine loads safetensors checkpoints")
    keys: set[str] = set()
    for name in files:
        with safe_open(name, framework="pt", device="cpu") as handle:
            keys.update(handle.keys())
    return keys


def write_hf(path: str, tensors: dict[str, torch.Tensor], hf_config: Any, value_model: bool, tokenizer_path: str | None) -> None:
    """A directory ``from_pretrained`` loads: safetensors, ``config.json`` (and the tokenizer)."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf_config = hf_config.__class__.from_dict(hf_config.to_dict())
    if value_model:
        hf_config.architectures = [hf_config.architectures[0].replace("ForCausalLM", "ForTokenClassification")] if hf_config.architectures else None
        hf_config.num_labels = 1
    hf_config.save_pretrained(path)
    if tokenizer_path is not None:
        for name in os.listdir(tokenizer_path):
            if name.startswith(("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template", "generation_config")):
                shutil.copy(os.path.join(tokenizer_path, name), os.path.join(path, name))
    with open(os.path.join(path, "rlplat_export.json"), "w") as handle:
        json.dump({"engine": "megatron", "value_model": value_model}, handle)
