"""HF rollout vs plain ``model.generate``, and ``sync_weights`` vs a plain ``load_state_dict``.

Prints medians over repeated, interleaved runs in one process, and the ratios. Same model, prompts and
sampling on both sides (temperature 1, top_k 0, top_p 1, EOS ends a response).
Run: python bench/hf_rollout.py
"""

from __future__ import annotations

import statistics
import time

import torch

from rlplat import LocalWorkerGroup, WorkerSpec
from rlplat.contracts.rollout import SamplingParams
from rlplat.testing.rollouts import left_padded_prompts
from rlplat.testing.tiny_models import tiny_causal_lm, tiny_qwen2_config
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

REPEATS = 7
PROMPTS, SAMPLES, NEW_TOKENS = 32, 8, 16


def median_time(function, repeats=REPEATS):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def demo_prompts():
    generator = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(PROMPTS):
        a, b = torch.randint(10, 100, (2,), generator=generator).tolist()
        prompts.append([1, *[4 + int(c) for c in str(a)], 14, *[4 + int(c) for c in str(b)], 15])  # BOS a + b =
    return left_padded_prompts(prompts, pad_token_id=0)


def generation(model_overrides: dict, label: str) -> None:
    from rlplat import registry

    config = tiny_qwen2_config(**model_overrides)
    rollout = registry.get("rollout", "hf")({"model_config": config.to_dict(), "load_weights": False})
    plain = tiny_causal_lm(seed=0, **model_overrides)
    rollout.update_weights(plain.state_dict().items())
    prompts = demo_prompts()
    sampling = SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    repeated = prompts.repeat(SAMPLES, interleave=True).batch

    counts = {}

    def ours():
        out = rollout.generate(prompts, sampling)
        counts["ours"] = int(out.batch["response_mask"].sum())

    def baseline():
        torch.manual_seed(0)
        with torch.no_grad():
            out = plain.generate(input_ids=repeated["input_ids"], attention_mask=repeated["attention_mask"], do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=2)
        new = out[:, repeated["input_ids"].shape[1]:]
        ended = (new == 2).int().cumsum(-1)
        counts["generate"] = int(((ended == 0) | ((ended == 1) & (new == 2))).sum())

    ours(), baseline()  # warm-up
    ours_s, base_s = [], []
    for _ in range(REPEATS):
        ours_s.append(median_time(ours, 1))
        base_s.append(median_time(baseline, 1))
    ours_rate = counts["ours"] / statistics.median(ours_s)
    base_rate = counts["generate"] / statistics.median(base_s)
    print(f"{label:<28} {statistics.median(ours_s)*1e3:9.1f} ms {ours_rate:10.0f} tok/s | "
          f"{statistics.median(base_s)*1e3:9.1f} ms {base_rate:10.0f} tok/s | ratio {ours_rate / base_rate:5.2f}")


def weight_sync(model_overrides: dict, label: str) -> None:
    config = tiny_qwen2_config(**model_overrides).to_dict()
    worker_config = {
        "engine_config": {"model_config": config, "seed": 0},
        "rollout_config": {"model_config": config, "load_weights": False},
        "algorithm": "grpo",
        "roles": ["actor", "rollout"],
    }
    group = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, worker_config), role="actor_rollout")
    group.init_model()
    plain = tiny_causal_lm(seed=1, **model_overrides)
    state = {k: v.clone() for k, v in tiny_causal_lm(seed=2, **model_overrides).state_dict().items()}
    group.sync_weights(), plain.load_state_dict(state)
    sync_s, load_s = [], []
    for _ in range(REPEATS):
        sync_s.append(median_time(group.sync_weights, 1))
        load_s.append(median_time(lambda: plain.load_state_dict(state), 1))
    megabytes = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    sync, load = statistics.median(sync_s), statistics.median(load_s)
    print(f"{label:<28} {megabytes:7.1f} MB | sync_weights {sync*1e3:8.2f} ms | load_state_dict {load*1e3:8.2f} ms | ratio {sync / load:5.2f}")
    group.shutdown()


def main() -> None:
    torch.set_num_threads(2)
    print(f"HF rollout vs model.generate: {PROMPTS} prompts x {SAMPLES} samples, up to {NEW_TOKENS} new tokens, "
          f"median of {REPEATS} (ratio = rlplat tokens/s / generate tokens/s; > 1 means rlplat is faster)")
    print(f"{'model':<28} {'rlplat hf rollout':>31} | {'transformers generate':>31} |")
    generation({}, "demo (0.53M params)")
    generation(dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4), "4 layers x 256 (3.2M)")
    print(f"\nsync_weights (fsdp2 engine -> hf rollout, in process) vs load_state_dict of the same tensors, "
          f"median of {REPEATS} (ratio = sync / load; < 1 means sync is faster)")
    weight_sync({}, "demo (0.53M params)")
    weight_sync(dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8), "8 layers x 512 (25M)")


if __name__ == "__main__":
    main()
