"""``rlplat sft``: the config checked before a worker starts, a run's metrics and export, and exact resume
after a kill (the NLL loss it trains with is core's: tests/test_losses_nll.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlplat.config_node import ConfigError
from rlplat.kits.data import write_parquet
from rlplat.testing.tiny_models import save_tiny_model


# -- a tiny run ----------------------------------------------------------------------------------------------

def pairs(start, count):
    return [{"prompt": f"{a}+{a % 7}=", "response": str(a + a % 7)} for a in range(start, start + count)]


@pytest.fixture
def task(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    train = write_parquet(pairs(10, 32), tmp_path / "train.parquet")
    val = write_parquet(pairs(60, 8), tmp_path / "val.parquet")
    return model, train, val


def arguments(task, run_dir, *extra):
    model, train, val = task
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.train_batch_size=8",
            "actor.optim.lr=1e-3", "actor.micro_batch_size_per_gpu=4", "trainer.total_training_steps=3",
            "trainer.test_freq=2", f"trainer.output_dir={run_dir}", "trainer.logger=[jsonl]", "cluster.backend=local", *extra]


@pytest.mark.parametrize("override, says", [
    ("actor.optim.lrr=1", "unknown config key 'actor.optim.lrr'"),
    ("actor.engine_config.lr=1", "'actor.engine_config.lr' is set from actor.optim.lr"),
    ("actor.engine_config.use_remove_paddin=true", "use_remove_padding"),
    ("loss.loss_agg_mode=token-avg", "loss_agg_mode 'token-avg' is not one of"),
    ("cluster.devices_per_node=3", "data.train_batch_size=8 examples do not split over the 3 worker processes"),
    ("data.truncation=left", "data.truncation='left' is not one of"),
])
def test_a_config_error_names_the_key_before_any_worker_starts(task, tmp_path, override, says):
    from rlplat_sft.config import load_sft_config

    overrides = arguments(task, tmp_path / "run", override)
    if override.startswith("cluster."):
        overrides.remove("cluster.backend=local")
    with pytest.raises(ConfigError) as error:
        load_sft_config(None, overrides)
    assert says in str(error.value)


def test_the_trainer_keys_both_commands_share_have_one_definition():
    """``rlplat sft``'s trainer node takes the keys that mean the same as ``rlplat run``'s from one class,
    and ``rlplat run``'s node has each of them with the same type, default and documentation."""
    import dataclasses

    from rlplat.config import TrainerConfig
    from rlplat.config_node import field_docs
    from rlplat_sft.config import SFTTrainerConfig
    from rlplat.config.trainer import SharedTrainerConfig

    def described(schema):
        """Field name -> (type, default value, documentation)."""
        docs = field_docs(schema)
        return {field.name: (str(field.type), field.default if field.default_factory is dataclasses.MISSING
                             else field.default_factory(), docs.get(field.name)) for field in dataclasses.fields(schema)}

    shared = described(SharedTrainerConfig)
    assert issubclass(SFTTrainerConfig, SharedTrainerConfig)
    sft, run = described(SFTTrainerConfig), described(TrainerConfig)
    assert {name: sft[name] for name in shared} == shared
    assert {name: run.get(name) for name in shared} == shared


@pytest.mark.slow
def test_a_malformed_row_stops_the_command_with_its_file_row_and_column(task, tmp_path, cli_run):
    bad = write_parquet([{"prompt": "1+1=", "response": "2"}, {"prompt": "", "response": "2"}], tmp_path / "bad.parquet")
    result = cli_run("sft", *arguments(task, tmp_path / "run", f"data.train_files=[{bad}]", "data.train_batch_size=1"))
    assert result.returncode == 2
    assert f"rlplat: config error: data.train_files: {bad}, row 1, column 'prompt': the prompt is empty" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_run_logs_train_and_validation_loss_and_exports_a_model_rlplat_run_takes(task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlplat.config import load_config
    from rlplat_sft.config import load_sft_config
    from rlplat_sft.data import validation_batches
    from rlplat_sft.trainer import SFTTrainer
    from rlplat.trainer.tracking import read_metrics

    trainer = SFTTrainer(load_sft_config(None, arguments(task, tmp_path / "run")))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    records = read_metrics(tmp_path / "run")
    assert [record["step"] for record in records] == [0, 1, 2, 3]
    assert all("val/loss" in records[step] for step in (0, 2, 3)) and "val/loss" not in records[1]
    assert records[3]["val/perplexity"] == pytest.approx(math.exp(records[3]["val/loss"]))
    assert records[3]["train/loss"] < records[1]["train/loss"]

    # the engine's validation loss of the untrained model is Hugging Face's own loss on the same tokens
    model_path = task[0]
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    batch = validation_batches(trainer.val_set, None)[0].batch
    labels = batch["input_ids"].clone()
    width = batch["responses"].shape[1]
    labels[:, :-width] = -100
    labels[:, -width:][batch["response_mask"] == 0] = -100
    with torch.no_grad():
        hf_loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=batch["position_ids"], labels=labels).loss.item()
    assert records[0]["val/loss"] == pytest.approx(hf_loss, rel=1e-5)

    export = tmp_path / "run" / "hf_model"
    AutoModelForCausalLM.from_pretrained(export)
    AutoTokenizer.from_pretrained(export)
    rl_data = write_parquet([{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}],
                              "reward_model": {"ground_truth": "2"}}] * 4, tmp_path / "rl.parquet")
    load_config(None, [f"model.path={export}", f"data.train_files=[{rl_data}]", "data.train_batch_size=4",
                       "actor.ppo_mini_batch_size=4", "cluster.backend=local"], algo="grpo")


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_run(task, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from rlplat_sft.config import load_sft_config
    from rlplat_sft.trainer import run_sft
    from rlplat.trainer.tracking import read_metrics

    settings = ("trainer.total_training_steps=8", "trainer.save_freq=2", "trainer.test_freq=4")

    def comparable(record):
        return {key: value for key, value in record.items() if not key.startswith(("timing_s/", "perf/")) and key != "time"}

    run_sft(load_sft_config(None, arguments(task, tmp_path / "straight", *settings)))
    killed = tmp_path / "killed"
    script = ("from rlplat_sft.config import load_sft_config\nfrom rlplat_sft.trainer import run_sft\n"
              f"run_sft(load_sft_config(None, {arguments(task, killed, *settings)!r}))\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "global_step_2" / "COMPLETE").exists():
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    process.stderr.close()
    assert not (killed / "hf_model").exists(), "the run finished before it was killed: nothing was resumed"
    run_sft(load_sft_config(None, arguments(task, killed, *settings)))
    assert [comparable(r) for r in read_metrics(killed)] == [comparable(r) for r in read_metrics(tmp_path / "straight")]
    straight = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    resumed = load_file(killed / "hf_model" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
