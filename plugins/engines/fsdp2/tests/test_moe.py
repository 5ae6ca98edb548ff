"""Mixture-of-experts policies through the hf rollout and the fsdp2 engine: the rollout records the routes
it sampled with, aligned with input_ids; the engine replays them (r3) packed and padded alike, records its
own for the update (r2), adds the router losses and reports the experts' load; with a bfloat16 rollout and
a float32 trainer, replay removes the mismatch that routing adds."""

from __future__ import annotations

import pytest
import torch

from rlplat import registry
from rlplat.contracts.rollout import SamplingParams
from rlplat.kits.moe import ROUTES, find_routers
from rlplat.protocol import DataProto
from rlplat.testing.tiny_models import tiny_causal_lm, tiny_moe_config
from rlplat_engine_fsdp2.engine import FSDP2Engine
from rlplat_rollout_hf.rollout import HFRollout

pytestmark = pytest.mark.slow  # engines and rollouts of three architectures: left out of `make test-fast`


def engine_for(config: dict, **node) -> FSDP2Engine:
    engine = FSDP2Engine({"model_config": config, "seed": 3, "micro_batch_size_per_gpu": 4, "lr": 1e-3, **node})
    engine.init_model()
    return engine


def rollout_for(engine: FSDP2Engine, config: dict, dtype: str = "float32") -> HFRollout:
    rollout = HFRollout({"model_config": config, "dtype": dtype, "device": "cpu", "record_routes": True})
    for bucket in engine.named_weights():
        rollout.update_weights(bucket)
    return rollout


def prompts(rows: int = 4, length: int = 6, vocab: int = 16) -> DataProto:
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


def grpo_loss():
    algorithm = registry.get("algorithm", "grpo")()
    return algorithm.build_loss("actor", {**algorithm.default_nodes()["actor"]["loss"], "loss_agg_mode": "token-mean",
                                          "use_kl_loss": False})


def for_update(batch: DataProto, old_log_probs: torch.Tensor) -> DataProto:
    batch.batch["old_log_probs"] = old_log_probs
    batch.batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(5)) * batch.batch["response_mask"]
    return batch.with_meta_info({"temperature": 1.0})


def last_valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)


def test_the_rollout_records_each_tokens_experts_aligned_with_input_ids():
    config = tiny_moe_config("qwen2_moe")
    engine = engine_for(config)
    rollout = rollout_for(engine, config)
    output = rollout.generate(prompts(), SamplingParams(n=2, max_new_tokens=8, seed=1))
    routes, mask = output.batch[ROUTES], output.batch["attention_mask"].bool()
    assert routes.dtype == torch.int16 and routes.shape == (*output.batch["input_ids"].shape, 2, 2)
    last = last_valid(mask)
    matters = mask.clone()
    matters[torch.arange(len(mask)), last] = False
    assert (routes[~mask] == -1).all()  # padding; a row's last token has one only if a later call fed it (rows still running)
    assert (routes[torch.arange(len(mask)), last] == -1).any()  # the longest rows' last token: no forward saw it
    assert (routes[matters] >= 0).all() and int(routes.max()) < 8
    # the same routes as one float32 forward of the whole sequence
    hooks_model = rollout.model
    from rlplat.kits.moe import RouteHooks, RoutingCall

    hooks = RouteHooks(hooks_model)
    with torch.no_grad():
        call = hooks.begin(RoutingCall(output.batch["input_ids"].numel(), record=True))
        hooks_model(input_ids=output.batch["input_ids"], attention_mask=output.batch["attention_mask"],
                    position_ids=output.batch["position_ids"])
    hooks.remove()
    full = hooks.stacked(call).view(routes.shape)
    recorded = routes >= 0
    assert torch.equal(full[recorded].sort(-1).values, routes[recorded].sort(-1).values.to(full.dtype))


def test_record_routes_on_a_dense_model_is_refused():
    rollout = HFRollout({"model_config": tiny_causal_lm().config.to_dict(), "device": "cpu", "record_routes": True})
    with pytest.raises(ValueError, match="has no MoE routers"):
        rollout.generate(prompts(), SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_r3_replays_the_rollouts_routes_packed_and_padded_alike(model_type):
    config = tiny_moe_config(model_type)
    packed = engine_for(config, moe={"router_replay": "r3", "aux_loss_coef": 0.01, "z_loss_coef": 0.001})
    padded = engine_for(config, moe={"router_replay": "r3", "aux_loss_coef": 0.01, "z_loss_coef": 0.001},
                        use_remove_padding=False)
    assert packed.remove_padding and not padded.remove_padding
    output = rollout_for(packed, config).generate(prompts(), SamplingParams(n=2, max_new_tokens=8, seed=1))
    mask = output.batch["response_mask"].bool()
    old = {name: engine.forward(output).batch["log_probs"] for name, engine in (("packed", packed), ("padded", padded))}
    assert torch.allclose(old["packed"][mask], output.batch["rollout_log_probs"][mask], atol=1e-5)
    assert torch.allclose(old["padded"][mask], old["packed"][mask], atol=1e-5)
    metrics = {name: engine.train_batch(for_update(output, old["packed"]), grpo_loss())
               for name, engine in (("packed", packed), ("padded", padded))}
    for found in metrics.values():
        assert found["actor/moe/replayed_fraction"] == 1.0 and found["actor/moe/replay_agreement"] == 1.0
        assert found["actor/moe/load_imbalance"] >= 1.0 and "actor/moe/load_imbalance/layer_1" in found
    for key in ("loss", "grad_norm", "actor/moe/aux_loss", "actor/moe/z_loss", "actor/moe/load_imbalance"):
        assert metrics["packed"][key] == pytest.approx(metrics["padded"][key], rel=1e-4, abs=1e-6), key


def test_r3_without_routes_in_the_batch_is_refused():
    config = tiny_moe_config("qwen3_moe")
    engine = engine_for(config, moe={"router_replay": "r3"})
    rollout = HFRollout({"model_config": config, "device": "cpu"})
    output = rollout.generate(prompts(), SamplingParams(max_new_tokens=3))
    with pytest.raises(KeyError, match="router_replay=r3: the batch has no 'routed_experts'"):
        engine.forward(output)


def test_actor_moe_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="has no mixture-of-experts routers"):
        engine_for(tiny_causal_lm().config.to_dict(), moe={"router_replay": "r2"})


def test_r2_records_the_old_policys_routes_and_the_update_replays_them():
    config = tiny_moe_config("qwen3_moe")
    engine = engine_for(config, moe={"router_replay": "r2"}, ppo_mini_batch_size=4)
    output = HFRollout({"model_config": config, "device": "cpu"}).generate(prompts(), SamplingParams(n=2, max_new_tokens=6, seed=2))
    forward = engine.forward(output)
    routes, mask = forward.batch[ROUTES], output.batch["attention_mask"].bool()
    assert routes.shape == (*mask.shape, 2, 2) and (routes[~mask] == -1).all() and (routes[mask] >= 0).all()
    batch = for_update(output.union(DataProto.from_dict({ROUTES: routes})), forward.batch["log_probs"])
    metrics = engine.train_batch(batch, grpo_loss())  # two mini-batches: the second one's weights moved
    assert metrics["actor/moe/replayed_fraction"] == 1.0
    assert metrics["actor/moe/replay_agreement"] <= 1.0


def test_the_load_balancing_loss_is_switchs_per_layer_and_trains_the_routers():
    config = tiny_moe_config("mixtral")
    output = HFRollout({"model_config": config, "device": "cpu"}).generate(prompts(), SamplingParams(n=2, max_new_tokens=6, seed=2))
    engines = {coef: engine_for(config, moe={"aux_loss_coef": coef}, micro_batch_size_per_gpu=8) for coef in (0.0, 10.0)}
    old = engines[0.0].forward(output).batch["log_probs"]
    # the expected loss: per layer E * sum_e f_e P_e over the valid tokens, averaged over layers
    model, mask = engines[0.0].module, output.batch["attention_mask"].bool()
    captured = {}
    handles = [router.module.register_forward_hook(lambda m, a, out, layer=router.layer: captured.__setitem__(layer, out))
               for router in find_routers(model)]
    with torch.no_grad():
        model(input_ids=output.batch["input_ids"], attention_mask=output.batch["attention_mask"],
              position_ids=output.batch["position_ids"])
    for handle in handles:
        handle.remove()
    expected = []
    for logits, _, indices in captured.values():
        logits, indices = logits[mask.flatten()], indices[mask.flatten()]
        f = torch.bincount(indices.flatten(), minlength=8).double() / len(logits)
        expected.append(8 * (f * torch.softmax(logits.double(), -1).mean(0)).sum())
    before = {coef: {r.name: r.module.weight.detach().clone() for r in find_routers(e.module)} for coef, e in engines.items()}
    metrics = {coef: engine.train_batch(for_update(output, old), grpo_loss()) for coef, engine in engines.items()}
    assert metrics[0.0]["actor/moe/aux_loss"] == pytest.approx(float(torch.stack(expected).mean()), rel=1e-5)
    assert metrics[10.0]["actor/moe/aux_loss"] == pytest.approx(metrics[0.0]["actor/moe/aux_loss"], rel=1e-5)
    moved = {coef: sum(float((r.module.weight.detach() - before[coef][r.name]).abs().sum()) for r in find_routers(e.module))
             for coef, e in engines.items()}
    assert moved[0.0] > 0 and moved[10.0] != pytest.approx(moved[0.0], rel=1e-3)


def test_replay_removes_the_mismatch_routing_adds_between_a_bfloat16_rollout_and_a_float32_trainer():
    """The rollout samples in bfloat16, the trainer scores in float32: near-tied router logits pick other
    experts in one than in the other. The mismatch is measured as the KL estimate the rollout-correction
    metrics use (k3 on the sampled tokens); what r3 leaves is bfloat16 rounding of everything else."""
    config = tiny_moe_config("qwen3_moe", vocab_size=64, num_experts=16, initializer_range=0.1)
    engine = engine_for(config, moe={"router_replay": "r3"})
    rollout = rollout_for(engine, config, dtype="bfloat16")
    batch = prompts(rows=16, length=8, vocab=64)
    output = rollout.generate(batch, SamplingParams(n=4, max_new_tokens=32, seed=1))
    mask, sampled = output.batch["response_mask"].bool(), output.batch["rollout_log_probs"]
    replayed = engine.forward(output).batch["log_probs"]
    output.batch[ROUTES] = torch.full_like(output.batch[ROUTES], -1)  # -1: route live
    live = engine.forward(output).batch["log_probs"]

    def k3(trained):
        log_ratio = (trained - sampled)[mask]
        return float((log_ratio.exp() - 1 - log_ratio).mean())

    assert k3(replayed) <= 0.1 * k3(live), (k3(replayed), k3(live))
