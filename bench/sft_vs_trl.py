"""``rlplat sft`` vs TRL's ``SFTTrainer``: seconds per supervised step on the demo's task, on CPU.

Same model (the demo's architecture, randomly initialised under seed 0 and saved once), same data (the
demo's training pairs as ``prompt`` / ``response`` rows: ``a+b=`` -> the sum, loss on the answer and EOS),
same batch (128 examples per optimizer step, one micro-batch), AdamW lr 1e-3 constant (betas 0.9/0.999,
no weight decay), gradient norm clipped at 1.0, float32, no gradient checkpointing, no packing on the
TRL side (its default), the engine's default (packing on) on rlplat's. Contenders, each in a fresh child
process of this script with ``--threads`` torch threads:

* ``TRL SFTTrainer``: ``trl.SFTTrainer`` with a prompt-completion dataset (``completion_only_loss``);
* ``rlplat sft local``: :class:`rlplat_sft.trainer.SFTTrainer` with ``cluster.backend=local`` (the fsdp2
  engine in the driver process), as ``rlplat sft ... cluster.backend=local`` runs;
* ``rlplat sft padded``: the same with ``actor.engine_config.use_remove_padding=false`` (padded rows, as
  TRL runs them; the demo's examples are 9 to 11 tokens, so packing saves little here).

Seconds per step: TRL from a ``TrainerCallback`` (``on_step_begin`` -> ``on_step_end``: the batch is already
collated), rlplat from its ``timing_s/step`` metric (which includes collating the batch and the call into the
worker). Medians over the steps after ``--warmup``; each contender runs ``--rounds`` times (fresh processes,
alternating order) and the table takes its quietest run. Nothing passes or fails: the script prints the
medians and the ratios rlplat / TRL beside the target (<= 1.0x).

Run: ``.venv-bench/bin/python bench/sft_vs_trl.py [--warmup 3] [--steps 10] [--rounds 3] [--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH, LR, MAX_LENGTH = 128, 1e-3, 16
RESULT_TAG = "SFT_VS_TRL_RESULT "
TARGET = 1.0


def prepare(folder: Path) -> tuple[str, str]:
    """The randomly initialised demo-sized model and the training rows, written once for every contender."""
    from rlplat.kits.data import write_parquet
    from rlplat_demo.build import split_pairs, supervised_rows
    from rlplat.testing.tiny_models import save_tiny_model

    train_pairs, _ = split_pairs(0)
    model = save_tiny_model(folder / "model", seed=0)
    data = write_parquet(supervised_rows(train_pairs), folder / "train.parquet")
    return model, data


def run_trl(model_path: str, data: str, warmup: int, steps: int, threads: int, output_dir: str) -> list[float]:
    import time

    import torch

    torch.set_num_threads(threads)
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    rows = datasets.Dataset.from_parquet(data).rename_column("response", "completion")
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.started)

    config = SFTConfig(
        output_dir=output_dir, max_steps=warmup + steps, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9,
        adam_beta2=0.999, logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, max_length=MAX_LENGTH, completion_only_loss=True, packing=False,
        bf16=False, fp16=False,  # TRL's SFTConfig turns bf16 autocast on by default: float32 on both sides
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    return times[warmup:]


def run_rlplat(model_path: str, data: str, warmup: int, steps: int, threads: int, output_dir: str,
               extra: tuple[str, ...] = ()) -> list[float]:
    import torch

    torch.set_num_threads(threads)
    from rlplat_sft.config import load_sft_config
    from rlplat_sft.trainer import run_sft
    from rlplat.trainer.tracking import read_metrics

    config = load_sft_config(None, [
        f"model.path={model_path}", f"data.train_files=[{data}]", f"data.train_batch_size={BATCH}",
        f"data.max_length={MAX_LENGTH}", f"actor.optim.lr={LR}", "actor.optim.weight_decay=0.0", "actor.optim.grad_clip=1.0",
        f"actor.micro_batch_size_per_gpu={BATCH}", f"trainer.total_training_steps={warmup + steps}",
        f"trainer.output_dir={output_dir}", "trainer.logger=[jsonl]", "cluster.backend=local", *extra,
    ])
    run_sft(config)
    return [record["timing_s/step"] for record in read_metrics(output_dir)][warmup:]


def run_rlplat_padded(model_path: str, data: str, warmup: int, steps: int, threads: int, output_dir: str) -> list[float]:
    return run_rlplat(model_path, data, warmup, steps, threads, output_dir, ("actor.engine_config.use_remove_padding=false",))


CONTENDERS = {"TRL SFTTrainer": run_trl, "rlplat sft local": run_rlplat, "rlplat sft padded": run_rlplat_padded}


def child(name: str, model: str, data: str, warmup: int, steps: int, threads: int) -> None:
    with tempfile.TemporaryDirectory() as output_dir:
        times = CONTENDERS[name](model, data, warmup, steps, threads, output_dir)
    print(RESULT_TAG + json.dumps({"name": name, "times": times}), flush=True)


def measure(name: str, model: str, data: str, args: argparse.Namespace) -> list[float]:
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--model", model, "--data", data,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])["times"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per contender (fresh processes); the quietest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each contender")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.data, args.warmup, args.steps, args.threads)
        return
    import platform

    with tempfile.TemporaryDirectory() as folder:
        model, data = prepare(Path(folder))
        medians: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for round_index in range(args.rounds):
            names = list(CONTENDERS)
            names = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in names:
                medians[name].append(statistics.median(measure(name, model, data, args)))
                print(f"round {round_index + 1}: {name}: {medians[name][-1] * 1e3:.1f} ms/step (median of {args.steps})", flush=True)
    best = {name: min(values) for name, values in medians.items()}
    print(f"\nSFT step on the demo task (batch {BATCH}, {args.threads} torch thread(s), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores); quietest of {args.rounds} runs, median of {args.steps} steps each")
    for name, value in best.items():
        print(f"  {name:<18} {value * 1e3:8.1f} ms/step   (runs: {', '.join(f'{v * 1e3:.1f}' for v in medians[name])})")
    for name in ("rlplat sft local", "rlplat sft padded"):
        print(f"  ratio {name} / TRL: {best[name] / best['TRL SFTTrainer']:.2f}x (target <= {TARGET:.1f}x)")


if __name__ == "__main__":
    main()
