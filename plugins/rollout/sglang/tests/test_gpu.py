"""The sglang rollout with a real SGLang engine on a tiny Qwen2 built locally: the conformance suite in
hybrid and in server mode, plus weight updates that must change (and restore) the samples.

Needs a CUDA GPU and sglang: ``make test-sglang-gpu`` (or ``make gpu-check-sglang``, which adds a GRPO run).
"""

from __future__ import annotations

import pytest
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat.testing import RolloutEngineConformance, TinyModelRolloutFixtures, left_padded_prompts
from rlplat.testing.rollouts import TINY_MODEL_PROMPTS as PROMPTS
from rlplat.testing.tiny_models import save_tiny_model, tiny_causal_lm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The tiny model's head size is 32, which the default FlashInfer kernels may not cover: Triton attention
# takes any head size. Deterministic inference makes SGLang honour per-request seeds.
ENGINE_SETTINGS = {
    "load_weights": True,
    "dtype": "bfloat16",
    "mem_fraction_static": 0.3,
    "context_length": 256,
    "enable_deterministic_inference": True,
    "engine_kwargs": {"attention_backend": "triton", "cuda_graph_max_bs_decode": 16},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="class")
def engine(request, model_dir):
    pytest.importorskip("sglang", reason="sglang is not installed in this environment")
    from rlplat_rollout_sglang.rollout import SGLangRollout

    rollout = SGLangRollout({"model_path": model_dir, "mode": request.cls.mode, **ENGINE_SETTINGS})
    yield rollout
    rollout.close()


def weights_of(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(tiny_causal_lm(seed).state_dict().items())


class SGLangConformance(TinyModelRolloutFixtures, RolloutEngineConformance):
    mode = "hybrid"

    @pytest.fixture
    def rollout(self, engine):
        return engine

    # SGLang reports log_softmax(logits / temperature), before top-k / top-p (see the README)
    log_probs_after_filters = False

    def test_other_weights_change_the_samples_and_the_old_ones_restore_them(self, rollout, prompts):
        sampling = SamplingParams(n=2, max_new_tokens=6, greedy=True)
        before = rollout.generate(prompts, sampling)
        rollout.update_weights(weights_of(1))
        changed = rollout.generate(prompts, sampling)
        rollout.update_weights(weights_of(0))
        restored = rollout.generate(prompts, sampling)
        assert not torch.equal(before.batch["rollout_log_probs"], changed.batch["rollout_log_probs"])
        assert torch.equal(before.batch["responses"], restored.batch["responses"])

    def test_a_staged_wake_up_refuses_generation_until_it_is_complete(self, rollout, prompts):
        rollout.sleep()
        rollout.wake_up_weights()
        with pytest.raises(RuntimeError, match="wake_up_kv_cache"):
            rollout.generate(prompts, SamplingParams())
        rollout.update_weights(weights_of(0))
        rollout.wake_up_kv_cache()
        assert len(rollout.generate(left_padded_prompts(PROMPTS[:1], 0), SamplingParams(max_new_tokens=2))) == 1


class TestHybridSGLangRollout(SGLangConformance):
    mode = "hybrid"


class TestServerSGLangRollout(SGLangConformance):
    mode = "server"
