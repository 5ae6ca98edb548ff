"""Router replay's seam (rlplat.kits.moe) on tiny Qwen2-MoE, Qwen3-MoE and Mixtral models: replaying the
routes a forward took changes nothing, replaying other routes keeps every router's gradient, and the
replayed weights are the full softmax's at the replayed experts; and actor.moe's load-time checks."""

from __future__ import annotations

import pytest
import torch

from rlplat.config import ConfigError, load_config
from rlplat.kits.moe import RouteHooks, RoutingCall, find_routers, replayed_weights
from rlplat.testing.tiny_models import MOE_MODEL_TYPES, save_tiny_moe_model, tiny_moe_config


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = tiny_moe_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings), dtype=torch.float32)
    return model.eval()


def inputs(rows: int = 3, length: int = 10) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 16, (rows, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_routers_are_found_with_their_experts_and_normalisation(model_type):
    routers = find_routers(build(model_type))
    assert [router.layer for router in routers] == [0, 1]
    assert {(router.num_experts, router.top_k) for router in routers} == {(8, 2)}
    assert all(router.renormalize == (model_type != "qwen2_moe") for router in routers)  # qwen2_moe: norm_topk_prob false


def test_a_dense_model_has_no_routers():
    from rlplat.testing.tiny_models import tiny_causal_lm

    assert find_routers(tiny_causal_lm()) == []


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_replaying_the_routes_a_forward_took_gives_the_same_logits(model_type):
    model, batch = build(model_type), inputs()
    with torch.no_grad():
        plain = model(**batch).logits
    hooks = RouteHooks(model)
    tokens = batch["input_ids"].numel()
    with torch.no_grad():
        recorded = hooks.begin(RoutingCall(tokens, record=True))
        recorded_logits = model(**batch).logits
        routes = hooks.stacked(recorded)
        replay = hooks.begin(RoutingCall(tokens, replay=routes.long()))
        replayed_logits = model(**batch).logits
    hooks.remove()
    assert torch.equal(plain, recorded_logits)
    assert torch.equal(plain, replayed_logits)
    assert routes.shape == (tokens, 2, 2) and int(routes.min()) >= 0
    assert replay.replayed_tokens == 2 * tokens and replay.agreeing_tokens == replay.replayed_tokens


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_drifted_routes_change_the_output_and_keep_every_routers_gradient(model_type):
    model, batch = build(model_type), inputs()
    hooks = RouteHooks(model)
    tokens = batch["input_ids"].numel()
    with torch.no_grad():
        live = hooks.begin(RoutingCall(tokens, record=True))
        live_logits = model(**batch).logits
        routes = hooks.stacked(live).long()
    drifted = (routes + 3) % 8  # every token to two other experts: none of its live ones
    replacements = {}

    def keep(router, output):
        replacements[router.layer] = (output, call(router, output))
        return replacements[router.layer][1]

    call = RoutingCall(tokens, replay=drifted)
    hooks.call = keep
    model.zero_grad()
    logits = model(**batch).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten()).backward()
    hooks.remove()
    assert not torch.allclose(logits.detach(), live_logits)
    assert call.agreeing_tokens == 0 and call.replayed_tokens == 2 * tokens
    for router in find_routers(model):
        gradient = router.module.weight.grad
        assert gradient is not None and torch.isfinite(gradient).all() and gradient.abs().sum() > 0, router.name
        (live_logits_of_router, live_weights, _), (_, weights, indices) = replacements[router.layer]
        assert torch.equal(indices, drifted[:, router.layer])
        expected = replayed_weights(router, live_logits_of_router.detach(), drifted[:, router.layer], live_weights.dtype)
        assert torch.allclose(weights.detach(), expected)
        probabilities = torch.softmax(live_logits_of_router.detach().float(), -1).gather(-1, drifted[:, router.layer])
        if router.renormalize:
            probabilities = probabilities / probabilities.sum(-1, keepdim=True)
        assert torch.allclose(weights.detach().float(), probabilities, atol=1e-6)  # never zero for a dropped expert


def test_routes_of_another_model_are_refused():
    model, batch = build("qwen2_moe"), inputs()
    hooks = RouteHooks(model)
    tokens = batch["input_ids"].numel()
    with pytest.raises(ValueError, match="name expert 9, router .* has 8"):
        hooks.begin(RoutingCall(tokens, replay=torch.full((tokens, 2, 2), 9)))
        model(**batch)
    with pytest.raises(ValueError, match="hold 1 MoE layers"):
        hooks.begin(RoutingCall(tokens, replay=torch.zeros(tokens, 1, 2, dtype=torch.long)))
        model(**batch)
    hooks.remove()


# -- actor.moe at load ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return save_tiny_moe_model(tmp_path_factory.mktemp("moe") / "model")


def demo_config(tmp_path, moe_model, *extra):
    from rlplat_demo import overrides

    return load_config(overrides=[*overrides(), f"model.path={moe_model}", f"trainer.output_dir={tmp_path / 'run'}", *extra],
                       algo="grpo")


def test_actor_moe_reaches_the_engine_and_r3_asks_the_rollout_for_routes(tmp_path, moe_model):
    from rlplat.config import engine_node, rollout_node

    config = demo_config(tmp_path, moe_model, "actor.moe.router_replay=r3", "actor.moe.aux_loss_coef=0.01")
    assert engine_node(config, "actor", 10)["moe"] == {"router_replay": "r3", "aux_loss_coef": 0.01, "z_loss_coef": 0.0}
    assert rollout_node(config)["record_routes"] is True
    plain = demo_config(tmp_path, moe_model)
    assert "moe" not in engine_node(plain, "actor", 10) and "record_routes" not in rollout_node(plain)


@pytest.mark.parametrize("extra, match", [
    (["actor.moe.router_replay=r4"], "router_replay must be one of off, r2, r3"),
    (["actor.moe.aux_loss_coef=-1"], "aux_loss_coef must be >= 0"),
    (["actor.moe.router_replay=r3", "trainer.mode=separate_async", "trainer.partial_rollout=keep", "cluster.backend=ray"],
     "trainer.partial_rollout=keep generates through generate_tokens"),
    (["actor.moe.router_replay=r3", "rollout.driver=agent_loops"], "rollout driver 'agent_loops' generates through generate_tokens"),
])
def test_actor_moe_is_refused_at_load_where_it_cannot_work(tmp_path, moe_model, extra, match):
    with pytest.raises(ConfigError, match=match):
        demo_config(tmp_path, moe_model, *extra)


def test_r3_with_a_rollout_that_records_no_routes_is_refused_at_load(tmp_path, moe_model, register_temporary_plugin):
    from rlplat.contracts.rollout import RolloutBuildConfig
    from rlplat.hookspecs import hookimpl
    from rlplat_rollout_hf.rollout import HFRollout

    class Plugin:
        @hookimpl
        def register_rollouts(self, register):  # the hf rollout's class, without records_routes in its metadata
            register("routeless", HFRollout, config_schema=RolloutBuildConfig)

    register_temporary_plugin(Plugin(), name="routeless-rollout")
    with pytest.raises(ConfigError, match="rollout 'routeless' does not record them"):
        demo_config(tmp_path, moe_model, "actor.moe.router_replay=r3", "rollout.name=routeless")
    demo_config(tmp_path, moe_model, "actor.moe.router_replay=r2", "rollout.name=routeless")  # r2 needs nothing of it


def test_an_engine_without_moe_in_its_metadata_is_refused_at_load(tmp_path, moe_model, register_temporary_plugin):
    from rlplat.hookspecs import hookimpl
    from rlplat_engine_fsdp2.config import FSDP2EngineConfig
    from rlplat_engine_fsdp2.engine import FSDP2Engine

    class Plugin:
        @hookimpl
        def register_engines(self, register):  # the fsdp2 engine's class, without "moe" in its metadata
            register("plain", FSDP2Engine, config_schema=FSDP2EngineConfig)

    register_temporary_plugin(Plugin(), name="plain-engine")
    with pytest.raises(ConfigError, match="engine 'plain' does not train mixture-of-experts routing"):
        demo_config(tmp_path, moe_model, "actor.moe.router_replay=r2", "actor.engine=plain")


def test_the_megatron_engine_checks_its_moe_node():
    pytest.importorskip("rlplat_engine_megatron")
    from rlplat_engine_megatron.config import read_engine_config

    read_engine_config({"model_config": tiny_moe_config("qwen2_moe"), "moe": {"router_replay": "r2"}})
    with pytest.raises((ValueError, ConfigError), match="router_replay must be one of"):
        read_engine_config({"model_config": tiny_moe_config("qwen2_moe"), "moe": {"router_replay": "r5"}})


def test_the_fsdp2_engine_checks_its_moe_node():
    from rlplat_engine_fsdp2.config import read_engine_config

    with pytest.raises((ValueError, ConfigError), match="router_replay must be one of off, r2, r3"):
        read_engine_config({"model_config": tiny_moe_config("qwen2_moe"), "moe": {"router_replay": "R3"}})
    assert read_engine_config({"model_config": tiny_moe_config("qwen2_moe"), "moe": {"router_replay": "r3"}}).moe


def test_the_plan_counts_every_expert_and_only_the_sparse_layers():
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlplat.contracts.memory import ModelShape

    for model_type, extra in [(name, {}) for name in MOE_MODEL_TYPES] + [("qwen2_moe", {"decoder_sparse_step": 2}),
                                                                         ("qwen3_moe", {"mlp_only_layers": [0]})]:
        settings = tiny_moe_config(model_type, **extra)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        model = AutoModelForCausalLM.from_config(config)
        shape = ModelShape.from_config({**config.to_dict(), "model_type": model_type})
        assert shape.parameters() == sum(parameter.numel() for parameter in model.parameters()), (model_type, extra)
        experts = sum(parameter.numel() for name, parameter in model.named_parameters()
                      if ".experts." in name or name.endswith("mlp.gate.weight"))
        assert shape.expert_parameters() == experts, (model_type, extra)
