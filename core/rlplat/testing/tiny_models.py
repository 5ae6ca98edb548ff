"""Tiny models and a character tokenizer made locally, so tests run the whole loop on CPU offline.

The tokenizer is the arithmetic one of the built-in demo: 16 ids (``[PAD] [BOS] [EOS] [UNK] 0-9 + =``),
one token per character, BOS prepended, left padding. The model is a 2-layer Qwen2 of ~0.5M parameters
with tied embeddings; :func:`tiny_moe_config` and :func:`save_tiny_moe_model` give mixture-of-experts ones
(Qwen2-MoE, Qwen3-MoE, Mixtral).
"""

from __future__ import annotations

from typing import Any

ARITHMETIC_VOCAB = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", *"0123456789", "+", "="]


def arithmetic_tokenizer():
    """A ``PreTrainedTokenizerFast`` over :data:`ARITHMETIC_VOCAB` (pad 0, bos 1, eos 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(ARITHMETIC_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
        padding_side="left",
    )


def tiny_qwen2_config(**overrides: Any):
    """The demo's architecture: vocab 16, hidden 128, intermediate 512, 2 layers, 4 heads, tied embeddings."""
    from transformers import Qwen2Config

    settings = dict(
        vocab_size=len(ARITHMETIC_VOCAB), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    settings.update(overrides)
    return Qwen2Config(**settings)


def tiny_causal_lm(seed: int = 0, **overrides: Any):
    """A randomly initialised tiny Qwen2 causal LM (deterministic under ``seed``), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_qwen2_config(**overrides), attn_implementation="eager")
    return model.eval()


def save_tiny_model(directory, seed: int = 0) -> str:
    """Write a tiny model and the arithmetic tokenizer to ``directory`` (a local HF directory)."""
    model = tiny_causal_lm(seed)
    model.save_pretrained(directory)
    arithmetic_tokenizer().save_pretrained(directory)
    return str(directory)


#: Mixture-of-experts architectures :func:`tiny_moe_config` builds (Hugging Face ``model_type``).
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")


def tiny_moe_config(model_type: str = "qwen2_moe", **overrides: Any) -> dict[str, Any]:
    """A tiny mixture-of-experts causal LM's config as a dict with ``model_type`` (an engine's or rollout's
    ``model_config``): the arithmetic vocabulary, hidden 64, 2 layers, 8 experts with 2 per token, every
    layer sparse (Qwen2-MoE with its shared expert)."""
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: one of {', '.join(MOE_MODEL_TYPES)}")
    settings: dict[str, Any] = dict(
        model_type=model_type, vocab_size=len(ARITHMETIC_VOCAB), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
    )
    if model_type == "mixtral":
        settings.update(num_local_experts=8, intermediate_size=64)
    else:
        settings.update(num_experts=8, moe_intermediate_size=64, intermediate_size=128, norm_topk_prob=model_type == "qwen3_moe",
                        decoder_sparse_step=1, mlp_only_layers=[])
        if model_type == "qwen2_moe":
            settings.update(shared_expert_intermediate_size=64)
        else:
            settings.update(head_dim=16)
    settings.update(overrides)
    return settings


def save_tiny_moe_model(directory, model_type: str = "qwen2_moe", seed: int = 0, **overrides: Any) -> str:
    """Write a tiny MoE model (:func:`tiny_moe_config`) and the arithmetic tokenizer to ``directory``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = tiny_moe_config(model_type, **overrides)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    arithmetic_tokenizer().save_pretrained(directory)
    return str(directory)
