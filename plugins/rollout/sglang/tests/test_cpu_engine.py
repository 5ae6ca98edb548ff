"""The ``sglang`` rollout on a real SGLang engine on CPUs (SGLang's CPU engine, pure-torch layers; ``make test``
runs these in ``.venv-sglang-cpu``): rlplat's rollout conformance suite in hybrid and server mode on the tiny
Qwen2 in float32, log-probs against a transformers forward, weight updates that change and restore what it
samples, updates it refuses before SGLang sees them, and the log-probs after every weight sync from the fsdp2
engine equal to the engine's own.

SGLang's CPU engine cannot honour seeds (its seeded sampler needs deterministic mode, which needs CUDA or XPU):
the rollout says so (``honours_seeds`` False) and the suite holds it to greedy reproducibility instead;
comparisons here are greedy, or of log-probs of whatever was sampled.

Tolerances: SGLang's CPU engine and transformers run the same float32 model with different kernels (SGLang's
``torch_native`` attention is per-sequence SDPA; its linear layers are torch's); their log-probs agree to about
4e-7 on this model (measured). The weight-sync tolerance is the sync probe's 1e-5 in float32; a stale or missing
tensor moves them by more than 1e-2.
"""

from __future__ import annotations


import pytest
import torch

from rlplat_rollout_sglang.platform import cpu_engine

pytest.importorskip("sglang", reason="sglang is not installed here: `make test` runs these tests in .venv-sglang-cpu")
if not cpu_engine():
    pytest.skip("the installed SGLang is a CUDA build: tests/test_gpu.py covers it (`make test-sglang-gpu`)", allow_module_level=True)

from rlplat.contracts.rollout import SamplingParams  # noqa: E402
from rlplat.testing import RolloutEngineConformance, TinyModelRolloutFixtures, left_padded_prompts  # noqa: E402
from rlplat.testing.engines import TokenMeanNLL  # noqa: E402
from rlplat.testing.rollouts import TINY_MODEL_PROMPTS as PROMPTS  # noqa: E402
from rlplat.testing.rollouts import concurrent_calls_difference, log_probs_after_syncs, trainer_weights, transformers_log_probs  # noqa: E402
from rlplat.testing.tiny_models import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.slow

SETTINGS = {"dtype": "float32", "cpu_kv_cache_gib": 0.05, "engine_kwargs": {"log_level": "error"}}
#: SGLang's CPU kernels vs transformers' on the same float32 weights (measured: up to 4e-7)
KERNEL_TOLERANCE = 1e-5
#: the sync probe's tolerance in float32
SYNC_TOLERANCE = 1e-5
GREEDY = SamplingParams(n=2, max_new_tokens=6, greedy=True)


def other_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The weights of another tiny model (the same initialisation, another seed): samples change."""
    return trainer_weights(tiny_causal_lm(seed=seed))


def difference_to(model, out, temperature: float = 1.0) -> float:
    return float((transformers_log_probs(model.eval(), out, temperature) - out.batch["rollout_log_probs"]).abs().max())


# model_dir, hybrid_engine and server_engine (built with SETTINGS): conftest.py


@pytest.fixture(params=["hybrid", "server"])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


class Fixtures(TinyModelRolloutFixtures):
    @pytest.fixture
    def named_weights(self):
        return trainer_weights(tiny_causal_lm(seed=0))


class TestHybridConformance(Fixtures, RolloutEngineConformance):
    log_probs_after_filters = False  # SGLang reports log-probs before top-k / top-p (README)

    @pytest.fixture
    def rollout(self, hybrid_engine):
        return hybrid_engine


class TestServerConformance(Fixtures, RolloutEngineConformance):
    log_probs_after_filters = False

    @pytest.fixture
    def rollout(self, server_engine):
        return server_engine


def test_it_runs_on_sglangs_cpu_engine_and_says_seeds_are_not_honoured(hybrid_engine, server_engine):
    import os

    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    for engine in (hybrid_engine, server_engine):
        assert engine.cpu and not engine.honours_seeds


def test_hybrid_and_server_sample_the_same_tokens_greedily(hybrid_engine, server_engine):
    prompts = left_padded_prompts(PROMPTS, 0)
    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    assert torch.equal(hybrid_engine.generate(prompts, sampling).batch["responses"], server_engine.generate(prompts, sampling).batch["responses"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_a_transformers_forward_of_the_same_tokens(engine, temperature):
    out = engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=4, max_new_tokens=6, temperature=temperature))
    assert difference_to(tiny_causal_lm(seed=0), out, temperature) < KERNEL_TOLERANCE


def test_the_samples_of_a_group_are_drawn_independently(engine):
    """8 samples of one prompt at temperature 1 (SGLang's own random stream, no seed): most differ."""
    out = engine.generate(left_padded_prompts(PROMPTS[:1], 0), SamplingParams(n=8, max_new_tokens=6))
    assert len({tuple(row) for row in out.batch["responses"].tolist()}) >= 6


def test_new_weights_change_the_samples_and_the_old_ones_bring_them_back(engine):
    prompts = left_padded_prompts(PROMPTS, 0)
    before = engine.generate(prompts, GREEDY)
    try:
        engine.update_weights(other_weights(seed=1))
        changed = engine.generate(prompts, GREEDY)
    finally:
        engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))
    after = engine.generate(prompts, GREEDY)
    assert not torch.equal(before.batch["rollout_log_probs"], changed.batch["rollout_log_probs"])
    assert difference_to(tiny_causal_lm(seed=1), changed) < KERNEL_TOLERANCE
    assert torch.equal(before.batch["responses"], after.batch["responses"])
    torch.testing.assert_close(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"], atol=KERNEL_TOLERANCE, rtol=0)


def test_a_tied_output_layer_sent_once_is_served_under_both_names(engine):
    """The trainer sends the tied embedding once; SGLang's model shares it with its output layer."""
    model = tiny_causal_lm(seed=2)
    try:
        engine.update_weights(trainer_weights(model))
        out = engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6))
        assert difference_to(model, out) < KERNEL_TOLERANCE
    finally:
        engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))


def test_bfloat16_tensors_load_into_the_float32_engine(engine):
    """A bf16 training engine's bucket into the float32 rollout: what it then samples is the bf16-rounded model's."""
    model = tiny_causal_lm(seed=3)
    rounded = [(name, tensor.to(torch.bfloat16)) for name, tensor in trainer_weights(model)]
    model.load_state_dict({name: tensor.float() for name, tensor in rounded}, strict=False)
    try:
        engine.update_weights(rounded)
        out = engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6))
        assert difference_to(model, out) < KERNEL_TOLERANCE
    finally:
        engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))


@pytest.mark.parametrize("bad, message", [
    ([("model.layers.9.mlp.up_proj.weight", torch.zeros(512, 128))],
     r"'model\.layers\.9\.mlp\.up_proj\.weight' is not a weight of the model \(did you mean 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    ([("model.layers.0.mlp.up_proj.weight", torch.zeros(5, 3))], r"has shape \(5, 3\); the model's is \(512, 128\)"),
])
def test_an_update_sglang_would_skip_or_die_on_is_refused_with_the_name_and_nothing_changes(engine, bad, message):
    """SGLang skips unknown names (the update "succeeds", the samples stay stale) and its scheduler dies on a wrong
    shape, taking the worker with it (measured): the rollout refuses both before sending, and still serves."""
    before = engine.generate(left_padded_prompts(PROMPTS, 0), GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.update_weights(bad)
    after = engine.generate(left_padded_prompts(PROMPTS, 0), GREEDY)
    assert torch.equal(before.batch["responses"], after.batch["responses"])


def test_a_sync_refused_halfway_is_refused_to_sample_until_every_weight_came_again(engine):
    own = trainer_weights(tiny_causal_lm(seed=0))
    try:
        engine.update_weights(other_weights(seed=1)[:5])  # the first bucket of a sync went through
        with pytest.raises(ValueError, match="is not a weight"):
            engine.update_weights([("model.layers.7.self_attn.q_proj.weight", torch.zeros(128, 128))])
        with pytest.raises(RuntimeError, match="without its weights"):
            engine.generate(left_padded_prompts(PROMPTS, 0), GREEDY)
        engine.update_weights(own[:5])
        with pytest.raises(RuntimeError, match="without its weights"):  # half a sync is not enough
            engine.generate(left_padded_prompts(PROMPTS, 0), GREEDY)
    finally:
        engine.update_weights(own)
    assert difference_to(tiny_causal_lm(seed=0), engine.generate(left_padded_prompts(PROMPTS, 0), GREEDY)) < KERNEL_TOLERANCE


def test_the_training_engines_parameters_are_sent_as_copies(hybrid_engine):
    """Pickling a CPU tensor for SGLang's scheduler moves its storage into shared memory: the rollout sends
    copies, and the tensors it was given keep their own memory."""
    given = trainer_weights(tiny_causal_lm(seed=0))
    pointers = [tensor.untyped_storage().data_ptr() for _, tensor in given]
    hybrid_engine.update_weights(given)
    assert [tensor.untyped_storage().data_ptr() for _, tensor in given] == pointers
    assert not any(tensor.is_shared() for _, tensor in given)


def test_concurrent_agent_calls_after_an_update_see_the_new_weights(hybrid_engine):
    model = tiny_causal_lm(seed=3).eval()
    try:
        hybrid_engine.update_weights(trainer_weights(model))
        assert concurrent_calls_difference(hybrid_engine, model, PROMPTS, seeded=False) < KERNEL_TOLERANCE
    finally:
        hybrid_engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))


def test_log_probs_after_every_sync_from_the_fsdp2_engine_equal_the_engines(engine, model_dir):
    """Three optimizer steps of the fsdp2 engine (float32), each followed by a sync in buckets of about
    100 kB (the tiny model's 0.5 MB in several buckets, the tied embedding once): the rollout's log-probs
    of what it samples equal the engine's forward of the same tokens within the sync probe's 1e-5."""
    from rlplat_engine_fsdp2.engine import FSDP2Engine

    trainer = FSDP2Engine({"model_path": model_dir, "dtype": "float32", "lr": 3e-2, "seed": 7, "micro_batch_size_per_gpu": 8})
    trainer.init_model()
    assert "lm_head.weight" not in {name for bucket in trainer.named_weights() for name, _ in bucket}  # tied: sent once, as the embedding
    try:
        differences = log_probs_after_syncs(engine, trainer, left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6), TokenMeanNLL())
    finally:
        engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))
    print(f"rollout vs fsdp2 log-probs after each sync: {differences}")
    assert max(differences) < SYNC_TOLERANCE


def test_partial_rollouts_are_declared_unsupported():
    """SGLang's pause / continue over new weights is not wired into this rollout: it declares no
    ``partial_rollout_modes``, so the trainer refuses ``trainer.partial_rollout`` with it at load."""
    from rlplat_rollout_sglang.rollout import SGLangRollout

    assert SGLangRollout.partial_rollout_modes == ()
