"""The Tinker API through the stock ``tinker`` SDK against ``rlplat serve`` on loopback, compared with rlplat's own
engine and rollout in this process (float32, CPU).

The service's step and the native step run the same engine code on the same rows, so they agree to the last bits
or nearly (1e-6 is the issue's bound); sampling with a seed draws the same streams as the hf rollout does
(exact tokens; log-probs within 1e-6)."""

from __future__ import annotations

import threading

import pytest
import torch
from tinker import types

from rlplat.contracts.rollout import SamplingParams
from rlplat.protocol import DataProto
from rlplat_engine_fsdp2.engine import FSDP2Engine
from rlplat_rollout_hf.rollout import HFRollout
from rlplat_tinker.datums import Datum, rows_of
from rlplat_tinker.losses import TinkerLoss
from rlplat_tinker.serve import ENGINE_DEFAULTS
from rlplat_tinker.service import LORA_ALPHA

pytestmark = pytest.mark.slow

RANK = 4
ADAM = dict(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def sequence(seed: int, length: int = 9) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(4, 16, (length - 1,), generator=generator).tolist()]


def rl_datum(tokens: list[int], prompt: int, advantage: float, sampled: float = -2.5) -> types.Datum:
    """A cookbook GRPO datum: inputs all but the last token, targets shifted, advantage on the response positions."""
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * (prompt - 1) + [sampled] * (n - prompt + 1),
                                       "advantages": [0.0] * (prompt - 1) + [advantage] * (n - prompt + 1)})


def sft_datum(tokens: list[int], prompt: int) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (prompt - 1) + [1.0] * (n - prompt + 1)})


def as_rows(data: list[types.Datum]) -> DataProto:
    return rows_of([Datum(datum.model_input.to_ints(), {key: value.tolist() for key, value in datum.loss_fn_inputs.items()})
                    for datum in data], pad_token_id=0)


def native_engine(model_dir: str) -> FSDP2Engine:
    """The engine the service builds for a rank-4 client, built here."""
    engine = FSDP2Engine({**ENGINE_DEFAULTS, "seed": 0, "model_path": model_dir,
                          "lora": {"rank": RANK, "alpha": LORA_ALPHA, "target_modules": ["all-linear"]}},
                         lr=ADAM["learning_rate"], betas=[ADAM["beta1"], ADAM["beta2"]], eps=ADAM["eps"])
    engine.init_model()
    return engine


def new_client(service_client, running):
    return service_client.create_lora_training_client(base_model=running.service.base_model, rank=RANK).result()


def logprobs(result) -> list[list[float]]:
    return [output["logprobs"].tolist() for output in result.loss_fn_outputs]


def largest(left: list[list[float]], right: list[list[float]]) -> float:
    return max(abs(a - b) for x, y in zip(left, right, strict=True) for a, b in zip(x, y, strict=True))


BATCHES = {
    "importance_sampling": [rl_datum(sequence(seed), 4, advantage) for seed, advantage in ((1, 1.0), (2, -0.5), (3, 0.25))],
    "ppo": [rl_datum(sequence(seed, 7), 3, advantage, sampled=-2.0) for seed, advantage in ((4, 1.0), (5, -1.0))],
    "cross_entropy": [sft_datum(sequence(seed, 11), 5) for seed in (6, 7)],
}


@pytest.mark.parametrize("loss", sorted(BATCHES))
def test_a_step_through_the_sdk_equals_the_native_engine_step(service_client, running, model_dir, loss):
    data = BATCHES[loss]
    client = new_client(service_client, running)
    before = client.forward_backward(data, loss).result()
    client.optim_step(types.AdamParams(**ADAM)).result()
    after = client.forward(data, "cross_entropy").result()

    engine, rows = native_engine(model_dir), as_rows(data)
    expected_before = engine.forward(rows).batch["log_probs"]
    metrics = engine.train_batch(rows.with_meta_info({"ppo_mini_batch_size": None}), TinkerLoss(loss))
    expected_after = engine.forward(rows).batch["log_probs"]
    lengths = [len(datum.model_input.to_ints()) for datum in data]

    def per_datum(tensor):
        return [tensor[row, :n].tolist() for row, n in enumerate(lengths)]

    assert largest(logprobs(before), per_datum(expected_before)) < 1e-6
    assert abs(before.metrics["loss:sum"] - metrics["loss"]) < 1e-5 * max(1.0, abs(metrics["loss"]))
    assert largest(logprobs(after), per_datum(expected_after)) < 1e-6
    assert largest(logprobs(after), logprobs(before)) > 1e-3  # the step changed the adapter


def test_gradients_add_up_over_forward_backward_calls(service_client, running):
    """Tinker's losses are sums: two calls on halves then one step equal one call on the whole."""
    data = BATCHES["importance_sampling"]
    whole = new_client(service_client, running)
    halves = new_client(service_client, running)
    whole.forward_backward(data, "importance_sampling").result()
    halves.forward_backward(data[:1], "importance_sampling").result()
    halves.forward_backward(data[1:], "importance_sampling").result()
    for client in (whole, halves):
        client.optim_step(types.AdamParams(**ADAM)).result()
    assert largest(logprobs(whole.forward(data, "cross_entropy").result()), logprobs(halves.forward(data, "cross_entropy").result())) < 1e-5


def test_sampling_with_a_seed_equals_the_hf_rollout_on_the_trained_weights(service_client, running, model_dir):
    data = BATCHES["importance_sampling"]
    client = new_client(service_client, running)
    client.forward_backward(data, "importance_sampling").result()
    client.optim_step(types.AdamParams(**ADAM)).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = [1, 5, 6, 7]
    result = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=4,
                            sampling_params=types.SamplingParams(max_tokens=8, seed=11, temperature=0.8)).result()

    engine, rows = native_engine(model_dir), as_rows(data)
    engine.train_batch(rows.with_meta_info({"ppo_mini_batch_size": None}), TinkerLoss("importance_sampling"))
    rollout = HFRollout({"model_path": model_dir, "load_weights": False})
    rollout.update_weights([item for bucket in engine.named_weights() for item in bucket])
    ids = torch.tensor([prompt])
    expected = rollout.generate(DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(4)[None]}),
                                SamplingParams(n=4, seed=11, temperature=0.8, max_new_tokens=8))
    for row, sampled in enumerate(result.sequences):
        n = int(expected.batch["response_mask"][row].sum())
        assert sampled.tokens == expected.batch["responses"][row, :n].tolist()
        assert max(abs(a - b) for a, b in zip(sampled.logprobs, expected.batch["rollout_log_probs"][row, :n].tolist())) < 1e-6
        assert sampled.stop_reason == ("stop" if n < 8 or sampled.tokens[-1] in rollout.eos_token_ids else "length")
    # the prompt's log-probs are the trained model's
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    forward = engine.forward(as_rows([types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                                                  loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * 3})])).batch["log_probs"]
    assert scored[0] is None and max(abs(a - b) for a, b in zip(scored[1:], forward[0, :3].tolist())) < 1e-5


def test_snapshots_hold_a_lora_clients_frozen_weights_once_and_each_samples_its_own(service_client, running):
    """Two sampler snapshots around a step: the weights the step left alone are one tensor in both (memory
    grows by what changed, not by the model), and the older snapshot still samples the older weights."""
    client = new_client(service_client, running)
    prompt = types.ModelInput.from_ints([1, 5, 6, 7])
    before = client.save_weights_and_get_sampling_client().result()
    first = before.compute_logprobs(prompt).result()
    client.forward_backward(BATCHES["importance_sampling"], "importance_sampling").result()
    client.optim_step(types.AdamParams(**ADAM)).result()
    after = client.save_weights_and_get_sampling_client().result()
    worker = running.group.backend.host.workers["tinker"]
    newest = list(worker.snapshots)[-2:]
    older, newer = (dict(worker.snapshots[name]) for name in newest)
    shared = {name for name in older if older[name] is newer[name]}
    changed = {name for name in older if not torch.equal(older[name], newer[name])}
    assert changed and shared and shared.isdisjoint(changed)
    assert shared | changed == set(older)  # every unchanged tensor is shared
    assert "model.embed_tokens.weight" in shared and all(".layers." in name for name in changed)
    assert largest([after.compute_logprobs(prompt).result()[1:]], [first[1:]]) > 1e-6
    assert before.compute_logprobs(prompt).result() == first  # the older snapshot is intact


def test_sampler_weights_saved_again_under_their_name_are_the_new_weights(service_client, running):
    """A loop that saves its sampler weights under one name every step samples the newest weights each time."""
    client = new_client(service_client, running)
    prompt = types.ModelInput.from_ints([1, 5, 6, 7])
    path = client.save_weights_for_sampler("latest").result().path
    first = service_client.create_sampling_client(model_path=path).result().compute_logprobs(prompt).result()
    client.forward_backward(BATCHES["importance_sampling"], "importance_sampling").result()
    client.optim_step(types.AdamParams(**ADAM)).result()
    assert client.save_weights_for_sampler("latest").result().path == path
    again = service_client.create_sampling_client(model_path=path).result().compute_logprobs(prompt).result()
    fresh = client.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    assert again == fresh and largest([again[1:]], [first[1:]]) > 1e-6


def test_save_state_then_load_state_resumes_bit_for_bit(service_client, running):
    first, second = BATCHES["importance_sampling"], BATCHES["ppo"]
    adam = types.AdamParams(**ADAM)
    original = new_client(service_client, running)
    original.forward_backward(first, "importance_sampling").result()
    original.optim_step(adam).result()
    saved = original.save_state("after-one-step").result().path
    assert saved.startswith("tinker://") and saved.endswith("/weights/after-one-step")
    original.forward_backward(second, "ppo").result()
    original.optim_step(adam).result()
    uninterrupted = logprobs(original.forward(first, "cross_entropy").result())

    resumed = service_client.create_training_client_from_state_with_optimizer(saved).result()
    resumed.forward_backward(second, "ppo").result()
    resumed.optim_step(adam).result()
    assert largest(logprobs(resumed.forward(first, "cross_entropy").result()), uninterrupted) == 0.0
    # without the optimizer state the second step differs (Adam's moments start again)
    weights_only = service_client.create_training_client_from_state(saved).result()
    weights_only.forward_backward(second, "ppo").result()
    weights_only.optim_step(adam).result()
    assert largest(logprobs(weights_only.forward(first, "cross_entropy").result()), uninterrupted) > 1e-6


def test_three_concurrent_lora_clients_stay_isolated(service_client, running):
    """Three clients step at once from three threads on one base; each ends where it ends when it trains alone."""
    plans = {name: [rl_datum(sequence(seed + 10 * index), 3, 1.0 - index) for seed in range(3)]
             for index, name in enumerate(("a", "b", "c"))}
    adam = types.AdamParams(**ADAM)

    def train(client, data) -> None:
        for datum in data:
            client.forward_backward([datum], "importance_sampling").result()
            client.optim_step(adam).result()

    clients = {name: new_client(service_client, running) for name in plans}
    threads = [threading.Thread(target=train, args=(clients[name], plans[name])) for name in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    probe = BATCHES["cross_entropy"]
    for name, data in plans.items():
        alone = new_client(service_client, running)
        train(alone, data)
        together = logprobs(clients[name].forward(probe, "cross_entropy").result())
        assert largest(together, logprobs(alone.forward(probe, "cross_entropy").result())) == 0.0
    a, b = (logprobs(clients[name].forward(probe, "cross_entropy").result()) for name in "ab")
    assert largest(a, b) > 1e-4


def test_a_state_saved_before_a_restart_resumes_in_a_new_service(model_dir, tmp_path):
    """Saved states outlive the service (``--state-dir``): a new service builds the client in the saved one's shape
    (rank 2 here, not the default) and it steps exactly as the uninterrupted one."""
    import tinker

    from rlplat_tinker.serve import start

    first, second = BATCHES["importance_sampling"], BATCHES["ppo"]
    adam = types.AdamParams(**ADAM)
    with start(model_dir, state_dir=str(tmp_path)) as running, tinker.ServiceClient(base_url=running.base_url, api_key="tml-test") as service:
        original = service.create_lora_training_client(base_model=running.service.base_model, rank=2).result()
        original.forward_backward(first, "importance_sampling").result()
        original.optim_step(adam).result()
        saved = original.save_state("before-restart").result().path
        original.forward_backward(second, "ppo").result()
        original.optim_step(adam).result()
        uninterrupted = logprobs(original.forward(first, "cross_entropy").result())
    with start(model_dir, state_dir=str(tmp_path)) as running, tinker.ServiceClient(base_url=running.base_url, api_key="tml-test") as service:
        resumed = service.create_training_client_from_state_with_optimizer(saved).result()
        assert resumed.get_info().lora_rank == 2
        resumed.forward_backward(second, "ppo").result()
        resumed.optim_step(adam).result()
        assert largest(logprobs(resumed.forward(first, "cross_entropy").result()), uninterrupted) == 0.0
