"""The GRPO update on the demo's shape: the fsdp2 engine's ``train_batch`` against a plain PyTorch
forward + backward + AdamW step of the same recipe, in one process.

The batch: 32 demo prompts (7 tokens: BOS + ``ab+cd=``) x 8 samples of up to 4 tokens drawn from the demo
model with ``bench/plain_grpo.py``'s sampler (right-padded, ``response_mask`` 1 up to and including EOS),
per-row advantages drawn from a seeded normal. The update, both sides: the PPO clipped surrogate (clip
0.2) with old log-probs = the detached current ones, token-mean over the batch, no KL, gradient norm
clipped at 1.0, AdamW lr 1e-4 (betas 0.9/0.999, eps 1e-8, no weight decay), float32.

- ``engine``: ``FSDP2Engine`` on ``rlplat_demo.model_dir()`` (one rank, gloo) configured as a demo run
  configures the actor (``core/rlplat/config/`` ``engine_node`` with the demo's overrides: one mini-batch, one
  micro-batch of 256 rows, packing on), ``train_batch`` with the grpo algorithm's ``ActorLoss``
  (token-mean, no KL) wrapped in ``OldLogProbsFromForward``, as ``update_actor`` runs it;
- ``plain``: ``AutoModelForCausalLM`` + ``torch.optim.AdamW``, ``bench/plain_grpo.py``'s ``grpo_step``.

Each repetition is one optimizer step of each (interleaved, order rotating). After the race the script
prints the medians and their ratio, then a breakdown of each side's step from one more pass with
``perf_counter`` sections (engine: the methods it calls, wrapped; plain: the lines of ``grpo_step``), and
how far one step from the same weights moves the two models apart (they start equal; packing and
fused/foreach kernels round differently in float32). ``--profile`` adds torch.profiler's top operators
of the engine's step.

Run: ``.venv/bin/python bench/update_step.py [--repetitions 15] [--torch-threads 1] [--profile]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import Contender, describe_environment, print_table, race  # noqa: E402
from plain_grpo import left_pad, load_prompts, grpo_step, sample  # noqa: E402

PROMPTS, SAMPLES, NEW_TOKENS, CLIP = 32, 8, 4, 0.2


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=15, help="timed steps per contender at least (>= 7)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender before them")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (1: see bench/measure.py)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top operators of one engine step")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine config override (Python literal value), e.g. use_remove_padding=False")
    args = parser.parse_args()
    if args.repetitions < 7:
        parser.error("--repetitions must be at least 7: medians of fewer are noise")
    torch.set_num_threads(args.torch_threads)
    return args


def demo_batch(seed: int = 0):
    """(input_ids, attention_mask, responses, response_mask, per-row advantages) of one demo step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rlplat_demo as demo

    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir())
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir(), dtype=torch.float32)
    prompt_ids, _ = load_prompts(demo.train_file(), tokenizer)
    chosen = [prompt_ids[index] for index in range(PROMPTS) for _ in range(SAMPLES)]
    ids, mask = left_pad(chosen, tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(seed)
    responses, response_mask = sample(model, ids, mask, NEW_TOKENS, tokenizer.eos_token_id, tokenizer.pad_token_id, generator)
    advantages = torch.randn(len(chosen), generator=generator)
    return ids, mask, responses, response_mask, advantages


def engine_config(options: list[str]) -> dict:
    """The actor's engine node of a demo run (``core/rlplat/config/`` ``engine_node``), then ``options``."""
    import ast

    import rlplat_demo as demo

    node = {
        "model_path": str(demo.model_dir()), "seed": 0, "lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999],
        "lr_warmup_steps": 0, "lr_scheduler_type": "constant", "min_lr_ratio": 0.0, "grad_clip": 1.0,
        "total_training_steps": 150, "ppo_mini_batch_size": PROMPTS * SAMPLES, "ppo_epochs": 1,
        "micro_batch_size_per_gpu": PROMPTS * SAMPLES, "use_dynamic_bsz": False, "max_token_len_per_gpu": 16384,
        "value_model": False,
    }
    for option in options:
        key, _, value = option.partition("=")
        node[key] = ast.literal_eval(value)
    return node


class EngineUpdate:
    """``update_actor``'s call of ``train_batch`` on the demo batch, without the worker around it."""

    def __init__(self, batch, options: list[str]):
        from rlplat import registry
        from rlplat.protocol import DataProto
        from rlplat.workers.actor_rollout_ref import ROW_INDEX
        from rlplat_engine_fsdp2.engine import FSDP2Engine

        ids, mask, responses, response_mask, advantages = batch
        attention_mask = torch.cat([mask, response_mask], dim=1)
        self.rows = len(ids)
        self.batch = DataProto.from_dict(
            {
                "input_ids": torch.cat([ids, responses], dim=1),
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                "responses": responses,
                "response_mask": response_mask.float(),
                "advantages": advantages[:, None].expand_as(responses).contiguous() * response_mask,
                ROW_INDEX: torch.arange(self.rows),
            },
            meta_info={"temperature": 1.0, "calculate_entropy": False, "ppo_mini_batch_size": None, "ppo_epochs": 1},
        )
        self.engine = FSDP2Engine(engine_config(options))
        self.engine.init_model()
        algorithm = registry.get("algorithm", "grpo")()
        node = {**algorithm.default_nodes()["actor"]["loss"], "loss_agg_mode": "token-mean", "use_kl_loss": False}
        self.actor_loss = algorithm.build_loss("actor", node)

    def __call__(self, _=None) -> dict[str, float]:
        from rlplat.workers.actor_rollout_ref import OldLogProbsFromForward

        return self.engine.train_batch(self.batch, OldLogProbsFromForward(self.actor_loss, self.rows))

    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for bucket in self.engine.named_weights() for name, tensor in bucket}


class PlainUpdate:
    def __init__(self, batch):
        from transformers import AutoModelForCausalLM

        import rlplat_demo as demo

        self.batch = batch
        self.model = AutoModelForCausalLM.from_pretrained(demo.model_dir(), dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def __call__(self, _=None) -> float:
        return grpo_step(self.model, self.optimizer, *self.batch, clip=CLIP)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.model.named_parameters()}


class CpuClock:
    """``update`` as a contender's run that also records the process's CPU seconds of each call."""

    def __init__(self, update):
        self.update = update
        self.seconds: list[float] = []

    def __call__(self, argument=None):
        start = time.process_time()
        result = self.update(argument)
        self.seconds.append(time.process_time() - start)
        return result

    def median_ms(self, last: int) -> float:
        """Median of the last ``last`` calls (the race's timed ones come after its warm-up)."""
        return statistics.median(self.seconds[-last:]) * 1e3


class Sections:
    """Seconds spent inside named calls, summed over one pass."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def engine_breakdown(update: EngineUpdate, passes: int) -> dict[str, float]:
    """Median seconds per section of ``passes`` engine steps. The model call's time is ``run`` less the
    log-prob computation; ``backward`` is the autograd pass (FSDP2's hooks and reduce-scatter in it)."""
    from rlplat_engine_fsdp2 import modeling

    engine = update.engine
    per_pass: dict[str, list[float]] = defaultdict(list)
    for _ in range(passes):
        sections = Sections()
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(modeling, "response_log_probs", sections.wrap("log-probs", modeling.response_log_probs)))
            stack.enter_context(patched(engine, "run", sections.wrap("run", engine.run)))
            stack.enter_context(patched(engine, "clip_gradients", sections.wrap("grad clip", engine.clip_gradients)))
            stack.enter_context(patched(engine, "gather_metrics", sections.wrap("metrics", engine.gather_metrics)))
            stack.enter_context(patched(engine.optimizer, "step", sections.wrap("optimizer step", engine.optimizer.step)))
            stack.enter_context(patched(engine.lr_scheduler, "step", sections.wrap("lr schedule", engine.lr_scheduler.step)))
            stack.enter_context(patched(torch.Tensor, "backward", sections.wrap("backward", torch.Tensor.backward)))
            loss_fn = update.actor_loss
            stack.enter_context(patched(update, "actor_loss", sections.wrap("loss", loss_fn)))
            start = time.perf_counter()
            update()
            total = time.perf_counter() - start
        seconds = dict(sections.seconds)
        seconds["model forward"] = seconds.pop("run") - seconds["log-probs"]
        seconds["other"] = total - sum(seconds.values())
        seconds["total"] = total
        for key, value in seconds.items():
            per_pass[key].append(value)
    return {key: statistics.median(values) for key, values in per_pass.items()}


def plain_breakdown(update: PlainUpdate, passes: int) -> dict[str, float]:
    """The lines of ``grpo_step``, timed one by one."""
    model, optimizer = update.model, update.optimizer
    ids, mask, responses, response_mask, advantages = update.batch
    per_pass: dict[str, list[float]] = defaultdict(list)
    for _ in range(passes):
        marks = [("start", time.perf_counter())]
        sequence = torch.cat([ids, responses], dim=1)
        attention = torch.cat([mask, response_mask], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=sequence, attention_mask=attention, position_ids=positions).logits
        marks.append(("model forward", time.perf_counter()))
        log_probs = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1].float(), -1).gather(-1, responses[..., None]).squeeze(-1)
        marks.append(("log-probs", time.perf_counter()))
        ratio = torch.exp(log_probs - log_probs.detach())
        advantage = advantages[:, None]
        loss = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP))
        weight = response_mask.float()
        loss = (loss * weight).sum() / weight.sum().clamp(min=1)
        marks.append(("loss", time.perf_counter()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(("backward", time.perf_counter()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        marks.append(("grad clip", time.perf_counter()))
        optimizer.step()
        marks.append(("optimizer step", time.perf_counter()))
        float(loss.detach())
        marks.append(("metrics", time.perf_counter()))
        for (_, before), (name, after) in zip(marks, marks[1:]):
            per_pass[name].append(after - before)
        per_pass["total"].append(marks[-1][1] - marks[0][1])
    return {key: statistics.median(values) for key, values in per_pass.items()}


def profile_engine(update: EngineUpdate) -> None:
    from torch.profiler import ProfilerActivity, profile

    update()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        update()
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main() -> None:
    args = parse_arguments()
    batch = demo_batch()
    engine, plain = EngineUpdate(batch, args.engine_option), PlainUpdate(batch)
    start_engine, start_plain = engine.parameters(), plain.parameters()
    drift_start = max((start_engine[name] - start_plain[name]).abs().max().item() for name in start_engine)
    engine()
    plain()
    after_engine, after_plain = engine.parameters(), plain.parameters()
    drift_step = max((after_engine[name] - after_plain[name]).abs().max().item() for name in after_engine)
    moved = max((after_plain[name] - start_plain[name]).abs().max().item() for name in after_plain)

    engine_cpu, plain_cpu = CpuClock(engine), CpuClock(plain)
    contenders = race([Contender("engine train_batch", engine_cpu), Contender("plain forward+backward+AdamW", plain_cpu)],
                      args.repetitions, args.warmup)
    engine_ms, plain_ms = contenders[0].median_ms, contenders[1].median_ms
    cpu_ms = [clock.median_ms(len(c.seconds)) for clock, c in zip((engine_cpu, plain_cpu), contenders)]
    valid = batch[3].float().mean().item()
    print_table(
        f"GRPO update on the demo batch ({PROMPTS * SAMPLES} rows, 7 + {NEW_TOKENS} tokens, {valid:.0%} of response "
        f"tokens valid), {len(contenders[0].seconds)} interleaved steps each",
        ["contender", "median ms", "min ms", "x plain", "CPU ms", "CPU x plain"],
        [[c.name, f"{c.median_ms:.1f}", f"{c.min_ms:.1f}", f"{c.median_ms / plain_ms:.2f}", f"{cpu:.1f}", f"{cpu / cpu_ms[1]:.2f}"]
         for c, cpu in zip(contenders, cpu_ms)],
        [f"engine / plain: {engine_ms / plain_ms:.2f} (median ratio of wall time), {cpu_ms[0] / cpu_ms[1]:.2f} of "
         "CPU time (this process's, all threads: what others' work on the shared cores inflates least)",
         f"max |engine - plain| parameter difference: {drift_start:.1e} at the start, {drift_step:.1e} after one step "
         f"(the step moves parameters by up to {moved:.1e})",
         describe_environment({"engine options": " ".join(args.engine_option) or "the demo's"})],
    )
    passes = 9
    engine_sections, plain_sections = engine_breakdown(engine, passes), plain_breakdown(plain, passes)
    order = ["model forward", "log-probs", "loss", "backward", "grad clip", "optimizer step", "lr schedule", "metrics", "other", "total"]
    print_table(
        f"Where a step goes (median ms of {passes} more steps each, timed by sections)",
        ["section", "engine", "plain"],
        [[name, f"{engine_sections.get(name, 0.0) * 1e3:.1f}", f"{plain_sections[name] * 1e3:.1f}" if name in plain_sections else "-"]
         for name in order],
        ["engine 'other': train_batch's own work (batch slicing and moves, micro-batch planning, global counts, "
         "OldLogProbsFromForward's bookkeeping, zero_grad)"],
    )
    if args.profile:
        profile_engine(engine)


if __name__ == "__main__":
    main()
