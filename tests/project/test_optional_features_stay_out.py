"""With only the engine, rollout, algorithm and rule-reward plugins enabled (and the demo, whose preset the
run uses), the single-turn demo trains, and no module of any other feature is imported: measured with
``python -X importtime`` on a real run (the local backend: workers in the same process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlplat import registry

ENABLED = ["engine-fsdp2", "rollout-hf", "algorithms", "rewards", "demo"]
#: Packages (or modules) of the optional features, none of which a single-turn run may import.
OPTIONAL = ("rlplat_agents", "rlplat_python_tool", "rlplat_judge", "rlplat_reward_model", "rlplat_verl", "rlplat_sft", "rlplat_distill", "rlplat_tinker",
            "rlplat_rewards.reward_loop", "rlplat_engine_megatron", "rlplat_rollout_vllm", "rlplat_rollout_sglang",
            # and what only the command line's other commands use
            "rlplat.cli.explain")

RUN = """
import json, sys
from rlplat.cli.main import main
try:
    main(["run", "trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
          "trainer.output_dir={output}", "trainer.resume=disable", "trainer.logger=[jsonl]"])
except SystemExit as exited:
    if exited.code:
        raise
print(json.dumps(sorted(sys.modules)))
"""


def imported_modules(result: subprocess.CompletedProcess) -> set[str]:
    """The modules ``-X importtime`` reports (``import time: self | cumulative | name``: every ``import``
    statement's), and those in ``sys.modules`` at the end of the run (also what ``importlib.import_module``
    loaded, which ``-X importtime`` does not report)."""
    timed = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    return (timed - {"package"}) | set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_the_single_turn_demo_trains_without_importing_an_optional_feature(tmp_path):
    plugins = {record.name for record in registry.plugins()}
    enabled = [name for name in ENABLED if name in plugins]
    assert set(ENABLED) - {"demo"} <= set(enabled), plugins
    output = tmp_path / "run"
    environment = {**__import__("os").environ, "RLPLAT_PLUGINS": ",".join(enabled)}
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", RUN.format(output=output)], capture_output=True,
                            text=True, env=environment, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    imported = imported_modules(result)
    assert {"rlplat.trainer.loop", "rlplat_engine_fsdp2", "rlplat_rollout_hf", "rlplat_algorithms"} <= imported  # it sees the run
    leaked = sorted(name for name in imported if any(name == prefix or name.startswith(prefix + ".") for prefix in OPTIONAL))
    assert leaked == []


def test_without_the_agents_distribution_data_naming_agent_loops_is_refused_naming_it(tmp_path, run_files, python_run):
    from rlplat.kits.data import write_parquet

    model, _ = run_files
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"},
             "agent_name": "tool"}]
    data = write_parquet(rows, tmp_path / "agents.parquet")
    result = python_run(f"""
        from rlplat.config import ConfigError, load_config
        try:
            load_config(None, ["model.path={model}", "data.train_files=[{data}]", "cluster.backend=local"])
        except ConfigError as error:
            print(error)
        """, env={"RLPLAT_PLUGINS": ",".join(ENABLED)})
    assert result.returncode == 0, result.stderr
    assert "agent_name column" in result.stdout and "pip install rlplat-agents" in result.stdout
