"""trainer.profile writes valid Chrome-trace JSON whose phases tile each profiled step; trainer.rollout_dump_dir
and trainer.replay_rollouts: a replayed run's updates equal the original's bit for bit; status.json during a run."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import torch

from rlplat.config import load_config
from rlplat.config_node import ConfigError
from rlplat.kits.data import write_parquet
from rlplat.protocol import DataProto
from rlplat.testing.runs import fit_run
from rlplat.trainer.rollout_dump import ReplayError, read_batch, step_file, write_batch
from rlplat.testing.runs import doubling_overrides

# The Trace Event Format's complete ("X"), instant ("i") and metadata ("M") events, as chrome://tracing and
# Perfetto read them (times in microseconds).
TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "items": {"oneOf": [
            {"type": "object", "required": ["name", "ph", "ts", "dur", "pid", "tid"],
             "properties": {"ph": {"const": "X"}, "name": {"type": "string"}, "ts": {"type": "number", "minimum": 0},
                            "dur": {"type": "number", "minimum": 0}, "pid": {"type": "integer"}, "tid": {"type": "integer"},
                            "cat": {"type": "string"}, "args": {"type": "object"}}},
            {"type": "object", "required": ["name", "ph", "ts", "pid", "s"],
             "properties": {"ph": {"const": "i"}, "s": {"enum": ["g", "p", "t"]}, "ts": {"type": "number"}}},
            {"type": "object", "required": ["name", "ph", "pid", "args"],
             "properties": {"ph": {"const": "M"}, "name": {"const": "process_name"},
                            "args": {"type": "object", "required": ["name"]}}},
        ]}},
    },
}


@pytest.fixture(scope="module")
def assets(doubling_assets):
    return doubling_assets


def overrides(assets, run, *extra):
    return doubling_overrides(assets, run, "rollout.response_length=4", "trainer.total_training_steps=3", *extra)


@pytest.mark.slow
def test_a_profiled_step_is_valid_chrome_trace_json_whose_phases_add_up_to_the_step(assets, tmp_path):
    fit_run(load_config(overrides=overrides(assets, tmp_path, "trainer.profile.steps=[2,3]", "trainer.test_freq=3",
                                            f"data.val_files=[{assets['train']}]"), algo="grpo"))
    assert sorted(path.name for path in (tmp_path / "profile").iterdir()) == ["step_2.trace.json", "step_3.trace.json"]
    for step in (2, 3):
        trace = json.loads((tmp_path / "profile" / f"step_{step}.trace.json").read_text())
        jsonschema.validate(trace, TRACE_SCHEMA)
        spans = [event for event in trace["traceEvents"] if event["ph"] == "X"]
        (whole,) = [event for event in spans if event["name"] == f"step {step}"]
        end = whole["ts"] + whole["dur"]
        track = [event for event in spans if (event["pid"], event["tid"]) == (whole["pid"], whole["tid"])
                 and event is not whole]
        top = []  # the step's children: spans not inside another span of the step
        for event in sorted(track, key=lambda item: (item["ts"], -item["dur"])):
            if top and event["ts"] + event["dur"] <= top[-1]["ts"] + top[-1]["dur"] + 1e-3:
                continue
            top.append(event)
        assert all(whole["ts"] - 1 <= event["ts"] and event["ts"] + event["dur"] <= end + 1 for event in top)
        covered = sum(event["dur"] for event in top)
        assert 0.95 * whole["dur"] <= covered <= 1.0001 * whole["dur"], (covered, whole["dur"], [e["name"] for e in top])
        names = {event["name"] for event in spans}
        assert {"gen", "reward", "update_actor", "sync_weights", "actor.update_actor", "actor.generate_sequences"} <= names
        assert ("validate" in names) == (step == 3) and ("save" in names) == (step == 3)
    written = subprocess.run([sys.executable, "-m", "rlplat.cli.main", "plot", str(tmp_path)], capture_output=True, text=True,
                             timeout=300)
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "plots" / "timeline_step_2.png").stat().st_size > 1000


def test_a_bad_profile_node_is_refused_at_load(assets, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.profile: steps are step numbers from 1, got \[0\]"):
        load_config(overrides=overrides(assets, tmp_path, "trainer.profile.steps=[0,2]"), algo="grpo")


@pytest.mark.slow
def test_a_replayed_run_updates_exactly_as_the_run_that_dumped_its_rollouts(assets, tmp_path):
    dump = tmp_path / "dump"
    original = fit_run(load_config(overrides=overrides(assets, tmp_path / "a", f"trainer.rollout_dump_dir={dump}"), algo="grpo"))
    replayed = fit_run(load_config(overrides=overrides(assets, tmp_path / "b", f"trainer.replay_rollouts={dump}"), algo="grpo"))
    assert len(original) == len(replayed) == 3
    for first, second in zip(original, replayed):
        update = {key for key in first if key.startswith(("actor/", "response_length/", "critic/score", "critic/advantages"))}
        assert update and {key: first[key] for key in update} == {key: second.get(key) for key in update}
        assert "timing_s/gen" in second and "timing_s/reward" not in second  # nothing generated or scored
    batch = read_batch(step_file(dump, 1))
    assert {"responses", "response_mask", "rollout_log_probs", "policy_version", "token_level_scores"} <= set(batch.batch.keys())
    assert {"uid", "data_source", "reward_model"} <= set(batch.non_tensor_batch)


def test_a_dumped_batch_reads_back_bit_for_bit_with_every_dtype_and_odd_values(tmp_path):
    generator = torch.Generator().manual_seed(0)
    batch = DataProto.from_dict(
        {"log_probs": torch.randn(3, 5, generator=generator), "ids": torch.randint(0, 1000, (3, 5), generator=generator),
         "half": torch.randn(3, 2, 2, generator=generator).to(torch.bfloat16), "mask": torch.tensor([[1, 0], [1, 1], [0, 0]]).bool()},
        {"uid": ["a", "a", "b"], "reward_model": [{"ground_truth": "4"}, {"ground_truth": "4"}, {"ground_truth": "9"}],
         "trajectory": [(1, 2), np.arange(3), {"turns": [("user", "hi")]}]},
        meta_info={"reward_metrics": {"reward/errors": 0.0}})
    batch.batch["log_probs"][0, 0] = float("nan")
    path = tmp_path / "step_000001.parquet"
    write_batch(batch, path)
    back = read_batch(path)
    for key in batch.batch.keys():
        assert back.batch[key].dtype == batch.batch[key].dtype and back.batch[key].shape == batch.batch[key].shape
        assert torch.equal(back.batch[key].view(-1).view(torch.uint8) if key == "mask" else back.batch[key].nan_to_num(7.0),
                           batch.batch[key].view(-1).view(torch.uint8) if key == "mask" else batch.batch[key].nan_to_num(7.0))
    assert list(back.non_tensor_batch["uid"]) == ["a", "a", "b"]
    assert back.non_tensor_batch["trajectory"][0] == (1, 2) and np.array_equal(back.non_tensor_batch["trajectory"][1], np.arange(3))
    assert back.meta_info == {"reward_metrics": {"reward/errors": 0.0}}
    assert not list(tmp_path.glob("*.partial"))


def test_replay_needs_every_step_and_the_sync_mode(assets, tmp_path):
    from rlplat.trainer.rollout_dump import check_replay

    (tmp_path / "dump").mkdir()
    write_parquet([{"x": 1}], tmp_path / "dump" / "step_000001.parquet")
    with pytest.raises(ReplayError, match=r"has no batch for steps 2, 3 \(of 1..3\)"):
        check_replay(tmp_path / "dump", 1, 3)
    with pytest.raises(ReplayError, match="not a rollout dump"):
        read_batch(step_file(tmp_path / "dump", 1))
    with pytest.raises(ConfigError, match="use trainer.mode=sync"):
        load_config(overrides=overrides(assets, tmp_path, f"trainer.replay_rollouts={tmp_path / 'dump'}",
                                        "trainer.mode=colocate_async", "trainer.max_staleness=0"), algo="grpo")
