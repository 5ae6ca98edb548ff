"""FSDP2 engine on CPU: training tokens/s of 2 processes against 1 on the same global batch (the scaling
ratio), and memory per process against an unsharded model (the sharding ratio).

Run with ``make bench`` (or ``.venv/bin/python bench/fsdp2_scaling.py``). Every contender runs in
fresh rlplat worker processes (Ray, gloo), one contender at a time, and trains the same Qwen2 model
from the same seed on the same global batch with one optimizer step per ``train_batch``:

- ``fsdp2 2 proc``: the engine sharded over two processes (defaults: gradients reduce-scattered
  after every micro-batch);
- ``fsdp2 2 proc, 1 reduce``: the same with ``gradient_sync_every_micro_batch=False`` (one
  reduce-scatter per optimizer step; the all-gathers stay per micro-batch);
- ``fsdp2 1 proc``: the engine in one process (a world of one: nothing is sharded);
- ``unsharded 1 proc``: the plain Hugging Face model with AdamW, no FSDP (the memory reference).

Each process runs one torch thread. The default model (~27M parameters, 6 layers) makes parameters,
gradients and AdamW state outweigh the activations of a 2-row micro-batch, so sharding shows in RSS too.

Time is measured inside the workers around ``train_batch`` (after a barrier), so Ray's dispatch is not
in it. Memory per process: model state (parameters, gradients and AdamW state held by the process,
counted from the tensors) and the growth of peak RSS over the process's peak after imports. Medians
over the timed steps; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

import torch

from rlplat import DataProto, Dispatch, RayWorkerGroup, ResourcePool, Worker, WorkerSpec, register


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def tensor_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class PolicyGradientLoss:
    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"]
        return loss, {}


class BenchWorker(Worker):
    """Builds one engine (or the unsharded reference) and times its training steps."""

    def __init__(self, threads: int):
        super().__init__()
        torch.set_num_threads(threads)
        from rlplat_engine_fsdp2 import engine  # noqa: F401  (imports count in the baseline)

        warm = torch.nn.Linear(64, 64)
        warm(torch.randn(8, 64)).sum().backward()  # kernels and allocator warmed up before the baseline
        self.baseline_mib = peak_rss_mib()

    @register(Dispatch.ONE_TO_ALL)
    def build(self, config: dict, sharded: bool) -> None:
        from rlplat_engine_fsdp2.engine import FSDP2Engine

        self.engine = FSDP2Engine(config)
        if sharded:
            self.engine.init_model()
            self.model, self.optimizer = self.engine.module, self.engine.optimizer
        else:
            from rlplat_engine_fsdp2 import modeling

            self.model = modeling.build_model(self.engine.config)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.engine.config.lr)
        self.sharded = sharded

    def unsharded_step(self, batch: DataProto) -> None:
        from rlplat_engine_fsdp2 import modeling

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        size = self.engine.config.micro_batch_size_per_gpu
        meta = {"global_token_count": float(batch.batch["response_mask"].sum())}
        for start in range(0, len(batch), size):
            micro = batch.slice(start, start + size).with_meta_info(meta)
            inputs = {key: micro.batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")}
            outputs = modeling.run_model(self.model, inputs, value_model=False, temperature=1.0, chunk_tokens=4096, calculate_entropy=False)
            loss, _ = PolicyGradientLoss()(outputs, micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def train_steps(self, batch: DataProto, warmup: int, steps: int) -> dict:
        import torch.distributed as dist

        seconds = []
        for index in range(warmup + steps):
            dist.barrier()
            start = time.perf_counter()
            if self.sharded:
                self.engine.train_batch(batch, PolicyGradientLoss())
            else:
                self.unsharded_step(batch)
            if index >= warmup:
                seconds.append(time.perf_counter() - start)
        state = [*self.model.parameters(), *(p.grad for p in self.model.parameters() if p.grad is not None)]
        state += [value for per_parameter in self.optimizer.state.values() for value in per_parameter.values() if torch.is_tensor(value)]
        return {"seconds": seconds, "state_mib": tensor_bytes(state) / 2**20, "rss_growth_mib": peak_rss_mib() - self.baseline_mib}


def global_batch(rows: int, prompt: int, response: int, vocab: int) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, prompt + response), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt:],
            "response_mask": attention_mask[:, prompt:].float(),
            "advantages": torch.randn(rows, response, generator=generator),
        },
        meta_info={"ppo_mini_batch_size": rows},
    )


def run_contender(processes: int, threads: int, sharded: bool, config: dict, batch: DataProto, warmup: int, steps: int) -> dict:
    pool = ResourcePool([processes], cpus_per_process=threads)
    group = RayWorkerGroup(pool, WorkerSpec(BenchWorker, threads), role="bench")
    try:
        group.build(config, sharded)
        per_rank = group.train_steps(batch, warmup, steps)
    finally:
        group.shutdown()
        pool.release()
    step_seconds = [max(rank["seconds"][i] for rank in per_rank) for i in range(steps)]
    return {
        "median_s": statistics.median(step_seconds),
        "state_mib": max(rank["state_mib"] for rank in per_rank),
        "rss_growth_mib": max(rank["rss_growth_mib"] for rank in per_rank),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=16, help="rows of the global batch (one optimizer step)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch per process")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    model_config = dict(
        model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True,
        max_position_embeddings=args.prompt + args.response,
    )
    config = dict(model_config=model_config, seed=0, lr=1e-4, dtype="float32", micro_batch_size_per_gpu=args.micro_batch)
    batch = global_batch(args.rows, args.prompt, args.response, args.vocab)
    tokens = int(batch.batch["attention_mask"].sum())

    os.environ["RAY_ADDRESS"] = "local"  # a cluster of our own, never one that tests or `ray start` announced
    # Workers inherit this: glibc then serves every allocation over 64 KiB with mmap and returns it on
    # free, so peak RSS follows the tensors alive at once instead of what the heap kept from earlier ones.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    import rlplat

    rlplat.start_ray(num_cpus=4)
    once = {**config, "gradient_sync_every_micro_batch": False}
    contenders = {
        "fsdp2 2 proc": (2, 1, True, config),
        "fsdp2 2 proc, 1 reduce": (2, 1, True, once),
        "fsdp2 1 proc": (1, 1, True, config),
        "unsharded 1 proc": (1, 1, False, config),
    }
    results = {name: run_contender(*setting, batch, args.warmup, args.steps) for name, setting in contenders.items()}

    parameters = args.vocab * args.hidden + args.layers * (4 * args.hidden**2 + 3 * args.hidden * 4 * args.hidden)
    print(
        f"\nFSDP2 engine, CPU, gloo: Qwen2 ~{parameters / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}), global batch {args.rows} x {args.prompt + args.response} = {tokens} tokens, "
        f"{args.micro_batch} rows per micro-batch; median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), python {platform.python_version()}, torch {torch.__version__}")
    header = f"{'contender':<26}{'step s':>9}{'tokens/s':>11}{'state MiB/proc':>16}{'peak RSS growth MiB/proc':>26}"
    print(header)
    print("-" * len(header))
    for name, result in results.items():
        print(f"{name:<26}{result['median_s']:>9.3f}{tokens / result['median_s']:>11.0f}{result['state_mib']:>16.1f}{result['rss_growth_mib']:>26.1f}")
    two, two_once, one, unsharded = (results[name] for name in contenders)
    print(f"scaling ratio (tokens/s, fsdp2 2 proc / 1 proc): {one['median_s'] / two['median_s']:.2f}  (ideal 2.00)")
    print(f"scaling ratio with one reduce per step (2 proc, 1 reduce / 1 proc): {one['median_s'] / two_once['median_s']:.2f}")
    print(f"sharding ratio, model state per process (2-proc fsdp2 / unsharded): {two['state_mib'] / unsharded['state_mib']:.2f}  (ideal 0.50)")
    print(f"sharding ratio, peak RSS growth per process (2-proc fsdp2 / unsharded): {two['rss_growth_mib'] / unsharded['rss_growth_mib']:.2f}"
          f"  (with one reduce per step: {two_once['rss_growth_mib'] / unsharded['rss_growth_mib']:.2f})")


if __name__ == "__main__":
    main()
