"""The checks of ``scripts/gpu_check.py``, each run in a process of its own: ``CASES[name](context)``
returns its report lines (:func:`gpu_check.line`).

Every check builds what it needs here (random-init models from a config, the demo model shipped with
rlplat, random token batches): nothing is downloaded. On the GPU each runs at the sizes below; with
``Context.smoke`` (``--cpu-smoke``) the same code runs at toy sizes on the CPU, which tests the code, not
the GPU path, so the pass rules that only mean something on a GPU (NCCL, memory, MFU, accuracy) are
reported but not applied there.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gpu_check import REPO, child_environment, line

#: bf16 keeps 8 bits of mantissa: a loss of a few nats computed in bf16 (and trained a few steps in it)
#: stays within about 1% of the float32 run; 2% leaves room for the steps' drift.
BF16_LOSS_TOLERANCE = 0.02
#: Rollout-vs-training log-prob difference on the same tokens in bf16 (mean and max over response
#: tokens); the float32 control must agree to FP32_LOGPROB_TOLERANCE.
BF16_LOGPROB_MEAN_TOLERANCE = 0.05
BF16_LOGPROB_MAX_TOLERANCE = 1.0
FP32_LOGPROB_TOLERANCE = 1e-3
MFU_TARGET = 0.30
DEMO_RISE = 0.05

#: The Qwen2.5-0.5B shape (random weights): 494M parameters, 136M of them the tied embedding.
QWEN2_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
                 rms_norm_eps=1e-6)
#: A mid-size Qwen2 (123M parameters: 90M in the layers, 33M the tied embedding) for memory figures that
#: stand out of the allocator's noise.
QWEN2_MEDIUM = dict(model_type="qwen2", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True)
#: The toy size of every model under --cpu-smoke.
QWEN2_TOY = dict(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
GIB = 2**30


@dataclasses.dataclass
class Context:
    device: str
    """``cuda`` on the GPU machine, ``cpu`` under ``--cpu-smoke``."""
    work: Path
    """Where a check writes what it needs on disk (the demo's run, pytest's report)."""
    smoke: bool = False

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def size(self, gpu: Any, smoke: Any) -> Any:
        return smoke if self.smoke else gpu

    def model(self, gpu: dict) -> dict:
        return dict(QWEN2_TOY if self.smoke else gpu)


# -- helpers -----------------------------------------------------------------------------------------------


def allocated() -> int:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def peak_allocated() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release(*objects: Any) -> None:
    """Drop the caller's last references (it deletes its own names) and give cached blocks back."""
    import torch

    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def token_batch(rows: int, prompt_length: int, response_length: int, vocab_size: int, seed: int):
    """Full-length rows of random tokens (ids 3..vocab-1, no padding), ``response_mask`` all ones."""
    import torch

    from rlplat.protocol import DataProto

    generator = torch.Generator().manual_seed(seed)
    length = prompt_length + response_length
    input_ids = torch.randint(3, vocab_size, (rows, length), generator=generator)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    return DataProto.from_dict({
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(length).expand(rows, length).clone(),
        "responses": input_ids[:, prompt_length:].clone(),
        "response_mask": torch.ones(rows, response_length, dtype=torch.long),
    })


def engine(**config: Any):
    from rlplat_engine_fsdp2.engine import FSDP2Engine

    built = FSDP2Engine(config)
    built.init_model()
    return built


def nll():
    from rlplat_sft.loss import NLLLoss

    return NLLLoss()


def finish_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# -- doctor ------------------------------------------------------------------------------------------------


def check_doctor(context: Context) -> list[dict]:
    result = subprocess.run([sys.executable, "-m", "rlplat.cli.main", "doctor", "--json"], capture_output=True, text=True,
                            cwd=REPO, env=child_environment(), timeout=120)
    print(result.stdout[-4000:], result.stderr[-4000:], sep="\n")
    try:
        report = __import__("json").loads(result.stdout)
    except ValueError:
        return [line("doctor", "doctor", False, f"exited {result.returncode} without a JSON report: {result.stderr.strip()[-300:]}")]
    versions = report.get("versions", {})
    figure = ", ".join(f"{name} {versions.get(name) or '-'}" for name in ("torch", "cuda", "nccl", "transformers", "ray", "peft"))
    problems = [f"{problem['severity']}: {problem['message']}" for problem in report.get("problems", [])
                if problem["severity"] != "note"]
    if problems:
        figure += "; " + "; ".join(problems)
    return [line("doctor", "doctor", result.returncode == 0, f"exit {result.returncode}: {figure}", devices=report.get("devices"),
                 plugins=report.get("plugins"))]


# -- fsdp2: bf16 against fp32 ------------------------------------------------------------------------------


def check_fsdp2_precision(context: Context) -> list[dict]:
    """The same model, batch and steps in float32 (the plain module) and with FSDP2's bf16 parameters
    and fp32 reduction over NCCL; the loss of every step must agree within bf16's tolerance."""
    import torch
    import torch.distributed as dist

    model_config = context.model(dict(QWEN2_MEDIUM, num_hidden_layers=4))
    steps = context.size(5, 3)
    batch = token_batch(context.size(16, 4), context.size(64, 8), context.size(64, 8), model_config["vocab_size"], seed=0)
    losses: dict[str, list[float]] = {}
    facts: dict[str, dict[str, Any]] = {}
    for run in ("float32", "bfloat16", "bfloat16 no fsdp2"):
        dtype = run.split()[0]
        # FSDP2 over one rank for the bf16 run (NCCL's path); the engine's default for one bf16 rank, cast copies
        # without FSDP2, must give the same losses bit for bit
        trained = engine(model_config=model_config, seed=3, lr=1e-4, dtype=dtype, reduce_dtype="float32",
                         micro_batch_size_per_gpu=context.size(8, 2), shard_one_rank=run == "bfloat16")
        compute_dtypes: set[str] = set()
        probe = next(module for module in trained.module.modules() if isinstance(module, torch.nn.Linear))
        handle = probe.register_forward_hook(lambda module, inputs, output: compute_dtypes.add(str(output.dtype).replace("torch.", "")))
        losses[run] = [trained.train_batch(batch, nll())["loss"] for _ in range(steps)]
        handle.remove()
        master = {str(parameter.dtype).replace("torch.", "") for parameter in trained.module.parameters()}
        gradients = {str(parameter.grad.dtype).replace("torch.", "") for parameter in trained.module.parameters() if parameter.grad is not None}
        facts[run] = dict(sharded=trained.sharded, compute=sorted(compute_dtypes), master=sorted(master), gradients=sorted(gradients),
                            device=str(trained.device))
        del trained, probe, handle
        release()
    backend = dist.get_backend()
    finish_process_group()
    differences = [abs(low - high) / abs(high) for low, high in zip(losses["bfloat16"], losses["float32"])]
    worst = max(differences)
    bf16 = facts["bfloat16"]
    right_path = bf16["sharded"] and bf16["compute"] == ["bfloat16"] and bf16["master"] == ["float32"] and bf16["gradients"] == ["float32"]
    expected_backend = "nccl" if context.cuda else "gloo"
    passed = worst <= BF16_LOSS_TOLERANCE and right_path and backend == expected_backend and all(map(math.isfinite, losses["bfloat16"]))
    figure = (f"max rel loss diff {worst:.4f} (tol {BF16_LOSS_TOLERANCE}) over {steps} steps; backend {backend}; bf16 run: "
              f"compute {'/'.join(bf16['compute'])}, master {'/'.join(bf16['master'])}, grads {'/'.join(bf16['gradients'])}; "
              f"loss {losses['float32'][0]:.3f}->{losses['float32'][-1]:.3f} (fp32) vs {losses['bfloat16'][0]:.3f}->{losses['bfloat16'][-1]:.3f}")
    plain = facts["bfloat16 no fsdp2"]
    same = losses["bfloat16 no fsdp2"] == losses["bfloat16"] and not plain["sharded"] and plain["compute"] == ["bfloat16"]
    return [line("fsdp2-precision", "fsdp2 bf16 vs fp32", passed, figure, losses=losses, relative_differences=differences,
                 backend=backend, facts=facts),
            line("fsdp2-precision", "one bf16 rank without fsdp2", same,
                 f"cast copies, no fully_shard (sharded={plain['sharded']}, compute {'/'.join(plain['compute'])}, grads "
                 f"{'/'.join(plain['gradients'])}): losses {'equal' if same else 'differ'} to fsdp2's bit for bit over {steps} steps "
                 f"({losses['bfloat16 no fsdp2'][-1]:.6f} vs {losses['bfloat16'][-1]:.6f})", losses=losses["bfloat16 no fsdp2"])]


# -- fsdp2: offload ----------------------------------------------------------------------------------------


def state_bytes(trained) -> tuple[int, int]:
    """``(parameter bytes, optimizer-state bytes)`` of the engine's own tensors (master weights, AdamW)."""
    import torch

    parameters = sum(parameter.numel() * parameter.element_size() for parameter in trained.module.parameters())
    optimizer = sum(value.numel() * value.element_size() for state in trained.optimizer.state.values() for key, value in state.items()
                    if isinstance(value, torch.Tensor) and key != "step")
    return parameters, optimizer


def check_fsdp2_offload(context: Context) -> list[dict]:
    """Two steps for each of param_offload x optimizer_offload: the memory the engine holds on the GPU
    between steps (allocated after ``train_batch`` returns, less what was allocated before the engine
    existed), the peak during the second step, and its loss, which offloading must not change."""
    model_config = context.model(QWEN2_MEDIUM)
    batch = token_batch(context.size(8, 4), context.size(128, 8), context.size(128, 8), model_config["vocab_size"], seed=1)
    variants = [(False, False), (True, False), (False, True), (True, True)]
    measured: dict[tuple[bool, bool], dict[str, Any]] = {}
    for param_offload, optimizer_offload in variants:
        base = allocated()
        trained = engine(model_config=model_config, seed=5, lr=1e-4, dtype=context.size("bfloat16", "float32"),
                         micro_batch_size_per_gpu=context.size(4, 2), param_offload=param_offload, optimizer_offload=optimizer_offload)
        first = trained.train_batch(batch, nll())["loss"]
        reset_peak()
        second = trained.train_batch(batch, nll())["loss"]
        synchronize()
        measured[(param_offload, optimizer_offload)] = dict(
            held=allocated() - base, peak=peak_allocated() - base, losses=[first, second], bytes=state_bytes(trained))
        del trained
        release()
    finish_process_group()
    reference = measured[(False, False)]
    parameter_bytes, optimizer_bytes = reference["bytes"]
    lines = []
    for (param_offload, optimizer_offload), figures in measured.items():
        label = f"params {'off' if param_offload else 'on'} GPU, optimizer {'off' if optimizer_offload else 'on'} GPU"
        expected_drop = 0.9 * ((parameter_bytes if param_offload else 0) + (optimizer_bytes if optimizer_offload else 0))
        drop = reference["held"] - figures["held"]
        same_loss = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(figures["losses"], reference["losses"]))
        passed = same_loss and (drop >= expected_drop if context.cuda else True)
        figure = (f"{label}: held {gib(figures['held'])} between steps (-{gib(drop)}, expected >= -{gib(expected_drop)}), "
                  f"peak {gib(figures['peak'])}, loss {figures['losses'][1]:.4f} ({'same' if same_loss else 'DIFFERENT'})")
        lines.append(line("fsdp2-offload", f"offload p={int(param_offload)} o={int(optimizer_offload)}", passed, figure,
                          held_bytes=figures["held"], peak_bytes=figures["peak"], losses=figures["losses"],
                          parameter_bytes=parameter_bytes, optimizer_bytes=optimizer_bytes))
    return lines


# -- hf rollout: sleep / wake --------------------------------------------------------------------------------


def random_prompts(rows: int, vocab_size: int, seed: int, shortest: int, longest: int):
    import torch

    from rlplat.kits.data import left_padded
    from rlplat.protocol import DataProto

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=generator).tolist()
    tokens = [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]
    return DataProto.from_dict(left_padded(tokens, 0), {"uid": [f"prompt-{row}" for row in range(rows)]})


def check_rollout_sleep(context: Context) -> list[dict]:
    import torch

    from rlplat.contracts.rollout import SamplingParams
    from rlplat_rollout_hf.rollout import HFRollout

    model_config = context.model(QWEN2_MEDIUM)
    rollout = HFRollout({"model_config": model_config, "dtype": context.size("bfloat16", "float32"), "seed": 0})
    weights = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in rollout.model.state_dict().items()]
    prompts = random_prompts(context.size(8, 2), model_config["vocab_size"], seed=2, shortest=8, longest=context.size(32, 8))
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=context.size(32, 4), seed=1234, stop_token_ids=())
    before = rollout.generate(prompts, sampling)
    parameter_bytes = rollout.parameter_bytes()
    synchronize()
    awake = allocated()
    rollout.sleep()
    asleep = allocated()
    rollout.wake_up()
    woken = allocated()
    rollout.update_weights(weights)
    after = rollout.generate(prompts, sampling)
    same = torch.equal(before.batch["responses"], after.batch["responses"]) and torch.equal(
        before.batch["rollout_log_probs"], after.batch["rollout_log_probs"])
    freed = awake - asleep
    frees = freed >= 0.95 * parameter_bytes if context.cuda else True
    tokens = int(before.batch["response_mask"].sum())
    return [
        line("rollout-sleep", "hf rollout sleep frees memory", frees,
             f"allocated {gib(awake)} awake -> {gib(asleep)} asleep: freed {gib(freed)} of {gib(parameter_bytes)} weights; "
             f"{gib(woken)} after wake_up", awake_bytes=awake, asleep_bytes=asleep, woken_bytes=woken, parameter_bytes=parameter_bytes),
        line("rollout-sleep", "hf rollout wake_up + sync: same samples", same,
             f"{'identical' if same else 'DIFFERENT'} responses and log-probs for seed 1234 ({tokens} tokens, "
             f"{len(before)} rows)", tokens=tokens),
    ]


# -- rollout vs training log-probs -------------------------------------------------------------------------


def demo_prompts(rows: int, seed: int):
    """``ab+cd=`` prompts of the demo's task, tokenised with its tokenizer."""
    import random

    from rlplat.kits.data import left_padded
    from rlplat.protocol import DataProto
    from rlplat.testing.tiny_models import arithmetic_tokenizer

    tokenizer = arithmetic_tokenizer()
    generator = random.Random(seed)
    texts = [f"{generator.randint(10, 99)}+{generator.randint(10, 99)}=" for _ in range(rows)]
    tokens = [tokenizer(text)["input_ids"] for text in texts]
    return DataProto.from_dict(left_padded(tokens, tokenizer.pad_token_id), {"uid": [f"prompt-{row}" for row in range(rows)]})


def check_logprob_parity(context: Context) -> list[dict]:
    """The demo model (trained, so its distributions are peaked like a real policy's) samples with the hf
    rollout; the fsdp2 engine scores the same tokens. In bf16 on both sides, and in float32 as the control
    that the two paths compute the same thing."""
    import torch

    import rlplat_demo as demo
    from rlplat.contracts.rollout import SamplingParams
    from rlplat_rollout_hf.rollout import HFRollout

    model_path = str(demo.model_dir())
    prompts = demo_prompts(context.size(64, 4), seed=3)
    sampling = SamplingParams(n=context.size(8, 2), temperature=1.0, max_new_tokens=8, seed=99)
    figures = {}
    for dtype in ("float32", "bfloat16"):
        rollout = HFRollout({"model_path": model_path, "dtype": dtype})
        sampled = rollout.generate(prompts, sampling)
        del rollout
        release()
        scorer = engine(model_path=model_path, dtype=dtype, micro_batch_size_per_gpu=512)
        scored = scorer.forward(sampled).batch["log_probs"]
        del scorer
        release()
        mask = sampled.batch["response_mask"].bool()
        difference = (scored - sampled.batch["rollout_log_probs"]).abs()[mask]
        figures[dtype] = dict(mean=float(difference.mean()), max=float(difference.max()), tokens=int(mask.sum()))
    finish_process_group()
    bf16, fp32 = figures["bfloat16"], figures["float32"]
    passed = (bf16["mean"] <= BF16_LOGPROB_MEAN_TOLERANCE and bf16["max"] <= BF16_LOGPROB_MAX_TOLERANCE
              and fp32["max"] <= FP32_LOGPROB_TOLERANCE)
    figure = (f"bf16 |diff| mean {bf16['mean']:.4f} max {bf16['max']:.4f} (tol {BF16_LOGPROB_MEAN_TOLERANCE} / "
              f"{BF16_LOGPROB_MAX_TOLERANCE}); fp32 control mean {fp32['mean']:.2e} max {fp32['max']:.2e} (tol {FP32_LOGPROB_TOLERANCE}); "
              f"{bf16['tokens']} tokens")
    return [line("logprob-parity", "rollout vs training log-probs", passed, figure, **figures)]


# -- throughput --------------------------------------------------------------------------------------------


def matmul_peak(size: int, repetitions: int = 10) -> float:
    """FLOP/s of a ``size``-cubed bf16 matrix product (CUDA) or float32 one (CPU), the mean of
    ``repetitions`` after three warm-ups."""
    import torch

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(left, right)
    synchronize()
    started = time.perf_counter()
    for _ in range(repetitions):
        torch.mm(left, right)
    synchronize()
    return 2 * size**3 * repetitions / (time.perf_counter() - started)


def update_flops(config: dict, rows: int, length: int, response_length: int) -> float:
    """Model FLOPs of one forward + backward over ``rows`` full rows of ``length`` tokens: 6 x the
    multiply-adds of every linear layer of the decoder per token, 6 x the lm head's per response token
    (the engine computes logits only there), and 6 x L x h x T^2 per row for causal attention (QK^T and
    AV over half of a T x T square, forward and twice that backward). Embedding lookups, norms, rotary
    and the loss are not counted (as in the usual MFU)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    key_value = config["num_key_value_heads"] * head_dim
    per_layer = 2 * hidden * hidden + 2 * hidden * key_value + 3 * hidden * config["intermediate_size"]
    body = 6 * per_layer * layers * rows * length
    head = 6 * config["vocab_size"] * hidden * rows * response_length
    attention = 6 * layers * hidden * length * length * rows
    return float(body + head + attention)


#: Dense bf16 tensor-core peak of each card, TFLOP/s, from the vendors' datasheets (the figure peers divide by); the
#: first name found in ``torch.cuda.get_device_name()`` wins, so the longer names come first.
DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H200", 989.4), ("H100", 989.4),
                         ("H800", 989.4), ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
                         ("L4", 121.0), ("A10G", 70.0))
FLOP_CONVENTION = ("model FLOPs: 6 x the multiply-adds of the decoder's linear layers per token, 6 x the lm head's per "
                   "response token, 6 x layers x hidden x T^2 per row of causal attention (half the square; no recompute, "
                   "embeddings, norms, rotary or loss counted)")
#: The Qwen2-1.5B shape (random weights): 1.54B parameters, 233M of them the tied embedding.
QWEN2_15B = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True,
                 rms_norm_eps=1e-6)
MFU_TARGET_15B = 0.35
#: bf16 losses of the fused log-prob head and the unfused one (the output layer and log-softmax a chunk at a time,
#: recomputed in backward) on the same batch and weights: both round the hidden states to bf16 and accumulate the
#: log-softmax in float32, so they differ by the matmuls' summation order, well under bf16's 2^-8 relative step.
FUSED_HEAD_TOLERANCE = 1e-3


def datasheet_peak() -> tuple[str, float | None]:
    """The card's name and its datasheet dense bf16 FLOP/s (None when the table does not know it)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name()
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key in name:
            return name, tflops * 1e12
    return name, None


def measure_update(context: Context, model_config: dict, rows: int, prompt_length: int, response_length: int, micro_rows: int,
                   profile: bool = False, timed: int = 4, **options: Any) -> dict[str, Any]:
    """Build the fsdp2 engine on ``model_config`` (random weights, bf16 on the GPU) and time ``train_batch`` of the
    SFT loss on ``rows`` random full rows: two warm-up steps, then the median of ``timed``; one more step profiled
    when ``profile``. Returns the figures; the engine is released."""
    started = time.perf_counter()
    trained = engine(model_config=model_config, seed=0, lr=1e-6, dtype=context.size("bfloat16", "float32"),
                     micro_batch_size_per_gpu=micro_rows, **options)
    build_s = time.perf_counter() - started
    parameters = sum(parameter.numel() for parameter in trained.module.parameters())
    batch = token_batch(rows, prompt_length, response_length, model_config["vocab_size"], seed=4)
    loss = nll()
    losses = []
    warm_started = time.perf_counter()
    for _ in range(context.size(2, 1)):  # warm-up: allocator, kernels chosen (compiled), optimizer state
        losses.append(trained.train_batch(batch, loss)["loss"])
    warm_s = time.perf_counter() - warm_started
    reset_peak()
    times = []
    for _ in range(context.size(timed, 2)):
        synchronize()
        step_started = time.perf_counter()
        losses.append(trained.train_batch(batch, loss)["loss"])
        synchronize()
        times.append(time.perf_counter() - step_started)
    memory = peak_allocated()
    profiled = profile_step(lambda: trained.train_batch(batch, loss), context.cuda) if profile else {}
    sharded = trained.sharded
    del trained
    release()
    finish_process_group()
    step_s = statistics.median(times)
    length = prompt_length + response_length
    flops = update_flops(model_config, rows, length, response_length)
    return dict(parameters=parameters, rows=rows, length=length, micro_rows=micro_rows, step_s=step_s, step_times=times,
                tokens_per_s=rows * length / step_s, flops_per_step=flops, build_s=build_s, warm_s=warm_s, losses=losses,
                peak_memory_bytes=memory, profile=profiled, sharded=sharded, options=options)


def mfu_figure(figures: dict[str, Any], peak: float, datasheet: tuple[str, float | None], context: Context) -> str:
    """'N tokens/s, s/step, MFU of both peaks' for one measured case."""
    dtype = "bf16" if context.cuda else "fp32"
    name, sheet = datasheet
    mfu = figures["flops_per_step"] / figures["step_s"] / peak
    text = (f"{figures['parameters'] / 1e6:,.0f}M params, {figures['rows']} rows x {figures['length']} tokens "
            f"({figures['micro_rows']} per micro-batch): {figures['tokens_per_s']:,.0f} tokens/s, {figures['step_s']:.3f} s/step; "
            f"MFU {mfu:.1%} of the measured {dtype} peak {peak / 1e12:.0f} TFLOP/s")
    if sheet is not None:
        text += f", {figures['flops_per_step'] / figures['step_s'] / sheet:.1%} of the {sheet / 1e12:.0f} TFLOP/s datasheet peak of the {name}"
    return text + f"; peak memory {gib(figures['peak_memory_bytes'])}"


def check_throughput(context: Context) -> list[dict]:
    """The 0.5B case at 16 x 2048 as the engine runs by default on one GPU (no FSDP2, fused head, varlen packed
    attention), then with the decoder layers compiled, with the unfused head (its loss compared) and with grouped
    packed attention."""
    import torch

    peak = matmul_peak(context.size(8192, 256))
    datasheet = datasheet_peak()
    model_config = context.model(QWEN2_05B)
    shape = dict(rows=context.size(16, 2), prompt_length=context.size(1024, 16), response_length=context.size(1024, 16),
                 micro_rows=context.size(8, 1))
    refused: list[dict] = []
    try:
        default = measure_update(context, model_config, profile=True, **shape)
    except Exception as error:  # noqa: BLE001 - a default kernel that fails here must not hide the other figures
        refused.append(line("throughput", "actor update, default packed attention", False,
                            f"the default settings failed: {type(error).__name__}: {str(error)[:300]}; the figures below run "
                            "packed_attention=grouped", error=f"{type(error).__name__}: {error}"))
    if refused:  # out of the except block: the failed engine's frames are gone, so its memory can be given back
        release()
        shape["packed_attention"] = "grouped"
        default = measure_update(context, model_config, profile=True, **shape)
    mfu = default["flops_per_step"] / default["step_s"] / peak
    passed = mfu >= MFU_TARGET if context.cuda else True
    busy = default["profile"].get("busy")
    top = ", ".join(f"{entry['name'][:40]} {entry['self_ms']:.0f} ms" for entry in default["profile"].get("top", [])[:5])
    lines = [line("throughput", "actor update throughput", passed,
                  mfu_figure(default, peak, datasheet, context) + f" (target {MFU_TARGET:.0%} of the measured peak); built in "
                  f"{default['build_s']:.0f} s" + (f"; kernels busy {busy:.0%} of a profiled step" if busy is not None else "")
                  + (f"; top: {top}" if top else "") + f". {FLOP_CONVENTION}",
                  mfu=mfu, peak_flops=peak, datasheet=datasheet[0], datasheet_flops=datasheet[1], flop_convention=FLOP_CONVENTION,
                  torch_version=torch.__version__, **default)]
    lines = refused + lines
    try:
        compiled = measure_update(context, model_config, compile=True, **shape)
    except Exception as error:  # noqa: BLE001 - the eager figures stand; a compile that fails is reported, not raised
        compiled = None
        failure = f"{type(error).__name__}: {str(error)[:300]}"
    if compiled is None:
        release()
        finish_process_group()
        # on the GPU a compile that fails is a failure; under --cpu-smoke it may be this CPU's toolchain (information)
        lines.append(line("throughput", "actor update, decoder layers compiled", False if context.cuda else None,
                          f"compile=true failed: {failure}", error=failure))
    else:
        compiled_mfu = compiled["flops_per_step"] / compiled["step_s"] / peak
        lines.append(line("throughput", "actor update, decoder layers compiled", None,
                          mfu_figure(compiled, peak, datasheet, context) + f"; {default['step_s'] / compiled['step_s']:.2f}x the "
                          f"eager step; compiling took {compiled['warm_s']:.0f} s of the warm-up; first loss "
                          f"{compiled['losses'][0]:.5f} vs eager {default['losses'][0]:.5f}", mfu=compiled_mfu, **compiled))
    unfused = measure_update(context, model_config, fused_head=False, timed=2, **shape)
    difference = abs(unfused["losses"][0] - default["losses"][0]) / max(abs(default["losses"][0]), 1e-12)
    lines.append(line("throughput", "fused vs unfused log-prob head", difference <= FUSED_HEAD_TOLERANCE,
                      f"first-step loss {default['losses'][0]:.6f} fused, {unfused['losses'][0]:.6f} unfused: relative difference "
                      f"{difference:.1e} (tolerance {FUSED_HEAD_TOLERANCE:g}); unfused {unfused['step_s']:.3f} s/step, "
                      f"{unfused['step_s'] / default['step_s']:.2f}x the fused step, peak {gib(unfused['peak_memory_bytes'])}",
                      relative_difference=difference, fused=default["losses"], unfused=unfused["losses"], unfused_step_s=unfused["step_s"]))
    if refused:
        return lines
    grouped = measure_update(context, model_config, packed_attention="grouped", timed=2, **shape)
    lines.append(line("throughput", "packed attention: grouped vs the default", None,
                      f"grouped sub-batches {grouped['step_s']:.3f} s/step, {grouped['step_s'] / default['step_s']:.2f}x the default "
                      f"step (packed_attention auto: varlen on CUDA in bf16 where torch has it); first loss {grouped['losses'][0]:.6f} "
                      f"vs {default['losses'][0]:.6f}", grouped_step_s=grouped["step_s"], grouped_losses=grouped["losses"]))
    return lines


def check_throughput_large(context: Context) -> list[dict]:
    """The Qwen2-1.5B shape at 16 x 2048 (4 rows per micro-batch): MFU against its target."""
    peak = matmul_peak(context.size(8192, 256))
    datasheet = datasheet_peak()
    figures = measure_update(context, context.model(QWEN2_15B), rows=context.size(16, 2), prompt_length=context.size(1024, 16),
                             response_length=context.size(1024, 16), micro_rows=context.size(4, 1), timed=3)
    mfu = figures["flops_per_step"] / figures["step_s"] / peak
    passed = mfu >= MFU_TARGET_15B if context.cuda else True
    return [line("throughput-1.5b", "actor update throughput, 1.5B", passed,
                 mfu_figure(figures, peak, datasheet, context) + f" (target {MFU_TARGET_15B:.0%} of the measured peak)",
                 mfu=mfu, peak_flops=peak, datasheet_flops=datasheet[1], **figures)]


def check_throughput_long(context: Context) -> list[dict]:
    """The 0.5B case at 4k and 8k tokens a row (the same 32k tokens a step): how attention's share grows."""
    peak = matmul_peak(context.size(8192, 256))
    datasheet = datasheet_peak()
    lines = []
    for rows, half, micro in ((context.size(8, 2), context.size(2048, 32), context.size(4, 1)),
                              (context.size(4, 2), context.size(4096, 64), context.size(2, 1))):
        figures = measure_update(context, context.model(QWEN2_05B), rows=rows, prompt_length=half, response_length=half,
                                 micro_rows=micro, timed=3)
        mfu = figures["flops_per_step"] / figures["step_s"] / peak
        lines.append(line("throughput-long", f"actor update, {2 * half // 1024 if context.cuda else 2 * half} "
                          f"{'k ' if context.cuda else ''}tokens a row", None, mfu_figure(figures, peak, datasheet, context),
                          mfu=mfu, peak_flops=peak, **figures))
    return lines


def profile_step(step: Callable[[], Any], cuda: bool, rows: int = 25) -> dict[str, Any]:
    """One more step under torch's profiler, so a figure under its target says where the time went: the
    wall time, the share of it the GPU's kernels ran (their summed self time; a low share means the step
    waits on the host: launches, synchronisations, copies) and the ``rows`` operators and kernels of the
    most self time (device time on the GPU, host time on the CPU), also printed into the log. A profiler
    failure is reported in the result, not raised: the measured figures stand without it."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as profiler:
            synchronize()
            started = time.perf_counter()
            step()
            synchronize()
            wall = time.perf_counter() - started
        averages = profiler.key_averages()
        field = "self_device_time_total" if cuda else "self_cpu_time_total"
        kernels_s = sum(event.self_device_time_total for event in averages if event.device_type == DeviceType.CUDA) / 1e6
        top = sorted(averages, key=lambda event: getattr(event, field), reverse=True)[:rows]
        table = [dict(name=event.key[:90], calls=event.count, self_ms=round(getattr(event, field) / 1e3, 2)) for event in top]
        print(f"profiled step: {wall:.3f} s wall" + (f", kernels {kernels_s:.3f} s ({kernels_s / wall:.0%})" if cuda and kernels_s else ""))
        for entry in table:
            print(f"  {entry['self_ms']:10.2f} ms  {entry['calls']:6d}x  {entry['name']}")
        counted = cuda and kernels_s > 0  # no kernel rows: a profiler that files them otherwise, no share to give
        return dict(wall_s=wall, kernels_s=kernels_s if counted else None, busy=kernels_s / wall if counted else None, top=table)
    except Exception as error:  # noqa: BLE001 - the profile is an explanation, not the measurement
        return dict(error=f"{type(error).__name__}: {error}")


# -- pytest -m gpu -----------------------------------------------------------------------------------------


def gpu_test_files() -> list[Path]:
    """The test files that mark tests ``gpu`` (collecting only those keeps pytest away from modules that
    import Ray and other things this machine lacks)."""
    candidates = sorted(REPO.glob("tests/*/test_*.py")) + sorted(REPO.glob("plugins/*/*/tests/test_*.py"))
    return [path for path in candidates if "mark.gpu" in path.read_text()]


def junit_counts(path: Path) -> dict[str, Any]:
    """Tests, failures, errors and skips of a JUnit XML report, and each skip's reason."""
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    reasons: dict[str, int] = {}
    for skipped in root.iter("skipped"):
        reason = (skipped.get("message") or "").strip()
        reasons[reason] = reasons.get(reason, 0) + 1
    counts["skip_reasons"] = reasons
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def check_pytest_gpu(context: Context) -> list[dict]:
    files = gpu_test_files()
    junit = context.work / "pytest-gpu.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *map(str, files)]
    result = subprocess.run(command, cwd=REPO, env=child_environment(), timeout=600)
    if not junit.exists():
        return [line("pytest-gpu", "pytest -m gpu", False, f"pytest exited {result.returncode} without a report")]
    counts = junit_counts(junit)
    passed = result.returncode in (0, 5) and counts["failures"] == 0 and counts["errors"] == 0
    reasons = "; ".join(f"{number} skipped: {reason}" for reason, number in counts["skip_reasons"].items())
    figure = (f"{counts['passed']} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
              f"in {len(files)} files" + (f" ({reasons})" if reasons else ""))
    return [line("pytest-gpu", "pytest -m gpu", passed, figure, returncode=result.returncode,
                 files=[str(path.relative_to(REPO)) for path in files], counts=counts)]


# -- the demo ----------------------------------------------------------------------------------------------


def check_demo(context: Context) -> list[dict]:
    """``rlplat run --demo arith`` on the GPU (the in-process backend, as the demo runs) for a fixed
    number of steps; validation accuracy at the last evaluation must exceed the first by DEMO_RISE."""
    from rlplat.trainer.tracking import read_metrics

    steps = context.size(150, 2)
    output_dir = context.work / "demo-run"
    shutil.rmtree(output_dir, ignore_errors=True)  # a rerun's metrics must not follow the last run's
    command = [sys.executable, "-m", "rlplat.cli.main", "run", "--demo", "arith", f"trainer.total_training_steps={steps}",
               f"trainer.test_freq={context.size(50, 1)}", "trainer.save_freq=0", "trainer.resume=disable",
               f"trainer.output_dir={output_dir}", "trainer.logger=[console,jsonl]", f"cluster.use_gpu={str(context.cuda).lower()}"]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=child_environment(), timeout=900)
    wall_s = time.perf_counter() - started
    if result.returncode:
        return [line("demo", "demo trained on the GPU", False, f"rlplat run exited {result.returncode}")]
    records = read_metrics(output_dir)
    accuracy = [(record["step"], record["val/arith/acc/mean"]) for record in records if "val/arith/acc/mean" in record]
    step_times = [record["timing_s/step"] for record in records if "timing_s/step" in record]
    if len(accuracy) < 2:
        return [line("demo", "demo trained on the GPU", False, f"{len(accuracy)} validations in {output_dir}; expected one at step 0 and later ones")]
    first, last = accuracy[0][1], accuracy[-1][1]
    passed = last >= first + DEMO_RISE if context.cuda else True
    curve = " ".join(f"{step}:{value:.3f}" for step, value in accuracy)
    return [line("demo", "demo trained on the GPU", passed,
                 f"validation accuracy {first:.3f} -> {last:.3f} in {steps} steps (rise >= {DEMO_RISE} expected; {curve}); "
                 f"median {statistics.median(step_times):.3f} s/step, {wall_s:.0f} s in all",
                 accuracy=accuracy, median_step_s=statistics.median(step_times), wall_s=wall_s)]


CASES: dict[str, Callable[[Context], list[dict]]] = {
    "doctor": check_doctor,
    "fsdp2-precision": check_fsdp2_precision,
    "rollout-sleep": check_rollout_sleep,
    "logprob-parity": check_logprob_parity,
    "throughput": check_throughput,
    "throughput-1.5b": check_throughput_large,
    "throughput-long": check_throughput_long,
    "fsdp2-offload": check_fsdp2_offload,
    "pytest-gpu": check_pytest_gpu,
    "demo": check_demo,
}
