"""``rlplat plan``: the memory of a run per device and per phase, from config.json alone, with the numbers
worked out by hand; ``rlplat run`` refuses a run that cannot fit, before anything starts."""

from __future__ import annotations

import json
import math
import time

import pytest

from rlplat.contracts.memory import MemoryContext, ModelShape
from rlplat.kits.memory import GIB

#: Meta-Llama-3-8B's config.json (the sizes that matter): 8,030,261,248 parameters.
LLAMA3_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16", "max_position_embeddings": 8192,
}
LLAMA3_8B_PARAMETERS = 8_030_261_248


def context(**overrides) -> MemoryContext:
    settings = dict(role="actor", processes=8, device="cuda", prompt_length=1024, response_length=1024,
                    sequences_per_process=64, device_memory=80 * GIB)
    return MemoryContext(**{**settings, **overrides})


@pytest.fixture
def llama_dir(tmp_path):
    """A model directory holding only Llama-3-8B's config.json (no weights: the plan needs none)."""
    directory = tmp_path / "llama3-8b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA3_8B))
    return directory


def test_the_parameter_count_of_llama3_8b_comes_from_its_config_json():
    # embeddings 128256 x 4096 = 525,336,576; each layer: q, o 4096^2, k, v 4096 x 1024, MLP 3 x 4096 x 14336,
    # two norms -> 218,112,000; 32 layers; final norm 4096; untied head 525,336,576
    shape = ModelShape.from_config(LLAMA3_8B)
    assert shape.layer_parameters() == 218_112_000
    assert shape.parameters() == 525_336_576 + 32 * 218_112_000 + 4096 + 525_336_576 == LLAMA3_8B_PARAMETERS


def test_fsdp_mixed_precision_adam_holds_16_bytes_per_parameter_over_the_shards():
    from rlplat_engine_fsdp2.memory import estimate

    # 8 GPUs of 80 GB, bf16 compute: float32 master weights (4 B), float32 gradients (4 B), AdamW's two float32
    # moments (8 B): 16 B per parameter, divided over the 8 shards = 16,060,522,496 B (14.96 GiB) per device
    result = estimate({"model_path": "llama", "dtype": "bfloat16"}, LLAMA3_8B, context())
    items = {item.name: item.bytes for item in result.items if item.name in ("parameters", "gradients", "optimizer states")}
    assert items == {"parameters": LLAMA3_8B_PARAMETERS * 4 // 8, "gradients": LLAMA3_8B_PARAMETERS * 4 // 8,
                     "optimizer states": LLAMA3_8B_PARAMETERS * 8 // 8}
    assert sum(items.values()) == 16 * LLAMA3_8B_PARAMETERS // 8 == 16_060_522_496


def test_replicated_data_parallel_holds_16_bytes_per_parameter_on_every_process_and_a_reduce_bucket():
    from rlplat_engine_fsdp2.config import REDUCE_BUCKET_BYTES
    from rlplat_engine_fsdp2.memory import estimate

    result = estimate({"model_path": "llama", "dtype": "float32", "data_parallel": "replicate"}, LLAMA3_8B, context())
    items = {item.name: item.bytes for item in result.items}
    assert (items["parameters"], items["gradients"], items["optimizer states"]) == (
        LLAMA3_8B_PARAMETERS * 4, LLAMA3_8B_PARAMETERS * 4, LLAMA3_8B_PARAMETERS * 8)
    assert items["all-reduce bucket"] == REDUCE_BUCKET_BYTES
    assert "gathered parameters" not in items and "weight-sync bucket" not in items  # nothing is gathered


def test_the_reference_holds_only_its_parameter_shards_and_forward_activations():
    from rlplat_engine_fsdp2.memory import estimate

    result = estimate({"model_path": "llama", "dtype": "bfloat16"}, LLAMA3_8B, context(role="reference"))
    names = [item.name for item in result.items]
    assert "gradients" not in names and "optimizer states" not in names
    assert result.during("update") == result.during("resident")  # nothing of it is held for an update


def test_the_hf_kv_cache_is_2_x_layers_x_kv_heads_x_head_dim_x_bytes_x_tokens():
    from rlplat_rollout_hf.memory import estimate

    # 64 sequences of 1024 + 1024 tokens in bfloat16: 2 x 32 x 8 x 128 x 2 B = 131,072 B per token,
    # x 131,072 tokens = 17,179,869,184 B (16 GiB)
    result = estimate({"model_path": "llama", "dtype": "bfloat16"}, LLAMA3_8B, context(role="rollout"))
    kv = next(item for item in result.items if item.name == "KV cache")
    assert kv.bytes == 2 * 32 * 8 * 128 * 2 * (64 * 2048) == 16 * GIB


def test_vllm_fills_its_memory_fraction_with_a_kv_cache_of_whole_tokens():
    from rlplat_rollout_vllm.memory import estimate

    # gpu_memory_utilization 0.5 of 80 GiB = 42,949,672,960 B; weights 8,030,261,248 x 2 B = 16,060,522,496 B; the
    # activation reserve: 8192 batched tokens x 2 B x (4 x 4096 + 3 x 14336) = 973,078,528 B and 256 rows of float32
    # logits x 2 = 262,668,288 B; left 25,653,403,648 B / 131,072 B per token = 195,719 whole tokens
    result = estimate({"model_path": "llama", "dtype": "bfloat16", "gpu_memory_utilization": 0.5}, LLAMA3_8B, context(role="rollout"))
    items = {item.name: item.bytes for item in result.items}
    reserve = 8192 * 2 * (4 * 4096 + 3 * 14336) + 256 * 128256 * 4 * 2
    assert items["weights"] == LLAMA3_8B_PARAMETERS * 2 and items["activation reserve"] == reserve
    tokens = (40 * GIB - LLAMA3_8B_PARAMETERS * 2 - reserve) // 131_072
    assert items["KV cache"] == 2 * 32 * 8 * 128 * 2 * tokens and tokens == 195_719
    assert not result.problems


def test_vllm_with_a_fraction_smaller_than_its_weights_is_a_problem_that_names_the_key():
    from rlplat_rollout_vllm.memory import estimate

    result = estimate({"model_path": "llama", "gpu_memory_utilization": 0.15}, LLAMA3_8B, context(role="rollout"))
    assert result.problems and "raise rollout.config.gpu_memory_utilization" in result.problems[0]


def test_ulysses_divides_the_tokens_per_process_and_a_size_that_does_not_divide_is_refused_naming_the_key():
    from rlplat.testing.tiny_models import tiny_moe_config
    from rlplat_engine_fsdp2.memory import estimate

    model = dict(model_type="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2)

    def actor(sp: int, processes: int, model: dict = model):
        context = MemoryContext(role="actor", processes=processes, device="cpu", prompt_length=64, response_length=64,
                                sequences_per_process=8 // processes)
        return estimate(dict(model_config=model, micro_batch_size_per_gpu=8, dtype="float32",
                             ulysses_sequence_parallel_size=sp), model, context)

    plain, parallel = actor(1, 1), actor(2, 2)
    activations = {name: next(item for item in estimate_.items if item.name == "activations") for name, estimate_ in
                   (("plain", plain), ("parallel", parallel))}
    assert "1,024 tokens per micro-batch" in activations["plain"].detail
    assert "512 tokens (1/2 of a micro-batch's pack: Ulysses)" in activations["parallel"].detail
    with pytest.raises(ValueError, match=r"actor\.engine_config\.ulysses_sequence_parallel_size=4 on the role's 2 process\(es\): "
                                         r"it does not divide the 2 processes"):
        actor(4, 2)
    with pytest.raises(ValueError, match=r"does not divide the model's 3 attention heads"):
        actor(2, 2, dict(model, num_attention_heads=3, num_key_value_heads=3, hidden_size=96))
    moe = tiny_moe_config()  # a mixture of experts runs sequence-parallel too: its routers see each rank's slice
    moe_activations = [next(item.bytes for item in actor(sp, sp, moe).items if item.name == "activations") for sp in (1, 2)]
    assert moe_activations[1] < moe_activations[0]


def test_recomputation_keeps_one_layer_and_the_layer_inputs():
    from rlplat_engine_fsdp2.memory import estimate, layer_activation_bytes

    shape = ModelShape.from_config(LLAMA3_8B)
    plain, recomputed = (
        next(item.bytes for item in estimate({"model_path": "m", "dtype": "bfloat16", "micro_batch_size_per_gpu": 2,
                                              "enable_gradient_checkpointing": flag}, LLAMA3_8B, context()).items
             if item.name == "activations" and "update" in item.calls)
        for flag in (False, True))
    # 2 rows x 2048 tokens; per layer and token 2 B x (2h + 3q + 2kv + 4i) + 2 norms x (4h + 2 x 2 B x h)
    assert layer_activation_bytes(shape, 2) == 2 * (2 * 4096 + 3 * 4096 + 2 * 1024 + 4 * 14336) + 2 * (4 * 4096 + 4 * 4096)
    assert plain - recomputed == 4096 * (32 - 1) * (layer_activation_bytes(shape, 2) - 2 * 4096) - 4096 * 2 * 4096


def plan_of(llama_dir, *overrides):
    from rlplat.config import load_config
    from rlplat.cli.planner import plan_run

    config = load_config(overrides=[f"model.path={llama_dir}", "data.max_prompt_length=1024", "rollout.response_length=1024",
                                    "data.train_batch_size=64", "actor.ppo_mini_batch_size=64", "rollout.n=8",
                                    "cluster.use_gpu=true", "cluster.devices_per_node=8", "cluster.device_memory_gib=80",
                                    "rollout.name=vllm", *overrides], validate=False)
    return plan_run(config)


def test_a_ppo_plan_places_the_roles_counts_the_devices_and_names_the_peak(llama_dir):
    plan = plan_of(llama_dir, "algorithm.name=ppo", "roles.critic.placement=separate", "roles.critic.devices_per_node=4",
                   "actor.engine_config.enable_gradient_checkpointing=true", "actor.micro_batch_size_per_gpu=1",
                   "critic.engine_config.enable_gradient_checkpointing=true", "critic.micro_batch_size_per_gpu=1",
                   "actor.engine_config.dtype=bfloat16")
    assert [(pool.name, pool.devices, pool.roles) for pool in plan.pools] == [("actor", 8, ["actor", "rollout"]), ("critic", 4, ["critic"])]
    assert plan.devices_needed == 12
    assert plan.phases == ["generation", "old_log_prob", "values", "update_critic", "update_actor", "weight_sync"]
    phase, total, (component, item) = plan.peak("actor")
    assert total == max(plan.totals("actor").values()) and phase in plan.phases
    assert (component.role, item.name) == ("rollout", "KV cache")  # vLLM's fraction: its KV cache is the largest part
    critic = plan.totals("critic")
    assert critic["generation"] == critic["old_log_prob"] < critic["values"] < critic["update_critic"]
    assert plan.to_dict()["fits"] is True and not plan.problems()


def test_a_plan_that_cannot_fit_names_the_phase_the_component_and_the_numbers(llama_dir):
    # one device: 8,030,261,248 parameters x 16 B = 119.7 GiB of weights, gradients and AdamW states alone
    plan = plan_of(llama_dir, "cluster.devices_per_node=1", "cluster.backend=local", "rollout.name=hf", "data.train_batch_size=1",
                   "actor.ppo_mini_batch_size=1", "rollout.n=1", "rollout.config.dtype=bfloat16")
    (problem,) = plan.problems()
    # one bf16 rank without FSDP2: a bf16 copy of every weight in each call, and the update's bf16 gradients of a
    # layer and the output layer on top: the update is the largest phase
    assert problem.startswith("the update (actor) phase needs 181 GiB on each device of the actor pool")
    assert "more than the 80 GiB of a device (cluster.device_memory_gib)" in problem
    assert "its largest part is the actor's optimizer states: 59.8 GiB (AdamW: 2 x 8,030,261,248 x 4 B (float32))" in problem


def invoke(*args: str):
    """The ``rlplat`` command line in this process (its imports are warm): ``(exit code, stdout, stderr)``."""
    from typer.testing import CliRunner

    from rlplat.cli.main import build_app

    result = CliRunner().invoke(build_app(), list(args))
    return result.exit_code, result.stdout, result.stderr


def test_plan_prints_json_reading_only_config_json_and_exits_1_when_it_does_not_fit(llama_dir):
    code, stdout, stderr = invoke("plan", "--json", f"model.path={llama_dir}", "data.train_files=[missing.parquet]",
                                  "cluster.use_gpu=true", "cluster.device_memory_gib=24", "data.max_prompt_length=512",
                                  "rollout.response_length=512")
    assert code == 1, stderr[-2000:]
    plan = json.loads(stdout)
    assert plan["fits"] is False and plan["devices_needed"] == 1 and plan["device_memory"] == 24 * GIB
    (pool,) = plan["pools"]
    assert pool["roles"] == ["actor", "rollout", "reference"]  # GRPO's KL loss reads reference log-probs
    actor = next(component for component in pool["components"] if component["role"] == "actor")
    assert {item["name"] for item in actor["items"]} >= {"parameters", "gradients", "optimizer states", "activations"}
    assert pool["peak"]["bytes"] == max(pool["phases"].values()) > 24 * GIB
    assert plan["problems"][0].startswith(f"the {json.loads(stdout)['phases'][pool['peak']['phase']]} phase needs ")


def train_file(tmp_path):
    from rlplat.kits.data import write_parquet

    return write_parquet([{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}],
                           "reward_model": {"ground_truth": "2"}}], tmp_path / "train.parquet")


def refused_run_arguments(llama_dir, tmp_path) -> list[str]:
    return ["run", f"model.path={llama_dir}", f"data.train_files=[{train_file(tmp_path)}]", "data.train_batch_size=1",
            "actor.ppo_mini_batch_size=1", "cluster.use_gpu=true", "cluster.device_memory_gib=40",
            f"trainer.output_dir={tmp_path / 'run'}"]


def test_run_refuses_a_config_that_cannot_fit_in_under_5_s_with_the_phase_and_numbers(llama_dir, tmp_path):
    invoke("config", "show", "--help")  # the command line's own imports, which any command pays once
    started = time.monotonic()
    code, _, stderr = invoke(*refused_run_arguments(llama_dir, tmp_path))
    elapsed = time.monotonic() - started
    assert code == 2, stderr[-2000:]
    assert "rlplat: the run would run out of memory, refused before anything starts:" in stderr
    # 8,030,261,248 parameters x 16 B on one device: 119.7 GiB before any activation
    assert "the update (actor) phase needs 1" in stderr and "more than the 40 GiB of a device (cluster.device_memory_gib)" in stderr
    assert "optimizer states: 59.8 GiB" in stderr and "cluster.memory_check=warn" in stderr
    assert not (tmp_path / "run").exists()
    assert elapsed < 5, elapsed


@pytest.mark.slow
def test_the_rlplat_process_refuses_with_exit_code_2_and_no_traceback(cli_run, llama_dir, tmp_path):
    result = cli_run(*refused_run_arguments(llama_dir, tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "refused before anything starts" in result.stderr and "Traceback" not in result.stderr


def test_memory_check_warn_lets_the_run_pass_and_skip_makes_no_plan(llama_dir, tmp_path, capsys):
    import typer

    from rlplat.cli.run import check_memory
    from rlplat.config import load_config

    arguments = refused_run_arguments(llama_dir, tmp_path)[1:-1]
    check_memory(load_config(overrides=[*arguments, "cluster.memory_check=warn"]))  # no exit
    assert "the memory plan does not fit (cluster.memory_check=warn, running anyway)" in capsys.readouterr().err
    (llama_dir / "config.json").unlink()  # without it no plan can be made: refused, unless no plan is asked for
    with pytest.raises(typer.Exit) as refused:
        check_memory(load_config(overrides=arguments))
    assert refused.value.exit_code == 2 and "has no config.json" in capsys.readouterr().err
    check_memory(load_config(overrides=[*arguments, "cluster.memory_check=skip"]))
    assert capsys.readouterr().err == ""


def test_tensor_pipeline_and_data_parallel_sharding_of_the_training_state():
    from rlplat.kits.memory import training_state_items

    # Megatron's layout for 8,030,261,248 parameters on TP 2 x PP 2 x DP 2 = 8 devices: bf16 weights and fp32
    # gradients split by TP x PP (2,007,565,312 each), fp32 master weights and AdamW's moments split by DP too
    # (distributed optimizer): 2 + 4 + (4 + 8) / 2 = 12 B per local parameter
    items = {item.name: item.bytes for item in training_state_items(LLAMA3_8B_PARAMETERS, data_parallel=2, tensor_parallel=2,
                                                                     pipeline_parallel=2)}
    local = LLAMA3_8B_PARAMETERS // 4
    assert items == {"parameters": local * 2, "gradients": local * 4, "master weights": local * 4 // 2,
                     "optimizer states": local * 8 // 2}
    assert sum(items.values()) == 12 * local == 24_090_783_744
    # FSDP's layout is the same helper with everything sharded over 8: the 16 B per parameter of mixed-precision Adam
    fsdp = training_state_items(LLAMA3_8B_PARAMETERS, data_parallel=8, weight_dtype="float32", master_dtype=None,
                                shard_weights_and_gradients=True)
    assert sum(item.bytes for item in fsdp) == 16 * LLAMA3_8B_PARAMETERS // 8


class FixedEngine:
    """A third party's engine class as the registry holds it: only the optional estimate matters here."""

    @classmethod
    def estimate_memory(cls, config, model_config, context):
        from rlplat.contracts.memory import MemoryEstimate, MemoryItem

        layers = model_config["num_hidden_layers"]
        return MemoryEstimate((MemoryItem("weights", layers * GIB, ("resident",), f"{layers} layers x 1 GiB"),
                               MemoryItem("workspace", GIB // context.processes, ("update",), "1 GiB over the processes")))


class SilentEngine:
    """An engine that gives no estimate (the contract's default)."""

    @classmethod
    def estimate_memory(cls, config, model_config, context):
        return None


def test_a_third_party_engine_plugs_its_own_estimate_into_the_plan(llama_dir):
    import rlplat
    from rlplat import registry

    class Plugin:
        @rlplat.hookimpl
        def register_engines(self, register):
            register("fixed-test-engine", FixedEngine)
            register("silent-test-engine", SilentEngine)

    registry.register_plugin(Plugin(), name="plan-test-engines")
    try:
        plan = plan_of(llama_dir, "actor.engine=fixed-test-engine", "rollout.name=hf", "cluster.devices_per_node=4")
        actor = next(component for component in plan.components if component.role == "actor")
        assert [(item.name, item.bytes) for item in actor.estimate.items] == [("weights", 32 * GIB), ("workspace", GIB // 4)]
        assert plan.totals("actor")["update_actor"] - plan.totals("actor")["old_log_prob"] == GIB // 4
        silent = plan_of(llama_dir, "actor.engine=silent-test-engine", "rollout.name=hf")
        assert "actor (engine silent-test-engine): unknown, engine 'silent-test-engine' gives no memory estimate; not counted" in silent.notes()
    finally:
        registry.unregister_plugin("plan-test-engines")


def test_plan_reads_the_engine_node_with_the_engines_own_reader(llama_dir):
    code, _, stderr = invoke("plan", f"model.path={llama_dir}", "actor.engine_config.enable_gradient_checkpoint=true")
    assert code == 2
    assert "unknown key 'enable_gradient_checkpoint'. Did you mean 'enable_gradient_checkpointing'?" in stderr


def test_an_enabled_role_the_plan_cannot_count_is_named_in_the_notes(llama_dir):
    plan = plan_of(llama_dir, "reward.manager=judge", "reward.config.model_path=/judge")
    assert plan.unplanned == ["judge"]
    assert "role judge: the plan has no estimate for it; not counted" in plan.notes()
