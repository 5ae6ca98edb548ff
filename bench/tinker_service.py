"""What the Tinker-compatible service adds to a step: ``python bench/tinker_service.py [--repeats 15]``.

The same GRPO-shaped batch (the demo's: 256 datums of 7 prompt and 4 response tokens, ``importance_sampling``)
through ``rlplat serve`` (a process of its own, as a user runs it) with the stock ``tinker`` SDK on loopback
(protobuf over HTTP, futures, one worker thread) and through the same engine in this process (``forward_backward`` then ``optimizer_step``), taking turns;
then the same with two LoRA clients alternating (each call puts the other's trainable state away); then sampling
32 prompts x 8 samples of 4 tokens through the SDK against the hf rollout's ``generate`` on the same prompts.
Prints medians and ratios and writes ``bench/results/tinker_service.{json,txt}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS, GROUP, PROMPT_TOKENS, RESPONSE_TOKENS = 32, 8, 7, 4


def datums(types, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(PROMPTS * GROUP):
        tokens = [1, *torch.randint(4, 16, (PROMPT_TOKENS + RESPONSE_TOKENS - 1,), generator=generator).tolist()]
        observed, advantage = PROMPT_TOKENS - 1, float(torch.randn((), generator=generator))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": [0.0] * observed + [-1.5] * RESPONSE_TOKENS,
            "advantages": [0.0] * observed + [advantage] * RESPONSE_TOKENS}))
    return data


@contextlib.contextmanager
def serving(model: str):
    """``rlplat serve --model MODEL --port 0`` in a process of its own; yields its base URL."""
    process = subprocess.Popen([sys.executable, "-c", "from rlplat.cli.main import main; main()", "serve", "--model", model, "--port", "0"],
                               stderr=subprocess.PIPE, text=True)
    try:
        url = None
        while url is None:
            line = process.stderr.readline()
            if not line and process.poll() is not None:
                raise RuntimeError("rlplat serve exited before it served")
            found = re.search(r"rlplat serve: (http://127\.0\.0\.1:\d+)", line)
            url = found.group(1) if found else None
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def median_s(samples: list[float]) -> float:
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    arguments = parser.parse_args()
    import rlplat_demo
    import tinker
    from tinker import types

    from rlplat.contracts.rollout import SamplingParams
    from rlplat.protocol import DataProto
    from rlplat.registry import EngineRegistry
    from rlplat_tinker.datums import Datum, rows_of
    from rlplat_tinker.losses import TinkerLoss
    from rlplat_tinker.serve import ENGINE_DEFAULTS
    from rlplat_tinker.service import LORA_ALPHA

    model = str(rlplat_demo.model_dir())
    lora = {"rank": 32, "alpha": LORA_ALPHA, "target_modules": ["all-linear"]}
    adam = types.AdamParams(learning_rate=5e-4, beta1=0.9, beta2=0.95, eps=1e-8)
    settings = {"lr": 5e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "grad_clip": None}
    batches = [datums(types, seed) for seed in range(4)]
    rows = [rows_of([Datum(d.model_input.to_ints(), {k: v.tolist() for k, v in d.loss_fn_inputs.items()}) for d in batch], 0)
            for batch in batches]
    engine = EngineRegistry("engine").build("fsdp2", {**ENGINE_DEFAULTS, "seed": 0, "model_path": model, "lora": lora})
    engine.init_model()
    loss = TinkerLoss("importance_sampling")
    times: dict[str, list[float]] = {"native": [], "service": [], "service, two clients alternating": []}
    sampling_times: dict[str, list[float]] = {"native": [], "service": []}
    with serving(model) as base_url:
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench")
        clients = [service.create_lora_training_client(base_model=model, rank=32).result() for _ in range(2)]

        def through(client, batch) -> None:
            backward, update = client.forward_backward(batch, "importance_sampling"), client.optim_step(adam)
            backward.result()
            update.result()

        for repeat in range(arguments.repeats + 1):  # the first round warms up
            index = repeat % len(batches)
            started = time.perf_counter()
            engine.forward_backward(rows[index], loss)
            engine.optimizer_step(settings)
            native = time.perf_counter() - started
            started = time.perf_counter()
            through(clients[0], batches[index])
            served = time.perf_counter() - started
            started = time.perf_counter()
            through(clients[repeat % 2], batches[index])
            alternating = time.perf_counter() - started
            if repeat:
                times["native"].append(native)
                times["service"].append(served)
                times["service, two clients alternating"].append(alternating)
        sampler = clients[0].save_weights_and_get_sampling_client().result()
        prompts = [[1, *torch.randint(4, 16, (PROMPT_TOKENS - 1,), generator=torch.Generator().manual_seed(p)).tolist()] for p in range(PROMPTS)]
        params = types.SamplingParams(max_tokens=RESPONSE_TOKENS, temperature=1.0)
        from rlplat_rollout_hf.rollout import HFRollout

        local = HFRollout({"model_path": model})
        prompt_batch = DataProto.from_dict({"input_ids": torch.tensor(prompts), "attention_mask": torch.ones(PROMPTS, PROMPT_TOKENS, dtype=torch.long),
                                            "position_ids": torch.arange(PROMPT_TOKENS).expand(PROMPTS, -1).clone()})
        for repeat in range(arguments.repeats + 1):
            started = time.perf_counter()
            local.generate(prompt_batch, SamplingParams(n=GROUP, max_new_tokens=RESPONSE_TOKENS))
            native = time.perf_counter() - started
            started = time.perf_counter()
            futures = [sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=GROUP, sampling_params=params) for prompt in prompts]
            for future in futures:
                future.result()
            served = time.perf_counter() - started
            if repeat:
                sampling_times["native"].append(native)
                sampling_times["service"].append(served)
        service.close("success").result()  # ends the session's heartbeats before the server goes
    step = {name: median_s(values) for name, values in times.items()}
    sample = {name: median_s(values) for name, values in sampling_times.items()}
    lines = [f"A training step of {PROMPTS * GROUP} datums ({PROMPT_TOKENS + RESPONSE_TOKENS - 1} tokens each), importance_sampling, "
             f"LoRA rank 32 on the demo model; medians of {arguments.repeats} steps:"]
    for name, value in step.items():
        lines.append(f"  {name:34s} {value * 1000:8.1f} ms   {value / step['native']:5.2f}x native")
    lines.append(f"Sampling {PROMPTS} prompts x {GROUP} samples of {RESPONSE_TOKENS} tokens (the service: one request per prompt, "
                 "all sent before any is awaited; native: one generate call):")
    for name, value in sample.items():
        lines.append(f"  {name:34s} {value * 1000:8.1f} ms   {value / sample['native']:5.2f}x native")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tinker_service.txt").write_text(text + "\n")
    (RESULTS / "tinker_service.json").write_text(json.dumps({"step_s": step, "sample_s": sample, "repeats": arguments.repeats,
                                                             "threads": torch.get_num_threads()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
