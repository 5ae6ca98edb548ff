"""Cost vs model size and response length: the fsdp2 engine's GRPO update against a plain PyTorch step, the
plan's predicted peak against the measured one, and both against what this machine's cores and memory can do.

In one process, every figure a median of repeated steps:

1. **Model size.** Random-init Qwen2 shapes built from a config (``SHAPES``: 0.5M, 5M, 50M parameters by
   default, 500M with ``--sizes``), the demo's vocabulary (16 tokens) unless ``--vocab-size``, tied
   embeddings, float32. The batch is fixed: ``--rows`` (32: 8 prompts x 4 samples) rows of 7 prompt tokens
   (the demo's length) and ``--response-length`` (64) response tokens, every row full length (no padding:
   the plan's worst case), random tokens, a normal advantage per row. Three contenders, interleaved step by
   step (``bench/measure.py``'s ``race``):

   - ``rlplat``: ``FSDP2Engine.train_batch`` configured as ``bench/update_step.py`` configures it (one
     mini-batch, one micro-batch of every row, packing on), the grpo algorithm's ``ActorLoss``
     (token-mean, no KL) wrapped in ``OldLogProbsFromForward``, as ``update_actor`` runs it;
   - ``plain``: ``AutoModelForCausalLM`` with the same weights and ``torch.optim.AdamW``,
     ``bench/plain_grpo.py``'s ``grpo_step``;
   - ``TRL`` (where ``trl`` is installed, as in ``make bench``'s environment; ``--no-trl`` leaves it out):
     ``trl.GRPOTrainer``'s update on the same batch and weights, ``compute_loss`` (its ``dapo`` loss, the
     token-mean; it computes the entropy too), backward, clipping and its AdamW, without its generation.

   Peak memory: live tensor bytes during a second update (the first made the optimizer state), each
   contender measured alone from before its model is built, with :class:`rlplat.testing.memory.TensorMemoryMeter`;
   the plan's figure is ``FSDP2Engine.estimate_memory(...).during("update")``, what ``rlplat plan`` sums for
   the actor's update phase.
2. **Response length** 64, 256, 1024, 2048 (``--lengths``) at the 5M shape (``--length-size``), with
   ``min(--rows, --length-tokens // length)`` rows (4096 tokens: 32, 16, 4, 2 rows) so a step stays a few
   seconds.
3. **Against the machine.** This CPU's float32 GEMM rate (``torch.matmul`` of two 2048 x 2048 matrices,
   ``2 n^3`` FLOP a call) and its copy bandwidth (``Tensor.copy_`` of a 512 MiB tensor, bytes copied per
   second) with the same thread count; the update's achieved rate as ``6 x parameters x tokens`` FLOP per
   step (forward 2, backward 4 per parameter and token; attention's ``T^2`` term and the optimizer are not
   counted); and the weight sync (``FSDP2Engine.named_weights()`` in 256 MiB buckets into the hf rollout's
   ``update_weights``, the path of ``rollout.share_weights=false``) in bytes per second.

Writes PNG plots (log-log) and the raw figures as JSON under ``--out`` (bench/results).

A point whose two contenders would not fit in memory together (500M on a 23 GiB machine) runs them one after
the other ("apart" in the table): built, measured, timed and freed in turn.

Run: ``.venv/bin/python bench/scaling.py [--sizes 0.5M,5M,50M] [--lengths 64,256,1024,2048] [--repetitions 5]
[--torch-threads 2]``; about 3.5 minutes on 2 cores. ``--sizes 0.5M,5M,50M,500M`` adds 4 minutes (8 rows at 500M, 10 s a
step: each contender's weights, gradients and AdamW state are 7.5 GiB, so they run apart).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import Contender, describe_environment, print_table, race  # noqa: E402
from rlplat import Dispatch, Worker, register  # noqa: E402
from plain_grpo import grpo_step  # noqa: E402
from update_step import CpuClock  # noqa: E402

PROMPT_LENGTH, CLIP, SEED = 7, 0.2, 0
MIB = 1 << 20
BUCKET_BYTES = 256 << 20  # the weight sync's default bucket (actor_rollout_ref.weight_bucket_bytes)

#: name -> (hidden, intermediate, layers, heads, rows): Qwen2 with as many KV heads as heads, as the demo's.
#: rows None takes --rows; 500M takes 8: a 10 s step on 2 cores, and one contender's state (7.5 GiB) and activations
#: well inside 23 GiB (the two run apart there, see measure_point).
SHAPES = {
    "0.5M": (128, 512, 2, 4, None),  # the demo's model
    "5M": (256, 1024, 5, 4, None),
    "50M": (512, 2048, 12, 8, None),
    "500M": (1024, 4096, 30, 16, 8),
}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5M,5M,50M", help=f"model shapes of the size sweep, of {', '.join(SHAPES)}")
    parser.add_argument("--lengths", default="64,256,1024,2048", help="response lengths of the length sweep ('' for none)")
    parser.add_argument("--length-size", default="5M", help="the shape of the length sweep")
    parser.add_argument("--length-tokens", type=int, default=4096, help="rows at a response length: min(--rows, this // length)")
    parser.add_argument("--rows", type=int, default=32, help="rows of the fixed batch (prompts x samples)")
    parser.add_argument("--response-length", type=int, default=64, help="response tokens of the size sweep")
    parser.add_argument("--vocab-size", type=int, default=16, help="vocabulary (16: the demo's arithmetic tokenizer)")
    parser.add_argument("--sync-sizes", default="0.5M,5M,50M", help="shapes whose weight sync is timed")
    parser.add_argument("--repetitions", type=int, default=5, help="timed steps per contender at least (quick ones get more)")
    parser.add_argument("--torch-threads", type=int, default=2, help="torch intra-op threads for every contender")
    parser.add_argument("--two-workers", default="0.5M,5M,50M", help="shapes also run on 2 Ray worker processes ('' for none)")
    parser.add_argument("--two-worker-modes", default="replicate,shard", help="the fsdp2 engine's data_parallel modes on 2 workers")
    parser.add_argument("--no-trl", dest="trl", action="store_false",
                        help="leave TRL's update out (it runs where trl is installed: make bench's environment)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder of the plots and scaling.json")
    args = parser.parse_args()
    args.trl = args.trl and trl_available()
    args.sizes = [size for size in args.sizes.split(",") if size]
    args.lengths = [int(length) for length in args.lengths.split(",") if length]
    args.sync_sizes = [size for size in args.sync_sizes.split(",") if size]
    args.two_workers = [size for size in args.two_workers.split(",") if size]
    args.two_worker_modes = [mode for mode in args.two_worker_modes.split(",") if mode]
    unknown = [size for size in [*args.sizes, args.length_size] if size not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    torch.set_num_threads(args.torch_threads)
    return args


def model_config(size: str, vocab_size: int, response_length: int) -> dict:
    hidden, intermediate, layers, heads, _ = SHAPES[size]
    return dict(model_type="qwen2", vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=True,
                max_position_embeddings=max(256, PROMPT_LENGTH + response_length), rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)


def grpo_batch(rows: int, response_length: int, vocab_size: int):
    """(prompt ids, prompt mask, responses, response_mask, per-row advantages): full-length random rows."""
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab_size, (rows, PROMPT_LENGTH), generator=generator)
    responses = torch.randint(0, vocab_size, (rows, response_length), generator=generator)
    return ids, torch.ones_like(ids), responses, torch.ones_like(responses), torch.randn(rows, generator=generator)


def engine_node(config: dict, rows: int) -> dict:
    """``bench/update_step.py``'s engine node (the demo's actor) on a model built from ``config``."""
    return {"model_config": config, "seed": SEED, "lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999],
            "lr_warmup_steps": 0, "lr_scheduler_type": "constant", "min_lr_ratio": 0.0, "grad_clip": 1.0,
            "total_training_steps": 150, "ppo_mini_batch_size": rows, "ppo_epochs": 1, "micro_batch_size_per_gpu": rows,
            "use_dynamic_bsz": False, "max_token_len_per_gpu": 16384, "value_model": False}


class EngineStep:
    """``update_actor``'s call of ``train_batch``, without the worker around it."""

    def __init__(self, config: dict, batch, global_rows: int | None = None, **node: object):
        """``batch``: this process's rows; ``global_rows``: the mini-batch's rows over every process (default: the
        batch's); ``node``: engine settings over ``engine_node``'s."""
        from rlplat import registry
        from rlplat.protocol import DataProto
        from rlplat.workers.actor_rollout_ref import ROW_INDEX
        from rlplat_engine_fsdp2.engine import FSDP2Engine

        ids, mask, responses, response_mask, advantages = batch
        attention_mask = torch.cat([mask, response_mask], dim=1)
        self.rows = len(ids)
        self.batch = DataProto.from_dict(
            {"input_ids": torch.cat([ids, responses], dim=1), "attention_mask": attention_mask,
             "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
             "response_mask": response_mask.float(), "advantages": advantages[:, None] * response_mask,
             ROW_INDEX: torch.arange(self.rows)},
            meta_info={"temperature": 1.0, "calculate_entropy": False, "ppo_mini_batch_size": None, "ppo_epochs": 1},
        )
        self.node = {**engine_node(config, global_rows or self.rows), "micro_batch_size_per_gpu": self.rows, **node}
        self.engine = FSDP2Engine(self.node)
        self.engine.init_model()
        algorithm = registry.get("algorithm", "grpo")()
        loss = {**algorithm.default_nodes()["actor"]["loss"], "loss_agg_mode": "token-mean", "use_kl_loss": False}
        self.actor_loss = algorithm.build_loss("actor", loss)

    def __call__(self, _=None) -> dict[str, float]:
        from rlplat.workers.actor_rollout_ref import OldLogProbsFromForward

        return self.engine.train_batch(self.batch, OldLogProbsFromForward(self.actor_loss, self.rows))


class TwoWorkerUpdate(Worker):
    """One of two rlplat worker processes (Ray, gloo, one torch thread each): ``EngineStep`` on its half of the
    point's batch, the mini-batch the whole batch (``ppo_mini_batch_size`` = its rows), as ``update_actor``'s
    dispatch splits it."""

    @register(Dispatch.ONE_TO_ALL)
    def measure(self, config: dict, rows: int, response_length: int, vocab_size: int, data_parallel: str, repetitions: int) -> dict:
        import torch.distributed as dist

        from rlplat.testing.memory import TensorMemoryMeter

        torch.set_num_threads(1)
        ids, mask, responses, response_mask, advantages = grpo_batch(rows, response_length, vocab_size)
        half = slice(self.rank * rows // 2, (self.rank + 1) * rows // 2)
        shard = (ids[half], mask[half], responses[half], response_mask[half], advantages[half])
        with TensorMemoryMeter() as meter:
            step = EngineStep(config, shard, global_rows=rows, data_parallel=data_parallel)
            step()
            with meter.phase("update"):
                step()
        seconds = []
        for _ in range(max(repetitions, 3)):
            dist.barrier()
            started = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - started)
        return {"seconds": seconds, "peak": meter.peaks()["update"]}


def measure_two_workers(size: str, rows: int, response_length: int, args) -> dict:
    """``TwoWorkerUpdate`` in each ``data_parallel`` mode: the median step (the slower rank's) and one rank's peak."""
    from rlplat import RayWorkerGroup, ResourcePool, WorkerSpec

    config = model_config(size, args.vocab_size, response_length)
    found = {}
    for mode in args.two_worker_modes:
        pool = ResourcePool([2])
        group = RayWorkerGroup(pool, WorkerSpec(TwoWorkerUpdate), role="bench")
        try:
            per_rank = group.measure(config, rows, response_length, args.vocab_size, mode, args.repetitions)
        finally:
            group.shutdown()
            pool.release()
        steps = [max(rank["seconds"][i] for rank in per_rank) for i in range(len(per_rank[0]["seconds"]))]
        found[mode] = {"s": statistics.median(steps), "peak": max(rank["peak"] for rank in per_rank)}
    return found


def random_model(config: dict) -> torch.nn.Module:
    """The Hugging Face model of ``config`` drawn under ``SEED``: the engine draws its weights under its seed the
    same way, so every contender starts from equal models."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings),
                                            dtype=torch.float32, attn_implementation="sdpa")


class PlainStep:
    def __init__(self, config: dict, batch):
        self.model = random_model(config)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        self.batch = batch

    def __call__(self, _=None) -> float:
        return grpo_step(self.model, self.optimizer, *self.batch, clip=CLIP)


class TRLStep:
    """TRL's update on the same batch: ``GRPOTrainer.compute_loss`` (its ``dapo`` loss, token sum over the batch's
    response tokens: the token-mean of the others; no KL; old log-probs the detached current ones, as TRL with
    ``num_iterations=1``), ``accelerator.backward``, gradient clipping at 1.0 and the trainer's AdamW: what its
    ``training_step`` and the optimizer step run after generation, without the generation (``_prepare_inputs``)."""

    def __init__(self, config: dict, batch, output_dir: str):
        import datasets
        import trl
        from transformers import AutoTokenizer

        import rlplat_demo

        model = random_model(config)
        ids, mask, responses, response_mask, advantages = batch
        arguments = trl.GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, seed=SEED,
            per_device_train_batch_size=len(ids), generation_batch_size=len(ids), num_generations=len(ids),
            gradient_accumulation_steps=1, num_iterations=1, max_completion_length=responses.shape[1],
            learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch", beta=0.0, loss_type="dapo",
            epsilon=CLIP, gradient_checkpointing=False, logging_strategy="no", save_strategy="no", eval_strategy="no",
            report_to="none", disable_tqdm=True)
        tokenizer = AutoTokenizer.from_pretrained(rlplat_demo.model_dir())
        self.trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                       args=arguments, processing_class=tokenizer,
                                       train_dataset=datasets.Dataset.from_dict({"prompt": ["1+1="]}))
        self.trainer.create_optimizer()
        self.trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which this step leaves out
        self.model = self.trainer.model
        self.model.train()
        self.inputs = {"prompt_ids": ids, "prompt_mask": mask, "completion_ids": responses, "completion_mask": response_mask,
                       "advantages": advantages, "num_items_in_batch": response_mask.sum()}

    def __call__(self, _=None) -> float:
        optimizer = self.trainer.optimizer
        optimizer.zero_grad(set_to_none=True)
        loss = self.trainer.compute_loss(self.model, self.inputs)
        self.trainer.accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        optimizer.step()
        return float(loss.detach())


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def built_and_measured(build):
    """``build()``'s contender and its peak live tensor bytes during its second step (the first makes
    AdamW's state), counted from before the model exists."""
    from rlplat.testing.memory import TensorMemoryMeter

    with TensorMemoryMeter() as meter:
        contender = build()
        contender()
        with meter.phase("update"):
            contender()
    return contender, meter.peaks()["update"]


def planned_update_bytes(node: dict, config: dict, rows: int, response_length: int):
    """What ``rlplat plan`` counts for the actor's update phase, and its largest item."""
    from rlplat.contracts.memory import MemoryContext
    from rlplat_engine_fsdp2.engine import FSDP2Engine

    context = MemoryContext(role="actor", processes=1, device="cpu", prompt_length=PROMPT_LENGTH,
                            response_length=response_length, sequences_per_process=rows)
    estimate = FSDP2Engine.estimate_memory(node, config, context)
    held = [item for item in estimate.items if "resident" in item.calls or "update" in item.calls]
    resident = sum(item.bytes for item in estimate.items if "resident" in item.calls)
    return estimate.during("update"), max(held, key=lambda item: item.bytes).name, resident


def weight_sync(engine: EngineStep, config: dict, repetitions: int) -> dict:
    """Median seconds of ``named_weights()`` into the hf rollout's ``update_weights``, and the bytes moved."""
    from rlplat_rollout_hf.rollout import HFRollout

    rollout = HFRollout({"model_config": config, "dtype": "float32", "device": "cpu"})
    nbytes = sum(tensor.numel() * tensor.element_size() for bucket in engine.engine.named_weights(BUCKET_BYTES) for _, tensor in bucket)

    def sync(_=None):
        for bucket in engine.engine.named_weights(BUCKET_BYTES):
            rollout.update_weights(bucket)

    bound = HFRollout({"model_config": config, "dtype": "float32", "device": "cpu"})

    def share(_=None):  # rollout.share_weights, as every sync runs it: the rollout's parameters become views of the engine's
        if not bound.bind_weights(engine.engine.shared_weights()):
            raise RuntimeError("the hf rollout refused the engine's shared weights")

    import ray

    host = rollout_host_class().remote(config)
    ray.get(host.ready.remote())

    from rlplat.kits.weights import pack_bucket

    def object_store(_=None):  # a rollout in its own process: each bucket packed and put in Ray's object store, as
        # export_weights and load_weights move them
        ray.get(host.load.remote([ray.put(pack_bucket(bucket)) for bucket in engine.engine.named_weights(BUCKET_BYTES)]))

    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    contenders = race([Contender("sync", sync), Contender("copy", lambda _: target.copy_(source)), Contender("share", share)],
                      repetitions, warmup=2)
    # on its own: interleaved with the in-process contenders its median at 50M was 500 ms, alone 70-140 ms
    contenders += race([Contender("object store", object_store)], repetitions, warmup=2)
    ray.kill(host)
    seconds = {contender.name: contender.median_ms / 1e3 for contender in contenders}
    return {"bytes": nbytes, "sync_s": seconds["sync"], "copy_s": seconds["copy"], "share_s": seconds["share"],
            "object_store_s": seconds["object store"]}


def rollout_host_class():
    import ray

    @ray.remote(num_cpus=0)
    class Host:
        """An hf rollout in its own process, loading weight buckets it is handed as object references."""

        def __init__(self, config: dict):
            from rlplat_rollout_hf.rollout import HFRollout

            torch.set_num_threads(1)
            self.rollout = HFRollout({"model_config": config, "dtype": "float32", "device": "cpu"})

        def ready(self) -> bool:
            return True

        def load(self, buckets: list) -> None:
            import ray

            from rlplat.kits.weights import unpack_bucket

            for bucket in buckets:
                self.rollout.update_weights(unpack_bucket(ray.get(bucket)))

    return Host


def available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (Linux), None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def measure_point(size: str, rows: int, response_length: int, args, sync: bool) -> dict:
    """Both contenders at one point: peaks, then the interleaved race. When the two would not fit in memory
    together (three residents, weights, gradients and AdamW state: both contenders' and a step's transients,
    the plain loop's stale gradients and foreach AdamW's temporaries; and 2.5 x the update's activations, above
    what the machine has available), each is built, measured, timed and freed in turn."""
    started = time.perf_counter()
    config = model_config(size, args.vocab_size, response_length)
    batch = grpo_batch(rows, response_length, args.vocab_size)
    node = engine_node(config, rows)
    planned, largest, resident = planned_update_bytes(node, config, rows, response_length)
    available = available_bytes()
    # interleaved, each contender keeps its weights, gradients and AdamW state between its steps while the other
    # steps: both residents, plus a step's transients: one more resident's worth (the plain loop's stale gradients,
    # foreach AdamW's temporaries; 500M was killed for memory at 24 GB without it) and the update's activations
    builders = {"rlplat": lambda: EngineStep(config, batch), "plain": lambda: PlainStep(config, batch)}
    if args.trl:
        builders["trl"] = lambda: TRLStep(config, batch, args.trl_output)
    together = available is None or (len(builders) + 1) * resident + 2.5 * (planned - resident) < available
    point = {"size": size, "rows": rows, "response_length": response_length, "tokens": rows * (PROMPT_LENGTH + response_length),
             "planned_peak": planned, "planned_largest": largest, "interleaved": together}
    groups = [list(builders)] if together else [[name] for name in builders]
    for names in groups:
        built = {}
        for name in names:
            built[name], point[f"{name}_peak"] = built_and_measured(builders[name])
        clocks = {name: CpuClock(step) for name, step in built.items()}
        contenders = race([Contender(name, clock) for name, clock in clocks.items()], args.repetitions, warmup=1)
        for contender in contenders:
            point[f"{contender.name}_s"] = contender.median_ms / 1e3
            point[f"{contender.name}_cpu_s"] = clocks[contender.name].median_ms(len(contender.seconds)) / 1e3
            point["steps"] = min(point.get("steps", len(contender.seconds)), len(contender.seconds))
        if "rlplat" in built:
            point["parameters"] = built["rlplat"].engine.trainable_params
            if sync:
                point["sync"] = weight_sync(built["rlplat"], config, args.repetitions)
        del built, clocks, contenders
        gc.collect()
    point["wall_s"] = time.perf_counter() - started
    print(f"  {size}, {rows} x ({PROMPT_LENGTH} + {response_length}) tokens: {point['wall_s']:.0f} s"
          + ("" if together else " (one contender after the other: both do not fit in memory)"), flush=True)
    return point


def machine_rates(repetitions: int) -> dict:
    """This CPU's float32 GEMM FLOP/s and copy bytes/s at the process's thread count."""
    n = 2048
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    source = torch.ones(512 * MIB // 4)
    target = torch.empty_like(source)
    gemm, copy = race([Contender("gemm", lambda _: torch.matmul(a, b, out=c)), Contender("copy", lambda _: target.copy_(source))],
                      max(repetitions, 7), warmup=2)
    return {"gemm_flops": 2 * n**3 / (gemm.median_ms / 1e3), "copy_bytes_per_s": source.nbytes / (copy.median_ms / 1e3)}


def update_flops(point: dict) -> float:
    return 6 * point["parameters"] * point["tokens"] / point["rlplat_s"]


def mib(value: float) -> str:
    return f"{value / MIB:,.1f}"


def print_tables(sizes: list[dict], lengths: list[dict], machine: dict, args) -> None:
    gemm = machine["gemm_flops"]
    for title, points, label in (
        (f"GRPO update step vs model size ({args.rows} rows x ({PROMPT_LENGTH} + {args.response_length}) tokens unless stated, "
         f"vocabulary {args.vocab_size}, float32)", sizes, lambda p: f"{p['size']} ({p['parameters'] / 1e6:.2f}M)"),
        (f"GRPO update step vs response length ({args.length_size} shape, "
         f"min({args.rows}, {args.length_tokens} // length) rows)", lengths, lambda p: f"{p['response_length']}"),
    ):
        if not points:
            continue
        trl = all("trl_s" in p for p in points)
        print_table(
            title,
            ["point", "rows", "steps", "rlplat ms", "plain ms", *(["TRL ms"] if trl else []), "rlplat/plain",
             *(["rlplat/TRL"] if trl else []), "CPU-time ratio", "GFLOP/s (6NT)", "of GEMM peak"],
            [[label(p), str(p["rows"]), str(p["steps"]) + ("" if p["interleaved"] else ", apart"),
              f"{p['rlplat_s'] * 1e3:,.1f}", f"{p['plain_s'] * 1e3:,.1f}", *([f"{p['trl_s'] * 1e3:,.1f}"] if trl else []),
              f"{p['rlplat_s'] / p['plain_s']:.2f}", *([f"{p['rlplat_s'] / p['trl_s']:.2f}"] if trl else []),
              f"{p['rlplat_cpu_s'] / p['plain_cpu_s']:.2f}", f"{update_flops(p) / 1e9:.1f}", f"{update_flops(p) / gemm:.0%}"]
             for p in points],
            ["target: rlplat/plain <= 1.10 (medians of interleaved steps; 'apart': one contender's steps after the "
             "other's, they did not fit in memory together; CPU-time ratio: rlplat's CPU seconds over plain's, what others' "
             "work on the cores inflates least)"]
            + (["TRL: GRPOTrainer.compute_loss (dapo: token-mean; it also computes the entropy) + backward + clipping + "
                "AdamW on the same batch, its generation left out"] if trl else []),
        )
        print_table(
            title.replace("GRPO update step", "Peak live tensor memory of the update"),
            ["point", "rlplat MiB", "plain MiB", *(["TRL MiB"] if trl else []), "rlplat/plain", "plan MiB", "plan/measured",
             "plan's largest item"],
            [[label(p), mib(p["rlplat_peak"]), mib(p["plain_peak"]), *([mib(p["trl_peak"])] if trl else []),
              f"{p['rlplat_peak'] / p['plain_peak']:.2f}", mib(p["planned_peak"]), f"{p['planned_peak'] / p['rlplat_peak']:.2f}",
              p["planned_largest"]] for p in points],
            ["target: plan/measured within 0.85-1.15 (the plan: FSDP2Engine.estimate_memory(...).during('update'))"],
        )
    two = [p for p in sizes if "two_workers" in p]
    if two:
        modes = list(two[0]["two_workers"])
        print_table(
            f"GRPO update step on 2 Ray worker processes (1 torch thread each, half the rows each) vs one process with "
            f"{args.torch_threads} threads",
            ["point", "1 process ms", *(f"2 workers {m} ms" for m in modes), *(f"{m}/1 process" for m in modes),
             "peak MiB 1 process", *(f"peak MiB/worker {m}" for m in modes)],
            [[f"{p['size']} ({p['parameters'] / 1e6:.2f}M)", f"{p['rlplat_s'] * 1e3:,.1f}",
              *(f"{p['two_workers'][m]['s'] * 1e3:,.1f}" for m in modes),
              *(f"{p['two_workers'][m]['s'] / p['rlplat_s']:.2f}" for m in modes),
              mib(p["rlplat_peak"]), *(mib(p["two_workers"][m]["peak"]) for m in modes)] for p in two],
            ["2 workers: the slower rank's median step, timed in the workers after a barrier (Ray's dispatch, about 1 ms, "
             "not in it); below 1.00 the 2-worker layout pays for time, and the sharded layout's peak per worker is where it "
             "pays for memory"],
        )
    synced = [p for p in sizes if "sync" in p]
    print_table(
        "Against the machine",
        ["figure", "measured", "of the machine"],
        [["float32 GEMM 2048^3 (GFLOP/s)", f"{gemm / 1e9:.1f}", "peak"],
         ["copy of 512 MiB (GB/s copied)", f"{machine['copy_bytes_per_s'] / 1e9:.2f}", "peak"]]
        + [[f"update at {p['size']} (GFLOP/s, 6NT)", f"{update_flops(p) / 1e9:.1f}", f"{update_flops(p) / gemm:.0%}"] for p in sizes]
        + [row for p in synced for row in (
            [f"weight sync at {p['size']}, bucketed: {mib(p['sync']['bytes'])} MiB in {p['sync']['sync_s'] * 1e3:.2f} ms (GB/s)",
             f"{p['sync']['bytes'] / p['sync']['sync_s'] / 1e9:.2f}",
             f"{p['sync']['bytes'] / p['sync']['sync_s'] / machine['copy_bytes_per_s']:.0%} "
             f"(one copy_ of as many bytes: {p['sync']['bytes'] / p['sync']['copy_s'] / 1e9:.2f} GB/s, "
             f"{p['sync']['copy_s'] / p['sync']['sync_s']:.0%} of it)"],
            [f"weight sync at {p['size']}, zero copy (shared): {p['sync']['share_s'] * 1e3:.3f} ms", "0 bytes", "-"],
            [f"weight sync at {p['size']}, through Ray's object store: {p['sync']['object_store_s'] * 1e3:.2f} ms (GB/s)",
             f"{p['sync']['bytes'] / p['sync']['object_store_s'] / 1e9:.2f}",
             f"{p['sync']['bytes'] / p['sync']['object_store_s'] / machine['copy_bytes_per_s']:.0%}"])],
        ["6NT: 6 x parameters x tokens per step (forward 2, backward 4). Weight sync: bucketed = named_weights() in 256 MiB "
         "buckets into HFRollout.update_weights in the same process (rollout.share_weights=false); zero copy = the rollout's "
         "parameters made views of the engine's (share_weights, the default when colocated); object store = each bucket "
         "ray.put by this process and loaded by an hf rollout in another (a rollout in its own pool); bytes over median time"],
    )


def trl_series(points: list[dict], xs: list, key: str, unit: float) -> list[tuple]:
    """TRL's line where every point has it."""
    if not points or not all(key in p for p in points):
        return []
    return [("TRL GRPOTrainer (compute_loss, backward, AdamW)", xs, [p[key] / unit for p in points], "x-")]


def plot(sizes: list[dict], lengths: list[dict], args, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    written = []

    def figure(name: str, title: str, xlabel: str, ylabel: str, series, xticks):
        fig, axes = plt.subplots(figsize=(6.4, 4.4))
        for label, xs, ys, style in series:
            axes.plot(xs, ys, style, label=label)
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xticks([x for x, _ in xticks], [text for _, text in xticks])
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.yaxis.set_major_locator(LogLocator(subs=(1, 2, 3, 5)))
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.yaxis.set_minor_formatter(NullFormatter())
        axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
        axes.grid(True, which="major", alpha=0.3)
        axes.legend(loc="lower right", fontsize="small")
        fig.tight_layout()
        path = folder / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if sizes:
        parameters = [p["parameters"] for p in sizes]
        ticks = [(p["parameters"], f"{p['size']}") for p in sizes]
        figure("scaling_time_vs_size.png", f"GRPO update step, {args.rows} rows x {PROMPT_LENGTH}+{args.response_length} tokens",
               "parameters", "median step (s)",
               [("rlplat (fsdp2 train_batch)", parameters, [p["rlplat_s"] for p in sizes], "o-"),
                ("plain PyTorch", parameters, [p["plain_s"] for p in sizes], "s--")]
               + trl_series(sizes, parameters, "trl_s", 1)
               + [(f"rlplat, 2 Ray workers, {mode}", [p["parameters"] for p in sizes if "two_workers" in p],
                   [p["two_workers"][mode]["s"] for p in sizes if "two_workers" in p], style)
                  for mode, style in zip(args.two_worker_modes, ("v-.", "d:"))], ticks)
        figure("scaling_memory_vs_size.png", "Peak live tensor memory of the update", "parameters", "MiB",
               [("rlplat measured", parameters, [p["rlplat_peak"] / MIB for p in sizes], "o-"),
                ("plain measured", parameters, [p["plain_peak"] / MIB for p in sizes], "s--"),
                ("rlplat plan", parameters, [p["planned_peak"] / MIB for p in sizes], "^:")]
               + trl_series(sizes, parameters, "trl_peak", MIB)
               + [(f"rlplat, per worker of 2, {mode}", [p["parameters"] for p in sizes if "two_workers" in p],
                   [p["two_workers"][mode]["peak"] / MIB for p in sizes if "two_workers" in p], style)
                  for mode, style in zip(args.two_worker_modes, ("v-.", "d:"))], ticks)
    if lengths:
        xs = [p["response_length"] for p in lengths]
        rows = ", ".join(f"{p['rows']}" for p in lengths)
        figure("scaling_time_vs_length.png", f"GRPO update step at {args.length_size}, rows {rows}",
               "response tokens", "median step (s)",
               [("rlplat (fsdp2 train_batch)", xs, [p["rlplat_s"] for p in lengths], "o-"),
                ("plain PyTorch", xs, [p["plain_s"] for p in lengths], "s--")] + trl_series(lengths, xs, "trl_s", 1),
               [(x, str(x)) for x in xs])
    return written


def main() -> None:
    args = parse_arguments()
    trl_output = tempfile.TemporaryDirectory(prefix="scaling-trl-")  # GRPOTrainer wants an output_dir; nothing is saved
    args.trl_output = trl_output.name
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    cpu_before = sum(os.times()[:4])
    if args.two_workers or args.sync_sizes:
        os.environ["RAY_ADDRESS"] = "local"  # a private cluster, never one that tests or `ray start` announced
        import rlplat

        rlplat.start_ray(num_cpus=4)
    machine = machine_rates(args.repetitions)
    print(f"machine: {machine['gemm_flops'] / 1e9:.1f} GFLOP/s float32 GEMM, {machine['copy_bytes_per_s'] / 1e9:.2f} GB/s copy", flush=True)
    sizes = []
    for size in args.sizes:
        rows = SHAPES[size][4] or args.rows
        sizes.append(measure_point(size, rows, args.response_length, args, sync=size in args.sync_sizes))
    if args.two_workers:
        for point in sizes:
            if point["size"] in args.two_workers:
                started_point = time.perf_counter()
                point["two_workers"] = measure_two_workers(point["size"], point["rows"], point["response_length"], args)
                print(f"  {point['size']} on 2 workers: {time.perf_counter() - started_point:.0f} s", flush=True)
    lengths = []
    for length in args.lengths:
        rows = min(args.rows, max(1, args.length_tokens // length))
        reuse = [p for p in sizes if (p["size"], p["rows"], p["response_length"]) == (args.length_size, rows, length)]
        lengths.append(reuse[0] if reuse else measure_point(args.length_size, rows, length, args, sync=False))
    print_tables(sizes, lengths, machine, args)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    written = plot(sizes, lengths, args, folder)
    elapsed = time.perf_counter() - started
    (folder / "scaling.json").write_text(json.dumps(
        {"machine": machine, "sizes": sizes, "lengths": lengths, "seconds": elapsed,
         "arguments": {k: v for k, v in vars(args).items() if k != "trl_output"}}, indent=1))
    print(f"\n{describe_environment({})}")
    print(f"load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; this process used "
          f"{sum(os.times()[:4]) - cpu_before:.0f} CPU s in {elapsed:.0f} s")
    print(f"wrote {', '.join(str(path) for path in written)} and {folder / 'scaling.json'}")
    sys.stdout.flush()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
