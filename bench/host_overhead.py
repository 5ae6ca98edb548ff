"""Host overhead of the fsdp2 engine's update at the GPU check's layer structure, on CPU at tiny dimensions.

The model: the GPU check's Qwen2.5-0.5B shape (24 decoder layers, 14 query heads, 2 key/value heads, tied embedding)
with every width cut down (hidden 56, intermediate 128, vocabulary 512), so that the step's arithmetic is small and
what is left is the host's work: Python, operator dispatch, hooks, autograd bookkeeping. The step: ``train_batch`` of
the SFT loss on 16 random full rows of 64 tokens (32 + 32), 8 rows per micro-batch, one optimizer step, as the check
runs it (one rank, packing on).

Contenders, each in both compute dtypes of the check (bfloat16, the GPU's; float32):

- ``fsdp2``: ``shard_one_rank=True``, the model wrapped in FSDP2's ``fully_shard`` over one rank: how the engine ran
  one bf16 rank before (and still runs it when asked);
- ``plain``: the engine's default for one rank (the plain module; in bf16 cast copies of the weights per call,
  ``ComputeCopies``);
- ``compiled``: ``plain`` with ``compile=True`` (the decoder layers under ``torch.compile``; the first steps compile).

Printed per contender: aten operators in one profiled step (the profiler's ``aten::`` events, nested ones included),
the median wall time of a step (interleaved repetitions, after warm-up), and the host's milliseconds: the median over
five profiled steps of their time outside the matmul and attention kernels (on CPU in bfloat16 most of a step's wall time is the CPU's bf16
attention-backward kernel, arithmetic that a GPU does elsewhere; a compiled graph's call counts as host time although
it holds the fused elementwise arithmetic, so its figure is an upper bound).

Run: ``.venv/bin/python bench/host_overhead.py [--repetitions 9] [--torch-threads 1] [--no-compile]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import describe_environment, print_table  # noqa: E402

TINY_05B_STRUCTURE = dict(model_type="qwen2", vocab_size=512, hidden_size=56, intermediate_size=128, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
                          rms_norm_eps=1e-6)
CONTENDERS = {"fsdp2": dict(shard_one_rank=True), "plain": {}, "compiled": dict(compile=True)}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=9, help="timed steps per contender (>= 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first (compiling ones included)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-compile", action="store_true", help="leave the compiled contender out (it takes ~30 s to compile)")
    args = parser.parse_args()
    if args.repetitions < 5:
        parser.error("--repetitions must be at least 5")
    torch.set_num_threads(args.torch_threads)
    return args


def build(dtype: str, options: dict):
    from gpu_check_cases import nll, token_batch

    from rlplat_engine_fsdp2.engine import FSDP2Engine

    engine = FSDP2Engine(dict(model_config=TINY_05B_STRUCTURE, seed=0, lr=1e-6, micro_batch_size_per_gpu=8, dtype=dtype, **options))
    engine.init_model()
    batch = token_batch(16, 32, 32, TINY_05B_STRUCTURE["vocab_size"], seed=4)
    return engine, batch, nll()


#: The kernels that do a step's arithmetic on CPU; the self time of every other event is the host's share.
ARITHMETIC = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


PROFILED_STEPS = 5
#: The profiler's name of a call into a compiled graph: its self time is the generated kernels' (the arithmetic
#: fused into them; a GPU runs them on the device), apart from their launch.
COMPILED_GRAPH = "## Call CompiledFxGraph"


def profiled(step) -> tuple[int, float, float]:
    """aten operators of a step, and the milliseconds of it spent outside the matmul and attention kernels (profiler
    self times; compiled graphs count as outside, though they hold arithmetic too), and of those the compiled graphs'
    own: medians of PROFILED_STEPS steps."""
    from torch.profiler import ProfilerActivity, profile

    counts, hosts, graphs = [], [], []
    for _ in range(PROFILED_STEPS):
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            step()
        counts.append(sum(1 for event in profiler.events() if event.name.startswith("aten::")))
        averages = profiler.key_averages()
        total = sum(event.self_cpu_time_total for event in averages)
        arithmetic = sum(event.self_cpu_time_total for event in averages if event.key in ARITHMETIC)
        hosts.append((total - arithmetic) / 1e3)
        graphs.append(sum(event.self_cpu_time_total for event in averages if event.key.startswith(COMPILED_GRAPH)) / 1e3)
    return statistics.median(counts), statistics.median(hosts), statistics.median(graphs)


def main() -> None:
    args = parse_arguments()
    from rlplat_engine_fsdp2.modeling import compile_problem

    rows, notes = [], []
    problem = compile_problem("cpu")
    if problem is not None:
        notes.append(f"compiled contender left out: {problem}")
    names = [name for name in CONTENDERS if not ((args.no_compile or problem) and name == "compiled")]
    for dtype in ("bfloat16", "float32"):
        built = {name: build(dtype, CONTENDERS[name]) for name in names}
        steps = {name: (lambda engine=engine, batch=batch, loss=loss: engine.train_batch(batch, loss)) for name, (engine, batch, loss) in built.items()}
        first_losses = {}
        for name, step in steps.items():
            first_losses[name] = step()["loss"]
            for _ in range(args.warmup - 1):
                step()
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for repetition in range(args.repetitions):
            order = names[repetition % len(names):] + names[: repetition % len(names)]
            for name in order:
                started = time.perf_counter()
                steps[name]()
                seconds[name].append(time.perf_counter() - started)
        measured = {name: profiled(step) for name, step in steps.items()}
        base_ms, (base_ops, base_host, _) = statistics.median(seconds["fsdp2"]) * 1e3, measured["fsdp2"]
        for name in names:
            ms = statistics.median(seconds[name]) * 1e3
            operators, host, graphs = measured[name]
            lower = f"{host - graphs:.0f} ({(host - graphs) / base_host:.2f})" if graphs else ""
            rows.append([dtype, name, f"{operators:,}", f"{operators / base_ops:.2f}", f"{ms:.0f}", f"{ms / base_ms:.2f}",
                         f"{host:.0f}", f"{host / base_host:.2f}", lower, f"{first_losses[name]:.6f}"])
        del built, steps
    notes.append("host ms: a profiled step's time outside the matmul and attention kernels (profiler self times; median of 5)")
    notes.append("host ms, graphs as arithmetic: the same less the compiled graphs' own time (their fused kernels); the "
                 "compiled contender's host time lies between the two")
    notes.append("ratios are to fsdp2 (one rank in fully_shard) of the same dtype; first loss: the first step's, from the same "
                 "weights (equal for fsdp2 and plain: the same arithmetic)")
    print_table("fsdp2 update at the GPU check's 24-layer structure, tiny dims, CPU",
                ["dtype", "contender", "aten ops/step", "ops ratio", "step ms (median)", "time ratio", "host ms", "host ratio",
                 "host ms, graphs as arithmetic", "first loss"], rows, notes)
    print(describe_environment({"torch threads": str(args.torch_threads), "repetitions": str(args.repetitions)}))


if __name__ == "__main__":
    main()
