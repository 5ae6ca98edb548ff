"""Mixture-of-experts models in the megatron engine: Qwen2-MoE, Qwen3-MoE and Mixtral checkpoints give the
fsdp2 engine's log-probs and export unchanged; on two gloo processes expert parallelism (EP=2) equals EP=1 and
the fsdp2 engine under router replay (r3 with drifted routes, r2) and both router losses, and resumes exactly,
and context parallelism (CP=2) equals them too (moe_engine_worker.py); layouts and settings that cannot work are refused with the reason. Expert
parallelism runs on CPU through megatron-core's all-gather token dispatcher (its all-to-all one creates CUDA
streams)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from rlplat.testing.distributed import max_difference  # noqa: E402
from rlplat.testing.engines import TINY_QWEN2, tiny_engine_batch  # noqa: E402
from rlplat.testing.tiny_models import save_tiny_moe_model, tiny_moe_config  # noqa: E402
from rlplat_engine_megatron.config import MegatronEngineConfig  # noqa: E402
from rlplat_engine_megatron.memory import layout_problems  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_engine_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_moe_checkpoint_gives_the_fsdp2_engines_log_probs_and_exports_unchanged(tmp_path, model_type):
    from safetensors.torch import load_file

    from rlplat_engine_fsdp2.engine import FSDP2Engine
    from rlplat_engine_megatron.engine import MegatronEngine

    path = save_tiny_moe_model(tmp_path / "hf", model_type, seed=4)
    batch = tiny_engine_batch(6)
    megatron = MegatronEngine(dict(model_path=path))
    megatron.init_model()
    fsdp2 = FSDP2Engine(dict(model_path=path, dtype="float32"))
    fsdp2.init_model()
    ours, theirs = megatron.forward(batch, calculate_entropy=True), fsdp2.forward(batch, calculate_entropy=True)
    valid = batch.batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):  # float32 sums in another order: a few ulps of the ~2.8 nats
        assert float((ours.batch[key] - theirs.batch[key])[valid].abs().max()) <= 1e-5, key
    megatron.export_hf(str(tmp_path / "export"))
    exported, original = load_file(str(tmp_path / "export" / "model.safetensors")), load_file(os.path.join(path, "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Rank 0's results of moe_engine_worker.py on two gloo processes."""
    from two_process_launch import launch

    directory = tmp_path_factory.mktemp("megatron-moe")
    model = save_tiny_moe_model(directory / "hf", "qwen2_moe", seed=4)
    return launch(2, {"model": model}, directory, worker=WORKER)


@pytest.mark.slow
def test_expert_parallel_2_equals_1_and_the_fsdp2_engine_under_r3_replay_and_router_losses(two_ranks):
    mask = tiny_engine_batch(8, seed=3).batch["response_mask"].bool()
    for name in ("ep2", "fsdp2"):  # log-probs with the replayed (drifted) routes
        assert float((two_ranks[f"{name}/log_probs"] - two_ranks["ep1/log_probs"])[mask].abs().max()) <= 1e-5, name
    # one AdamW step (lr 1e-3) on the policy-gradient loss plus the load-balancing and z-losses
    assert max_difference(two_ranks["ep2/weights"], two_ranks["ep1/weights"]) <= 1e-5
    assert max_difference(two_ranks["fsdp2/weights"], two_ranks["ep1/weights"]) <= 1e-5
    for name in ("ep1", "ep2"):
        metrics, reference = two_ranks[f"{name}/metrics"], two_ranks["fsdp2/metrics"]
        assert metrics["actor/moe/replayed_fraction"] == 1.0  # every (token, layer) whose route matters was replayed
        assert metrics["actor/moe/replay_agreement"] < 0.5  # the drawn routes are not the live ones
        for key in ("actor/moe/aux_loss", "actor/moe/z_loss", "actor/moe/load_imbalance", "actor/moe/replay_agreement"):
            assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), (name, key)
        assert metrics["actor/moe/aux_loss"] > 0 and metrics["actor/moe/z_loss"] > 0
        assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_expert_parallel_exports_every_expert_and_resumes_exactly_and_the_plan_counts_each_ranks_parameters(two_ranks):
    from rlplat.contracts.memory import ModelShape
    from rlplat_engine_megatron.memory import stage_parameters

    assert two_ranks["ep2/export_names_equal"] and two_ranks["ep2/export_max_diff"] == 0.0
    assert any(".mlp.experts.7.down_proj.weight" in name for name in two_ranks["ep2/weights"])  # an expert of the second rank
    assert float(two_ranks["ep2/resume_max_diff"]) == 0.0
    shape = ModelShape.from_config(tiny_moe_config("qwen2_moe"), "config.json")
    for name, ep in (("ep1", 1), ("ep2", 2)):
        assert stage_parameters(shape, "lm", 1, 1, ep)[0] == two_ranks[f"{name}/local_parameters"], name
    assert two_ranks["ep2/local_parameters"] < two_ranks["ep1/local_parameters"]


@pytest.mark.slow
def test_r2_returns_the_live_routes_and_the_update_replays_them(two_ranks):
    ours, theirs = two_ranks["r2/routes"], two_ranks["fsdp2-r2/routes"]
    mask = tiny_engine_batch(8, seed=3).batch["attention_mask"].bool()
    assert ours.shape == theirs.shape == (*mask.shape, 2, 2) and ours.dtype == torch.int16
    assert bool((ours[~mask] == -1).all()) and bool((ours[mask] >= 0).all())
    # the same experts as the fsdp2 engine's live routing (as sets: the order of equal scores may differ)
    same = (ours.sort(-1).values == theirs.sort(-1).values).all(-1)[mask]
    assert float(same.float().mean()) >= 0.99
    metrics = two_ranks["r2/metrics"]
    assert metrics["actor/moe/replayed_fraction"] == 1.0 and metrics["actor/moe/replay_agreement"] >= 0.99
    assert max_difference(two_ranks["r2/weights"], two_ranks["fsdp2-r2/weights"]) <= 1e-5


@pytest.mark.slow
def test_context_parallelism_replays_records_and_balances_the_routers_as_one_rank(two_ranks):
    """CP=2: each rank's routers see half of every row's positions; the replayed routes are sliced alike, the
    recorded ones gathered back, and the router losses are the whole rows' (summed over the group)."""
    mask = tiny_engine_batch(8, seed=3).batch["response_mask"].bool()
    assert float((two_ranks["cp2/log_probs"] - two_ranks["ep1/log_probs"])[mask].abs().max()) <= 1e-5
    assert max_difference(two_ranks["cp2/weights"], two_ranks["ep1/weights"]) <= 1e-5
    metrics, reference = two_ranks["cp2/metrics"], two_ranks["ep1/metrics"]
    for key in ("actor/moe/aux_loss", "actor/moe/z_loss", "actor/moe/load_imbalance", "actor/moe/replayed_fraction",
                "actor/moe/replay_agreement"):
        assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    assert torch.equal(two_ranks["cp2-r2/routes"], two_ranks["r2/routes"])
    assert two_ranks["cp2-r2/metrics"]["actor/moe/replayed_fraction"] == 1.0
    assert max_difference(two_ranks["cp2-r2/weights"], two_ranks["r2/weights"]) <= 1e-5


def test_layouts_and_settings_that_cannot_work_are_refused_with_the_reason():
    moe = tiny_moe_config("qwen2_moe")
    config = MegatronEngineConfig(model_config=moe, expert_model_parallel_size=3)
    assert any("8 experts are not divisible by e.expert_model_parallel_size=3" in problem for problem in layout_problems(config, 3, moe, "e"))
    config = MegatronEngineConfig(model_config=moe, expert_model_parallel_size=2, tensor_parallel_size=2)
    assert any("world size 2 is not divisible by" in problem and "= 4" in problem for problem in layout_problems(config, 2, moe))
    dense = dict(model_type="qwen2", num_attention_heads=4, num_hidden_layers=2, vocab_size=16)
    assert any("needs a mixture-of-experts model" in problem
               for problem in layout_problems(MegatronEngineConfig(model_config=dense, expert_model_parallel_size=2), 2, dense))
    with pytest.raises(ValueError, match="recompute_granularity='full' with moe's router replay"):
        MegatronEngineConfig(model_config=moe, moe={"router_replay": "r3"}, recompute_granularity="full")
    MegatronEngineConfig(model_config=moe, moe={"router_replay": "r3"}, recompute_granularity="selective")


@pytest.mark.slow
def test_a_moe_model_is_refused_with_a_pipeline_on_cpu_and_moe_on_a_dense_model():
    from rlplat_engine_megatron.engine import MegatronEngine

    if torch.cuda.is_available():
        pytest.skip("the refusal is for CPU")
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 needs a GPU"):
        MegatronEngine(dict(model_config=tiny_moe_config("qwen2_moe"), pipeline_parallel_size=2)).init_model()
    with pytest.raises(ValueError, match="moe is set .* has no experts"):
        MegatronEngine(dict(model_config=dict(TINY_QWEN2), moe={"aux_loss_coef": 0.1})).init_model()
