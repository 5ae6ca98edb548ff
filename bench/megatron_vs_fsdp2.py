"""Training tokens/s of the megatron engine (TP=2, PP=2) against the fsdp2 engine (two data-parallel
ranks) with 2 CPU processes (gloo) on the same model, the same global batch and the same loss.

Run with ``make bench`` (or ``.venv/bin/python bench/megatron_vs_fsdp2.py [--repetitions 7]``). The script
launches two processes of itself (``--worker``); in them each contender in turn builds its engine from the
same Hugging Face checkpoint (a Qwen2 of ~7M parameters written by the launcher), takes warm-up steps,
then ``--repetitions`` timed ``train_batch`` calls (one optimizer step each, between barriers); this is
repeated for ``--rounds`` rounds, the contenders taking turns, so that drift on a shared machine falls on
all of them:

- ``megatron TP=2``: one replica split over both processes by tensor parallelism (each takes the whole batch);
- ``megatron PP=2``: one replica split into two pipeline stages (1F1B over the micro-batches);
- ``fsdp2 DP=2``: each process takes half the rows, parameters sharded (FSDP2).

Tokens/s counts the valid tokens (``attention_mask``) of the global batch per step; the table shows the
median over all timed steps and each contender's ratio to fsdp2; the spread column is the min-max. One
torch thread per process. megatron's parallel state is rebuilt between layouts in the same two processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MODEL = dict(model_type="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=256)
ROWS, PROMPT, RESPONSE = 16, 48, 48


class PolicyGradientLoss:
    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"]
        return loss, {}


def make_batch():
    from rlplat import DataProto

    generator = torch.Generator().manual_seed(0)
    length = PROMPT + RESPONSE
    input_ids = torch.randint(4, MODEL["vocab_size"], (ROWS, length), generator=generator)
    attention_mask = torch.ones(ROWS, length, dtype=torch.long)
    for row in range(ROWS):
        attention_mask[row, : row % 5] = 0
        attention_mask[row, length - 3 * (row % 4):] = 0
    input_ids = input_ids * attention_mask
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, PROMPT:], "response_mask": attention_mask[:, PROMPT:].float(),
        "advantages": torch.randn(ROWS, RESPONSE, generator=generator),
    })


def worker(arguments) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    from megatron.core import parallel_state

    from rlplat_engine_fsdp2.engine import FSDP2Engine
    from rlplat_engine_megatron.engine import MegatronEngine

    batch = make_batch()
    tokens = float(batch.batch["attention_mask"].sum())
    common = dict(model_path=arguments.model, seed=1, lr=1e-5, micro_batch_size_per_gpu=4)
    contenders = [
        ("megatron TP=2", lambda: MegatronEngine(dict(common, tensor_parallel_size=2)), False),
        ("megatron PP=2", lambda: MegatronEngine(dict(common, pipeline_parallel_size=2)), False),
        ("fsdp2 DP=2", lambda: FSDP2Engine(dict(common, dtype="float32")), True),
    ]
    results: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    for _ in range(arguments.rounds):
        for name, build, data_parallel in contenders:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            engine = build()
            engine.init_model()
            share = batch.chunk(dist.get_world_size())[dist.get_rank()] if data_parallel else batch
            share.meta_info["ppo_mini_batch_size"] = None
            for repetition in range(arguments.warmup + arguments.repetitions):
                dist.barrier()
                started = time.perf_counter()
                engine.train_batch(share, PolicyGradientLoss())
                dist.barrier()
                if repetition >= arguments.warmup:
                    results[name].append(tokens / (time.perf_counter() - started))
            del engine
    if dist.get_rank() == 0:
        with open(arguments.out, "w") as handle:
            json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


def launch(arguments) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        settings = dict(MODEL)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        model.save_pretrained(os.path.join(scratch, "model"))
        with socket.socket() as handle:
            handle.bind(("127.0.0.1", 0))
            port = handle.getsockname()[1]
        out = os.path.join(scratch, "results.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--model", os.path.join(scratch, "model"), "--out", out,
                   "--repetitions", str(arguments.repetitions), "--warmup", str(arguments.warmup), "--rounds", str(arguments.rounds)]
        processes = [
            subprocess.Popen(command, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(2)
        ]
        logs = [process.communicate()[0] for process in processes]
        for rank, process in enumerate(processes):
            if process.returncode != 0:
                raise SystemExit(f"worker {rank} failed:\n{logs[rank][-4000:]}")
        with open(out) as handle:
            return {"parameters": parameters, "results": json.load(handle)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="times each contender is built and timed, in turn")
    parser.add_argument("--repetitions", type=int, default=4, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        worker(arguments)
        return
    measured = launch(arguments)
    results = measured["results"]
    reference = statistics.median(results["fsdp2 DP=2"])
    print(f"megatron vs fsdp2 training throughput, 2 CPU processes (gloo, 1 thread each); Qwen2 {measured['parameters'] / 1e6:.1f}M "
          f"parameters ({MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, vocab {MODEL['vocab_size']}); "
          f"global batch {ROWS} rows x {PROMPT + RESPONSE} tokens, micro-batches of 4 rows; torch {torch.__version__}")
    print(f"{'contender':<16}{'tokens/s (median)':>20}{'spread (min-max)':>22}{'vs fsdp2':>10}")
    for name, rates in results.items():
        median = statistics.median(rates)
        print(f"{name:<16}{median:>20.0f}{f'{min(rates):.0f}-{max(rates):.0f}':>22}{median / reference:>9.2f}x")
    print(f"median of {arguments.rounds} rounds x {arguments.repetitions} steps per contender (each round rebuilds the engine "
          f"and takes {arguments.warmup} warm-up step(s); rounds alternate between contenders)")


if __name__ == "__main__":
    main()
