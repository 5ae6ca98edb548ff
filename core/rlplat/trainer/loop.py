"""``Trainer``: the driver loop, written as the algorithm reads.

load batch -> generate (n per prompt) -> algorithm.after_generate -> reward -> algorithm.filter_batch
-> old log-probs (from where ``actor.old_log_probs`` says, decided once at load: a pass of their own, the
update's first forward, or the rollout's) -> reference log-probs (when a KL term reads them) -> values -> KL in
the reward -> advantages -> update critic -> update actor -> sync weights to the rollout -> validate /
checkpoint / log. In the asynchronous modes (``trainer.mode``) the generations of the next steps run ahead
(:mod:`rlplat.trainer.pipeline`).

The heavy work runs in worker groups, one per role (kind ``role``, :mod:`rlplat.trainer.placement`); roles take
part in each step through :meth:`Role.on_stage`. What only watches a step (the sentinel, ``status.json``, the
rollout dump, the trained-prompts log, the profiler) is a step observer (kind ``step_observer``,
:mod:`rlplat.contracts.observer`), told each stage. The driver holds the data loader, the reward manager
and the advantage estimator. A run is exact across a kill: sampling seeds derive from
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

from rlplat.config import (algorithm_schema, check_machine, resolve_old_log_probs, rollout_driver, sampling_node,
                           total_training_steps, validate_config)
from rlplat.config.modes import AsyncSettings, partial_mode
from rlplat.config.trainer import RUN_CONFIG_FILE, first_logged_step, prepare_run_directory
from rlplat.config_node import read_config_node
from rlplat.contracts.health import HEALTH_EVENTS
from rlplat.contracts.observer import ObservedRun, StepObserver
from rlplat.contracts.role import RunContext
from rlplat.contracts.rollout import SamplingParams
from rlplat.controller import timeline
from rlplat.data import build_loaders
from rlplat.kits.reward import last_tokens
from rlplat.losses import rollout_correction
from rlplat.protocol import DataProto
from rlplat.trainer.checkpoint import CheckpointManager, capture_rng_state, graceful_interrupt, restore_rng_state
from rlplat.trainer.pipeline import RolloutPipeline, pop_window, row_versions
from rlplat.trainer.placement import Placement, enabled_roles, place
from rlplat.trainer.rollout_dump import check_replay, read_batch, step_file
from rlplat.trainer.sync_probe import SyncProbe, SyncProbeConfig
from rlplat.trainer.tracking import Tracker


@contextlib.contextmanager
def timed(timing: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - started


def batch_metrics(batch: DataProto, sampled_mask: torch.Tensor | None = None) -> dict[str, float]:
    """verl's data metrics of one training batch; lengths from ``sampled_mask`` when given (the mask as
    sampled, before rollout correction rejected tokens), else ``response_mask``."""
    tensors = batch.batch
    mask = (tensors["response_mask"] if sampled_mask is None else sampled_mask).bool()
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


def balanced_order(tokens: list[int], parts: int) -> list[int] | None:
    """Row order whose ``parts`` consecutive equal chunks hold about the same token sums (heaviest row
    first, into the lightest chunk with room), or None when the rows do not split evenly."""
    rows = len(tokens)
    if parts <= 1 or rows % parts:
        return None
    size, loads = rows // parts, [0] * parts
    chunks: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(rows), key=lambda r: (-tokens[r], r)):
        part = min((p for p in range(parts) if len(chunks[p]) < size), key=lambda p: (loads[p], p))
        chunks[part].append(row)
        loads[part] += tokens[row]
    return [row for chunk in chunks for row in sorted(chunk)]


def driver_batch_metrics(driver: str | None) -> Any:
    """The function ``(batch, prefix) -> metrics`` the run's rollout driver names in its entry's
    ``metadata["batch_metrics"]`` (agent loops: turns, tool calls, ...); one returning nothing otherwise."""
    from rlplat import registry
    from rlplat.registry import resolve_dotted_path

    path = registry.entry("rollout_driver", driver).metadata.get("batch_metrics") if driver is not None else None
    if path is None:
        return lambda batch, prefix: {}
    return resolve_dotted_path(path) if isinstance(path, str) else path


class Trainer:
    """Runs ``config`` (from :func:`rlplat.config.load_config`) to the end: ``Trainer(config).fit()``."""

    def __init__(self, config: DictConfig):
        from transformers import AutoTokenizer

        from rlplat import registry
        from rlplat.scorers import scorer_for

        validate_config(config)
        self.config = config
        self.role_metrics: dict[str, float] = {}  # what roles report at the stages of the current step
        self.node = OmegaConf.to_container(config, resolve=True)
        self.algorithm = registry.get("algorithm", config.algorithm.name)()
        self.algorithm.config = read_config_node(self.node["algorithm"], algorithm_schema(config.algorithm.name), "algorithm")
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        self.train_loader, self.val_loader = build_loaders(config.data, self.tokenizer)
        reward = config.reward
        scorer = scorer_for(reward.scorer, reward.custom_function.path, reward.custom_function.name)
        self.reward = registry.get("reward_manager", reward.manager)(scorer, self.tokenizer, self.node["reward"]["config"])
        algorithm_node = self.algorithm.config
        self.estimator = registry.get("advantage_estimator", algorithm_node.adv_estimator)
        self.kl_controller = None
        if algorithm_node.use_kl_in_reward:
            self.kl_controller = self.algorithm.resolve("kl_controller")(algorithm_node.kl_ctrl)
        self.rollout_correction = rollout_correction.read_rollout_correction(algorithm_node.rollout_correction)
        self.use_reference = self.algorithm.uses_reference(self.node["actor"]["loss"], algorithm_node)
        self.old_log_probs, _ = resolve_old_log_probs(config, self.algorithm)  # decided once: pass, update or rollout
        self.run_dir = Path(config.trainer.output_dir)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.trainer.keep_last)
        self.total_steps = total_training_steps(config, self.train_loader.rows_per_epoch)
        self.context = RunContext(config, self.algorithm, self.total_steps)
        self.placement: Placement | None = None
        self.actor = self.critic = self.rollout = None
        self.driver_metrics = driver_batch_metrics(rollout_driver(config))
        self.async_settings = AsyncSettings.of(config.trainer)
        self.pipeline: RolloutPipeline | None = None
        probe_set = self.val_loader.dataset if self.val_loader is not None else self.train_loader.dataset
        self.sync_probe = SyncProbe(read_config_node(self.node["rollout"]["sync_probe"], SyncProbeConfig, "rollout.sync_probe"),
                                    probe_set, self.train_loader.pad_token_id, config.trainer.seed, config.rollout.temperature)
        self.run = ObservedRun(config, self.node, self.run_dir, self.total_steps)
        self.phase_depth = 0  # of the timed phases in progress on the driver
        self.gap_start: float | None = None  # since when the driver works outside any phase (the trace's `driver`)
        self.step = 0

    # -- set-up --------------------------------------------------------------------------------------

    def sampling(self) -> dict[str, Any]:
        return sampling_node(self.config)

    def build_workers(self) -> None:
        """One worker group per enabled role (:mod:`rlplat.trainer.placement`), each started by its role."""
        self.placement = place(enabled_roles(self.context), self.context)
        groups = self.placement.groups
        self.actor, self.critic = groups["actor"], groups.get("critic")
        self.rollout = groups.get("rollout", self.actor)
        for name, group in groups.items():
            self.placement.roles[name].start(group)
        bind = getattr(self.reward, "bind_workers", None)  # a manager served by a worker group (the judge)
        if bind is not None:
            bind(groups)
        replicas = self.rollout.world_size if self.config.trainer.rollout_dispatch == "replica" else 1

        def start(prompts: DataProto, replica: int) -> Any:
            if replicas > 1:
                return self.rollout.call_rank(replica, "generate_sequences", prompts)
            return self.rollout.call_async("generate_sequences", prompts)

        partial = self.async_settings.mode == "separate_async" and partial_mode(self.config.trainer) != "off"
        self.pipeline = RolloutPipeline(self.async_settings, self.train_loader, start=start,
                                        regenerate=lambda prompts, replica: start(prompts, replica).get(),
                                        seed_of=self.step_seed, replicas=replicas,
                                        abort=self.rollout.abort_generations if partial else None)

    def step_seed(self, step: int) -> int:
        """The sampling seed of step ``step``'s first generation."""
        return self.config.trainer.seed * 1_000_003 + step

    def sync_weights(self, full: bool = False) -> dict[str, float]:
        """The actor's weights to the rollout: inside each process when colocated (in place where the
        engine and rollout allow it), else through the object store (the rollout group fetches the
        actor's buckets itself). Returns the first process's ``sync/*`` metrics when colocated."""
        if self.rollout is self.actor:
            reports = self.actor.sync_weights()
            return {key: value for key, value in reports[0].items() if key.startswith("sync/")} if reports else {}
        if self.async_settings.mode == "separate_async" and self.pipeline is not None and not full:
            # queued behind the generations already started (with partial rollouts: landing during them);
            # checked once a later generation finished (or once it finished)
            self.pipeline.add_load(self.rollout.call_async("load_weights", self.actor.call_async("export_weights", full)),
                                   version=self.step)
        else:  # the first weights of a rollout in its own pool are in before it generates anything
            self.rollout.load_weights(self.actor.call_async("export_weights", full))
            if self.pipeline is not None:
                self.pipeline.sent_version = self.step
        return {}

    def stage(self, name: str, batch: DataProto) -> DataProto:
        """Let every role take part in stage ``name`` of the step (:meth:`Role.on_stage`)."""
        for role_name, role in self.placement.roles.items():
            added = role.on_stage(name, self.placement.groups[role_name], batch)
            if added is None:
                continue
            self.role_metrics.update(added.meta_info.pop("metrics", None) or {})
            if name != "updated":
                batch = batch.union(added)
        return batch

    def start_observers(self) -> None:
        """One observer per registered ``step_observer`` entry that this run uses, in their order."""
        from rlplat import registry

        built = []
        for entry in registry.entries("step_observer"):
            try:
                observer = entry.load()(self.run)
            except Exception as error:
                raise RuntimeError(f"step observer {entry.name!r} ({entry.origin}) could not be built: "
                                   f"{type(error).__name__}: {error}") from error
            if observer is not None:
                built.append((getattr(observer, "order", 100), entry.name, observer))
        built.sort(key=lambda item: item[:2])
        self.run.observers = {name: observer for _, name, observer in built}  # built when the run starts (fit)
        for observer in self.observers:
            observer.start(self.run)

    @property
    def observers(self) -> list[StepObserver]:
        """The run's step observers, in their order."""
        return list(self.run.observers.values())

    def observe(self, stage: str, batch: DataProto | None = None, metrics: dict[str, Any] | None = None) -> None:
        """Tell every step observer that step ``self.step`` reached ``stage``."""
        self.run.step = self.step
        for observer in self.observers:
            observer.on_stage(stage, batch, metrics if metrics is not None else {})

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``, resuming per ``trainer.resume``; returns the last step's metrics."""
        check_machine(self.config)
        prepare_run_directory(self.config.trainer)
        (self.run_dir / RUN_CONFIG_FILE).write_text(OmegaConf.to_yaml(self.config, resolve=True))
        self.start_observers()
        try:
            metrics = self.run_steps()
        except BaseException as error:
            for observer in self.observers:
                observer.finish("failed", error)
            raise
        for observer in self.observers:
            observer.finish("finished" if self.step >= self.total_steps else "interrupted")
        return metrics

    def run_steps(self) -> dict[str, float]:
        self.build_workers()
        self.run.groups.update(self.placement.groups)
        self.resume()
        if self.config.trainer.replay_rollouts is not None:
            check_replay(self.config.trainer.replay_rollouts, self.step + 1, self.total_steps)
        self.actor.set_policy_version(self.step)
        if self.rollout is not self.actor:  # a rollout in its own pool starts from the built or restored weights
            self.sync_weights(full=True)
        metrics: dict[str, float] = {}
        trainer = self.config.trainer
        with Tracker(self.run_dir, trainer.logger, total_steps=self.total_steps, start_step=first_logged_step(self.step),
                     project=trainer.project_name, experiment=trainer.experiment_name or self.run_dir.name,
                     config=self.node) as tracker, graceful_interrupt() as interrupt:
            if self.step == 0 and trainer.val_before_train and self.val_loader is not None:
                self.enter_phase("validate")
                tracker.log(self.validate(), step=0)
            while self.step < self.total_steps:
                self.step += 1
                self.observe("step")
                try:
                    with timeline.span(f"step {self.step}", "step"):
                        metrics = self.run_step(tracker, interrupt)
                finally:
                    self.observe("step_done", None, metrics)
                if interrupt.requested:
                    break
        return metrics

    def run_step(self, tracker: Tracker, interrupt: Any) -> dict[str, float]:
        """Step ``self.step``: train, validate when due, log, checkpoint when due."""
        trainer = self.config.trainer
        self.gap_start = time.time()
        metrics = self.train_step()
        self.pipeline.fill(self.step, self.total_steps)  # the next generations start before validation
        if self.val_loader is not None and trainer.test_freq and (self.step % trainer.test_freq == 0 or self.step == self.total_steps):
            with self.timed(metrics, "validate"):
                metrics.update(self.validate())
        self.observe("step_end", None, metrics)
        tracker.log(metrics, step=self.step)
        if (trainer.save_freq and self.step % trainer.save_freq == 0) or self.step == self.total_steps or interrupt.requested:
            with self.timed({}, "save"):
                self.save()
        self.close_gap()
        return metrics

    @contextlib.contextmanager
    def timed(self, timing: dict[str, float], name: str) -> Iterator[None]:
        """Time phase ``name`` into ``timing_s/<name>``; ``status.json`` shows it as the current phase, and a
        profiled step's trace as a span (the driver's work between outermost phases as ``driver`` spans)."""
        self.enter_phase(name)
        outermost = self.phase_depth == 0
        if outermost:
            self.close_gap()
        self.phase_depth += 1
        try:
            with timeline.span(name), timed(timing, name):
                yield
        finally:
            self.phase_depth -= 1
            if outermost:
                self.gap_start = time.time()

    def enter_phase(self, name: str) -> None:
        self.run.step = self.step
        for observer in self.observers:
            observer.on_phase(name)

    def close_gap(self) -> None:
        if self.gap_start is not None and timeline.recording():
            timeline.record("driver", self.gap_start, time.time())
        self.gap_start = None

    def generate(self, prompts: DataProto, sampling: SamplingParams | None = None) -> DataProto:
        overrides = dataclasses.asdict(sampling) if sampling is not None else {}
        prompts = prompts.with_meta_info({**prompts.meta_info, **overrides})
        if self.pipeline is not None:  # partial rollouts: after the newest weights sent, not beside their load
            prompts = self.pipeline.with_min_version(prompts)
        return self.rollout.generate_sequences(prompts)

    def train_step(self) -> dict[str, float]:
        """Step ``self.step``: generate and score, old log-probs, advantages, update, sync the weights."""
        timing: dict[str, float] = {}
        metrics: dict[str, Any] = {}
        self.role_metrics = {}
        started = time.perf_counter()
        with self.timed(timing, "gen"):
            batch = self.generated_batch(timing)
        self.observe("generated", batch, metrics)
        batch = self.stage("scored", batch)
        self.arrange(batch, metrics)
        sampled_mask = batch.batch["response_mask"]  # as sampled, before rollout correction rejects tokens
        source = self.old_log_prob_source(batch)
        if source == "pass":
            with self.timed(timing, "old_log_prob"):
                batch = batch.union(self.actor.compute_log_prob(batch))
            mask = batch.batch["response_mask"].to(batch.batch["entropys"].dtype)
            metrics["actor/entropy"] = float((batch.batch["entropys"] * mask).sum() / mask.sum().clamp(min=1))
        metrics.update(self.correct_rollout(batch, source))
        batch = self.reference_and_values(batch, timing)
        with self.timed(timing, "adv"):
            batch, reward_kl_metrics = self.compute_advantage(batch)
        self.observe("prepared", batch, metrics)
        batch = self.stage("prepared", batch)
        metrics.update(reward_kl_metrics)
        batch = self.update(batch, source, sampled_mask, timing, metrics)
        self.observe("updated", batch, metrics)
        with self.timed(timing, "sync_weights"):
            metrics.update(self.sync_weights())
        if self.sync_probe.due(self.step):
            metrics.update(self.sync_probe.run(self.rollout, self.actor, self.step, prepare=self.pipeline.with_min_version,
                                               on_meta_info=lambda meta: self.observe("probed", DataProto(meta_info=meta))))
        self.stage("updated", batch)
        metrics.update(batch_metrics(batch, sampled_mask))
        metrics.update(self.driver_metrics(batch, ""))
        metrics.update(batch.meta_info.get("reward_metrics", {}))
        metrics.update(self.role_metrics)
        self.observe("trained", batch, metrics)
        timing["timing_s/step"] = time.perf_counter() - started
        tokens = float(batch.batch["attention_mask"].sum())
        metrics["perf/throughput"] = tokens / timing["timing_s/step"] / max(self.actor.world_size, 1)
        return {**metrics, **timing}

    def generated_batch(self, timing: dict[str, float]) -> DataProto:
        """The step's generated, scored and filtered batch (or the one a dumped run wrote for this step)."""
        if self.config.trainer.replay_rollouts is not None:
            return read_batch(step_file(self.config.trainer.replay_rollouts, self.step))
        return self.generate_filled_batch(self.step_seed(self.step), timing)

    def arrange(self, batch: DataProto, metrics: dict[str, Any]) -> None:
        """Balance the rows over the actor's data-parallel ranks; in the asynchronous modes, the staleness metrics."""
        if self.config.trainer.balance_batch:
            self.balance(batch, metrics)
        if self.async_settings.asynchronous:
            staleness = (self.step - 1) - row_versions(batch)
            metrics.update({"async/staleness_mean": float(staleness.float().mean()), "async/staleness_max": float(staleness.max())})

    def correct_rollout(self, batch: DataProto, source: str) -> dict[str, float]:
        """``algorithm.rollout_correction``: the rollout's log-probs as ``old_log_probs`` (source ``rollout``), or
        the decoupled correction's weights and rejection (its metrics)."""
        correction = self.rollout_correction
        if correction is None or not correction.enabled:
            return {}
        if "rollout_log_probs" not in batch.batch.keys() and (source == "rollout" or correction.compares_log_probs):
            raise RuntimeError(f"step {self.step}: algorithm.rollout_correction needs the rollout's log-probs, and rollout "
                               f"{self.config.rollout.name!r} returned no rollout_log_probs")
        if source == "rollout":  # the rollout's policy is the old one: the PPO ratio is pi_theta / pi_rollout
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
            return {}
        return rollout_correction.apply(batch, correction, trained_version=self.step - 1)

    def reference_and_values(self, batch: DataProto, timing: dict[str, float]) -> DataProto:
        if self.use_reference:
            with self.timed(timing, "ref"):
                batch = batch.union(self.actor.compute_ref_log_prob(batch))
        if self.critic is not None:
            with self.timed(timing, "values"):
                batch = batch.union(self.critic.compute_values(batch))
        return batch

    def update(self, batch: DataProto, source: str, sampled_mask: torch.Tensor, timing: dict[str, float],
               metrics: dict[str, Any]) -> DataProto:
        """The critic's and the actor's updates; with source ``update`` the actor's first forward gives
        ``old_log_probs``, joined to the batch here. Then how far they are from the rollout's."""
        if self.critic is not None:
            with self.timed(timing, "update_critic"):
                metrics.update(self.critic.update_critic(batch).meta_info["metrics"])
        with self.timed(timing, "update_actor"):
            updated = self.actor.update_actor(batch)
        update_metrics = dict(updated.meta_info["metrics"])
        self.pipeline.record_update(pop_window(update_metrics, "update"))
        metrics.update(update_metrics)
        if source == "update":
            batch = batch.union(updated.select(batch_keys=["old_log_probs"], meta_info_keys=[]))
        if "rollout_log_probs" in batch.batch.keys() and source != "rollout":  # rollout: old_log_probs are the rollout's
            metrics.update(rollout_correction.log_prob_mismatch(batch, sampled_mask))
            metrics.update(rollout_correction.offpolicy_metrics(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
                                                                sampled_mask))
        return batch

    def balance(self, batch: DataProto, metrics: dict[str, Any]) -> None:
        """Reorder ``batch`` in place so each data-parallel rank of the actor gets about the same tokens."""
        tokens = batch.batch["attention_mask"].sum(-1).tolist()
        parts = self.actor.layout().dp_size
        order = balanced_order(tokens, parts)
        if order is None:
            return
        batch.reorder(torch.tensor(order))
        size = len(order) // parts
        loads = [sum(tokens[row] for row in order[i * size:(i + 1) * size]) for i in range(parts)]
        metrics["perf/dp_token_imbalance"] = max(loads) / max(1.0, sum(loads) / parts)

    def old_log_prob_source(self, batch: DataProto) -> str:
        """Where this step's ``old_log_probs`` come from: ``actor.old_log_probs``, resolved at load. A step whose
        batch an algorithm's hooks grew past one mini-batch is not strictly on-policy, so ``update`` runs the
        pass there (``actor.recompute_old_log_prob=never`` refuses it instead)."""
        mini_batch_rows = self.config.actor.ppo_mini_batch_size * self.config.rollout.n
        if self.old_log_probs != "update" or len(batch) <= mini_batch_rows:
            return self.old_log_probs
        if self.config.actor.recompute_old_log_prob == "never":
            raise RuntimeError(
                f"step {self.step}: the batch has {len(batch)} rows, more than one mini-batch "
                f"(actor.ppo_mini_batch_size x rollout.n = {mini_batch_rows}; algorithm {self.algorithm.name!r} "
                "added rows), so the update is not strictly on-policy and actor.recompute_old_log_prob=never "
                "cannot take old_log_probs from its first forward; use auto or always"
            )
        return "pass"

    def needs_old_log_prob_pass(self, batch: DataProto) -> bool:
        """Deprecated: :meth:`old_log_prob_source` says where this step's ``old_log_probs`` come from."""
        from rlplat.deprecation import warn

        warn("Trainer.needs_old_log_prob_pass(batch)", "Trainer.old_log_prob_source(batch) == 'pass'", "1.4")
        return self.old_log_prob_source(batch) == "pass"

    @property
    def sentinel(self) -> Any:
        """Deprecated: the run sentinel is a step observer, ``self.run.observers["sentinel"].sentinel``."""
        from rlplat.deprecation import warn

        warn("Trainer.sentinel", "Trainer.run.observers['sentinel'].sentinel", "1.4")
        observer = self.run.observers.get("sentinel")
        return observer.sentinel if observer is not None else None

    def generate_filled_batch(self, seed: int, timing: dict[str, float]) -> DataProto:
        """Prompts -> responses -> rewards, through the algorithm's hooks; an algorithm that drops
        groups (DAPO) gets more prompts until its accumulator is full."""
        accumulator = self.algorithm.make_accumulator(self.config.data.train_batch_size)
        attempt = 0
        reward_metrics: list[dict[str, float]] = []  # per generation: kept out of meta_info, whose keys must agree to concat
        events: list[dict[str, Any]] = []  # health events of every generation and scoring, for the sentinel
        while True:
            if attempt == 0 and self.pipeline is not None and (self.pipeline.queue or self.async_settings.asynchronous):
                batch, async_metrics = self.pipeline.take(self.step, self.total_steps)
                reward_metrics.append(async_metrics)
            else:
                prompts = self.train_loader.next_batch()
                prompts = prompts.with_meta_info({**prompts.meta_info, "seed": seed + 7919 * attempt})
                batch = self.generate(prompts)
            events.extend(batch.meta_info.pop(HEALTH_EVENTS, ()))
            checks = {name: float(min(value) if isinstance(value, list) else value)  # every rollout rank's
                      for name, value in (batch.meta_info.get("metrics") or {}).items() if name.startswith("sentinel/")}
            batch = self.algorithm.after_generate(batch, self.generate, SamplingParams(**{**self.sampling(), "seed": seed}))
            events.extend(batch.meta_info.pop(HEALTH_EVENTS, ()))  # a baseline generation's (ReMax)
            batch = self.stage("generated", batch)
            with self.timed(timing, "reward"):
                scored = self.score(batch, timing)
            events.extend(scored.meta_info.get(HEALTH_EVENTS, ()))
            batch = batch.union(scored.select(batch_keys=["token_level_scores"], meta_info_keys=[]))
            for key, values in scored.non_tensor_batch.items():
                if key not in batch.non_tensor_batch:
                    batch.non_tensor_batch[key] = values
            reward_metrics.append({**scored.meta_info.get("reward_metrics", {}), **checks})
            batch = self.algorithm.filter_batch(batch)
            full = batch if accumulator is None else accumulator.add(batch)
            if full is not None:
                names = {name for metrics in reward_metrics for name in metrics}
                full.meta_info["reward_metrics"] = {  # the mean over this step's generations
                    name: float(np.mean([metrics[name] for metrics in reward_metrics if name in metrics])) for name in names}
                full.meta_info[HEALTH_EVENTS] = events
                return full
            attempt += 1

    def score(self, batch: DataProto, timing: dict[str, float] | None = None, *, validation: bool = False) -> DataProto:
        """The reward manager's scores (or those its :meth:`~RewardManager.trajectory_scorer` computed in the
        rollout workers while they generated: :meth:`~RewardManager.scores_from_rollout`); a row whose
        agent loop returned a reward of its own (an environment's, non-tensor ``agent_reward``) gets that
        instead, at its last sampled token; then each role that scores responses (a reward model) joins
        its scores (:meth:`Role.join_scores`). When such a role says the rule scores are not needed
        (:meth:`Role.rule_scores_needed`: a reward model with ``rule_weight=0``, in training), the manager
        is not called."""
        roles = self.placement.roles if self.placement is not None else {}
        if all(role.rule_scores_needed(self.context, validation) for role in roles.values()):
            scored = self.reward.scores_from_rollout(batch)
            scored = self.environment_rewards(batch, self.reward(batch) if scored is None else scored)
        else:
            scored = DataProto.from_dict({"token_level_scores": torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)},
                                         meta_info={"reward_metrics": {}})
        for name, role in roles.items():
            scored = role.join_scores(self.placement.groups[name], batch, scored, validation=validation, timing=timing)
        return scored

    def environment_rewards(self, batch: DataProto, scored: DataProto) -> DataProto:
        """``scored`` with the rows whose agent loop returned a reward of its own (non-tensor
        ``agent_reward``) given that instead, at their last sampled token."""
        if "agent_reward" not in batch.non_tensor_batch:
            return scored
        own = np.asarray(batch.non_tensor_batch["agent_reward"], dtype=np.float64)
        rows = np.flatnonzero(~np.isnan(own))
        if len(rows) == 0:
            return scored
        scores = scored.batch["token_level_scores"].clone()
        last = last_tokens(batch.batch["response_mask"])
        for row in rows.tolist():
            scores[row] = 0.0
            if last[row] >= 0:
                scores[row, last[row]] = float(own[row])
        scored.batch["token_level_scores"] = scores
        accuracy = np.asarray(scored.non_tensor_batch.get("acc", np.zeros(len(batch))), dtype=object).copy()
        accuracy[rows] = own[rows] > 0
        scored.non_tensor_batch["acc"] = accuracy
        return scored

    def compute_advantage(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        tensors = batch.batch
        metrics: dict[str, float] = {}
        if self.kl_controller is not None:
            rewards, metrics = self.algorithm.resolve("reward_kl")(
                tensors["token_level_scores"], tensors["old_log_probs"], tensors["ref_log_prob"],
                tensors["response_mask"], self.kl_controller, self.algorithm.config)
        else:
            rewards = tensors["token_level_scores"]
        extra = self.algorithm.estimator_inputs(batch)
        values = tensors["values"] if "values" in tensors.keys() else None
        advantages, returns = self.estimator(rewards, tensors["response_mask"], np.asarray(batch.non_tensor_batch["uid"]),
                                             values=values, config=self.algorithm.config, **extra)
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
            self.observe("validation", batch)
            scored = self.score(batch, validation=True)
            self.observe("validation", scored)
            for name, values in scored.meta_info.get("validation_values", {}).items():  # per row, e.g. a reward model's
                scores.setdefault(name, []).extend(values)
            for name, value in self.driver_metrics(batch, "val/").items():
                scores.setdefault(name, []).append(value)
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
            for name, group in self.placement.groups.items():
                self.placement.roles[name].save_checkpoint(group, str(directory))

            self.pipeline.write(directory)  # waits for the generations in flight: they are part of the state

        state = {"data": self.train_loader.state_dict(), "rng": capture_rng_state(),
                 "kl_coef": self.kl_controller.value if self.kl_controller is not None else None,
                 "rollout_buffer": self.pipeline.index()}
        return self.checkpoints.save(self.step, write, state)

    def resume(self) -> None:
        path = self.checkpoints.resolve(self.config.trainer.resume)
        if path is None:
            return
        for name, group in self.placement.groups.items():
            self.placement.roles[name].load_checkpoint(group, str(path))
        state = self.checkpoints.load_state(path)
        self.train_loader.load_state_dict(state["data"])
        if state.get("rollout_buffer"):
            self.pipeline.load(Path(path), state["rollout_buffer"])
        restore_rng_state(state["rng"])
        if self.kl_controller is not None and state.get("kl_coef") is not None:
            self.kl_controller.value = state["kl_coef"]
        self.step = int(state["step"])

    def shutdown(self) -> None:
        if self.placement is not None:
            self.placement.shutdown()
            self.placement = None
