"""Training runs through a real SGLang engine on CPUs (SGLang's CPU engine; ``make test`` runs these in
``.venv-sglang-cpu``): the mission's command, ``rlplat run --algo grpo --engine fsdp2 --rollout sglang``, learns
the demo with the weight-sync probe on every step; the tool demo's agent loop calls its calculator more often; a
black-box agent trains through the gateway; a separate rollout pool on Ray stays within its staleness bound; PPO
with a critic runs; what this rollout cannot do (partial rollouts) is refused at load.

The rollout runs in float32 here so that the sync probe can hold SGLang to the trainer's own log-probs at 1e-5
(measured: under 1e-6 per token). SGLang's CPU engine cannot honour seeds, so these runs do not replay their
samples; the thresholds below hold over the runs measured (the README's table).
"""

from __future__ import annotations

import json

import pytest

from rlplat_rollout_sglang.platform import cpu_engine

pytest.importorskip("sglang", reason="sglang is not installed here: `make test` runs these tests in .venv-sglang-cpu")
if not cpu_engine():
    pytest.skip("the installed SGLang is a CUDA build: `make gpu-check-sglang` runs a GRPO run through it", allow_module_level=True)

from rlplat.config import ConfigError, load_config  # noqa: E402
from rlplat.testing.runs import fit_run, probed, sums_assets, sums_overrides  # noqa: E402

pytestmark = pytest.mark.slow

#: the rollout in float32, the sync probe on every step at the float32 tolerance
SGLANG = ["rollout.name=sglang", "rollout.config.dtype=float32", "rollout.config.cpu_kv_cache_gib=0.1",
          "rollout.sync_probe.freq=1", "rollout.sync_probe.tolerance=1e-5"]
QUIET = ["trainer.logger=[jsonl]", "trainer.save_freq=0"]


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_running():
    """A run on ``cluster.backend=ray`` starts a local Ray cluster in this process and leaves it up for the
    next run; the module stops it."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return sums_assets(tmp_path_factory.mktemp("sglang_run_assets"))


def small_run(assets, output_dir, *extra) -> list[str]:
    return sums_overrides(assets, output_dir, *SGLANG, *extra)


def test_the_demos_grpo_learns_through_sglang_with_the_sync_probe_on_every_step(tmp_path):
    """``rlplat run --algo grpo --engine fsdp2 --rollout sglang`` on the built-in demo, its settings and cosine
    schedule over 200 steps: greedy validation accuracy rises by at least 0.15 (measured over 300 steps:
    0.445 -> 0.67 at step 200, 0.745 at 300; over 120: 0.61), and every step's weight sync passes the probe at 1e-5."""
    from rlplat_demo import overrides

    config = load_config(overrides=[*overrides(), *SGLANG, *QUIET, f"trainer.output_dir={tmp_path / 'demo'}",
                                    "trainer.total_training_steps=200", "trainer.test_freq=50"], algo="grpo", engine="fsdp2", rollout="sglang")
    records = fit_run(config)
    accuracy = [(record["step"], record["val/arith/acc/mean"]) for record in records if "val/arith/acc/mean" in record]
    differences = probed(records)
    print(f"greedy validation accuracy: {accuracy}; sync probe per token: max {max(differences):.2e} over {len(differences)} steps")
    assert accuracy[0][0] == 0 and max(value for _, value in accuracy[1:]) - accuracy[0][1] >= 0.15, accuracy
    assert len(differences) == 200 and max(differences) < 1e-5


def test_the_tool_demo_calls_its_calculator_more_often_through_sglang(tmp_path):
    """The tool demo (GRPO through the tool agent loop, token in and token out through ``generate_tokens``):
    the tool-call rate of its rollouts rises over its 20 steps, as it does with the hf rollout."""
    from rlplat_demo import preset

    config = load_config(overrides=[*preset("tools"), *SGLANG, *QUIET, f"trainer.output_dir={tmp_path / 'tools'}"], algo="grpo")
    records = fit_run(config)
    rates = [record["agent/tool_call_rate"] for record in records if "agent/tool_call_rate" in record]
    print(f"tool-call rate per step: {[round(rate, 3) for rate in rates]}")
    assert len(rates) == 20
    assert sum(rates[-5:]) / 5 > sum(rates[:5]) / 5 + 0.1, rates
    assert max(probed(records)) < 1e-5


def test_a_blackbox_openai_agent_trains_through_the_gateway_on_sglang(tmp_path):
    """The tools-blackbox demo: an agent written only against the ``openai`` client, served by the rollout
    worker's gateway over SGLang's ``generate_tokens``; every call recorded, its tool-call rate rises (5 steps)."""
    from rlplat_demo import preset

    config = load_config(overrides=[*preset("tools-blackbox"), *SGLANG, *QUIET, f"trainer.output_dir={tmp_path / 'blackbox'}",
                                    "trainer.total_training_steps=5", "trainer.test_freq=0"], algo="grpo")
    records = fit_run(config)
    rates = [record["agent/tool_call_rate"] for record in records if "agent/tool_call_rate" in record]
    print(f"tool-call rate per step: {[round(rate, 3) for rate in rates]}")
    assert len(rates) == 5
    assert sum(rates[-2:]) / 2 > rates[0] + 0.3, rates
    assert all(record["agent/agent_errors/mean"] <= 0.05 for record in records if "agent/agent_errors/mean" in record)
    assert max(probed(records)) < 1e-5


def test_a_separate_rollout_pool_on_ray_serves_sglang_within_the_staleness_bound(assets, tmp_path):
    """``trainer.mode=separate_async``: SGLang in a rollout pool of its own (a Ray actor), weights shipped to it
    after every update; 10 steps, each trained token at most one version stale."""
    run = tmp_path / "separate"
    records = fit_run(load_config(overrides=small_run(
        assets, run, "trainer.mode=separate_async", "trainer.max_staleness=1", "algorithm.rollout_correction.allow_uncorrected=true",
        "cluster.backend=ray", "roles.rollout.devices_per_node=1", "cluster.cpus_per_process=0.5", "trainer.total_training_steps=10"), algo="grpo"))
    assert [record["step"] for record in records] == list(range(1, 11))
    assert all(0 <= record["async/staleness_max"] <= 1 for record in records)
    assert all(record["async/samples_dropped"] == 0 for record in records)
    trained = [json.loads(line) for line in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in trained] == list(range(1, 11)) and max(line["staleness_max"] for line in trained) <= 1


def test_partial_rollouts_are_refused_at_load_with_the_reason(assets, tmp_path):
    """This rollout declares no ``partial_rollout_modes``: ``trainer.partial_rollout`` is refused before any worker starts."""
    with pytest.raises(ConfigError, match="rollout 'sglang' does not list 'keep' in its partial_rollout_modes \\(it cannot carry"):
        load_config(overrides=small_run(assets, tmp_path / "partial", "trainer.mode=separate_async", "trainer.max_staleness=1", "cluster.backend=ray",
                                        "algorithm.rollout_correction.allow_uncorrected=true", "trainer.partial_rollout=keep"), algo="grpo")


def test_lora_adapters_are_refused_at_load_on_the_cpu_engine(assets, tmp_path):
    """``actor.lora.sync=adapter`` needs a rollout that loads adapters: SGLang's CPU engine cannot (its LoRA layers
    pin host memory), so the run is refused before any worker starts, pointing at ``merged``."""
    with pytest.raises(ConfigError, match=r"rollout 'sglang' cannot load adapters .*use actor.lora.sync=merged"):
        load_config(overrides=small_run(assets, tmp_path / "adapter", "actor.lora.rank=8", "actor.lora.sync=adapter",
                                        "rollout.config.max_lora_rank=8"), algo="grpo")


def test_ppo_with_a_critic_runs_through_sglang(assets, tmp_path):
    records = fit_run(load_config(overrides=small_run(assets, tmp_path / "ppo", "critic.ppo_mini_batch_size=4", "critic.micro_batch_size_per_gpu=8",
                                                      "trainer.total_training_steps=3"), algo="ppo"))
    assert [record["step"] for record in records] == [1, 2, 3]
    assert all("critic/vf_loss" in record for record in records)
    assert max(probed(records)) < 1e-5


def test_lora_training_reaches_sglang_as_merged_weights(assets, tmp_path):
    """SGLang's CPU engine cannot serve adapters (its LoRA layers need pinned memory, CUDA-only): with
    ``actor.lora.sync=merged`` the adapter is merged into the weights the rollout gets at every sync; the probe on
    every step holds its samples to the trainer's policy at 1e-5."""
    records = fit_run(load_config(overrides=small_run(assets, tmp_path / "lora", "actor.lora.rank=8", "actor.lora.alpha=16",
                                                      "actor.lora.sync=merged", "actor.optim.lr=1e-2", "trainer.total_training_steps=3"),
                                  algo="grpo"))
    assert [record["step"] for record in records] == [1, 2, 3]
    assert len(probed(records)) == 3 and max(probed(records)) < 1e-5
