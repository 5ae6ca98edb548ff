"""rlplat GRPO vs TRL's ``GRPOTrainer``: seconds per training step on the built-in demo, on CPU.

Same model (``rlplat_demo.model_dir()``), training prompts (``rlplat_demo.train_file()``), 32 prompts x 8
samples per step, 4 new tokens, AdamW lr 1e-4 (constant, no weight decay, grad clip 1.0), temperature 1,
top_k 0, top_p 1, token-mean loss (TRL's ``dapo``), no KL, reward 1/0 exact match, float32, no gradient
checkpointing. Contenders, each in a fresh child process of this script:

* ``TRL GRPOTrainer``: one process, torch threads = ``--threads`` (2);
* ``TRL GRPOTrainer, 1 thread``: the same with one torch thread (two threads that wait for each other at
  every barrier suffer most when something else shares the 2 cores);
* ``rlplat ray x2``: 2 fsdp2 worker processes on a private Ray cluster (1 CPU each), each holding the whole
  model (``actor.engine_config.data_parallel=replicate``: one gradient all-reduce per step, and each
  worker's colocated rollout shares its engine's weights);
* ``rlplat ray x2, sharded``: the same with FSDP2's sharding (``data_parallel=shard``, the engine's default:
  per-layer all-gathers and reduce-scatters, DTensor optimizer, full weights gathered at every sync);
* ``rlplat local``: ``cluster.backend=local``, the worker in the driver process, torch threads = ``--threads``;
* ``plain PyTorch loop``: ``bench/plain_grpo.py``, the same recipe hand-written in one process (sampling with
  the KV cache, one forward and backward, AdamW), torch threads = ``--threads``: the floor a framework's own
  overhead is measured against.

Seconds per step: TRL from a ``TrainerCallback`` (``on_step_begin`` -> ``on_step_end``), rlplat from its
``timing_s/step`` metric (the checkpoint written after the last step is outside it), the plain loop from its
own clock around generation + update. Medians over the steps
after ``--warmup`` in one run; each contender runs ``--rounds`` times (fresh processes, alternating order) and
the table takes its quietest run. Nothing passes or fails: the script prints what it measured, the ratios
and, after the table, rlplat's targets (local <= 0.7x TRL, ray x2 <= 1.0x TRL, local <= 1.3x the plain loop)
beside the measured ratios.
Run: python bench/trl_vs_rlplat.py [--warmup 3] [--steps 6] [--rounds 3] [--only trl --only rlplat-ray ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, SAMPLES, NEW_TOKENS, LR = 32, 8, 4, 1e-4
RESULT_TAG = "TRL_VS_RLPLAT_RESULT "
RLPLAT_STAGES = ["gen", "old_log_prob", "update_actor", "sync_weights"]


# -- TRL ------------------------------------------------------------------------------------------------

def run_trl(warmup: int, steps: int, threads: int, output_dir: str) -> dict:
    import torch

    torch.set_num_threads(threads)
    import datasets
    import pyarrow.parquet as pq
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import rlplat_demo as demo
    from rlplat.scorers import exact_match

    rows = pq.read_table(demo.train_file()).to_pylist()
    # rlplat's data loader: no chat template on the demo tokenizer -> message contents concatenated, encoded
    # with special tokens (BOS). TRL encodes a plain-text prompt with processing_class(text=...), BOS included.
    dataset = datasets.Dataset.from_dict({
        "prompt": ["".join(m["content"] for m in row["prompt"]) for row in rows],
        "ground_truth": [row["reward_model"]["ground_truth"] for row in rows],
        "data_source": [row["data_source"] for row in rows],
    })
    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir())
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir(), dtype=torch.float32)

    def reward(prompts, completions, ground_truth, data_source, **_):
        return [exact_match(s, c, g)["score"] for s, c, g in zip(data_source, completions, ground_truth)]

    config = trl.GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, seed=0,
        per_device_train_batch_size=PROMPTS * SAMPLES, generation_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0, use_vllm=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", beta=0.0, loss_type="dapo", scale_rewards="group",
        gradient_checkpointing=False, max_steps=warmup + steps,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=False,
    )

    class Timed(trl.GRPOTrainer):
        generate_s: list = []

        def _generate_and_score_completions(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*args, **kwargs)
            finally:
                self.generate_s.append(time.perf_counter() - started)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.seconds, self.started = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)

    clock = StepClock()
    trainer = Timed(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    step_s, generate_s = clock.seconds[warmup:], Timed.generate_s[warmup:warmup + len(clock.seconds[warmup:])]
    return {
        "step": step_s,
        "breakdown": {"gen+score": generate_s, "rest (loss, backward, optimizer)": [s - g for s, g in zip(step_s, generate_s)]},
        "steps_seen": len(clock.seconds),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "threads": torch.get_num_threads(),
    }


# -- rlplat ---------------------------------------------------------------------------------------------

def run_rlplat(backend: str, warmup: int, steps: int, threads: int, output_dir: str, extra: tuple[str, ...] = ()) -> dict:
    import torch

    torch.set_num_threads(threads)
    os.environ["RAY_ADDRESS"] = "local"  # a private Ray cluster, never one recorded by someone else
    from rlplat_demo import overrides as demo_overrides
    from rlplat.config import load_config
    from rlplat.trainer.tracking import read_metrics
    from rlplat.trainer import Trainer

    overrides = demo_overrides() + [
        f"trainer.total_training_steps={warmup + steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.save_freq=0", "trainer.logger=[jsonl]", f"trainer.output_dir={output_dir}", "trainer.resume=disable",
        f"cluster.devices_per_node={2 if backend == 'ray' else 1}", f"cluster.backend={backend}",  # local: one process
        f"actor.optim.lr={LR}", "actor.optim.lr_scheduler_type=constant",  # the contenders' recipe, not the demo's schedule
        *extra,
    ]
    config = load_config(overrides=overrides, algo="grpo")
    Trainer(config).fit()
    records = [r for r in read_metrics(output_dir) if "timing_s/step" in r]
    records = records[warmup:]
    step_s = [r["timing_s/step"] for r in records]
    breakdown = {name: [r.get(f"timing_s/{name}", 0.0) for r in records] for name in RLPLAT_STAGES}
    breakdown["rest"] = [r["timing_s/step"] - sum(r.get(f"timing_s/{n}", 0.0) for n in RLPLAT_STAGES) for r in records]
    breakdown["(reward, inside gen)"] = [r.get("timing_s/reward", 0.0) for r in records]
    return {"step": step_s, "breakdown": breakdown, "steps_seen": len(records) + warmup, "threads": torch.get_num_threads()}


# -- plain PyTorch loop -------------------------------------------------------------------------------

def run_plain(warmup: int, steps: int, threads: int) -> dict:
    import torch

    import plain_grpo  # bench/plain_grpo.py, beside this script

    result = plain_grpo.run(warmup + steps, seed=0, threads=threads, lr=LR, prompts=PROMPTS, samples=SAMPLES, new_tokens=NEW_TOKENS)
    return {
        "step": result["step_s"][warmup:],
        "breakdown": {"gen+score": result["gen_s"][warmup:], "update (forward, backward, optimizer)": result["train_s"][warmup:]},
        "steps_seen": result["steps"], "threads": torch.get_num_threads(),
    }


# -- driver ---------------------------------------------------------------------------------------------

CONTENDERS = {"trl": "TRL GRPOTrainer", "trl-t1": "TRL GRPOTrainer, 1 thread", "rlplat-ray": "rlplat ray x2 (replicate)",
              "rlplat-ray-shard": "rlplat ray x2, sharded",
              "rlplat-local": "rlplat local x1", "plain": "plain PyTorch loop"}
# Targets: (contender, reference, most allowed ratio contender / reference).
TARGETS = [("rlplat-local", "trl", 0.7), ("rlplat-ray", "trl", 1.0), ("rlplat-local", "plain", 1.3)]


def child(name: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        if name.startswith("trl"):
            result = run_trl(args.warmup, args.steps, 1 if name == "trl-t1" else args.threads, tmp)
        elif name == "plain":
            result = run_plain(args.warmup, args.steps, args.threads)
        else:
            extra = ("actor.engine_config.data_parallel=replicate",) if name == "rlplat-ray" else ()
            result = run_rlplat(name.split("-")[1], args.warmup, args.steps, args.threads, str(Path(tmp) / "run"), extra)
    print(RESULT_TAG + json.dumps(result), flush=True)


def launch(name: str, args: argparse.Namespace) -> tuple[dict | None, float, str]:
    command = [sys.executable, __file__, "--child", name, "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--threads", str(args.threads)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - started
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):]), wall, ""
    tail = "\n".join((done.stdout + "\n" + done.stderr).strip().splitlines()[-25:])
    return None, wall, f"exit {done.returncode}:\n{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=6, help="timed steps after them (>= 5)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per contender, in alternating order")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the in-process trainers")
    parser.add_argument("--only", choices=sorted(CONTENDERS), action="append", help="run only these contenders")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per contender")
    parser.add_argument("--child", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 5:
        parser.error("--steps must be at least 5")
    if args.child:
        child(args.child, args)
        return

    from measure import print_table

    names = args.only or ["trl", "trl-t1", "rlplat-ray", "rlplat-ray-shard", "rlplat-local", "plain"]
    runs: dict[str, list[dict]] = {}
    load_before = os.getloadavg()[0]
    # Rounds in alternating order. The machine's 2 cores may be shared (a test suite, another benchmark):
    # a run that met a burst of someone else's work is slower throughout, so the table takes each
    # contender's quietest run (lowest median) and shows every run's median beside it.
    for round_index in range(args.rounds):
        for name in (names if round_index % 2 == 0 else names[::-1]):
            result, wall, error = launch(name, args)
            if result is None:
                print(f"{CONTENDERS[name]}: no result ({error})", flush=True)
                continue
            result["median"] = statistics.median(result["step"])
            runs.setdefault(name, []).append(result)
            print(f"round {round_index + 1}: {CONTENDERS[name]}: {len(result['step'])} timed steps, median "
                  f"{result['median']:.3f} s ({wall:.0f} s wall with start-up, load average {os.getloadavg()[0]:.1f})", flush=True)
    results = {name: min(name_runs, key=lambda r: r["median"]) for name, name_runs in runs.items()}
    if not results:
        sys.exit(1)
    load_after = os.getloadavg()[0]

    trl_median = statistics.median(results["trl"]["step"]) if "trl" in results else None
    rows = []
    for name, result in results.items():
        median = statistics.median(result["step"])
        ratio = f"{median / trl_median:.2f}" if trl_median else "-"
        rows.append([CONTENDERS[name], f"{median:.3f}", f"{min(result['step']):.3f}", ratio, str(len(result["step"])),
                     " ".join(f"{r['median']:.3f}" for r in runs[name])])
    header = ["contender", "median s/step", "min s/step", "ratio vs TRL", "steps", "every run's median"]
    versions = results.get("trl", {}).get("versions", {})
    print_table(
        f"GRPO step time on the demo: {PROMPTS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, lr {LR:g}, "
        f"{os.cpu_count()} CPUs, torch threads {args.threads} in-process; warm-up {args.warmup} steps per run; each contender's quietest of {args.rounds} runs",
        header, rows,
        [f"ratio = contender / TRL GRPOTrainer with {args.threads} threads (below 1: faster than TRL). "
         f"TRL has no separate old-log-prob pass (num_iterations 1); rlplat ray workers run 1 torch thread each.",
         f"{', '.join(f'{k} {v}' for k, v in versions.items())}; load average {load_before:.1f} before, "
         f"{load_after:.1f} after (above ~0.5 means something else shared the cores)"],
    )

    target_rows = []
    for name, reference, most in TARGETS:
        if name in results and reference in results:
            ratio = statistics.median(results[name]["step"]) / statistics.median(results[reference]["step"])
            target_rows.append([f"{CONTENDERS[name]} / {CONTENDERS[reference]}", f"<= {most:.1f}", f"{ratio:.2f}",
                                "met" if ratio <= most else "not met"])
        else:
            target_rows.append([f"{CONTENDERS[name]} / {CONTENDERS[reference]}", f"<= {most:.1f}", "-", "not measured"])
    print_table("rlplat's targets: median s/step of the quietest runs, as a ratio", ["ratio", "target", "measured", ""],
                target_rows, ["one run per contender is noisy on a shared machine: trust ratios from --rounds 3 or more"])

    for name, result in results.items():
        step_median = statistics.median(result["step"])
        stages = {stage: statistics.median(values) for stage, values in result["breakdown"].items()}
        counted = {k: v for k, v in stages.items() if not k.startswith("(")}
        dominant = max(counted, key=counted.get)
        stage_rows = [[stage, f"{seconds:.3f}", f"{100 * seconds / step_median:.0f}%"] for stage, seconds in stages.items()]
        print_table(f"{CONTENDERS[name]}: breakdown of its quietest run (medians per stage; they need not sum to the median step)",
                    ["stage", "median s", "of step"], stage_rows, [f"dominant: {dominant} ({counted[dominant]:.3f} s)"])


if __name__ == "__main__":
    main()
