"""FSDP2 engine on CPU, two processes (gloo): a training step on a long-tail batch, padded rows against
sequence packing (``use_remove_padding``).

Run: ``.venv/bin/python bench/packing.py`` (about 1-2 minutes on 2 cores). Two processes start with
``torch.multiprocessing`` and one gloo group; each builds every contender's engine from the same seed
and takes its half of the same global batch, one optimizer step per ``train_batch``. The contenders run
interleaved (the order rotates each round); a step's time is the slower rank's, measured around
``train_batch`` after a barrier.

- ``padded``: the engine's defaults, ``micro_batch_size_per_gpu`` rows per micro-batch, every row padded
  to the batch's width;
- ``packed, same micro-batches``: the same row groups, each packed into one row of its valid tokens;
- ``packed, token budget``: packing with ``use_dynamic_bsz`` (micro-batches by a token budget, balanced).

The batch: prompts of 8-32 tokens and log-normal responses (median 20 tokens, capped at 368, one row at
the cap), so sequences have a median of about 40 tokens and the longest 400 -- a long tail as RL rollouts
give. The model: a Qwen2 of hidden size 256, 4 layers, 4 heads, vocabulary 2000 (about 4.7M parameters),
so the model's compute, not the engine's bookkeeping, dominates a step. float32, one torch thread per
process. Targets: padding from >= 60% of the padded layout to <= 5%; packed step <= 0.75 of padded.
"""

from __future__ import annotations

import argparse
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

PROMPT_WIDTH, RESPONSE_WIDTH = 32, 368


def long_tail_batch(rows: int, vocab: int, seed: int = 0) -> DataProto:
    """verl's layout: prompts of 8-32 tokens left-padded to 32, responses of log-normal length (median 20,
    sigma 1, in 1-368) right-padded to 368; row 0 fills both (400 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(8, PROMPT_WIDTH + 1, (rows,), generator=generator)
    normal = torch.randn(rows, generator=generator)
    response_lengths = (20 * torch.exp(normal)).round().long().clamp(1, RESPONSE_WIDTH)
    prompt_lengths[0], response_lengths[0] = PROMPT_WIDTH, RESPONSE_WIDTH
    columns = torch.arange(max(PROMPT_WIDTH, RESPONSE_WIDTH))
    prompt_valid = columns[None, :PROMPT_WIDTH] >= PROMPT_WIDTH - prompt_lengths[:, None]
    response_valid = columns[None, :RESPONSE_WIDTH] < response_lengths[:, None]
    attention_mask = torch.cat([prompt_valid, response_valid], dim=1).long()
    input_ids = torch.randint(1, vocab, attention_mask.shape, generator=generator) * attention_mask
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, PROMPT_WIDTH:],
            "response_mask": response_valid.float(),
            "advantages": torch.randn(rows, RESPONSE_WIDTH, generator=generator),
        },
        meta_info={"ppo_mini_batch_size": rows},
    )


def policy_gradient(outputs, micro_batch):
    batch = micro_batch.batch
    return -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"], {}


def attention_padding(engine, shard: DataProto) -> tuple[int, int]:
    """(tokens gathered into attention groups, of which padding) over the packed micro-batches of ``shard``."""
    from rlplat_engine_fsdp2.packing import plan_attention_groups

    gathered = padding = 0
    for rows in engine.plan_micro_batches(shard, engine.config.micro_batch_size_per_gpu):
        lengths = [length for length in shard.batch["attention_mask"][rows].sum(-1).tolist() if length > 0]
        groups = plan_attention_groups(lengths, torch.device("cpu")).groups
        total = sum(group.rows * group.length for group in groups)
        gathered, padding = gathered + total, padding + total - sum(lengths)
    return gathered, padding


def worker(rank: int, port: int, contenders: dict, base: dict, batch: DataProto, rounds: int, warmup: int, results) -> None:
    from rlplat_engine_fsdp2.engine import FSDP2Engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shard = batch.chunk(2)[rank]
    engines = {}
    for name, overrides in contenders.items():
        engines[name] = FSDP2Engine(base, **overrides)
        engines[name].init_model()
    names = list(contenders)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            engines[name].train_batch(shard, policy_gradient)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_index >= warmup:
                seconds[name].append(float(elapsed))
    packed_name = names[-1]
    gathered, padding = attention_padding(engines[packed_name], shard)
    totals = torch.tensor([gathered, padding], dtype=torch.float64)
    dist.all_reduce(totals)
    micro_batches = {name: len(engines[name].plan_micro_batches(shard, engines[name].config.micro_batch_size_per_gpu)) for name in names}
    if rank == 0:
        results.put({"seconds": seconds, "attention": totals.tolist(), "micro_batches": micro_batches})
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="rows of the global batch (one optimizer step)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch per process (padded, and packed with the same groups)")
    parser.add_argument("--token-budget", type=int, default=1024, help="max_token_len_per_gpu of the token-budget contender")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    model_config = dict(
        model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        max_position_embeddings=PROMPT_WIDTH + RESPONSE_WIDTH,
    )
    base = dict(model_config=model_config, seed=0, lr=1e-5, dtype="float32", micro_batch_size_per_gpu=args.micro_batch)
    contenders = {
        "padded": {"use_remove_padding": False},
        "packed, same micro-batches": {"use_remove_padding": True},
        "packed, token budget": {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": args.token_budget},
    }
    batch = long_tail_batch(args.rows, args.vocab)
    mask = batch.batch["attention_mask"]
    lengths = mask.sum(-1).float()
    valid, padded_tokens = int(mask.sum()), mask.numel()

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(worker, args=(free_port(), contenders, base, batch, args.rounds, args.warmup, results), nprocs=2, join=True)
    measured = results.get()

    parameters = args.vocab * args.hidden + args.layers * (4 * args.hidden**2 + 3 * args.hidden * 4 * args.hidden)
    gathered, attention_pad = measured["attention"]
    medians = {name: statistics.median(values) for name, values in measured["seconds"].items()}
    rows = [
        [name, str(measured["micro_batches"][name]), f"{medians[name]:.3f}", f"{min(measured['seconds'][name]):.3f}", f"{medians[name] / medians['padded']:.2f}"]
        for name in contenders
    ]
    print_table(
        f"FSDP2 train_batch, 2 processes (gloo, 1 thread each), Qwen2 ~{parameters / 1e6:.1f}M parameters (hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}); global batch {args.rows} rows, sequences median "
        f"{lengths.median():.0f} / max {lengths.max():.0f} tokens; median of {args.rounds} interleaved steps after {args.warmup} warm-up",
        ["contender", "micro-batches/rank", "median step s", "min step s", "ratio to padded"],
        rows,
        [
            f"padding in the padded layout: {1 - valid / padded_tokens:.1%} of {padded_tokens} tokens (target >= 60%)",
            f"padding through the packed model: 0.0% of {valid} tokens (target <= 5%); inside attention only, the length "
            f"groups pad {attention_pad / gathered:.1%} of the {gathered:.0f} tokens they gather (token-budget contender)",
            f"packed step / padded step: {medians['packed, token budget'] / medians['padded']:.2f} with a token budget, "
            f"{medians['packed, same micro-batches'] / medians['padded']:.2f} with the same micro-batches (target <= 0.75)",
            f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), torch {torch.__version__}",
        ],
    )


if __name__ == "__main__":
    main()
