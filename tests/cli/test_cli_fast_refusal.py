"""A config error and a memory plan that does not fit are refused by a fresh ``rlplat`` process within
5 s, importing no torch, tensordict, transformers or Ray: the config schema is torch-free
(:mod:`rlplat.data_config`, :data:`rlplat.config.components.BUILTIN_LOSS_SCHEMAS`) and the built-in
engines and rollouts name their torch-free estimate in their registration (``metadata["estimate_memory"]``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HEAVY = ("torch", "tensordict", "transformers", "ray", "vllm", "sglang", "megatron")

#: Meta-Llama-3-8B's sizes: 16 B a parameter of training state alone is ~120 GiB on one device.
LLAMA3_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16", "max_position_embeddings": 8192,
}

MAIN = "import sys; from rlplat.cli.main import main; main(sys.argv[1:])"


def rlplat_process(*args: str) -> tuple[subprocess.CompletedProcess, list[str], float]:
    """``rlplat <args>`` in a fresh interpreter under ``-X importtime``: the finished process (its stderr
    without the import lines), the heavy packages it imported, and its wall time."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RLPLAT_PLUGINS", "RLPLAT_DISABLE_PLUGIN_AUTOLOAD", "PYTHONPROFILEIMPORTTIME")}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", MAIN, *map(str, args)], capture_output=True, text=True,
                            env=environment, timeout=120, cwd=ROOT)
    elapsed = time.monotonic() - started
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    heavy = sorted({name.split(".")[0] for name in imported} & set(HEAVY))
    result.stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    return result, heavy, elapsed


@pytest.fixture
def llama_dir(tmp_path):
    directory = tmp_path / "llama3-8b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA3_8B))
    return directory


@pytest.fixture
def train_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}],
                                          "reward_model": {"ground_truth": "2"}}]), path)
    return path


def test_a_config_error_exits_2_without_importing_torch(tmp_path):
    result, heavy, elapsed = rlplat_process("run", "trainer.nonexistent_key=1", f"trainer.output_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rlplat: config error: overrides: unknown config key 'trainer.nonexistent_key'." in result.stderr
    assert heavy == [], f"the config error imported {heavy}"
    assert elapsed < 5, elapsed


@pytest.mark.parametrize("engine, extra", [
    ("fsdp2", []), ("megatron", []),
    ("fsdp2", ["trainer.mode=separate_async", "trainer.max_staleness=0"]),  # a rollout pool of its own: the roles are built to ask for their pools
], ids=["fsdp2", "megatron", "fsdp2-separate-rollout-pool"])
def test_a_run_that_cannot_fit_is_refused_in_under_5_s_without_importing_torch(engine, extra, llama_dir, train_file, tmp_path):
    result, heavy, elapsed = rlplat_process(
        "run", "--engine", engine, f"model.path={llama_dir}", f"data.train_files=[{train_file}]", "data.train_batch_size=1",
        "actor.ppo_mini_batch_size=1", "cluster.use_gpu=true", "cluster.device_memory_gib=40", f"trainer.output_dir={tmp_path / 'run'}",
        *extra)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rlplat: the run would run out of memory, refused before anything starts:" in result.stderr
    assert "the update (actor) phase needs " in result.stderr and "more than the 40 GiB of a device" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
    assert heavy == [], f"the refusal imported {heavy}"
    assert elapsed < 5, elapsed


def test_rlplat_plan_imports_no_torch(llama_dir):
    result, heavy, _ = rlplat_process("plan", "--algo", "ppo", "--json", f"model.path={llama_dir}", "cluster.use_gpu=true",
                                      "cluster.device_memory_gib=40", "reward.model.path=" + str(llama_dir))
    assert result.returncode == 1, result.stderr[-2000:]  # 1: the plan does not fit
    plan = json.loads(result.stdout)
    assert {component["role"] for pool in plan["pools"] for component in pool["components"]} == {
        "actor", "rollout", "critic", "reward_model"}
    assert all(component["known"] for pool in plan["pools"] for component in pool["components"])
    assert heavy == [], f"rlplat plan imported {heavy}"


def test_core_losses_schemas_named_by_path_are_the_loss_classes_own():
    from rlplat.config.components import BUILTIN_LOSS_SCHEMAS, loss_schema
    from rlplat.contracts.algorithm import Algorithm
    from rlplat.registry import resolve_dotted_path

    for factory, schema in BUILTIN_LOSS_SCHEMAS.items():
        assert resolve_dotted_path(factory).config_schema is resolve_dotted_path(schema)
    default = Algorithm(name="test-default", adv_estimator="grpo")
    assert loss_schema(default, "actor") is default.loss_schema("actor")
    assert loss_schema(default, "critic") is default.loss_schema("critic")

    class OwnSchema(Algorithm):
        def loss_schema(self, which):
            return dict  # an override is asked, never bypassed

    assert loss_schema(OwnSchema(name="test-own", adv_estimator="grpo"), "actor") is dict


@pytest.mark.parametrize("kind, name, engine_class", [
    ("engine", "fsdp2", "rlplat_engine_fsdp2.engine:FSDP2Engine"),
    ("engine", "megatron", "rlplat_engine_megatron.engine:MegatronEngine"),
    ("rollout", "hf", "rlplat_rollout_hf.rollout:HFRollout"),
    ("rollout", "vllm", "rlplat_rollout_vllm.rollout:VLLMRollout"),
    ("rollout", "sglang", "rlplat_rollout_sglang.rollout:SGLangRollout"),
])
def test_each_builtin_registration_names_the_estimate_its_class_gives(kind, name, engine_class):
    from rlplat import registry
    from rlplat.contracts.memory import MemoryContext
    from rlplat.kits.memory import GIB
    from rlplat.cli.planner import estimate_function
    from rlplat.registry import resolve_dotted_path

    entry = registry.entry(kind, name)
    assert entry.metadata["estimate_memory"] == f"{engine_class.split('.')[0]}.memory:estimate"
    function, reason = estimate_function(entry)
    assert reason == "" and function is resolve_dotted_path(entry.metadata["estimate_memory"])
    role = "actor" if kind == "engine" else "rollout"
    context = MemoryContext(role=role, processes=8, device="cuda", prompt_length=1024, response_length=1024,
                            sequences_per_process=64, device_memory=80 * GIB)
    node = {"model_path": "/model"}
    assert function(node, LLAMA3_8B, context) == resolve_dotted_path(engine_class).estimate_memory(node, LLAMA3_8B, context)


class NamedEstimate:
    """A third party's engine whose registration names its estimate: the class is never imported."""

    @staticmethod
    def estimate(config, model_config, context):
        from rlplat.contracts.memory import MemoryEstimate, MemoryItem

        return MemoryEstimate((MemoryItem("weights", 3 << 30, ("resident",), "3 GiB"),))


def test_a_registration_that_names_its_estimate_is_planned_without_importing_the_engine(llama_dir):
    import rlplat
    from rlplat import registry
    from rlplat.config import load_config
    from rlplat.cli.planner import plan_run

    class Plugin:
        @rlplat.hookimpl
        def register_engines(self, register):
            register("named-estimate-engine", "no_such_module_anywhere:Engine",
                     metadata={"estimate_memory": f"{__name__}:NamedEstimate.estimate"})
            register("broken-estimate-engine", "no_such_module_anywhere:Engine",
                     metadata={"estimate_memory": "no_such_module_anywhere:estimate"})

    registry.register_plugin(Plugin(), name="named-estimate-engines")
    try:
        def actor(engine):
            config = load_config(overrides=[f"model.path={llama_dir}", f"actor.engine={engine}", "critic.engine=fsdp2"],
                                 validate=False)
            plan = plan_run(config)
            return plan, next(component for component in plan.components if component.role == "actor")

        _, named = actor("named-estimate-engine")
        assert [(item.name, item.bytes) for item in named.estimate.items] == [("weights", 3 << 30)]
        plan, broken = actor("broken-estimate-engine")
        assert broken.estimate is None
        assert any(note.startswith("actor (engine broken-estimate-engine): unknown, its estimate_memory "
                                   "'no_such_module_anywhere:estimate' cannot be imported (ModuleNotFoundError")
                   for note in plan.notes())
    finally:
        registry.unregister_plugin("named-estimate-engines")


def test_the_moved_names_stay_importable_where_they_were():
    import rlplat.config
    import rlplat.config.components
    import rlplat.data
    import rlplat.data_config

    for name in ("DataConfig", "DataError", "TRUNCATIONS", "as_file_list", "read_data_config"):
        assert getattr(rlplat.data, name) is getattr(rlplat.data_config, name)
    assert rlplat.config.DataConfig is rlplat.data_config.DataConfig
    for name in rlplat.config.components.__all__:
        assert getattr(rlplat.config, name) is getattr(rlplat.config.components, name)
    assert set(rlplat.config.__all__) <= set(dir(rlplat.config))
