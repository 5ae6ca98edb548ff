"""The driver loop end to end on CPU: a tiny model, arithmetic prompts, a reward from a file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlplat.config import load_config
from rlplat.kits.data import write_parquet
from rlplat.testing.runs import fit_run
from rlplat.testing.tiny_models import save_tiny_model
from rlplat.trainer.tracking import read_metrics

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

REWARD = '''
import os
import pathlib
import time


def stall_after_first_checkpoint():
    """Test hook: with RLPLAT_TEST_STALL_RUN set, block once the first checkpoint is complete, so that
    the test can SIGKILL the run in the middle of the following step."""
    run = os.environ.get("RLPLAT_TEST_STALL_RUN")
    if run and (pathlib.Path(run) / "checkpoints" / "global_step_2" / "COMPLETE").exists():
        (pathlib.Path(run) / "stalled").touch()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.1)


CALLS = []


def interrupt_at_call():
    """Test hook: with RLPLAT_TEST_INTERRUPT_AT_CALL=N, the N-th call sends Ctrl-C (SIGINT) to this process."""
    wanted = os.environ.get("RLPLAT_TEST_INTERRUPT_AT_CALL")
    CALLS.append(1)
    if wanted and len(CALLS) == int(wanted):
        import signal

        os.kill(os.getpid(), signal.SIGINT)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    stall_after_first_checkpoint()
    interrupt_at_call()
    # partial credit (digits written) so that a random tiny model already sees different scores
    digits = sum(character.isdigit() for character in solution_str)
    correct = solution_str.strip() == str(ground_truth)
    return {"score": 1.0 if correct else digits / 8, "acc": correct}
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    model = save_tiny_model(root / "model", seed=0)
    rows = [
        {"data_source": "arith", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "reward_model": {"ground_truth": str(a + b)}}
        for a, b in [(12, 34), (5, 6), (40, 2), (7, 7), (21, 13), (9, 1), (3, 30), (11, 11)]
    ]
    train = write_parquet(rows, root / "train.parquet")
    val = write_parquet(rows[:4], root / "val.parquet")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {"model": model, "train": train, "val": val, "reward": str(reward)}


def run_config(assets, output_dir, *extra, algo="grpo", validate=True):
    overrides = [
        f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['val']}]",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=4",
        "actor.optim.lr=1e-3", "actor.micro_batch_size_per_gpu=4", "critic.optim.lr=1e-3",
        f"reward.custom_function.path={assets['reward']}", "cluster.backend=local", f"trainer.output_dir={output_dir}",
        "trainer.logger=[jsonl]", "trainer.total_training_steps=4", "trainer.test_freq=2", *extra,
    ]
    return load_config(overrides=overrides, algo=algo) if validate else overrides


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory):
    """One uninterrupted 4-step run (checkpoints at steps 2 and 4), shared by the tests that check it or
    compare with it: its directory and its metric records."""
    run = tmp_path_factory.mktemp("straight") / "run"
    return run, train(run_config(assets, run, "trainer.save_freq=2"))


def test_a_run_killed_after_its_first_checkpoint_resumes_to_the_same_metrics(assets, straight, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    _, straight = straight
    killed = tmp_path / "killed"
    overrides = list(run_config(assets, killed, "trainer.save_freq=2", validate=False))
    script = (
        "import sys\nfrom rlplat.config import load_config\nfrom rlplat.trainer import Trainer\n"
        f"Trainer(load_config(overrides={overrides!r}, algo='grpo')).fit()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "RLPLAT_TEST_STALL_RUN": str(killed)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not (killed / "stalled").exists():
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    resumed = train(run_config(assets, killed, "trainer.save_freq=2"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    compared = [(comparable(a), comparable(b)) for a, b in zip(straight[3:], resumed[3:])]
    assert len(compared) == 2 and all(a == b for a, b in compared)


def test_ctrl_c_finishes_the_step_saves_and_stops(assets, tmp_path):
    import os
    import subprocess
    import sys

    run = tmp_path / "interrupted"
    overrides = run_config(assets, run, validate=False)
    script = f"from rlplat.config import load_config\nfrom rlplat.trainer import Trainer\nTrainer(load_config(overrides={overrides!r})).fit()\n"
    # one scorer call per response: 4 validating before training, 8 in step 1, then call 14 is in step 2
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "RLPLAT_TEST_INTERRUPT_AT_CALL": "14"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_2"]


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/")) and k != "time"}


def train(config, inspect=None) -> list[dict]:
    return fit_run(config, inspect=inspect)


def largest_weight_change(trainer, model_dir) -> float:
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    engine = trainer.actor.backend.host.workers["actor"].actor
    return max(float((tensor - initial[name]).abs().max()) for bucket in engine.named_weights() for name, tensor in bucket)


def test_grpo_trains_logs_validates_and_checkpoints(straight):
    run, records = straight
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert "val/arith/acc/mean" in records[0] and "val/arith/score/mean" in records[2]
    for record in records[1:]:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "timing_s/gen"):
            assert math.isfinite(record[key]), key
        assert record["rollout/log_prob_diff_max"] < 1e-4
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_2", "global_step_4"]
    assert (run / "config.yaml").exists()


def test_a_resumed_run_repeats_the_uninterrupted_one_exactly(assets, straight, tmp_path):
    _, straight = straight
    train(run_config(assets, tmp_path / "resumed", "trainer.save_freq=2", "trainer.total_training_steps=2"))
    resumed = train(run_config(assets, tmp_path / "resumed", "trainer.save_freq=2"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for before, after in zip(straight[3:], resumed[3:]):
        assert comparable(before) == comparable(after)


@pytest.mark.parametrize("algo", ["ppo", "dr_grpo", "rloo", "reinforce_pp", "remax", "dapo", "gspo"])
def test_every_algorithm_runs_through_the_loop(assets, tmp_path, algo):
    changes = []
    records = train(run_config(assets, tmp_path / algo, "trainer.total_training_steps=2", "trainer.test_freq=0",
                               "trainer.val_before_train=false", algo=algo),
                    inspect=lambda trainer: changes.append(largest_weight_change(trainer, assets["model"])))
    assert changes[0] > 1e-4
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert math.isfinite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0
        assert math.isfinite(record["critic/advantages/mean"])
    if algo == "ppo":
        assert math.isfinite(records[-1]["critic/vf_loss"])
    assert (tmp_path / algo / "checkpoints" / "global_step_2" / "COMPLETE").exists()
