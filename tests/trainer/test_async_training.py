"""Asynchronous training (``trainer.mode``): the staleness bound, colocate_async at staleness 0 equal to
sync, dropped samples regenerated, a separate rollout pool, lossless resume after kills, and partial rollouts
(``trainer.partial_rollout``): weight loads that land during the generations in flight of a rollout in a pool
of its own, the bound counted per token, and unfinished sequences in the checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import rlplat
from rlplat.config import load_config
from rlplat.config_node import ConfigError
from rlplat.kits.data import write_parquet
from rlplat.testing.fork_server import ForkServer
from rlplat.testing.runs import fit_run
from rlplat.testing.tiny_models import save_tiny_model
from rlplat.trainer.rollout_dump import read_batch, step_file
from rlplat.trainer.tracking import read_metrics

pytestmark = pytest.mark.slow  # whole runs, some of them on Ray: left out of `make test-fast`

PROMPTS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_assets")
    model = save_tiny_model(root / "model", seed=0)
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"ground_truth": str(a + b)}} for a, b in [(i, 3 * i % 7) for i in range(PROMPTS)]]
    return {"model": model, "train": write_parquet(rows, root / "train.parquet")}


def overrides(assets, output_dir, *extra) -> list[str]:
    return [
        f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=3", "actor.optim.lr=1e-3",
        "actor.micro_batch_size_per_gpu=4", "reward.scorer=exact_match", "cluster.backend=local", "cluster.threads_per_process=1",
        f"trainer.output_dir={output_dir}", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "algorithm.rollout_correction.allow_uncorrected=true",  # these tests are about staleness itself
        *extra,
    ]


def fit(config, inspect=None) -> list[dict]:
    return fit_run(config, inspect=inspect)


def trained(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]


def assert_each_prompt_once_per_epoch(records: list[dict], epochs: int) -> None:
    """Every prompt of epochs ``0 .. epochs - 1`` trained exactly once, none twice after them."""
    uids = [uid for record in records for uid in record["uids"]]
    assert len(uids) == len(set(uids)), "a prompt was trained twice"
    whole = [uid for uid in uids if int(uid.split("-")[0][1:]) < epochs]
    assert sorted(whole) == sorted(f"e{epoch}-i{index}" for epoch in range(epochs) for index in range(PROMPTS))


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/", "async/")) and k != "time"}


def engine_weights(trainer) -> dict[str, torch.Tensor]:
    engine = trainer.actor.backend.host.workers["actor"].actor
    return {name: tensor.clone() for bucket in engine.named_weights() for name, tensor in bucket}


def test_overlap_is_the_part_of_a_generation_covered_by_updates():
    from rlplat.trainer.pipeline import merge_windows, overlap_seconds, pop_window

    updates = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]
    assert merge_windows(updates) == [(0.0, 2.0), (3.0, 4.0)]
    assert overlap_seconds((1.5, 3.5), updates) == pytest.approx(1.0)  # 1.5-2.0 and 3.0-3.5, nothing counted twice
    assert overlap_seconds((5.0, 6.0), updates) == 0.0
    metrics = {"async/update_start": [2.0, 1.0], "async/update_end": [3.0, 4.0], "actor/loss": 1.0}
    assert pop_window(metrics, "update") == (1.0, 4.0) and metrics == {"actor/loss": 1.0}


@pytest.mark.parametrize("bad, message", [
    ("trainer.mode=asynch", "trainer.mode must be one of"),
    ("trainer.max_staleness=-1", "trainer.max_staleness must be an int >= 0"),
    ("trainer.staleness_policy=skip", "trainer.staleness_policy must be wait or drop"),
    ("trainer.rollout_ahead=0", "trainer.rollout_ahead must be an int >= 1"),
])
def test_bad_async_keys_are_refused_at_load(assets, tmp_path, bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides(assets, tmp_path, "trainer.mode=colocate_async", bad), algo="grpo")


@pytest.mark.parametrize("extra, message", [
    (["trainer.rollout_dispatch=replica", "trainer.mode=colocate_async"], "only trainer.mode=separate_async has"),
    (["cluster.cpus_per_process=0"], "cluster.cpus_per_process must be > 0"),
    (["trainer.mode=colocate_async", "trainer.rollout_ahead=3", "trainer.max_staleness=1"], "would be trained 2 versions stale"),
    (["trainer.mode=separate_async"], "needs cluster.backend=ray"),
    (["trainer.mode=separate_async", "cluster.backend=ray", "roles.rollout.placement=colocated"], "drop that key"),
    (["trainer.mode=colocate_async", "cluster.backend=ray", "roles.rollout.placement=separate"], "use trainer.mode=separate_async"),
])
def test_modes_that_contradict_the_placement_are_refused(assets, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides(assets, tmp_path, *extra), algo="grpo")


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_no_trained_sample_is_older_than_the_bound_over_200_steps(assets, tmp_path, bound):
    run = tmp_path / f"k{bound}"
    records = fit(load_config(overrides=overrides(assets, run, "trainer.mode=colocate_async", f"trainer.max_staleness={bound}",
                                                  "trainer.total_training_steps=200"), algo="grpo"))
    assert [r["step"] for r in records] == list(range(1, 201))
    assert max(r["async/staleness_max"] for r in records) == bound  # the pipeline runs as far ahead as allowed
    assert all(r["async/samples_dropped"] == 0 for r in records)
    lines = trained(run)
    assert max(line["staleness_max"] for line in lines) == bound
    assert [line["staleness_max"] for line in lines[bound:]] == [bound] * (200 - bound)
    assert_each_prompt_once_per_epoch(lines, epochs=200 * 2 // PROMPTS)  # whole epochs only
    assert lines[-1]["uids"]  # the last step trained


def test_colocate_async_at_staleness_0_equals_sync_over_30_steps(assets, tmp_path):
    weights = {}

    def run(mode):
        config = load_config(overrides=overrides(assets, tmp_path / mode, f"trainer.mode={mode}", "trainer.max_staleness=0",
                                                 "trainer.total_training_steps=30"), algo="grpo")
        return fit(config, inspect=lambda trainer: weights.__setitem__(mode, engine_weights(trainer)))

    sync, asynchronous = run("sync"), run("colocate_async")
    assert [comparable(r) for r in sync] == [comparable(r) for r in asynchronous]
    assert all(r["async/staleness_max"] == 0 for r in asynchronous)
    assert weights["sync"].keys() == weights["colocate_async"].keys()
    assert all(torch.equal(weights["sync"][name], weights["colocate_async"][name]) for name in weights["sync"])
    assert trained(tmp_path / "sync") == trained(tmp_path / "colocate_async")


def test_drop_regenerates_stale_samples_and_loses_no_prompt(assets, tmp_path):
    run = tmp_path / "drop"
    records = fit(load_config(overrides=overrides(assets, run, "trainer.mode=colocate_async", "trainer.max_staleness=0",
                                                  "trainer.staleness_policy=drop", "trainer.rollout_ahead=2",
                                                  "trainer.total_training_steps=12"), algo="grpo"))
    # two generations in flight at version v: the second is one version stale at its step, dropped, redone
    assert sum(r["async/samples_dropped"] for r in records) == 11 * 4
    assert all(r["async/staleness_max"] == 0 for r in records)
    assert_each_prompt_once_per_epoch(trained(run), epochs=2)


def test_separate_async_generates_in_its_own_pool_and_resumes_exactly(assets, tmp_path):
    # two rollout processes, each generating whole batches (step s on process s % 2), beside the actor's
    common = ["trainer.mode=separate_async", "trainer.max_staleness=1", "cluster.backend=ray", "trainer.save_freq=3",
              "roles.rollout.devices_per_node=2", "trainer.rollout_dispatch=replica", "cluster.cpus_per_process=0.5"]
    straight = fit(load_config(overrides=overrides(assets, tmp_path / "straight", *common, "trainer.total_training_steps=6"),
                               algo="grpo"))
    assert [r["async/staleness_max"] for r in straight] == [0, 1, 1, 1, 1, 1]
    assert all(r["async/samples_dropped"] == 0 for r in straight)
    assert all(0.0 <= r["async/overlap_fraction"] <= 1.0 for r in straight)  # how much is timing: the bench measures it
    stored = tmp_path / "straight" / "checkpoints" / "global_step_3"
    state = json.loads((stored / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["rollout_buffer"]] == [4, 5]  # finished generations, in the checkpoint

    # resume from the middle of the straight run: the stored generations are trained, none is redone
    resumed = fit(load_config(overrides=overrides(assets, tmp_path / "resumed", *common, "trainer.total_training_steps=6",
                                                  f"trainer.resume={stored}"), algo="grpo"))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [comparable(r) for r in resumed] == [comparable(r) for r in straight[3:]]
    assert trained(tmp_path / "resumed") == trained(tmp_path / "straight")[3:]


def kill_and_restart(server: ForkServer, arguments: list[str], run: Path, chooser: random.Random, times: int = 10) -> int:
    """Start the run (``arguments``, resuming from its latest checkpoint) in a child, wait until it trained a
    step beyond where it resumed, SIGKILL it at a random moment; ``times`` times, fewer if it finishes
    first. The number of kills."""
    kills = 0
    while kills < times:
        progress = len(trained(run)) if (run / "trained_prompts.jsonl").exists() else 0
        pid = server.start("rlplat.testing.runs:fit_overrides", arguments, "grpo")
        started = time.monotonic()
        exit_code = server.poll(pid)
        while exit_code is None and time.monotonic() - started < 120:
            if (len(trained(run)) if (run / "trained_prompts.jsonl").exists() else 0) > progress:
                break
            time.sleep(0.02)
            exit_code = server.poll(pid)
        if exit_code is not None:
            assert exit_code == 0, server.log_tail()
            break  # finished before it could be killed
        time.sleep(chooser.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        server.wait(pid)
        kills += 1
    return kills


def test_a_run_killed_ten_times_trains_every_prompt_of_each_epoch_once(assets, tmp_path):
    """SIGKILL at random points (generation, update, checkpoint), resume each time: the steps kept are
    exactly those of an uninterrupted run, and each epoch's prompts are trained once."""
    straight = tmp_path / "straight"
    settings = ["trainer.mode=colocate_async", "trainer.max_staleness=2", "trainer.save_freq=1", "trainer.total_training_steps=24"]
    fit(load_config(overrides=overrides(assets, straight, *settings), algo="grpo"))

    run = tmp_path / "killed"
    arguments = overrides(assets, run, *settings)
    # Each try is a process forked from a server that imported rlplat, torch and transformers once, so the
    # ten tries do not pay ten interpreter starts; the server and every try are stopped when the block ends.
    preload = ["torch", "transformers", "rlplat.config", "rlplat.trainer.loop", "rlplat.testing.runs"]
    with ForkServer(preload, log=tmp_path / "tries.log") as server:
        kills = kill_and_restart(server, arguments, run, random.Random(17))
    assert kills >= 5, "the run finished too quickly to be killed often"
    fit(load_config(overrides=arguments, algo="grpo"))
    assert trained(run) == trained(straight)
    assert_each_prompt_once_per_epoch(trained(run), epochs=4)


# A rollout in its own pool on Ray, one process, half a core; responses never end early (no EOS), so that a
# generation takes longer than a training step and weight loads and checkpoints find it in flight.
SEPARATE = ["trainer.mode=separate_async", "cluster.backend=ray", "roles.rollout.devices_per_node=1",
            "cluster.cpus_per_process=0.5", "rollout.config.eos_token_ids=[]", "rollout.response_length=64"]


def token_staleness(run: Path, steps: int) -> list[torch.Tensor]:
    """Per trained step, each trained token's staleness ((step - 1) - the version that sampled it), from the
    batches the run dumped."""
    found = []
    for step in range(1, steps + 1):
        batch = read_batch(step_file(run / "dump", step))
        mask = batch.batch["response_mask"].bool()
        found.append((step - 1) - batch.batch["policy_version"][mask])
    return found


@pytest.mark.parametrize("extra, message", [
    (["trainer.partial_rollout=sometimes"], "trainer.partial_rollout must be one of off, keep, recompute"),
    (["trainer.mode=colocate_async", "trainer.partial_rollout=keep"], "a weight update never lands during a generation"),
    (["trainer.partial_rollout=keep"], "only trainer.mode=separate_async has"),
    (["trainer.mode=separate_async", "cluster.backend=ray", "trainer.partial_rollout=keep", "rollout.free_between_phases=true"],
     "set rollout.free_between_phases=false"),
    (["trainer.mode=separate_async", "cluster.backend=ray", "trainer.partial_rollout=recompute", "rollout.name=steady"],
     "rollout 'steady' does not list 'recompute' in its partial_rollout_modes \\(it cannot carry"),
])
def test_partial_rollouts_are_refused_where_they_cannot_work(assets, tmp_path, extra, message):
    from rlplat import registry
    from rlplat_rollout_hf.rollout import HFRollout

    class SteadyRollout(HFRollout):
        partial_rollout_modes = ()

    class Plugin:
        @rlplat.hookimpl
        def register_rollouts(self, register):
            register("steady", SteadyRollout, config_schema="rlplat_rollout_hf.config:HFRolloutConfig")

    registry.register_plugin(Plugin(), name="steady-rollout")
    try:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides(assets, tmp_path, *extra), algo="grpo")
    finally:
        registry.unregister_plugin("steady-rollout")


@pytest.mark.slow
def test_loads_land_during_generations_and_no_token_is_trained_beyond_the_bound_over_200_steps(assets, tmp_path):
    mode, steps = "keep", 200  # recompute: the kill-six-times test below
    run = tmp_path / mode
    records = fit_run(load_config(overrides=overrides(
        assets, run, *SEPARATE, f"trainer.partial_rollout={mode}", "trainer.max_staleness=1",
        f"trainer.total_training_steps={steps}", f"trainer.rollout_dump_dir={run / 'dump'}"), algo="grpo"))
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    staleness = token_staleness(run, steps)
    assert max(int(tokens.max()) for tokens in staleness) <= 1 and min(int(tokens.min()) for tokens in staleness) >= 0
    # the loads landed during generations: samples whose tokens come from two versions, trained
    mixed = sum(r["async/partial_samples"] for r in records)
    assert mixed > 0, "no weight load landed during a generation"
    print(f"{mode}: {mixed:.0f} of {steps * 4} samples sampled by two policy versions; staleness per token "
          f"{torch.cat(staleness).float().mean():.3f} on average")
    assert all(r["async/samples_dropped"] == 0 for r in records)
    assert max(line["staleness_max"] for line in trained(run)) <= 1
    assert_each_prompt_once_per_epoch(trained(run), epochs=steps * 2 // PROMPTS)


@pytest.mark.slow
def test_a_run_with_partials_in_flight_killed_six_times_trains_every_prompt_of_each_epoch_once(assets, tmp_path):
    """SIGKILL at random points, resume from the last checkpoint each time: the checkpoints store the generations
    in flight cut short, with their tokens' versions, and the resumed run continues them. (Six kills, not the
    colocated test's ten: each try here starts a rollout process on Ray, about 17 s a try on 2 cores.)"""
    settings = [*SEPARATE, "trainer.partial_rollout=recompute", "trainer.max_staleness=2", "trainer.save_freq=1",
                "trainer.total_training_steps=24"]
    run = tmp_path / "killed"
    import ray

    from rlplat.controller.ray_backend import start_ray

    # one Ray cluster, started here, for every try: a killed driver's workers go with it, the cluster stays
    start_ray()
    try:
        arguments = overrides(assets, run, *settings, f"cluster.address={ray.get_runtime_context().gcs_address}")
        preload = ["torch", "transformers", "ray", "rlplat.config", "rlplat.trainer.loop", "rlplat.testing.runs"]
        with ForkServer(preload, log=tmp_path / "tries.log") as server:
            kills = kill_and_restart(server, arguments, run, random.Random(23), times=6)
        assert kills >= 4, "the run finished too quickly to be killed often"
        fit_run(load_config(overrides=arguments, algo="grpo"))  # to the end, on the same cluster
    finally:
        ray.shutdown()
    records = read_metrics(run)
    assert records[-1]["step"] == 24
    cut = sum(record.get("async/continued_samples", 0) for record in records)
    assert cut > 0, "no checkpoint found a generation in flight"
    lines = trained(run)
    assert [line["step"] for line in lines] == list(range(1, 25))
    assert max(line["staleness_max"] for line in lines) <= 2
    assert_each_prompt_once_per_epoch(lines, epochs=24 * 2 // PROMPTS)
    print(f"{kills} kills; samples cut short by a checkpoint and continued: {cut}")
