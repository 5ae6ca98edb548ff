"""LoRA through the whole loop: the reference is the actor with its adapter off (KL exactly 0 at the
first step, no reference engine), both sync modes pass the weight-sync probe after every sync, a lost
adapter push stops the run at the first sync, and a resumed run repeats the uninterrupted one."""

from __future__ import annotations

import pytest

from rlplat.config import load_config
from rlplat.kits.data import write_parquet
from rlplat.contracts.health import WeightCorruptedError
from rlplat.trainer.sync_probe import SyncProbeError
from rlplat.testing.runs import fit_run
from rlplat.testing.tiny_models import save_tiny_model
from rlplat.trainer import Trainer

pytestmark = pytest.mark.slow  # whole runs: left out of `make test-fast`


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_assets")
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{a}="}],
             "reward_model": {"ground_truth": str(2 * a)}} for a in range(8)]
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {"model": save_tiny_model(root / "model", seed=0), "train": write_parquet(rows, root / "train.parquet"),
            "reward": str(reward)}


# partial credit (digits written) so that a random tiny model already sees different scores and learns
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": sum(character.isdigit() for character in solution_str) / 4, "acc": solution_str.strip() == ground_truth}
"""


def overrides(assets, run, *extra):
    return [f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=3", "actor.optim.lr=5e-2",
            "actor.micro_batch_size_per_gpu=4", f"reward.custom_function.path={assets['reward']}", "cluster.backend=local",
            "cluster.threads_per_process=1", f"trainer.output_dir={run}", "trainer.logger=[jsonl]",
            "trainer.val_before_train=false", "trainer.total_training_steps=4", "actor.lora.rank=4",
            "actor.lora.alpha=8", "actor.loss.use_kl_loss=true", "rollout.sync_probe.freq=1",
            "rollout.sync_probe.tolerance=1e-5", *extra]


def fit(config, trainer_class=None, inspect=None):
    return fit_run(config, trainer_class=trainer_class, inspect=inspect)


def worker(trainer):
    return trainer.actor.backend.host.workers["actor"]


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_the_reference_is_the_actor_without_its_adapter_and_every_sync_passes_the_probe(assets, tmp_path, sync):
    seen = {}
    records = fit(load_config(overrides=overrides(assets, tmp_path, f"actor.lora.sync={sync}"), algo="grpo"),
                  inspect=lambda trainer: seen.update(reference=worker(trainer).reference,
                                                      from_actor=worker(trainer).reference_from_actor))
    assert seen == {"reference": None, "from_actor": True}  # no second copy of the base model
    assert records[0]["actor/kl_loss"] == 0.0  # the adapter starts at zero: the policy is the reference
    assert records[-1]["actor/kl_loss"] > 0.0
    assert all(r["sync_probe/mean_abs_diff"] < 1e-5 for r in records)
    assert all(r["actor/trainable_params"] < 0.2 * 1e6 for r in records)
    if sync == "adapter":  # the base once (before step 1), then the adapter alone
        assert all(r["sync/bytes"] == 4 * r["actor/trainable_params"] for r in records)  # fp32 adapter tensors


class LostAdapterPush(Trainer):
    """The rollout ignores adapter pushes once the workers are built (a push that got lost)."""

    def build_workers(self) -> None:
        super().build_workers()
        worker(self).rollout.load_adapter = lambda config, named_tensors: None


class LostWeightPush(Trainer):
    def build_workers(self) -> None:
        super().build_workers()
        worker(self).rollout.update_weights = lambda named_tensors: None


# Merged weights are fingerprinted after every sync (the sentinel's weight check names the lost push first); an
# adapter merged into the served weights is not, and the sync probe's log-probs catch it.
@pytest.mark.parametrize("sync, trainer_class, error, match", [
    ("adapter", LostAdapterPush, SyncProbeError, r"sync_probe: after the weight sync.*\(step 1, role rollout\)"),
    ("merged", LostWeightPush, WeightCorruptedError, r"weight_checksum: after the weight sync to version 1.*\(step 1, role rollout"),
])
def test_a_lost_push_stops_the_run_at_the_first_sync(assets, tmp_path, sync, trainer_class, error, match):
    with pytest.raises(error, match=match):
        fit(load_config(overrides=overrides(assets, tmp_path, f"actor.lora.sync={sync}"), algo="grpo"), trainer_class)


def test_a_lora_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_run(assets, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    def comparable(record):
        return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/")) and k != "time"}

    settings = ("trainer.save_freq=2", "trainer.total_training_steps=6", "actor.lora.sync=adapter")
    straight = fit(load_config(overrides=overrides(assets, tmp_path / "straight", *settings), algo="grpo"))
    killed = tmp_path / "killed"
    arguments = overrides(assets, killed, *settings)
    script = ("from rlplat.config import load_config\nfrom rlplat.testing.runs import fit_run\n"
              f"fit_run(load_config(overrides={arguments!r}, algo='grpo'))\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "global_step_2" / "COMPLETE").exists():
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)  # in step 3 or 4, or saving step 4
    process.wait()
    resumed = fit(load_config(overrides=arguments, algo="grpo"))
    assert [comparable(r) for r in resumed] == [comparable(r) for r in straight]


def test_adapter_sync_to_a_rollout_with_too_small_a_reserved_rank_is_refused_at_load(assets, tmp_path, register_temporary_plugin):
    import dataclasses

    from rlplat.config_node import ConfigError
    from rlplat.contracts.rollout import RolloutBuildConfig
    from rlplat.hookspecs import hookimpl
    from rlplat_rollout_hf.rollout import HFRollout

    @dataclasses.dataclass
    class ReservingConfig(RolloutBuildConfig):
        max_lora_rank: int = 0

    class Plugin:
        @hookimpl
        def register_rollouts(self, register):
            register("reserving", HFRollout, config_schema=ReservingConfig)

    register_temporary_plugin(Plugin(), name="reserving-rollout")
    base = overrides(assets, tmp_path, "actor.lora.sync=adapter", "rollout.name=reserving")
    with pytest.raises(ConfigError, match=r"rollout.config.max_lora_rank=0, below actor.lora.rank=4"):
        load_config(overrides=base, algo="grpo")
    load_config(overrides=[*base, "rollout.config.max_lora_rank=8"], algo="grpo")
