"""``Trainer``: the driver loop, written as the algorithm reads.

load batch -> generate (n per prompt) -> algorithm.after_generate -> reward -> algorithm.filter_batch
-> old log-probs -> reference log-probs -> values -> KL in the reward -> advantages -> update critic
-> update actor -> sync weights to the rollout -> validate / checkpoint / log.

The heavy work runs in worker groups (``rlplat.workers``); the driver holds the data loader, the reward
manager and the advantage estimator. A run is exact across a kill: sampling seeds derive from
``(trainer.seed, step)``, and a checkpoint holds the engines' state, the data position, the driver's RNG
and the KL coefficient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlplat.checkpoint import CheckpointManager, capture_rng_state, graceful_interrupt, restore_rng_state
from rlplat.config import validate_config
from rlplat.contracts.rollout import SamplingParams
from rlplat.controller.host import WorkerSpec
from rlplat.data import build_loaders
from rlplat.protocol import DataProto
from rlplat.tracking import Tracker
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker, log_prob_mismatch
from rlplat.workers.critic import CriticWorker


@contextlib.contextmanager
def timed(timing: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - started


def batch_metrics(batch: DataProto) -> dict[str, float]:
    """verl's data metrics of one training batch."""
    tensors = batch.batch
    mask = tensors["response_mask"].bool()
    lengths = mask.sum(-1).float()
    metrics = {}
    for name, key in (("score", "token_level_scores"), ("rewards", "token_level_rewards")):
        sequence = tensors[key].sum(-1)
        metrics.update({f"critic/{name}/mean": float(sequence.mean()), f"critic/{name}/max": float(sequence.max()),
                        f"critic/{name}/min": float(sequence.min())})
    for name in ("advantages", "returns", "values"):
        if name in tensors.keys():
            valid = tensors[name][mask]
            metrics[f"critic/{name}/mean"] = float(valid.mean()) if valid.numel() else 0.0
    width = tensors["responses"].shape[1]
    metrics.update({
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()), "response_length/clip_ratio": float((lengths == width).float().mean()),
        "prompt_length/mean": float(tensors["attention_mask"][:, : tensors["prompts"].shape[1]].sum(-1).float().mean()),
    })
    return metrics


class Trainer:
    """Runs ``config`` (from :func:`rlplat.config.load_config`) to the end: ``Trainer(config).fit()``."""

    def __init__(self, config: DictConfig):
        from transformers import AutoTokenizer

        from rlplat import registry

        validate_config(config)
        self.config = config
        self.node = OmegaConf.to_container(config, resolve=True)
        spec = registry.get("algorithm", config.algorithm.name)()
        self.algorithm = dataclasses.replace(spec, default_config=self.node["algorithm"])
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        self.train_loader, self.val_loader = build_loaders(config.data, self.tokenizer)
        reward = self.node["reward"]
        scorer = registry.get("reward_scorer", reward["scorer"]) if reward["scorer"] and not reward["custom_function"]["path"] else None
        manager_config = {**reward["config"], "custom_function": reward["custom_function"]}
        if reward["scorer"]:
            manager_config["scorer"] = reward["scorer"]
        self.reward = registry.get("reward_manager", reward["manager"])(scorer, self.tokenizer, manager_config)
        algorithm_node = self.node["algorithm"]
        self.estimator = registry.get("advantage_estimator", algorithm_node.get("adv_estimator", spec.adv_estimator))
        self.kl_controller = None
        if algorithm_node.get("use_kl_in_reward"):
            self.kl_controller = self.algorithm.resolve("kl_controller")(algorithm_node.get("kl_ctrl"))
        self.use_critic = self.algorithm.needs_critic if config.critic.enable is None else bool(config.critic.enable)
        self.run_dir = Path(config.trainer.output_dir)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.trainer.keep_last)
        steps_per_epoch = len(self.train_loader)
        self.total_steps = config.trainer.total_training_steps or steps_per_epoch * config.trainer.total_epochs
        self.actor = self.critic = None
        self.step = 0

    # -- set-up --------------------------------------------------------------------------------------

    def engine_node(self, role: str) -> dict[str, Any]:
        node, n = self.node[role], self.node["rollout"]["n"]
        optim = node["optim"]
        return {
            "model_path": self.node["model"]["path"], "seed": self.node["trainer"]["seed"], "lr": optim["lr"],
            "weight_decay": optim["weight_decay"], "betas": optim["betas"], "lr_warmup_steps": optim["warmup_steps"],
            "lr_scheduler_type": optim["lr_scheduler_type"], "min_lr_ratio": optim["min_lr_ratio"],
            "grad_clip": optim["grad_clip"], "total_training_steps": self.total_steps,
            "ppo_mini_batch_size": node["ppo_mini_batch_size"] * n, "ppo_epochs": node["ppo_epochs"],
            "micro_batch_size_per_gpu": node["micro_batch_size_per_gpu"], "use_dynamic_bsz": node["use_dynamic_bsz"],
            "max_token_len_per_gpu": node["max_token_len_per_gpu"], **node["engine_config"],
        }

    def sampling(self) -> dict[str, Any]:
        rollout = self.node["rollout"]
        return {"n": rollout["n"], "temperature": rollout["temperature"], "top_p": rollout["top_p"],
                "top_k": rollout["top_k"], "max_new_tokens": rollout["response_length"]}

    def build_workers(self) -> None:
        roles = ["actor", "rollout"] + (["ref"] if self.algorithm.needs_reference else [])
        actor_config = {
            "roles": roles, "engine": self.node["actor"]["engine"], "engine_config": self.engine_node("actor"),
            "rollout": self.node["rollout"]["name"], "algorithm": self.algorithm.name, "sampling": self.sampling(),
            "rollout_config": {"model_path": self.node["model"]["path"], "load_weights": False, **self.node["rollout"]["config"]},
            "actor": self.node["actor"]["loss"],
            "free_rollout_between_phases": self.node["rollout"]["free_between_phases"],
        }
        specs = {"actor": WorkerSpec(ActorRolloutRefWorker, actor_config)}
        if self.use_critic:
            specs["critic"] = WorkerSpec(CriticWorker, {
                "engine": self.node["critic"]["engine"], "engine_config": self.engine_node("critic"),
                "algorithm": self.algorithm.name, "critic": self.node["critic"]["loss"] or None,
            })
        cluster = self.config.cluster
        if cluster.backend == "local":
            from rlplat.controller.local_backend import LocalWorkerGroup

            groups = LocalWorkerGroup.colocated(specs, use_gpu=cluster.use_gpu)
        else:
            from rlplat.controller.ray_backend import RayWorkerGroup, ResourcePool, start_ray

            start_ray(cluster.address)
            self.pool = ResourcePool([cluster.devices_per_node] * cluster.nnodes, use_gpu=cluster.use_gpu)
            groups = RayWorkerGroup.colocated(self.pool, specs)
        self.actor, self.critic = groups["actor"], groups.get("critic")
        for group in groups.values():
            group.init_model()

    # -- the loop ------------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``, resuming per ``trainer.resume``; returns the last step's metrics."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.config, resolve=True))
        self.build_workers()
        self.resume()
        metrics: dict[str, float] = {}
        trainer = self.config.trainer
        with Tracker(self.run_dir, trainer.logger, total_steps=self.total_steps, start_step=self.step + 1,
                     project=trainer.project_name, experiment=trainer.experiment_name or self.run_dir.name,
                     config=self.node) as tracker, graceful_interrupt() as interrupt:
            if self.step == 0 and trainer.val_before_train and self.val_loader is not None:
                tracker.log(self.validate(), step=0)
            while self.step < self.total_steps:
                self.step += 1
                metrics = self.train_step()
                if self.val_loader is not None and trainer.test_freq and (self.step % trainer.test_freq == 0 or self.step == self.total_steps):
                    metrics.update(self.validate())
                tracker.log(metrics, step=self.step)
                if (trainer.save_freq and self.step % trainer.save_freq == 0) or self.step == self.total_steps or interrupt.requested:
                    self.save()
                if interrupt.requested:
                    break
        return metrics

    def generate(self, prompts: DataProto, sampling: SamplingParams | None = None) -> DataProto:
        overrides = dataclasses.asdict(sampling) if sampling is not None else {}
        return self.actor.generate_sequences(prompts.with_meta_info({**prompts.meta_info, **overrides}))

    def train_step(self) -> dict[str, float]:
        timing: dict[str, float] = {}
        started = time.perf_counter()
        seed = self.config.trainer.seed * 1_000_003 + self.step
        with timed(timing, "gen"):
            batch = self.generate_filled_batch(seed, timing)
        with timed(timing, "old_log_prob"):
            batch = batch.union(self.actor.compute_log_prob(batch))
        if self.algorithm.needs_reference:
            with timed(timing, "ref"):
                batch = batch.union(self.actor.compute_ref_log_prob(batch))
        if self.use_critic:
            with timed(timing, "values"):
                batch = batch.union(self.critic.compute_values(batch))
        with timed(timing, "adv"):
            batch, reward_kl_metrics = self.compute_advantage(batch)
        metrics: dict[str, Any] = {**reward_kl_metrics, **log_prob_mismatch(batch)}
        if self.use_critic:
            with timed(timing, "update_critic"):
                metrics.update(self.critic.update_critic(batch).meta_info["metrics"])
        with timed(timing, "update_actor"):
            metrics.update(self.actor.update_actor(batch).meta_info["metrics"])
        with timed(timing, "sync_weights"):
            self.actor.sync_weights()
        metrics.update(batch_metrics(batch))
        metrics.update(batch.meta_info.get("reward_metrics", {}))
        timing["timing_s/step"] = time.perf_counter() - started
        tokens = float(batch.batch["attention_mask"].sum())
        metrics["perf/throughput"] = tokens / timing["timing_s/step"] / max(self.actor.world_size, 1)
        return {**metrics, **timing}

    def generate_filled_batch(self, seed: int, timing: dict[str, float]) -> DataProto:
        """Prompts -> responses -> rewards, through the algorithm's hooks; an algorithm that drops
        groups (DAPO) gets more prompts until its accumulator is full."""
        accumulator = self.algorithm.make_accumulator(self.config.data.train_batch_size) if hasattr(self.algorithm, "make_accumulator") else None
        attempt = 0
        while True:
            prompts = self.train_loader.next_batch()
            prompts = prompts.with_meta_info({**prompts.meta_info, "seed": seed + 7919 * attempt})
            batch = self.generate(prompts)
            batch = self.algorithm.after_generate(batch, self.generate, SamplingParams(**{**self.sampling(), "seed": seed}))
            with timed(timing, "reward"):
                scored = self.reward(batch)
            batch = batch.union(scored.select(batch_keys=["token_level_scores"], meta_info_keys=[]))
            for key, values in scored.non_tensor_batch.items():
                if key not in batch.non_tensor_batch:
                    batch.non_tensor_batch[key] = values
            batch.meta_info["reward_metrics"] = scored.meta_info.get("reward_metrics", {})
            batch = self.algorithm.filter_batch(batch)
            if accumulator is None:
                return batch
            full = accumulator.add(batch)
            if full is not None:
                return full
            attempt += 1

    def compute_advantage(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        tensors = batch.batch
        metrics: dict[str, float] = {}
        if self.kl_controller is not None:
            rewards, metrics = self.algorithm.resolve("reward_kl")(
                tensors["token_level_scores"], tensors["old_log_probs"], tensors["ref_log_prob"],
                tensors["response_mask"], self.kl_controller, self.node["algorithm"])
        else:
            rewards = tensors["token_level_scores"]
        extra = {"reward_baselines": tensors["reward_baselines"]} if "reward_baselines" in tensors.keys() else {}
        values = tensors["values"] if "values" in tensors.keys() else None
        advantages, returns = self.estimator(rewards, tensors["response_mask"], np.asarray(batch.non_tensor_batch["uid"]),
                                             values=values, config=self.node["algorithm"], **extra)
        added = DataProto.from_dict({"token_level_rewards": rewards, "advantages": advantages, "returns": returns})
        return batch.union(added), metrics

    def validate(self) -> dict[str, float]:
        """Greedy (or sampled, per ``rollout.val_greedy``) responses to the validation set: mean score and
        accuracy per data source."""
        scores: dict[str, list[float]] = {}
        greedy = SamplingParams(n=1, greedy=self.config.rollout.val_greedy, temperature=self.config.rollout.temperature,
                                max_new_tokens=self.config.rollout.response_length, seed=self.config.trainer.seed)
        for prompts in self.val_loader:
            batch = self.generate(prompts, greedy)
            scored = self.reward(batch)
            sequence = scored.batch["token_level_scores"].sum(-1).tolist()
            accuracy = scored.non_tensor_batch.get("acc")
            for row, source in enumerate(batch.non_tensor_batch["data_source"]):
                correct = float(accuracy[row]) if accuracy is not None else float(sequence[row] > 0)
                scores.setdefault(f"val/{source}/score/mean", []).append(sequence[row])
                scores.setdefault(f"val/{source}/acc/mean", []).append(correct)
        return {key: float(np.mean(values)) for key, values in scores.items()}

    # -- checkpoints ---------------------------------------------------------------------------------

    def save(self) -> Path:
        def write(directory: Path) -> None:
            self.actor.save_checkpoint(str(directory))
            if self.critic is not None:
                self.critic.save_checkpoint(str(directory))

        state = {"data": self.train_loader.state_dict(), "rng": capture_rng_state(),
                 "kl_coef": self.kl_controller.value if self.kl_controller is not None else None}
        return self.checkpoints.save(self.step, write, state)

    def resume(self) -> None:
        path = self.checkpoints.resolve(self.config.trainer.resume)
        if path is None:
            return
        self.actor.load_checkpoint(str(path))
        if self.critic is not None:
            self.critic.load_checkpoint(str(path))
        state = self.checkpoints.load_state(path)
        self.train_loader.load_state_dict(state["data"])
        restore_rng_state(state["rng"])
        if self.kl_controller is not None and state.get("kl_coef") is not None:
            self.kl_controller.value = state["kl_coef"]
        self.step = int(state["step"])

    def shutdown(self) -> None:
        if self.actor is not None:
            self.actor.shutdown()
        if getattr(self, "pool", None) is not None:
            self.pool.release()
