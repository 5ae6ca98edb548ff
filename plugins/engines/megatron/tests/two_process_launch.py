"""Launches of ``numerics_worker.py`` on several processes, and the one two-process launch the numerics and
memory tests share (the ``two_process_results`` fixture of conftest): in the same two processes the memory
measurement of ``memory_worker.measure`` runs first (a fresh process, as the measurement needs), then the
numerics layouts, so the two tests pay megatron's imports (~8 s a launch) once."""

from __future__ import annotations

import json
import os

import torch

from rlplat.testing.distributed import launch_ranks
from rlplat.testing.engines import TINY_QWEN2

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "numerics_worker.py")

#: The measured model of the memory test (the fsdp2 engine's measured plan test uses the same): 4.2M
#: parameters, grouped-query attention.
MEMORY_MODEL = dict(model_type="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=128,
                    eos_token_id=2047)
MEMORY_ROWS, MEMORY_LENGTH = 8, 32
MEMORY_LAYOUTS = {
    "tp1 (2 DP ranks)": dict(),
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp1 full recompute, distributed optimizer": dict(recompute_granularity="full", use_distributed_optimizer=True),
    "cp2": dict(context_parallel_size=2),
}
MEMORY_BASE = dict(model_config=MEMORY_MODEL, seed=3, lr=1e-3, micro_batch_size_per_gpu=4, dtype="float32")

#: The numerics layouts on two processes (test_megatron_numerics reads their results).
NUMERICS_LAYOUTS = [
    {"name": "tp1"},
    {"name": "tp2", "tp": 2, "export": True},
    {"name": "pp2", "pp": 2, "resume": True},
    {"name": "dp2-distributed-recompute", "extra": {"use_distributed_optimizer": True, "recompute_granularity": "full"}},
    {"name": "pp2-selective-budget", "pp": 2, "extra": {"recompute_granularity": "selective", "use_dynamic_bsz": True,
                                                         "max_token_len_per_gpu": 24}},
    # the chunked output layer (forced: the tiny model's logits are far below the size that turns it on), 6 tokens a chunk
    {"name": "tp2-chunked", "tp": 2, "keep_float32_bytes": 0, "extra": {"logprob_chunk_size": 6}},
    # context parallelism: each rank runs half of every row's tokens; then with full recompute, the distributed
    # optimizer, the chunked output layer and a token budget of 6 a rank (rows of 11 tokens fit only because CP=2
    # makes a group's budget 12)
    {"name": "cp2", "cp": 2, "resume": True},
    {"name": "cp2-full-budget-chunked", "cp": 2, "keep_float32_bytes": 0, "extra": {
        "recompute_granularity": "full", "use_distributed_optimizer": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 6,
        "logprob_chunk_size": 6}},
]


def write_checkpoint(directory, settings: dict, seed: int) -> str:
    """A random-init HF model of ``settings`` (a config.json's fields), saved to ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(settings)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings),
                                     dtype=torch.float32).save_pretrained(str(directory))
    return str(directory)


def write_numerics_checkpoint(directory, **overrides) -> str:
    return write_checkpoint(directory, {**TINY_QWEN2, **overrides}, seed=11)


def memory_spec(model_path: str) -> dict:
    """What ``memory_worker.measure`` measures: every layout of :data:`MEMORY_LAYOUTS` on ``model_path``."""
    base = {key: value for key, value in MEMORY_BASE.items() if key != "model_config"}
    return dict(config=dict(base, model_path=model_path), vocab_size=MEMORY_MODEL["vocab_size"], rows=MEMORY_ROWS,
                prompt_length=MEMORY_LENGTH, response_length=MEMORY_LENGTH, bucket_bytes=256 << 20,
                layouts=[dict(name=name, config=config) for name, config in MEMORY_LAYOUTS.items()])


def launch(world_size: int, spec: dict, directory, worker: str = WORKER) -> dict:
    """Run ``worker`` (``numerics_worker.py``) on ``world_size`` processes (gloo) with ``spec``; rank 0's results."""
    spec = {**spec, "out": str(directory / "results.pt"), "scratch": str(directory)}
    launch_ranks(world_size, [worker, json.dumps(spec)])
    return torch.load(spec["out"], weights_only=True)


def launch_two_processes(directory) -> dict:
    """The shared launch: the memory measurement, then :data:`NUMERICS_LAYOUTS` and the fsdp2 engine."""
    return launch(2, {"model": write_numerics_checkpoint(directory / "hf", num_key_value_heads=2), "fsdp2": True,
                      "layouts": NUMERICS_LAYOUTS, "memory": memory_spec(write_checkpoint(directory / "memory-hf", MEMORY_MODEL, seed=3))},
                  directory)
