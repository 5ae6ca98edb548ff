"""Build the demo's assets: ``python -m rlplat_demo.build [--only all|arith|reward-model|tools|teacher] [--out DIR] [--seed 0] [--threshold 0.35]``.

``--only arith`` builds the arithmetic demo (below) into ``DIR``; ``--only reward-model`` trains the
arithmetic demo's reward model (:mod:`rlplat_demo.reward_model`) from the policy in ``DIR/model`` into
``DIR/reward_model``; ``--only tools`` builds the tool demo (:mod:`rlplat_demo.tools_build`) into ``DIR/tools``;
``--only teacher`` trains the arithmetic demo's teacher from ``DIR/model`` into ``DIR/teacher``
(:func:`build_teacher`); ``all``, the default, builds the four, the teacher last.

1. The task: every ``a+b=`` with ``a, b`` in 10..99 (8100 pairs), shuffled under the seed; the first 200
   are the validation split, the other 7900 the training split. Written with :func:`rlplat.kits.data.write_parquet`
   as ``data/train.parquet`` and ``data/val.parquet`` (``data_source="arith"``, the prompt as one user
   message, ``reward_model.ground_truth`` the decimal sum).
2. The model: the arithmetic tokenizer and the 0.53M-parameter Qwen2 of :mod:`rlplat.testing.tiny_models`,
   initialised under the seed.
3. The warm start: ``rlplat sft``'s library path (:class:`rlplat_sft.trainer.SFTTrainer`, the fsdp2 engine
   in process) on the training pairs as ``prompt`` / ``response`` rows (AdamW, lr 1e-3, batch 128, no
   gradient clipping, loss on the answer and EOS only), with greedy accuracy on the whole validation split
   measured every ``--eval-every`` steps;
   training stops at the first evaluation at or above ``--threshold``. A threshold rather than a step count
   because the demo needs a model that is right sometimes, not one already solved (DEMO_NOTES: ~38% after
   ~200 steps, 73% after 300), and a threshold gives the same starting point whatever the machine's speed.
4. ``model/`` (``save_pretrained`` of model and tokenizer) and ``build_info.json`` (seed, steps, accuracy
   history, sizes, versions).

Deterministic under the seed on a given machine and torch build (CPU, default thread count).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

DATA_SOURCE = "arith"
OPERANDS = range(10, 100)
VALIDATION_PAIRS = 200
ANSWER_TOKENS = 4
"""The longest answer, 3 digits, plus EOS: what generation needs at most."""


def split_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training pairs, validation pairs): all operand pairs shuffled under ``seed``, the first
    :data:`VALIDATION_PAIRS` held out."""
    import numpy as np

    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    order = np.random.default_rng(seed).permutation(len(pairs))
    shuffled = [pairs[index] for index in order]
    return shuffled[VALIDATION_PAIRS:], shuffled[:VALIDATION_PAIRS]


def task_rows(pairs: Sequence[tuple[int, int]], split: str) -> list[dict[str, Any]]:
    """Rows in the schema of :mod:`rlplat.data`, one per pair."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "reward_model": {"ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index},
        }
        for index, (a, b) in enumerate(pairs)
    ]


def supervised_rows(pairs: Sequence[tuple[int, int]]) -> list[dict[str, str]]:
    """``rlplat sft`` rows (``prompt`` / ``response``), one per pair: with the arithmetic tokenizer (no chat
    template) the prompt is ``BOS a+b=`` and the loss is on the sum and its EOS (:mod:`rlplat_sft.data`)."""
    return [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in pairs]


def greedy_accuracy(model, tokenizer, pairs: Sequence[tuple[int, int]], batch_size: int = 256) -> float:
    """Share of ``pairs`` whose greedy answer (at most :data:`ANSWER_TOKENS` new tokens) is the exact sum."""
    import torch

    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start: start + batch_size]
            prompts = tokenizer([f"{a}+{b}=" for a, b in chunk], return_tensors="pt", padding=True)
            output = model.generate(
                **prompts, do_sample=False, max_new_tokens=ANSWER_TOKENS,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )
            answers = tokenizer.batch_decode(output[:, prompts["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(answer.strip() == str(a + b) for answer, (a, b) in zip(answers, chunk))
    model.train(was_training)
    return correct / len(pairs)


def warm_start(model, tokenizer, train_pairs, val_pairs, *, seed: int, threshold: float, eval_every: int,
               max_steps: int, batch_size: int = 128, lr: float = 1e-3, log=print) -> list[dict[str, float]]:
    """Supervised steps until greedy validation accuracy reaches ``threshold``, through ``rlplat sft``'s
    library path (:class:`rlplat_sft.trainer.SFTTrainer` on the fsdp2 engine, in this process): ``model``
    and ``tokenizer`` are saved to a temporary folder, trained there, and the result is loaded back into
    ``model``. Returns the evaluations (``step``, ``val_accuracy``, ``loss``: the step's training loss).
    Raises RuntimeError when ``max_steps`` pass without reaching the threshold."""
    import tempfile

    from rlplat.kits.data import write_parquet
    from rlplat_sft.config import load_sft_config
    from rlplat_sft.trainer import SFTTrainer

    history = [{"step": 0, "val_accuracy": greedy_accuracy(model, tokenizer, val_pairs), "loss": None}]
    with tempfile.TemporaryDirectory(prefix="rlplat-warm-start-") as work:
        work = Path(work)
        model.save_pretrained(work / "init")
        tokenizer.save_pretrained(work / "init")
        train_file = write_parquet(supervised_rows(train_pairs), work / "sft_train.parquet")
        config = load_sft_config(None, [
            f"model.path={work / 'init'}", f"data.train_files=[{train_file}]", f"data.train_batch_size={batch_size}",
            f"data.seed={seed}", "data.max_length=16", f"actor.optim.lr={lr}", "actor.optim.grad_clip=null",
            f"actor.micro_batch_size_per_gpu={batch_size}", f"trainer.total_training_steps={max_steps}",
            f"trainer.test_freq={eval_every}", f"trainer.seed={seed}", f"trainer.output_dir={work / 'run'}",
            "trainer.logger=[jsonl]", "trainer.resume=disable", "cluster.backend=local",
        ])

        def evaluate(trainer: Any, step: int) -> tuple[dict[str, float], bool]:
            missing, unexpected = model.load_state_dict(trainer.full_weights(), strict=False)
            if unexpected or any(name != "lm_head.weight" for name in missing):  # the tied head is given once
                raise RuntimeError(f"the engine's weights do not fit the demo model: missing {missing}, unexpected {unexpected}")
            accuracy = greedy_accuracy(model, tokenizer, val_pairs)
            loss = trainer.metrics.get("train/loss")
            history.append({"step": step, "val_accuracy": accuracy, "loss": loss})
            log(f"step {step}: loss {loss:.3f}, greedy validation accuracy {accuracy:.3f}")
            return {"val/greedy_accuracy": accuracy}, accuracy >= threshold

        trainer = SFTTrainer(config, evaluate=evaluate)
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
    model.eval()
    if history[-1]["val_accuracy"] < threshold:
        raise RuntimeError(
            f"the warm start did not reach validation accuracy {threshold} within {max_steps} steps "
            f"(last: {history[-1]['val_accuracy']:.3f}); raise --max-steps or lower --threshold"
        )
    return history


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def build(out: Path, *, seed: int = 0, threshold: float = 0.35, eval_every: int = 20, max_steps: int = 2000,
          log=print) -> dict[str, Any]:
    """Write the demo's assets under ``out`` (``model/``, ``data/``, ``build_info.json``) and return the
    build info."""
    import torch
    import transformers

    from rlplat.kits.data import write_parquet
    from rlplat.testing.tiny_models import arithmetic_tokenizer, tiny_causal_lm

    started = time.monotonic()
    out = Path(out)
    train_pairs, val_pairs = split_pairs(seed)
    write_parquet(task_rows(train_pairs, "train"), out / "data" / "train.parquet")
    write_parquet(task_rows(val_pairs, "val"), out / "data" / "val.parquet")

    tokenizer = arithmetic_tokenizer()
    model = tiny_causal_lm(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        history = warm_start(model, tokenizer, train_pairs, val_pairs, seed=seed, threshold=threshold,
                             eval_every=eval_every, max_steps=max_steps, log=log)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")

    info = {
        "command": f"python -m rlplat_demo.build --seed {seed} --threshold {threshold} --eval-every {eval_every}",
        "seed": seed,
        "task": "a+b= with a, b in 10..99; answer: the decimal sum, then EOS",
        "train_prompts": len(train_pairs),
        "val_prompts": len(val_pairs),
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "warm_start": {"trainer": "rlplat sft (rlplat_sft.trainer.SFTTrainer, fsdp2 engine, in process)",
                       "optimizer": "AdamW", "lr": 1e-3, "batch_size": 128, "loss": "answer tokens and EOS",
                       "threshold": threshold, "steps": history[-1]["step"]},
        "val_accuracy": history[-1]["val_accuracy"],
        "val_accuracy_history": history,
        "build_seconds": round(time.monotonic() - started, 1),
        "bytes": {"model": folder_bytes(out / "model"), "data": folder_bytes(out / "data")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


TEACHER_THRESHOLD = 0.8
"""Greedy validation accuracy the teacher must reach, by the run's own validation."""
TEACHER_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")
"""What the teacher keeps of ``rlplat export``'s folder; the tokenizer files are the warm start's, copied."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VALIDATION_ACCURACY = f"val/{DATA_SOURCE}/acc/mean"
"""The run's greedy validation accuracy in its ``metrics.jsonl``."""


def preset_setting(key: str) -> str:
    """The value the ``arith`` preset (:func:`rlplat_demo.overrides`) gives the dotted ``key``."""
    from rlplat_demo import overrides

    values = [override.partition("=")[2] for override in overrides() if override.partition("=")[0] == key]
    if not values:
        raise KeyError(f"the arith preset (rlplat_demo.overrides) sets no {key}")
    return values[-1]


def rlplat_command(*arguments: str) -> list[str]:
    """``rlplat ARGUMENTS`` as this interpreter runs it: the rlplat installed beside this package."""
    return [sys.executable, "-m", "rlplat.cli.main", *arguments]


def teacher_run_overrides(out: Path, run_dir: Path, *, seed: int, steps: int, save_freq: int) -> list[str]:
    """What the teacher's run puts after ``--demo arith``: the model and data under ``out`` (the preset's own
    when ``out`` is the package's assets), the run's length and seed, and a checkpoint at every validation,
    all of them kept, so that any validated step can be exported."""
    return [
        f"model.path={out / 'model'}", f"data.train_files=[{out / 'data' / 'train.parquet'}]",
        f"data.val_files=[{out / 'data' / 'val.parquet'}]", f"trainer.total_training_steps={steps}",
        f"trainer.seed={seed}", f"trainer.save_freq={save_freq}", f"trainer.keep_last={steps // save_freq + 1}",
        "trainer.resume=disable", "cluster.backend=local", f"trainer.output_dir={run_dir}",
    ]


def validation_history(run_dir: Path) -> list[dict[str, float]]:
    """``{"step", "val_accuracy"}`` of every validation in the run's ``metrics.jsonl``, in step order."""
    history = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if VALIDATION_ACCURACY in record:
            history.append({"step": int(record["step"]), "val_accuracy": float(record[VALIDATION_ACCURACY])})
    return sorted(history, key=lambda entry: entry["step"])


def val_pairs_of(path: Path) -> list[tuple[int, int]]:
    """The ``(a, b)`` of each ``a+b=`` prompt in a task parquet."""
    import pyarrow.parquet as pq

    return [tuple(map(int, row[0]["content"].rstrip("=").split("+"))) for row in pq.read_table(path)["prompt"].to_pylist()]


def build_teacher(out: Path, *, seed: int = 0, steps: int | None = None, threshold: float = TEACHER_THRESHOLD,
                  log=print) -> dict[str, Any]:
    """Train the arithmetic demo's teacher into ``out/teacher`` and record it under ``"teacher"`` in
    ``out/build_info.json``; returns that record.

    The teacher is the ``arith`` preset's run itself, ``rlplat run --demo arith`` in a subprocess (in a
    temporary run directory, seeded, ``cluster.backend=local``) from the warm start in ``out/model``, for
    ``steps`` steps (default: the preset's own), with a checkpoint at each validation. The checkpoint whose
    greedy validation accuracy (the run's own, every ``trainer.test_freq`` steps) is highest, the later step on
    a tie, is written by ``rlplat export``; the folder keeps the model files and the warm start's tokenizer
    files, unchanged. The exported model's greedy accuracy is then measured again with ``transformers``
    (:func:`greedy_accuracy` on ``out/data/val.parquet``). Raises RuntimeError when the run or the export
    fails, or when no validated step reaches ``threshold``."""
    import torch
    import transformers

    started = time.monotonic()
    out = Path(out).resolve()
    steps = int(steps if steps is not None else preset_setting("trainer.total_training_steps"))
    save_freq = int(preset_setting("trainer.test_freq"))
    with tempfile.TemporaryDirectory(prefix="rlplat-teacher-") as work:
        work = Path(work)
        overrides = teacher_run_overrides(out, work / "run", seed=seed, steps=steps, save_freq=save_freq)
        log(f"training the teacher: rlplat run --demo arith {' '.join(overrides)}")
        if subprocess.run(rlplat_command("run", "--demo", "arith", *overrides), cwd=work).returncode != 0:
            raise RuntimeError(f"the teacher's run failed (rlplat run --demo arith {' '.join(overrides)}); "
                               "its output is above")
        trained = time.monotonic()
        history = validation_history(work / "run")
        exportable = [entry for entry in history if entry["step"] > 0 and (entry["step"] % save_freq == 0 or entry["step"] == steps)]
        chosen = max(exportable, key=lambda entry: (entry["val_accuracy"], entry["step"]), default=None)
        if chosen is None or chosen["val_accuracy"] < threshold:
            best = f"best {chosen['val_accuracy']:.3f} at step {chosen['step']}" if chosen else "no validation"
            raise RuntimeError(f"no validated step of the teacher's {steps}-step run reached greedy validation accuracy "
                               f"{threshold} ({best}); train longer with --teacher-steps or lower --teacher-threshold")
        export = work / "export"
        if subprocess.run(rlplat_command("export", str(work / "run"), "--step", str(chosen["step"]), "--out",
                                         str(export))).returncode != 0:
            raise RuntimeError(f"rlplat export of the teacher's step {chosen['step']} failed; its output is above")
        partial = out / ".teacher.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for name in TEACHER_MODEL_FILES:
            shutil.copyfile(export / name, partial / name)
        for name in TOKENIZER_FILES:
            shutil.copyfile(out / "model" / name, partial / name)
    teacher = out / "teacher"
    shutil.rmtree(teacher, ignore_errors=True)
    partial.rename(teacher)

    model = transformers.AutoModelForCausalLM.from_pretrained(teacher).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(teacher)
    measured = greedy_accuracy(model, tokenizer, val_pairs_of(out / "data" / "val.parquet"))
    info = {
        "command": f"python -m rlplat_demo.build --only teacher --seed {seed} --teacher-steps {steps} "
                   f"--teacher-threshold {threshold}",
        "run_command": "rlplat run --demo arith " + " ".join(overrides).replace(str(work), "TMP").replace(str(out), "ASSETS"),
        "export_command": f"rlplat export TMP/run --step {chosen['step']} --out TMP/export "
                          f"(kept: {', '.join(TEACHER_MODEL_FILES)}; tokenizer files copied from model/)",
        "seed": seed,
        "initialised_from": "model/ (the warm start)",
        "steps": steps,
        "threshold": threshold,
        "val_accuracy_history": history,
        "chosen_step": chosen["step"],
        "val_accuracy": chosen["val_accuracy"],
        "transformers_greedy_accuracy": measured,
        "build_seconds": round(time.monotonic() - started, 1),
        "train_seconds": round(trained - started, 1),
        "bytes": folder_bytes(teacher),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    info_path = out / "build_info.json"
    build_info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    build_info["teacher"] = info
    info_path.write_text(json.dumps(build_info, indent=2) + "\n")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlplat_demo.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("all", "arith", "reward-model", "tools", "teacher"), default="all",
                        help="which demo's assets to build: the arithmetic demo's, its reward model (into OUT/reward_model, "
                             "from OUT/model), the tool demo's (into OUT/tools), its teacher (into OUT/teacher, from "
                             "OUT/model), or all four")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "assets",
                        help="where to write model/, data/ and build_info.json (default: the package's assets)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the initialisation and the batches")
    parser.add_argument("--threshold", type=float, default=0.35,
                        help="arithmetic demo: stop the warm start at the first evaluation with greedy validation accuracy at or above this")
    parser.add_argument("--eval-every", type=int, default=20, help="arithmetic demo: supervised steps between evaluations")
    parser.add_argument("--max-steps", type=int, default=2000, help="arithmetic demo: give up after this many supervised steps")
    parser.add_argument("--teacher-steps", type=int, default=None,
                        help="teacher: steps of its rlplat run --demo arith (default: the preset's own)")
    parser.add_argument("--teacher-threshold", type=float, default=TEACHER_THRESHOLD,
                        help="teacher: the greedy validation accuracy its exported step must reach")
    args = parser.parse_args(argv)
    if args.only in ("all", "arith"):
        info = build(args.out, seed=args.seed, threshold=args.threshold, eval_every=args.eval_every,
                     max_steps=args.max_steps)
        total = sum(info["bytes"].values())
        print(f"wrote {args.out}: {info['warm_start']['steps']} supervised steps, validation accuracy "
              f"{info['val_accuracy']:.3f}, {total / 1e6:.2f} MB, {info['build_seconds']} s")
    if args.only in ("all", "reward-model"):
        from rlplat_demo import reward_model

        train_pairs, val_pairs = split_pairs(args.seed)
        info = reward_model.build(args.out / "reward_model", args.out / "model", train_pairs, val_pairs, seed=args.seed)
        print(f"wrote {args.out / 'reward_model'}: {info['steps']} steps; on validation prompts the correct answer ranks "
              f"above the policy's wrong ones in {info['val']['pairwise_accuracy']:.3f} of pairs; {info['build_seconds']} s")
    if args.only in ("all", "tools"):
        from rlplat_demo import tools_build

        info = tools_build.build(args.out / "tools", seed=args.seed)
        total = sum(info["bytes"].values())
        state = info["start_state"]
        print(f"wrote {args.out / 'tools'}: {info['warm_start']['steps']} supervised steps; multiplication: greedy "
              f"accuracy {state['multiply/greedy_accuracy']:.3f}, tool calls in {state['multiply/sampled_tool_call_rate']:.3f} "
              f"of samples; addition: greedy accuracy {state['add/greedy_accuracy']:.3f}; {total / 1e6:.2f} MB, "
              f"{info['build_seconds']} s")
    if args.only in ("all", "teacher"):
        info = build_teacher(args.out, seed=args.seed, steps=args.teacher_steps, threshold=args.teacher_threshold)
        print(f"wrote {args.out / 'teacher'}: step {info['chosen_step']} of {info['steps']}, greedy validation accuracy "
              f"{info['val_accuracy']:.3f} (the run's) and {info['transformers_greedy_accuracy']:.3f} (transformers), "
              f"{info['bytes'] / 1e6:.2f} MB, {info['build_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
