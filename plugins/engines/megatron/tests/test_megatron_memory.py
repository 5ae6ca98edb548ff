"""The megatron engine's memory estimate (``MegatronEngine.estimate_memory``, read by ``rlplat plan`` and
``rlplat run``): worked figures for an 8B Llama at TP=2 x PP=2 x DP=2, the plan through the CLI, the layout
refused at load (before any worker starts) naming the key and the numbers, and the estimate against the
peaks measured on CPU at TP=1 (two data-parallel ranks), TP=2, PP=2 and CP=2 within 15% (``memory_worker.measure``
in fresh processes at the start of the two-process launch the numerics test shares;
:class:`rlplat.testing.memory.LiveStorageMeter` counts live tensor storage bytes)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from typer.testing import CliRunner

from rlplat.contracts.memory import MemoryContext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from two_process_launch import MEMORY_BASE, MEMORY_LAYOUTS, MEMORY_LENGTH, MEMORY_MODEL, MEMORY_ROWS  # noqa: E402

TOLERANCE = 0.15
#: The measured model, rows, sequence length and layouts (the shared two-process launch measures them).
MODEL, ROWS, LENGTH, LAYOUTS, BASE = MEMORY_MODEL, MEMORY_ROWS, MEMORY_LENGTH, MEMORY_LAYOUTS, MEMORY_BASE

#: Llama-3-8B's config.json sizes.
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=8192)


def context(processes: int, rows_per_process: int, role: str = "actor", device: str = "cpu", length: int = LENGTH) -> MemoryContext:
    return MemoryContext(role=role, processes=processes, device=device, prompt_length=length, response_length=length,
                         sequences_per_process=rows_per_process)


def test_8b_llama_at_tp2_pp2_dp2_with_the_distributed_optimizer_holds_12_bytes_per_local_parameter():
    from rlplat_engine_megatron.engine import MegatronEngine

    config = dict(model_path="/models/llama-8b", tensor_parallel_size=2, pipeline_parallel_size=2, use_distributed_optimizer=True,
                  micro_batch_size_per_gpu=1, ppo_mini_batch_size=16)
    estimate = MegatronEngine.estimate_memory(config, LLAMA_8B, context(8, 2, device="cuda", length=1024))
    items = {item.name: item.bytes for item in estimate.items}
    # One layer: attention 4096 x (4096 + 2 x 1024) + 4096 x 4096 = 41,943,040; MLP 3 x 4096 x 14336 = 176,160,768;
    # two norms 8,192. Split by TP 2 except the norms: (218,112,000 - 8,192) / 2 + 8,192 = 109,060,096.
    layer = (41_943_040 + 176_160_768) // 2 + 8_192
    assert layer == 109_060_096
    # The last stage (16 layers, final norm, output layer 128,256 x 4,096 / 2) is larger than the first (embedding) by the norm.
    local = 16 * layer + 4_096 + 128_256 * 4_096 // 2
    assert local == 2_007_633_920
    assert items["parameters"] == 2 * local  # bfloat16
    assert items["gradients"] == 4 * local  # megatron's float32 gradient buffer
    assert items["master weights"] == 4 * local // 2  # float32, sharded over DP 2
    assert items["optimizer states"] == 8 * local // 2  # AdamW's two float32 moments, sharded over DP 2
    assert sum(items[name] for name in ("parameters", "gradients", "master weights", "optimizer states")) == 12 * local  # 24.1 GB
    assert "stage 1" in " ".join(estimate.notes)
    # Activations of the first stage: 2 micro-batches in flight (1F1B), 16 layers, 2,048 tokens each.
    assert estimate.during("update") > estimate.during("forward") > 12 * local


def test_the_reference_holds_no_optimizer_moments_and_the_critic_a_value_head():
    from rlplat_engine_megatron.engine import MegatronEngine

    reference = MegatronEngine.estimate_memory(dict(BASE), MODEL, context(1, ROWS, role="reference"))
    assert "optimizer states" not in {item.name for item in reference.items}
    assert {"activations", "weight-sync bucket"}.isdisjoint(item.name for item in reference.items)  # no update, no sync
    critic = MegatronEngine.estimate_memory(dict(BASE, value_model=True), MODEL, context(1, ROWS, role="critic"))
    actor = MegatronEngine.estimate_memory(dict(BASE), MODEL, context(1, ROWS))
    assert [item.bytes for item in critic.items if item.name == "parameters"] < [item.bytes for item in actor.items if item.name == "parameters"]
    assert "weight-sync bucket" not in {item.name for item in critic.items}


def test_the_estimate_refuses_a_layout_that_does_not_fit_naming_every_key():
    from rlplat_engine_megatron.engine import MegatronEngine

    model = dict(MODEL, num_key_value_heads=3, num_attention_heads=6, num_hidden_layers=3, vocab_size=2049)
    with pytest.raises(ValueError) as raised:
        MegatronEngine.estimate_memory(dict(BASE, tensor_parallel_size=2, pipeline_parallel_size=2), model, context(6, 4, role="critic"))
    message = str(raised.value)
    assert "world size 6 is not divisible by critic.engine_config.tensor_parallel_size=2 x critic.engine_config.pipeline_parallel_size=2 = 4" in message
    assert "3 key/value heads" in message and "3 layers" in message and "2049 tokens" in message


def test_the_estimate_refuses_context_parallelism_that_does_not_divide_the_processes():
    from rlplat_engine_megatron.engine import MegatronEngine

    with pytest.raises(ValueError) as raised:
        MegatronEngine.estimate_memory(dict(BASE, tensor_parallel_size=2, context_parallel_size=2), MODEL, context(6, 4))
    assert ("world size 6 is not divisible by actor.engine_config.tensor_parallel_size=2 x actor.engine_config.context_parallel_size=2 "
            "x actor.engine_config.pipeline_parallel_size=1 = 4") in str(raised.value)
    with pytest.raises(ValueError, match="context_parallel_size must be >= 1, got 0"):
        MegatronEngine.estimate_memory(dict(BASE, context_parallel_size=0), MODEL, context(2, 4))


def test_context_parallelism_divides_a_ranks_tokens_and_keeps_the_whole_sequences_keys_and_values():
    from rlplat_engine_megatron.engine import MegatronEngine
    from rlplat_engine_megatron.memory import busiest_response_share

    # 4096-token rows: CP=2 cuts them into chunks of 1024, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2. A response
    # of 1024 is predicted from positions 3071-4094, all rank 0's; one of 3000 from 1095-4094: rank 1 holds 953 + 1024
    assert busiest_response_share(4096, 1024, 2) == 1023 and busiest_response_share(4096, 3000, 2) == 953 + 1024
    whole = MegatronEngine.estimate_memory(dict(BASE, micro_batch_size_per_gpu=1), MODEL, context(2, 2, length=2048))
    split = MegatronEngine.estimate_memory(dict(BASE, micro_batch_size_per_gpu=1, context_parallel_size=2), MODEL, context(2, 2, length=2048))
    ratio = split.during("update") / whole.during("update")
    activations = {estimate: next(item.bytes for item in estimate.items if item.name == "activations") for estimate in (whole, split)}
    assert activations[split] < 0.75 * activations[whole], activations
    assert "TP 1 x CP 2 x PP 1 x DP 1" in " ".join(split.notes) and "(CP 2)" in next(
        item.detail for item in split.items if item.name == "activations"), ratio


def write_model(directory) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MODEL))
    return str(directory)


def cli(arguments: list[str]):
    from rlplat.cli.main import build_app

    return CliRunner().invoke(build_app(), arguments)


def test_rlplat_plan_shows_the_megatron_figures(tmp_path):
    model = write_model(tmp_path / "model")
    result = cli(["plan", "--engine", "megatron", "--json", f"model.path={model}", "cluster.backend=ray", "cluster.devices_per_node=4",
                  "actor.engine_config.tensor_parallel_size=2", "actor.engine_config.use_distributed_optimizer=true"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    (actor,) = [component for component in plan["pools"][0]["components"] if component["role"] == "actor"]
    assert actor["plugin"] == "engine megatron" and actor["known"]
    details = {item["name"]: item["detail"] for item in actor["items"]}
    assert "(stage 0's rank; the model's 4,198,656 over TP 2 x PP 1)" in details["parameters"] and "/ DP 2" in details["optimizer states"]
    assert "weight-sync bucket" in details
    assert any("TP 2 x PP 1 x DP 2" in note for note in plan["notes"])


def test_rlplat_run_refuses_a_tensor_parallel_size_the_processes_do_not_divide_before_any_worker_starts(tmp_path):
    from rlplat.kits.data import write_parquet

    model = write_model(tmp_path / "model")
    train = write_parquet([{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}],
                          tmp_path / "train.parquet")
    arguments = ["run", "--engine", "megatron", f"model.path={model}", f"data.train_files=[{train}]", "data.train_batch_size=2",
                 "actor.ppo_mini_batch_size=2", "cluster.backend=ray", "cluster.devices_per_node=2",
                 f"trainer.output_dir={tmp_path / 'run'}", "actor.engine_config.tensor_parallel_size=3"]
    result = cli(arguments)
    assert result.exit_code == 2, result.output
    assert "actor.engine_config.tensor_parallel_size=3" in result.output and "world size 2" in result.output
    assert not (tmp_path / "run").exists()
    # a layout error is a config error, not a memory figure: cluster.memory_check=warn does not let it through
    warned = cli([*arguments, "cluster.memory_check=warn"])
    assert warned.exit_code == 2 and "actor.engine_config.tensor_parallel_size=3" in warned.output
    # what the engine's config can check alone is checked by its schema when the config is loaded
    alone = cli([*arguments[:-1], "actor.engine_config.recompute_granularity=all", "actor.engine_config.virtual_pipeline_parallel_size=2"])
    assert alone.exit_code == 2 and "recompute_granularity 'all' is not one of" in alone.output
    assert "virtual_pipeline_parallel_size needs pipeline_parallel_size >= 2" in alone.output


def measured_peaks(two_process_results) -> dict[str, dict[str, int]]:
    """``{layout: {call: peak bytes over the ranks}}`` from the shared two-process launch."""
    ranks = two_process_results["memory"]
    return {name: {call: max(rank[name][call] for rank in ranks) for call in ranks[0][name]} for name in LAYOUTS}


def predicted(layout: dict, world_size: int):
    from rlplat_engine_megatron.engine import MegatronEngine

    dp = world_size // (layout.get("tensor_parallel_size", 1) * layout.get("context_parallel_size", 1)
                        * layout.get("pipeline_parallel_size", 1))
    config = dict(BASE, ppo_mini_batch_size=ROWS * dp, **layout)
    return MegatronEngine.estimate_memory(config, MODEL, context(world_size, ROWS * dp // world_size))


@pytest.mark.slow
def test_the_estimate_matches_the_measured_peaks_at_tp1_tp2_pp2_and_cp2(two_process_results):
    measured = measured_peaks(two_process_results)
    failures, lines = [], []
    for name, layout in LAYOUTS.items():
        estimate = predicted(layout, 2)
        for call in ("forward", "update", "export"):
            prediction, peak = estimate.during(call), measured[name][call]
            lines.append(f"{name}, {call}: predicted {prediction:,} B, measured {peak:,} B ({prediction / peak - 1:+.1%})")
            if abs(prediction - peak) > TOLERANCE * peak:
                failures.append(lines[-1])
    print("\n".join(lines))
    assert not failures, "\n".join(failures + ["all:"] + lines)
