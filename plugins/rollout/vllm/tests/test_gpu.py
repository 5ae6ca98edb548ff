"""The ``vllm`` rollout on a GPU: rlplat's rollout conformance suite, in-process (hybrid) and through a
server it starts, on a tiny random-init Qwen2 saved locally. Run with ``make test-vllm-gpu``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

vllm = pytest.importorskip("vllm", reason="vllm is not installed here: `make test-vllm-gpu` runs these tests in the vllm environment")
if not torch.cuda.is_available():
    pytest.skip("vllm generation needs a CUDA GPU", allow_module_level=True)

from rlplat.contracts.rollout import SamplingParams  # noqa: E402
from rlplat.testing import RolloutEngineConformance, TinyModelRolloutFixtures, left_padded_prompts  # noqa: E402
from rlplat.testing.rollouts import TINY_MODEL_PROMPTS as PROMPTS  # noqa: E402

SETTINGS = {"dtype": "bfloat16", "gpu_memory_utilization": 0.2, "max_model_len": 128, "enforce_eager": True}
# model_dir, hybrid_engine and server_engine (built with SETTINGS): conftest.py


@pytest.fixture(scope="module")
def hf_weights(model_dir):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())


class Fixtures(TinyModelRolloutFixtures):
    #: bfloat16: a prefill (scoring) and decoding steps (sampling) round differently (as the transformers check's 5e-2)
    score_tolerance = 5e-2

    @pytest.fixture
    def named_weights(self, hf_weights):
        return hf_weights


class TestHybridConformance(Fixtures, RolloutEngineConformance):
    @pytest.fixture
    def rollout(self, hybrid_engine):
        return hybrid_engine


class TestServerConformance(Fixtures, RolloutEngineConformance):
    @pytest.fixture
    def rollout(self, server_engine):
        return server_engine


def test_hybrid_and_server_sample_the_same_tokens_greedily(hybrid_engine, server_engine):
    prompts = left_padded_prompts(PROMPTS, 0)
    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    assert torch.equal(hybrid_engine.generate(prompts, sampling).batch["responses"], server_engine.generate(prompts, sampling).batch["responses"])


def test_rollout_log_probs_match_a_transformers_forward_of_the_same_tokens(hybrid_engine, model_dir):
    from transformers import AutoModelForCausalLM

    out = hybrid_engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=4))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"].cuda(), attention_mask=out.batch["attention_mask"].cuda(),
                       position_ids=out.batch["position_ids"].cuda()).logits.float().cpu()
    prompt_length = out.batch["prompts"].shape[1]
    expected = torch.log_softmax(logits[:, prompt_length - 1 : -1] / 0.8, -1)
    expected = expected.gather(-1, out.batch["responses"][..., None]).squeeze(-1) * out.batch["response_mask"]
    # vLLM samples in bfloat16; the reference runs in float32
    assert (expected - out.batch["rollout_log_probs"]).abs().max() < 5e-2


def test_new_weights_change_the_samples_and_the_old_ones_bring_them_back(hybrid_engine, hf_weights):
    prompts, sampling = left_padded_prompts(PROMPTS, 0), SamplingParams(max_new_tokens=6, greedy=True)
    before = hybrid_engine.generate(prompts, sampling).batch["responses"]
    generator = torch.Generator().manual_seed(1)
    hybrid_engine.update_weights([(name, torch.randn(tensor.shape, generator=generator) * 0.5) for name, tensor in hf_weights])
    changed = hybrid_engine.generate(prompts, sampling).batch["responses"]
    hybrid_engine.update_weights(hf_weights)
    after = hybrid_engine.generate(prompts, sampling).batch["responses"]
    assert not torch.equal(before, changed) and torch.equal(before, after)


def test_sleep_frees_gpu_memory_and_the_staged_wake_up_takes_it_back_in_two_steps(hybrid_engine, hf_weights):
    torch.cuda.synchronize()
    awake = torch.cuda.mem_get_info()[0]
    hybrid_engine.sleep()
    asleep = torch.cuda.mem_get_info()[0]
    hybrid_engine.wake_up_weights()
    weights_only = torch.cuda.mem_get_info()[0]
    hybrid_engine.update_weights(hf_weights)
    hybrid_engine.wake_up_kv_cache()
    woken = torch.cuda.mem_get_info()[0]
    print(f"free GPU bytes: awake {awake}, asleep {asleep}, weights only {weights_only}, woken {woken}")
    assert asleep > awake and asleep >= weights_only > woken
