"""``rlplat serve --processes 2``: the engine sharded over two worker processes on a local Ray cluster (FSDP2 on
gloo) serves the same steps as one process: log-probs after a step within 1e-5 (the issue's tolerance for two
ranks against one: the gradient is reduced in another order), sampling from rank 0's rollout, exact resume."""

from __future__ import annotations

import os

import pytest
from tinker import types

from rlplat_tinker.serve import start

pytestmark = pytest.mark.slow

ADAM = types.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def data() -> list[types.Datum]:
    rows = [[1, 5, 6, 7, 8, 9, 3], [1, 9, 12, 14, 11, 4, 6, 2], [1, 4, 4, 5]]  # three rows: one rank gets a padding row
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [-2.0] * (len(tokens) - 1),
                                        "advantages": [0.5 * (index + 1) - 1.0] * (len(tokens) - 1)})
            for index, tokens in enumerate(rows)]


def steps(base_url: str, base_model: str, tmp_name: str) -> tuple[list, list, list]:
    import tinker

    with tinker.ServiceClient(base_url=base_url, api_key="tml-test") as service:
        return steps_of(service, base_model, tmp_name)


def steps_of(service, base_model: str, tmp_name: str) -> tuple[list, list, list, list]:
    client = service.create_lora_training_client(base_model=base_model, rank=4).result()
    before = client.forward_backward(data(), "importance_sampling").result()
    client.optim_step(ADAM).result()
    saved = client.save_state(tmp_name).result().path
    client.forward_backward(data(), "ppo").result()
    client.optim_step(ADAM).result()
    after = client.forward(data(), "cross_entropy").result()
    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    resumed.forward_backward(data(), "ppo").result()
    resumed.optim_step(ADAM).result()
    again = resumed.forward(data(), "cross_entropy").result()
    sampler = client.save_weights_and_get_sampling_client().result()
    sampled = sampler.sample(prompt=types.ModelInput.from_ints([1, 5, 6]), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=4, seed=3)).result()
    values = [[output["logprobs"].tolist() for output in result.loss_fn_outputs] for result in (before, after, again)]
    return values[0], values[1], values[2], [sequence.tokens for sequence in sampled.sequences]


def largest(left, right) -> float:
    return max(abs(a - b) for x, y in zip(left, right, strict=True) for a, b in zip(x, y, strict=True))


def test_two_worker_processes_serve_the_steps_of_one(model_dir, tmp_path):
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "local"  # a cluster of this test's own
    try:
        with start(model_dir, state_dir=str(tmp_path / "two"), processes=2) as running:
            two = steps(running.base_url, running.service.base_model, "two")
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
    with start(model_dir, state_dir=str(tmp_path / "one")) as running:
        one = steps(running.base_url, running.service.base_model, "one")
    before, after, again, samples = two
    assert largest(before, one[0]) < 1e-5 and largest(after, one[1]) < 1e-5
    assert largest(again, after) == 0.0  # resumed exactly, on two processes
    assert largest(after, before) > 1e-3
    assert samples == one[3]  # rank 0's rollout with the same weights and seed
