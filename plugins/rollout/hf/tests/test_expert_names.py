"""The hf rollout takes a mixture-of-experts model's weights under their checkpoint names (one tensor per
expert and projection, as megatron's export and vLLM name them) as well as its own fused ones."""

from __future__ import annotations

import pytest
import torch

from rlplat.testing.tiny_models import MOE_MODEL_TYPES, tiny_moe_config
from rlplat_rollout_hf.experts import checkpoint_aliases, fused_to_checkpoint
from rlplat_rollout_hf.rollout import HFRollout


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_checkpoint_names_fill_the_fused_expert_tensors(tmp_path, model_type):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = tiny_moe_config(model_type)
    torch.manual_seed(1)
    source = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings), dtype=torch.float32)
    source.save_pretrained(tmp_path)
    checkpoint = load_file(str(tmp_path / "model.safetensors"))  # what transformers writes: the checkpoint names
    rollout = HFRollout({"model_config": tiny_moe_config(model_type), "dtype": "float32", "device": "cpu", "seed": 5})
    assert any(".experts.3." in name for name in checkpoint) and not any(".experts.3." in name for name in rollout.targets)
    rollout.update_weights(list(checkpoint.items()))
    for name, tensor in source.state_dict().items():
        assert torch.equal(rollout.targets[name].detach(), tensor), name
    # and back: the fused tensors split into the checkpoint's names and values
    split = fused_to_checkpoint(rollout.model, rollout.model.state_dict().items())
    split.pop("lm_head.weight")  # tied to the embedding: the checkpoint does not repeat it
    assert sorted(split) == sorted(checkpoint)
    assert all(torch.equal(split[name], checkpoint[name]) for name in checkpoint)


def test_a_wrong_shape_under_a_checkpoint_name_is_refused_naming_the_weight():
    rollout = HFRollout({"model_config": tiny_moe_config("qwen2_moe"), "dtype": "float32", "device": "cpu"})
    name = next(name for name in checkpoint_aliases(rollout.model) if name.endswith(".gate_proj.weight"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.gate_up_proj"):
        rollout.update_weights([(name, torch.zeros(3, 3))])


def test_a_dense_model_has_no_aliases():
    from rlplat.testing.tiny_models import tiny_causal_lm

    assert checkpoint_aliases(tiny_causal_lm()) == {}
