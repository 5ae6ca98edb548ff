"""A hand-written GRPO loop on the built-in demo, from rlplat's public names only (no Trainer).

    python examples/custom_pipeline.py --steps 5 --backend ray     # 2 worker processes on a local Ray cluster
    python examples/custom_pipeline.py --steps 5 --backend local   # everything in this process (breakpoints work)

It shows the pieces a custom algorithm composes: a colocated actor/rollout worker group, the data
loader, a reward manager and an advantage estimator from the registry, and the weight sync.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

import rlplat_demo
from rlplat import DataProto, LocalWorkerGroup, RayWorkerGroup, ResourcePool, WorkerSpec, registry, start_ray
from rlplat.data import RLDataset, StatefulLoader, ValidationLoader
from rlplat.scorers import exact_match
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker, log_prob_mismatch


def build_actor(backend: str, processes: int):
    config = {
        "roles": ["actor", "rollout"],
        "engine": "fsdp2",
        "engine_config": {"model_path": str(rlplat_demo.model_dir()), "lr": 1e-4, "weight_decay": 0.0, "seed": 0,
                          "ppo_mini_batch_size": 64, "micro_batch_size_per_gpu": 64},
        "rollout": "hf",
        "rollout_config": {"model_path": str(rlplat_demo.model_dir()), "load_weights": False},
        "algorithm": "grpo",
        "actor": {"loss_agg_mode": "token-mean", "use_kl_loss": False},
        "sampling": {"n": 8, "max_new_tokens": 4, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
    }
    spec = WorkerSpec(ActorRolloutRefWorker, config)
    if backend == "local":
        return LocalWorkerGroup(spec, role="actor_rollout"), None
    start_ray()
    pool = ResourcePool([processes])
    return RayWorkerGroup(pool, spec, role="actor_rollout"), pool


def accuracy(actor, loader: ValidationLoader, reward) -> float:
    correct = []
    for prompts in loader:
        responses = actor.generate_sequences(prompts.with_meta_info({"n": 1, "greedy": True}))
        correct.extend(reward(responses).non_tensor_batch["acc"].tolist())
    return float(np.mean(correct))


def main(steps: int, backend: str, processes: int = 2) -> dict[str, list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(rlplat_demo.model_dir())
    train = StatefulLoader(RLDataset([str(rlplat_demo.train_file())], tokenizer, max_prompt_length=16), batch_size=8, seed=0)
    validation = ValidationLoader(RLDataset([str(rlplat_demo.val_file())], tokenizer, max_prompt_length=16))
    reward = registry.get("reward_manager", "naive")(exact_match, tokenizer, {})
    estimator = registry.get("advantage_estimator", "grpo")
    actor, pool = build_actor(backend, processes)
    history: dict[str, list[float]] = {"score": [], "val_acc": [], "log_prob_diff": []}
    try:
        actor.init_model()
        history["val_acc"].append(accuracy(actor, validation, reward))
        for step in range(1, steps + 1):
            prompts = train.next_batch()
            batch = actor.generate_sequences(prompts.with_meta_info({"seed": step}))
            batch = batch.union(reward(batch).select(batch_keys=["token_level_scores"], meta_info_keys=[]))
            batch = batch.union(actor.compute_log_prob(batch))
            scores = batch.batch["token_level_scores"]
            advantages, returns = estimator(scores, batch.batch["response_mask"], batch.non_tensor_batch["uid"], config={})
            batch = batch.union(DataProto.from_dict({"advantages": advantages, "returns": returns}))
            actor.update_actor(batch)
            actor.sync_weights()
            history["score"].append(float(scores.sum(-1).mean()))
            history["log_prob_diff"].append(log_prob_mismatch(batch)["rollout/log_prob_diff_max"])
            print(f"step {step}: mean score {history['score'][-1]:.3f}, log-prob diff {history['log_prob_diff'][-1]:.2e}")
        history["val_acc"].append(accuracy(actor, validation, reward))
        print(f"validation accuracy: {history['val_acc'][0]:.3f} -> {history['val_acc'][-1]:.3f}")
    finally:
        actor.shutdown()
        if pool is not None:
            pool.release()
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", choices=["ray", "local"], default="ray")
    arguments = parser.parse_args()
    main(arguments.steps, arguments.backend)
