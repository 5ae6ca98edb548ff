"""Long sequences on the fsdp2 engine: peak memory and step time against sequence length, with the whole
logits, with the chunked output layer, and with the chunked output layer and Ulysses sequence parallelism;
``--engine megatron``: the same on the megatron engine, with context parallelism in place of Ulysses.

Run: ``.venv/bin/python bench/long_context.py`` (about 25 minutes on 2 cores, 17 with ``--rounds 1``, most of
it at 16k tokens; ``--lengths 1024,2048`` for a quick look). Two processes start with ``torch.multiprocessing`` and one gloo group, one torch thread each. At
every length the global batch is two rows of that many tokens (a 256-token prompt, the rest response; one
optimizer step per ``train_batch``, one row per micro-batch, packed):

- ``whole logits``: SP=1 (each process trains its own row), the output layer's logits and their float32
  log-softmax computed whole and kept for backward (the engine's small-tensor path forced on at every size);
- ``chunked``: SP=1, the engine's defaults: above 16 MiB of logits the output layer runs
  ``logprob_chunk_size`` (4096) tokens at a time inside the model's forward, recomputed in backward;
- ``chunked + SP=2``: both processes share each row (``ulysses_sequence_parallel_size=2``), each running half
  of its tokens, an all-to-all over attention heads around every attention;
- ``chunked + CP=2`` (``--engine megatron``): both processes share each row (``context_parallel_size=2``), each
  running two of its four chunks of positions, the keys and values all-gathered for every attention.
  megatron-core's local attention keeps each layer's ``heads x N x N`` float32 probabilities (at 8k about 10 GiB a
  process without CP, more than a 2-core machine's 23 GiB holds for two), so its lengths stop at 4k.

The same work per step in all three (two rows through the model and one optimizer step). Peak memory: the
largest live tensor storage of either process during a step (:class:`rlplat.testing.memory.LiveStorageMeter`,
what ``torch.cuda.max_memory_allocated`` counts on a GPU), from its own step after the timed ones. Step time:
the slower process's ``train_batch``, median of ``--rounds`` steps after a warm-up step. The model: a Qwen2 of
hidden size 256, 4 layers, 4 heads (2 key/value heads), vocabulary 8192 (about 5.3M parameters), float32.
Writes ``bench/results/long_context.{json,png}`` (``long_context_megatron.*`` for ``--engine megatron``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import print_table  # noqa: E402

from rlplat import DataProto  # noqa: E402

PROMPT = 256
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: per engine: its class, the module whose KEEP_FLOAT32_BYTES sets where the output layer is chunked, extra base
#: settings, and the contenders (the last one the parallel one).
ENGINES = {
    "fsdp2": {"engine": ("rlplat_engine_fsdp2.engine", "FSDP2Engine"), "limit": "rlplat_engine_fsdp2.modeling",
              "base": {"use_remove_padding": True},
              "contenders": {"whole logits": {}, "chunked": {}, "chunked + SP=2": {"ulysses_sequence_parallel_size": 2}}},
    "megatron": {"engine": ("rlplat_engine_megatron.engine", "MegatronEngine"), "limit": "rlplat_engine_megatron.vocab_parallel",
                 "base": {}, "contenders": {"whole logits": {}, "chunked": {}, "chunked + CP=2": {"context_parallel_size": 2}}},
}


def batch_of(rows: int, length: int, vocab: int, seed: int = 0) -> DataProto:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (rows, length), generator=generator)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    response = length - PROMPT
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": torch.arange(length).expand(rows, length).clone(), "responses": input_ids[:, PROMPT:],
        "response_mask": torch.ones(rows, response), "advantages": torch.randn(rows, response, generator=generator),
    }, meta_info={"ppo_mini_batch_size": rows})


def policy_gradient(outputs, micro_batch):
    batch = micro_batch.batch
    return -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"], {}


def worker(rank: int, port: int, engine_name: str, base: dict, lengths: list[int], rounds: int, results) -> None:
    import importlib

    from rlplat.testing.memory import LiveStorageMeter

    spec = ENGINES[engine_name]
    engine_class = getattr(importlib.import_module(spec["engine"][0]), spec["engine"][1])
    limits = importlib.import_module(spec["limit"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    chunked_limit = limits.KEEP_FLOAT32_BYTES
    measured: dict[str, dict[int, dict[str, float]]] = {name: {} for name in spec["contenders"]}
    for length in lengths:
        batch = batch_of(2, length, base["model_config"]["vocab_size"], seed=length)
        for name, overrides in spec["contenders"].items():
            limits.KEEP_FLOAT32_BYTES = 1 << 62 if name == "whole logits" else chunked_limit
            engine = engine_class({**base, **spec["base"]}, **overrides)
            engine.init_model()
            mesh = engine.data_parallel_info()
            shard = batch if mesh.dp_size == 1 else batch.chunk(mesh.dp_size)[mesh.dp_rank]
            seconds = []
            for step in range(1 + rounds):
                dist.barrier()
                start = time.perf_counter()
                engine.train_batch(shard, policy_gradient)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step:
                    seconds.append(float(elapsed))
            dist.barrier()
            with LiveStorageMeter() as meter, meter.phase("step"):
                engine.train_batch(shard, policy_gradient)
            peak = torch.tensor([float(meter.peaks()["step"])])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            measured[name][length] = {"seconds": statistics.median(seconds), "peak_bytes": float(peak)}
            if rank == 0:
                print(f"  {name:>16} at {length:>6} tokens: {statistics.median(seconds):7.2f} s, {float(peak) / 2**20:8.1f} MiB", flush=True)
            del engine
            if engine_name == "megatron":  # the next contender sets up its own parallel state
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
    if rank == 0:
        results.put(measured)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def plot(measured: dict, lengths: list[int], path: str, engine_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in measured:
        memory.plot(lengths, [measured[name][length]["peak_bytes"] / 2**20 for length in lengths], marker="o", label=name)
        speed.plot(lengths, [measured[name][length]["seconds"] for length in lengths], marker="o", label=name)
    for axis, label in ((memory, "peak live tensors per process (MiB)"), (speed, "step time (s, median)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(lengths, [f"{length // 1024}k" for length in lengths])
        axis.set_xlabel("sequence length (tokens)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    memory.legend()
    figure.suptitle(f"{engine_name} engine, 2 CPU processes, Qwen2 5.3M (vocab 8192): one step on 2 rows")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), default="fsdp2")
    parser.add_argument("--lengths", default=None, help="default 1024 to 16384 (fsdp2), to 4096 (megatron)")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per contender and length")
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    lengths = [int(length) for length in (args.lengths or ("1024,2048,4096,8192,16384" if args.engine == "fsdp2" else
                                                            "1024,2048,4096")).split(",")]
    contenders = list(ENGINES[args.engine]["contenders"])
    parallel, stem = contenders[-1], "long_context" if args.engine == "fsdp2" else f"long_context_{args.engine}"
    model_config = dict(model_type="qwen2", vocab_size=args.vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                        max_position_embeddings=max(lengths))
    base = dict(model_config=model_config, seed=0, lr=1e-5, dtype="float32", micro_batch_size_per_gpu=1)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(worker, args=(free_port(), args.engine, base, lengths, args.rounds, results), nprocs=2, join=True)
    measured = results.get()
    rows = []
    for length in lengths:
        whole = measured["whole logits"][length]
        cells = [f"{length:,}"]
        for name in contenders:
            entry = measured[name][length]
            cells += [f"{entry['peak_bytes'] / 2**20:.0f}", f"{entry['seconds']:.2f}"]
        cells += [f"{measured[parallel][length]['peak_bytes'] / whole['peak_bytes']:.2f}",
                  f"{measured[parallel][length]['seconds'] / whole['seconds']:.2f}"]
        rows.append(cells)
    short = parallel.split("+ ")[-1].split("=")[0]
    header = ["tokens"] + [f"{name} {unit}" for name in contenders for unit in ("MiB", "s")] + [f"{short}/whole mem", f"{short}/whole time"]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{stem}.json"), "w") as handle:
        json.dump({"lengths": lengths, "measured": {name: {str(k): v for k, v in values.items()} for name, values in measured.items()}},
                  handle, indent=1)
    plot(measured, lengths, os.path.join(RESULTS, f"{stem}.png"), args.engine)
    print_table(
        f"{args.engine} train_batch on 2 rows of N tokens, 2 processes (gloo, 1 thread each), Qwen2 hidden 256, 4 layers, vocab {args.vocab}: "
        f"peak live tensor storage per process and median step time of {args.rounds} after a warm-up",
        header, rows,
        [f"plot: {os.path.join(RESULTS, f'{stem}.png')}",
         f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), torch {torch.__version__}"],
    )


if __name__ == "__main__":
    main()
