"""The hf rollout on a tiny Qwen2 built locally: the conformance suite plus its own guarantees."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat.testing import RolloutEngineConformance, TinyModelRolloutFixtures, left_padded_prompts
from rlplat.testing.rollouts import TINY_MODEL_PROMPTS as PROMPTS
from rlplat_rollout_hf.rollout import HFRollout
from rlplat_rollout_hf.sampling import choose, filtered_logits


class TestHFRolloutConformance(TinyModelRolloutFixtures, RolloutEngineConformance):
    @pytest.fixture
    def rollout(self, engine):
        return engine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_equal_a_full_forward_of_the_same_tokens(engine, temperature):
    out = engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6, temperature=temperature, seed=4))
    with torch.no_grad():
        logits = engine.model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                              position_ids=out.batch["position_ids"]).logits
    prompt_length = out.batch["prompts"].shape[1]
    expected = torch.log_softmax(logits[:, prompt_length - 1 : -1].float() / temperature, -1)
    expected = expected.gather(-1, out.batch["responses"][..., None]).squeeze(-1) * out.batch["response_mask"]
    assert (expected - out.batch["rollout_log_probs"]).abs().max() < 1e-5


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: the nucleus for p = 0.8 is the first two tokens (0.5 + 0.3 >= 0.8)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filtered_logits(logits, SamplingParams(top_p=0.8)))
    assert kept.tolist() == [[True, True, False, False]]


def test_log_probs_are_under_the_filtered_distribution():
    # top_k = 2 on probabilities 0.5, 0.3, 0.2: renormalised, token 0 has 0.5 / 0.8 = 0.625
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    generator = torch.Generator().manual_seed(0)
    tokens, log_probs = choose(logits, SamplingParams(top_k=2), generator)
    expected = {0: 0.625, 1: 0.375}[tokens.item()]
    assert log_probs.exp().item() == pytest.approx(expected, abs=1e-6)


def test_sleep_releases_all_parameter_storage_and_wake_up_requires_fresh_weights(engine, model_dir):
    held = engine.parameter_bytes()
    assert held > 500_000 * 4  # ~0.5M float32 parameters
    old = [weakref.ref(parameter) for parameter in engine.model.parameters()]
    engine.sleep()
    assert engine.parameter_bytes() == 0
    gc.collect()
    # nothing of the rollout's keeps the old tensors (a name map did, so sleep freed nothing on CUDA)
    assert [ref for ref in old if ref() is not None] == []
    engine.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams())
    from transformers import AutoModelForCausalLM

    engine.update_weights(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())
    assert engine.parameter_bytes() == held


def test_update_weights_names_a_wrong_name_or_shape(engine):
    with pytest.raises(KeyError, match="model.not_a_layer.weight"):
        engine.update_weights([("model.not_a_layer.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(128,\), got \(3,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'rollout.config.temprature'. Did you mean 'rollout.config.temperature'|Known keys of rollout.config"):
        HFRollout({"model_path": str(tmp_path), "temprature": 1.0})
    with pytest.raises(FileNotFoundError, match="not a directory"):
        HFRollout({"model_path": str(tmp_path / "missing")})


def test_registered_as_hf():
    from rlplat import registry

    assert registry.get("rollout", "hf") is HFRollout
