"""The step in two calls (``forward_backward``, then ``optimizer_step`` with per-step settings) and the trainable
state in memory (``trainable_state``, ``load_trainable_state``): what a service that runs each client's step as
the client asks for it, several LoRA adapters taking turns on one base, needs. One process, float32: the same
operations in the same order as ``train_batch`` give the same bits, so equality is exact where the order is the
same and within 1e-6 where it is not (two calls sum the micro-batches' gradients in another order)."""

from __future__ import annotations

import pytest
import torch

from rlplat_engine_fsdp2.engine import FSDP2Engine


class SummedPolicyGradient:
    """``-sum(advantages * log_probs * mask)``: a sum over tokens, so batches split over calls add up."""

    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum()
        return loss, {"test/loss": float(loss.detach())}


LOSS = SummedPolicyGradient()


def built(config: dict, **overrides) -> FSDP2Engine:
    engine = FSDP2Engine(config, **overrides)
    engine.init_model()
    return engine


def parameters(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in engine.named_weights() for name, tensor in bucket}


def largest_difference(left: dict, right: dict) -> float:
    assert left.keys() == right.keys()
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def whole(batch):
    return batch.with_meta_info({"ppo_mini_batch_size": None})


def test_forward_backward_then_optimizer_step_is_train_batch_bit_for_bit(tiny_config, batch_of):
    native, split = built(tiny_config), built(tiny_config)
    for seed in range(2):
        batch = batch_of(8, seed=seed)
        expected = native.train_batch(whole(batch), LOSS)
        output = split.forward_backward(batch, LOSS)
        metrics = split.optimizer_step()
        assert output.meta_info["metrics"]["loss"] == expected["loss"]
        assert output.meta_info["metrics"]["test/loss"] == expected["test/loss"]
        assert (metrics["grad_norm"], metrics["lr"]) == (expected["grad_norm"], expected["lr"])
    assert largest_difference(parameters(native), parameters(split)) == 0.0
    assert split.global_step == native.global_step == 2


def test_forward_backward_returns_the_log_probs_forward_gives(tiny_config, batch_of):
    engine, batch = built(tiny_config), batch_of(8)
    expected = engine.forward(batch).batch["log_probs"] * batch.batch["response_mask"]
    returned = engine.forward_backward(batch, LOSS).batch["log_probs"] * batch.batch["response_mask"]
    assert returned.shape == expected.shape and float((returned - expected).abs().max()) < 1e-6


def gradients(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in engine.module.named_parameters() if parameter.grad is not None}


def test_gradients_add_up_over_calls_until_the_step(tiny_config, batch_of):
    """Compared before the step: Adam divides by the gradient's size, which turns a rounding difference in a
    near-zero gradient into a difference of the learning rate's order."""
    one_call, two_calls, batch = built(tiny_config), built(tiny_config), batch_of(8)
    one_call.forward_backward(batch, LOSS)
    two_calls.forward_backward(batch.select_idxs(list(range(5))), LOSS)
    two_calls.forward_backward(batch.select_idxs([5, 6, 7]), LOSS)
    expected, summed = gradients(one_call), gradients(two_calls)
    scale = max(float(gradient.abs().max()) for gradient in expected.values())
    assert largest_difference(expected, summed) < 1e-6 * scale
    two_calls.optimizer_step()
    assert two_calls.global_step == 1
    # the step cleared the gradients: the next call starts from none
    assert all(parameter.grad is None for parameter in two_calls.module.parameters())


def test_step_settings_apply_to_that_step_only(tiny_config, batch_of):
    default, overridden, reference = built(tiny_config), built(tiny_config), built(tiny_config, lr=5e-3, betas=[0.8, 0.95], eps=1e-6)
    settings = {"lr": 5e-3, "betas": [0.8, 0.95], "eps": 1e-6}
    for engine, step_settings in ((default, None), (overridden, settings), (reference, None)):
        engine.forward_backward(batch_of(8), LOSS)
        engine.optimizer_step(step_settings)
    assert largest_difference(parameters(overridden), parameters(reference)) == 0.0
    assert largest_difference(parameters(overridden), parameters(default)) > 1e-4
    group = overridden.optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"]) == (1e-3, (0.9, 0.999), overridden.config.eps)
    # lr 0 leaves the weights as they were (AdamW's decay is scaled by the lr too)
    before = parameters(overridden)
    overridden.forward_backward(batch_of(8, seed=1), LOSS)
    assert overridden.optimizer_step({"lr": 0.0})["lr"] == 0.0
    assert largest_difference(before, parameters(overridden)) == 0.0


@pytest.mark.parametrize("settings, named", [
    ({"learning_rate": 1e-3}, "unknown setting 'learning_rate'"),
    ({"lr": -1.0}, "lr must be a finite number >= 0"),
    ({"betas": [0.9]}, "betas must be two numbers"),
    ({"eps": 0}, "eps must be a finite number > 0"),
    ({"grad_clip": float("nan")}, "grad_clip must be"),
])
def test_bad_step_settings_are_refused_before_anything_changes(tiny_config, batch_of, settings, named):
    engine = built(tiny_config)
    engine.forward_backward(batch_of(8), LOSS)
    before = parameters(engine)
    with pytest.raises(ValueError, match=named):
        engine.optimizer_step(settings)
    assert largest_difference(before, parameters(engine)) == 0.0 and engine.global_step == 0
    engine.optimizer_step()  # the gradients are still there to apply
    assert engine.global_step == 1


def test_adapters_taking_turns_on_one_base_train_as_if_alone(tiny_config, batch_of):
    """Two LoRA clients on one engine, their steps interleaved (one's gradients held across the other's step):
    each ends where it would have alone, bit for bit; the base weights never change."""
    lora = {"rank": 4, "alpha": 8.0}
    alone, shared = built(tiny_config, lora=lora), built(tiny_config, lora=lora)
    base = {name: parameter.detach().clone() for name, parameter in shared.module.named_parameters() if ".lora_" not in name}
    fresh = shared.trainable_state()
    first = [batch_of(8, seed=seed) for seed in (1, 2)]
    for batch in first:
        alone.forward_backward(batch, LOSS)
        alone.optimizer_step({"lr": 2e-3})
    states = {"first": fresh, "second": fresh}

    def turn(client: str, action) -> None:
        shared.load_trainable_state(states[client])
        action()
        states[client] = shared.trainable_state()

    turn("first", lambda: shared.forward_backward(first[0], LOSS))
    turn("second", lambda: (shared.forward_backward(batch_of(8, seed=9), LOSS), shared.optimizer_step({"lr": 1e-2})))
    turn("first", lambda: shared.optimizer_step({"lr": 2e-3}))
    turn("second", lambda: (shared.forward_backward(batch_of(8, seed=10), LOSS), shared.optimizer_step()))
    turn("first", lambda: (shared.forward_backward(first[1], LOSS), shared.optimizer_step({"lr": 2e-3})))
    shared.load_trainable_state(states["first"])
    assert largest_difference(parameters(alone), parameters(shared)) == 0.0
    assert shared.global_step == alone.global_step == 2
    shared.load_trainable_state(states["second"])
    assert largest_difference(parameters(alone), parameters(shared)) > 1e-4
    assert all(torch.equal(parameter, base[name]) for name, parameter in shared.module.named_parameters() if ".lora_" not in name)


def test_a_trainable_state_of_another_adapter_shape_is_refused(tiny_config):
    small, large = built(tiny_config, lora={"rank": 2, "alpha": 4.0}), built(tiny_config, lora={"rank": 4, "alpha": 8.0})
    state = small.trainable_state()
    with pytest.raises(ValueError, match="another engine or LoRA config"):
        large.load_trainable_state({"parameters": {}})
    with pytest.raises(RuntimeError):  # same names, other shapes: copy_ refuses
        large.load_trainable_state(state)
