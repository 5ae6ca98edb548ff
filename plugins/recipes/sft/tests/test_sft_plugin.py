"""rlplat-sft as a plugin: it registers the ``rlplat sft`` command, its config is checked like ``rlplat
run``'s (the same cluster rules, read by core's one reader of a run's arguments)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlplat.config_node import ConfigError
from rlplat.kits.data import write_parquet
from rlplat_sft.config import load_sft_config


def test_the_plugin_registers_the_sft_command():
    from rlplat import registry
    from rlplat_sft.command import sft

    entry = registry.entry("command", "sft")
    assert entry.distribution == "rlplat-sft"
    assert entry.load() is sft


def test_rlplat_sft_help_is_mounted_from_the_plugin(cli_in_process):
    result = cli_in_process("sft", "--help")
    assert result.returncode == 0, result.stderr
    assert "Supervised fine-tuning on the same engines" in result.stdout


def test_rlplat_sft_refuses_the_same_cluster_settings(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    train = write_parquet([{"prompt": "1+1=", "response": "2"}], tmp_path / "train.parquet")
    with pytest.raises(ConfigError, match="cluster.backend=local runs one worker process"):
        load_sft_config(None, [f"model.path={model}", f"data.train_files=[{train}]", "cluster.backend=local",
                               "cluster.devices_per_node=2"])
    with pytest.raises(ConfigError, match="cluster.use_gpu must be auto, true or false"):
        load_sft_config(None, [f"model.path={model}", f"data.train_files=[{train}]", "cluster.use_gpu=cuda"])


@pytest.mark.parametrize("config_file, overrides, says", [
    ("/no/such/file.yaml", [], "--config: /no/such/file.yaml does not exist or is not a file."),
    (None, ["data.train_files=[a.parquet"], "; write them as key=value, e.g. actor.optim.lr=1e-5."),
])
def test_the_arguments_are_read_by_cores_reader(config_file, overrides, says):
    with pytest.raises(ConfigError) as raised:
        load_sft_config(config_file, overrides)
    assert says in str(raised.value)


