"""The plan against measured peaks on CPU: the fsdp2 engine and the hf rollout on a tiny model, within 15%.

What is measured: the peak of live tensor storage bytes in each call, what ``torch.cuda.max_memory_allocated``
counts on a GPU. One process: :class:`rlplat.testing.memory.TensorMemoryMeter` (the CPU allocator reports every
allocation and free to the profiler; their running sum). Two processes: :class:`rlplat.testing.memory.LiveStorageMeter`
(every storage an operator returns, sized after each operator and dropped when freed in any thread), because gloo
releases collective buffers in its own threads, whose frees the profiler does not see; on one process the two
meters agree within 0.02% (forward 71,803,892 vs 71,790,580 B, update 95,285,740 vs 95,271,412 B). The engine is measured in its steady state: after one update (the
optimizer states and the gradients exist from then on), a forward and a second update. Each process runs
``python -m rlplat.testing.memory`` (two of them form a gloo group for the 2-process case).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from rlplat.contracts.memory import MemoryContext

pytestmark = pytest.mark.slow  # starts three Python processes that train and generate (about a minute on 2 cores)

#: Large enough that activations and logits, not constant overheads, make the numbers: 4.2M parameters.
MODEL = dict(model_type="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=128,
             eos_token_id=2047)
ROWS = 8
TOLERANCE = 0.15

ENGINE_CASES = {
    "float32, one micro-batch per step": (dict(dtype="float32", micro_batch_size_per_gpu=8), 32),
    "float32, micro-batch 4": (dict(dtype="float32", micro_batch_size_per_gpu=4), 32),
    "float32, micro-batch 2": (dict(dtype="float32", micro_batch_size_per_gpu=2), 32),
    "float32, recomputation": (dict(dtype="float32", micro_batch_size_per_gpu=4, enable_gradient_checkpointing=True), 32),
    "float32, offload (a no-op on CPU)": (dict(dtype="float32", micro_batch_size_per_gpu=4, param_offload=True, optimizer_offload=True), 32),
    "bfloat16, micro-batch 4": (dict(dtype="bfloat16", micro_batch_size_per_gpu=4), 16),
}
ROLLOUT_CASES = {"hf float32": ("float32", 32), "hf bfloat16": ("bfloat16", 16)}


def spec(kind: str, name: str, config: dict, length: int) -> dict:
    return dict(kind=kind, name=name, config=dict(model_config=MODEL, **config), rows=ROWS, prompt_length=length, response_length=length)


def measure(specs: list[dict], world_size: int = 1) -> list[list[dict]]:
    """Peaks per spec from each of ``world_size`` processes."""
    # an in-process worker group earlier in this process leaves RANK and WORLD_SIZE set, which the measuring
    # process would read as a distributed launch: it gets them only for one
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    environment["RLPLAT_MEASURE_THREADS"] = "1"
    if world_size > 1:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size))
    processes = [subprocess.Popen([sys.executable, "-m", "rlplat.testing.memory", json.dumps(specs)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**environment, "RANK": str(rank)})
                 for rank in range(world_size)]
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    return [[output[index] for output in outputs] for index in range(len(specs))]


def predicted(kind: str, config: dict, length: int, processes: int = 1, device: str = "cpu", model: dict = MODEL,
              rows: int = ROWS):
    context = MemoryContext(role="actor" if kind == "engine" else "rollout", processes=processes, device=device,
                            prompt_length=length, response_length=length, sequences_per_process=rows)
    if kind == "engine":
        from rlplat_engine_fsdp2.memory import estimate

        return estimate(dict(model_config=model, ppo_mini_batch_size=rows * processes, **config), model, context)
    from rlplat_rollout_hf.memory import estimate

    return estimate(dict(model_config=model, **config), model, context)


@pytest.fixture(scope="module")
def single_process():
    specs = [spec("engine", "fsdp2", config, length) for config, length in ENGINE_CASES.values()]
    specs += [spec("rollout", "hf", {"dtype": dtype}, length) for dtype, length in ROLLOUT_CASES.values()]
    specs += [moe_spec(model, config) for model, config in MOE_CASES.values()]  # one process's imports for all
    specs += [dict(kind="engine", name="fsdp2", config=dict(model_config=CHUNKED_MODEL, **config), rows=ROWS,
                   prompt_length=CHUNKED_LENGTH, response_length=CHUNKED_LENGTH) for config in CHUNKED_CASES.values()]
    results = [peaks[0] for peaks in measure(specs)]
    return dict(zip([*ENGINE_CASES, *ROLLOUT_CASES, *MOE_CASES, *CHUNKED_CASES], results))


def within(prediction: int, measured: int) -> bool:
    return abs(prediction - measured) <= TOLERANCE * measured


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_fsdp2_forward_and_update_peaks_on_one_process(single_process, case):
    config, length = ENGINE_CASES[case]
    estimate = predicted("engine", config, length)
    for call in ("forward", "update"):
        measured, prediction = single_process[case][call], estimate.during(call)
        assert within(prediction, measured), f"{case}, {call}: predicted {prediction:,} B, measured {measured:,} B ({prediction / measured - 1:+.1%})"


@pytest.mark.parametrize("case", list(ROLLOUT_CASES))
def test_hf_generation_peak(single_process, case):
    dtype, length = ROLLOUT_CASES[case]
    measured, prediction = single_process[case]["generate"], predicted("rollout", {"dtype": dtype}, length).during("generate")
    assert within(prediction, measured), f"{case}: predicted {prediction:,} B, measured {measured:,} B ({prediction / measured - 1:+.1%})"


#: Ulysses sequence parallelism on the two processes: one data-parallel group, both holding the same 8 rows (the
#: measuring processes draw the same synthetic batch), each running half of every pack's tokens.
SEQUENCE_PARALLEL = dict(dtype="float32", micro_batch_size_per_gpu=4, ulysses_sequence_parallel_size=2)


def test_fsdp2_on_two_processes_holds_half_the_training_state_per_process():
    """Two data-parallel processes, and the same two as one Ulysses group (SP=2): activations per process halve."""
    config, length = ENGINE_CASES["float32, micro-batch 4"]
    ranks, sequence_ranks = measure([spec("engine", "fsdp2", config, length), spec("engine", "fsdp2", SEQUENCE_PARALLEL, length)],
                                    world_size=2)
    cases = ((ranks, predicted("engine", config, length, processes=2), "2 processes"),
             # the group's 8 rows are 4 sequences per process
             (sequence_ranks, predicted("engine", SEQUENCE_PARALLEL, length, processes=2, rows=ROWS // 2), "2 processes, SP=2"))
    for measured_ranks, estimate, name in cases:
        for call in ("forward", "update"):
            measured, prediction = max(rank[call] for rank in measured_ranks), estimate.during(call)
            print(f"{name}, {call}: predicted {prediction:,} B, measured {measured:,} B ({prediction / measured - 1:+.1%})")
            assert within(prediction, measured), f"{name}, {call}: predicted {prediction:,} B, measured {measured:,} B ({prediction / measured - 1:+.1%})"


#: On a GPU: a model large enough that cuBLAS's workspace and CUDA's 512-byte rounding are noise (170M parameters).
GPU_MODEL = dict(MODEL, vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, max_position_embeddings=1024, eos_token_id=31999)


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="the GPU check needs CUDA")
def test_on_a_gpu_the_plan_matches_cudas_measured_peaks():
    """CUDA's ``max_memory_allocated`` per call (:class:`rlplat.testing.memory.CudaPeaks`) against the plan with
    ``device=cuda``: bfloat16 compute (the engine's ``auto``) and the hf rollout in bfloat16."""
    specs = [dict(kind="engine", name="fsdp2", config=dict(model_config=GPU_MODEL, micro_batch_size_per_gpu=4), rows=8,
                  prompt_length=256, response_length=256),
             dict(kind="rollout", name="hf", config=dict(model_config=GPU_MODEL, dtype="bfloat16"), rows=8,
                  prompt_length=256, response_length=256)]
    engine, rollout = (peaks[0] for peaks in measure(specs))
    plan = predicted("engine", dict(micro_batch_size_per_gpu=4), 256, device="cuda", model=GPU_MODEL, rows=8)
    for call in ("forward", "update"):
        assert within(plan.during(call), engine[call]), f"GPU {call}: predicted {plan.during(call):,} B, measured {engine[call]:,} B"
    generation = predicted("rollout", {"dtype": "bfloat16"}, 256, device="cuda", model=GPU_MODEL, rows=8).during("generate")
    assert within(generation, rollout["generate"]), f"GPU generation: predicted {generation:,} B, measured {rollout['generate']:,} B"


#: Mixture-of-experts models: the experts (8, 2 per token), the dispatch copies and the router's logits.
MOE_MODELS = {
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                      shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=256,
                      eos_token_id=2047),
    "mixtral": dict(model_type="mixtral", vocab_size=2048, hidden_size=256, intermediate_size=384, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False, max_position_embeddings=256, eos_token_id=2047),
}
MOE_CASES = {
    "qwen2_moe, float32, micro-batch 8": ("qwen2_moe", dict(dtype="float32", micro_batch_size_per_gpu=8)),
    "qwen2_moe, recomputation": ("qwen2_moe", dict(dtype="float32", micro_batch_size_per_gpu=8, enable_gradient_checkpointing=True)),
    "mixtral, bfloat16, micro-batch 8": ("mixtral", dict(dtype="bfloat16", micro_batch_size_per_gpu=8)),
}
MOE_ROWS, MOE_LENGTH = 8, 64


def moe_spec(model: str, config: dict) -> dict:
    return dict(kind="engine", name="fsdp2", config=dict(model_config=MOE_MODELS[model], **config), rows=MOE_ROWS,
                prompt_length=MOE_LENGTH, response_length=MOE_LENGTH)


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_fsdp2_peaks_of_a_mixture_of_experts_model(single_process, case):
    moe_measured = single_process
    model, config = MOE_CASES[case]
    estimate = predicted("engine", config, MOE_LENGTH, model=MOE_MODELS[model], rows=MOE_ROWS)
    parameters = next(item for item in estimate.items if item.name == "parameters")
    assert "experts and routers of 4 MoE layers" in parameters.detail
    for call in ("forward", "update"):
        measured, prediction = moe_measured[case][call], estimate.during(call)
        assert within(prediction, measured), f"{case}, {call}: predicted {prediction:,} B, measured {measured:,} B ({prediction / measured - 1:+.1%})"


#: The chunked output layer: a vocabulary of 8192 and 8 rows of 128 response tokens, so the whole float32 logits
#: (32 MiB) exceed what the engine keeps whole and the layer runs a chunk of tokens (and of the vocabulary) at a
#: time. The plan's bound here is 5%.
CHUNKED_MODEL = dict(MODEL, vocab_size=8192, max_position_embeddings=512, eos_token_id=8191)
CHUNKED_LENGTH = 128
CHUNKED_TOLERANCE = 0.05
CHUNKED_CASES = {
    "chunked head, 1024 tokens at a time": dict(dtype="float32", micro_batch_size_per_gpu=8),
    "chunked head, 256 tokens": dict(dtype="float32", micro_batch_size_per_gpu=8, logprob_chunk_size=256),
    "chunked head, 256 tokens x 2048 entries": dict(dtype="float32", micro_batch_size_per_gpu=8, logprob_chunk_size=256,
                                                    logprob_vocab_chunk_size=2048),
    "chunked head, bfloat16, 256 tokens": dict(dtype="bfloat16", micro_batch_size_per_gpu=8, logprob_chunk_size=256),
}


@pytest.mark.parametrize("case", list(CHUNKED_CASES))
def test_the_plan_predicts_the_chunked_output_layers_peaks_within_5_percent(single_process, case):
    estimate = predicted("engine", CHUNKED_CASES[case], CHUNKED_LENGTH, model=CHUNKED_MODEL)
    update = next(item for item in estimate.items if item.name == "activations")
    assert "the output layer" in update.detail and "at a time" in update.detail
    for call in ("forward", "update"):
        measured, prediction = single_process[case][call], estimate.during(call)
        assert abs(prediction - measured) <= CHUNKED_TOLERANCE * measured, \
            f"{case}, {call}: predicted {prediction:,} B, measured {measured:,} B ({prediction / measured - 1:+.1%})"
