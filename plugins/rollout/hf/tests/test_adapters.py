"""LoRA adapters in the hf rollout: after ``load_adapter`` it samples as peft's own model with that adapter
does, the next adapter replaces the previous one, full weights loaded later are the new base, and an
adapter it cannot serve exactly is refused before anything changes."""

from __future__ import annotations

import peft  # the reference adapters (installed with the fsdp2 engine plugin, which trains them)
import pytest
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat.testing import left_padded_prompts
from rlplat.testing.rollouts import TINY_MODEL_PROMPTS as PROMPTS
from rlplat.testing.tiny_models import tiny_causal_lm
from rlplat_rollout_hf.adapters import AdapterError
from rlplat_rollout_hf.rollout import HFRollout

TOLERANCE = 1e-5
#: standard deviation of the random adapters (see :func:`peft_lora`)
ADAPTER_SCALE = 0.1
SAMPLING = SamplingParams(n=2, max_new_tokens=6, seed=4)


def peft_lora(model_seed: int = 0, adapter_seed: int = 1, **settings):
    """peft's LoRA on the tiny model of ``model_seed`` (the conftest's model for 0), lora_B random and
    nonzero (peft starts it at zero, which would leave the model unchanged).

    The adapter's entries are ``N(0, 0.1^2)``: it moves the sampled log-probs by about 0.6 nats, and the
    float32 forwards compared here (the rollout's merged weights, peft's separate adapter path) stay within
    1e-6 of a float64 forward (measured over 8 adapter seeds, with AVX-512 and with the default kernels).
    At ``N(0, 0.5^2)`` the merged weights were about 50x the model's own and those float32 errors reached
    5e-5 to 8e-5, depending on which kernels the CPU picks: a difference of 1.55e-5 on one Intel Xeon."""
    settings = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **settings}
    model = peft.get_peft_model(tiny_causal_lm(model_seed), peft.LoraConfig(**settings))
    generator = torch.Generator().manual_seed(adapter_seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * ADAPTER_SCALE)
    return model.eval()


def adapter_of(model, with_adapter_name: bool = False):
    """``(config dict, [(name, tensor)])`` as a training engine hands them over."""
    if with_adapter_name:  # peft's full state dict names them '...lora_A.default.weight'
        tensors = [(name, tensor) for name, tensor in model.state_dict().items() if ".lora_" in name]
    else:
        tensors = list(peft.get_peft_model_state_dict(model).items())
    return model.peft_config["default"].to_dict(), [(name, tensor.clone()) for name, tensor in tensors]


def sampled_log_probs(model, out) -> torch.Tensor:
    """Log-probs of ``out``'s responses under ``model`` (one full forward), 0 where masked."""
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits
    prompt_length = out.batch["prompts"].shape[1]
    log_probs = torch.log_softmax(logits[:, prompt_length - 1:-1].float(), -1)
    return log_probs.gather(-1, out.batch["responses"][..., None]).squeeze(-1) * out.batch["response_mask"]


def difference(engine, model) -> float:
    out = engine.generate(left_padded_prompts(PROMPTS, 0), SAMPLING)
    return float((sampled_log_probs(model, out) - out.batch["rollout_log_probs"]).abs().max())


def served_weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in engine.model.state_dict().items()}


@pytest.mark.parametrize("with_adapter_name", [False, True], ids=["peft-adapter-names", "with-default"])
def test_log_probs_after_load_adapter_equal_peft_models(engine, with_adapter_name):
    lora = peft_lora()
    engine.load_adapter(*adapter_of(lora, with_adapter_name))
    assert difference(engine, lora) < TOLERANCE
    with lora.disable_adapter():  # the adapter matters: the base model's log-probs are far off
        assert difference(engine, lora) > 0.1


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(engine):
    lora = peft_lora(r=4, lora_alpha=3, use_rslora=True)  # scale 3 / 2, not 3 / 4
    engine.load_adapter(*adapter_of(lora))
    assert difference(engine, lora) < TOLERANCE


def test_a_second_adapter_replaces_the_first(engine):
    engine.load_adapter(*adapter_of(peft_lora(adapter_seed=1)))
    second = peft_lora(adapter_seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    engine.load_adapter(*adapter_of(second))
    # modules the first adapter alone targeted (mlp, o_proj, k_proj) are back at their base weights
    assert difference(engine, second) < TOLERANCE


def test_full_weights_loaded_later_are_the_new_base(engine):
    lora = peft_lora(model_seed=0)
    engine.load_adapter(*adapter_of(lora))
    new_base = tiny_causal_lm(seed=1)
    engine.update_weights(new_base.state_dict().items())
    assert difference(engine, new_base) < TOLERANCE  # the adapter is off until loaded again
    lora_on_new_base = peft_lora(model_seed=1)
    engine.load_adapter(*adapter_of(lora_on_new_base))
    assert difference(engine, lora_on_new_base) < TOLERANCE


def test_bucketed_full_weights_refresh_the_base_of_every_module(engine):
    engine.load_adapter(*adapter_of(peft_lora()))
    new_base = list(tiny_causal_lm(seed=1).state_dict().items())
    for start in range(0, len(new_base), 5):  # the way a sync sends them: a bucket at a time
        engine.update_weights(new_base[start:start + 5])
    lora_on_new_base = peft_lora(model_seed=1, adapter_seed=3)
    engine.load_adapter(*adapter_of(lora_on_new_base))
    assert difference(engine, lora_on_new_base) < TOLERANCE


def test_bind_weights_refused_while_an_adapter_is_in_use(engine):
    own = [(name, tensor.detach().clone()) for name, tensor in engine.model.named_parameters()]
    engine.load_adapter(*adapter_of(peft_lora()))
    assert engine.bind_weights(own) is False
    engine.update_weights(own)
    assert engine.bind_weights(own) is True


def test_load_adapter_never_writes_into_bound_weights(engine):
    bound = [(name, tensor.detach().clone()) for name, tensor in engine.model.named_parameters()]
    before = [tensor.clone() for _, tensor in bound]
    assert engine.bind_weights(bound)
    lora = peft_lora()
    engine.load_adapter(*adapter_of(lora))
    assert all(torch.equal(tensor, original) for (_, tensor), original in zip(bound, before))
    assert difference(engine, lora) < TOLERANCE


def test_load_adapter_after_sleep_needs_full_weights_first(engine, model_dir):
    engine.load_adapter(*adapter_of(peft_lora()))
    engine.sleep()
    engine.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.load_adapter(*adapter_of(peft_lora()))
    engine.update_weights(tiny_causal_lm(seed=0).state_dict().items())
    lora = peft_lora(adapter_seed=5)
    engine.load_adapter(*adapter_of(lora))
    assert difference(engine, lora) < TOLERANCE


def renamed(tensors, old: str, new: str):
    return [(name.replace(old, new), tensor) for name, tensor in tensors]


def without(tensors, name_part: str):
    return [(name, tensor) for name, tensor in tensors if name_part not in name]


Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("change, message", [
    (lambda c, t: (c, renamed(t, "layers.1.", "layers.7.")),
     r"names module 'model\.layers\.7\.self_attn\.q_proj', which the model does not have \(did you mean 'model\.layers\.1\.self_attn\.q_proj'"),
    (lambda c, t: (c, [(n, x[:, :-1] if n == f"{Q_PROJ}.lora_A.weight" else x) for n, x in t]),
     r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' has shape \(4, 127\); rank r=4 .* needs \(4, 128\)"),
    (lambda c, t: (c, without(t, f"{Q_PROJ}.lora_B")), r"q_proj\.lora_A\.weight' has no lora_B partner"),
    (lambda c, t: ({**c, "r": 8}, t), r"lora_A\.weight' has shape \(4, 128\); rank r=8"),
    (lambda c, t: ({**c, "use_dora": True}, t), r"use_dora \(DoRA"),
    (lambda c, t: ({**c, "bias": "all"}, t), r"bias='all'"),
    (lambda c, t: ({**c, "modules_to_save": ["lm_head"]}, t), r"modules_to_save"),
    (lambda c, t: ({**c, "rank_pattern": {"q_proj": 2}}, t), r"rank_pattern \(per-module ranks\)"),
    (lambda c, t: ({**c, "peft_type": "IA3"}, t), r"peft_type is 'IA3'"),
    (lambda c, t: (c, t + [("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 16))]),
     r"lora_embedding_A' is LoRA on an embedding layer"),
    (lambda c, t: (c, t + [(f"{Q_PROJ}.lora_magnitude_vector", torch.zeros(128))]), r"is DoRA \(use_dora\)"),
    (lambda c, t: (c, t + [(f"{Q_PROJ}.base_layer.weight", torch.zeros(128, 128))]), r"is not a LoRA weight"),
    (lambda c, t: (c, t + [(f"{Q_PROJ}.lora_A.other.weight", t[0][1])]), r"are both lora_A of module"),
    (lambda c, t: (c, []), r"got no adapter tensors"),
], ids=["unknown-module", "wrong-shape", "missing-lora_B", "rank-mismatch", "dora", "bias", "modules_to_save",
        "rank_pattern", "not-lora", "embedding-lora", "dora-tensor", "base-layer-tensor", "two-adapters", "empty"])
def test_an_adapter_it_cannot_serve_is_refused_and_changes_nothing(engine, change, message):
    config, tensors = change(*adapter_of(peft_lora()))
    before = served_weights(engine)
    with pytest.raises(AdapterError, match=message):
        engine.load_adapter(config, tensors)
    after = served_weights(engine)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_an_adapter_on_a_tied_weight_is_refused(engine):
    # the tiny model ties lm_head to the input embeddings: merging into one would change the other
    tensors = [("base_model.model.lm_head.lora_A.weight", torch.ones(4, 128)),
               ("base_model.model.lm_head.lora_B.weight", torch.ones(16, 4))]
    with pytest.raises(AdapterError, match=r"'lm_head' has its weight tied to \['model\.embed_tokens\.weight'\]"):
        engine.load_adapter({"r": 4, "lora_alpha": 8}, tensors)


def test_an_adapter_on_a_module_that_is_not_linear_is_refused(engine):
    tensors = [("base_model.model.model.norm.lora_A.weight", torch.ones(4, 128)),
               ("base_model.model.model.norm.lora_B.weight", torch.ones(128, 4))]
    with pytest.raises(AdapterError, match=r"'model\.norm' is a Qwen2RMSNorm; .* linear layers only"):
        engine.load_adapter({"r": 4, "lora_alpha": 8}, tensors)


def test_declares_adapter_support():
    assert HFRollout.supports_adapters is True
