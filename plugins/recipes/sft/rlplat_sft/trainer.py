"""``SFTTrainer``: the supervised loop, ``rlplat sft``'s and the demo's warm start's.

load batch -> train step (the engine's ``train_batch`` with the NLL loss, on the worker group) ->
validation loss and perplexity every ``trainer.test_freq`` steps -> log -> checkpoint; at the end, the
model as a Hugging Face folder (``trainer.export_dir``) that ``rlplat run model.path=...`` takes.

The workers are one :class:`~rlplat_sft.worker.SFTWorker` group on the run's cluster (Ray, or this one
process with ``cluster.backend=local``), built from the same pieces as ``rlplat run``'s actor. The data
is read and checked in the driver before any worker starts. A run is exact across a kill: a checkpoint
holds the engine's state (model, optimizer, LR schedule) and the data position, and a resumed run
repeats the uninterrupted one's steps.

``evaluate`` (optional) is called after each validation with ``(trainer, step)`` and returns ``(metrics,
stop)``: metrics to log with the step's, and whether to stop there (the run then saves and exports as at
its end). The demo's warm start uses it to measure greedy accuracy and stop at its threshold.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from rlplat.trainer.checkpoint import CheckpointManager, capture_rng_state, graceful_interrupt, restore_rng_state
from rlplat.config import check_machine
from rlplat.contracts.role import Role, RoleConfig, RunContext
from rlplat.trainer.tracking import Tracker
from rlplat.config.trainer import RUN_CONFIG_FILE, first_logged_step, prepare_run_directory
from rlplat_sft.config import sft_engine_node, training_steps, validate_sft_config
from rlplat_sft.data import build_sft_data, validation_batches

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

Evaluate = Callable[["SFTTrainer", int], "tuple[dict[str, float], bool]"]


def first_value(value: Any) -> Any:
    """A metric gathered from several ranks (a list) as its first value: the engine reduces its metrics
    over the ranks, so they agree."""
    return value[0] if isinstance(value, list) else value


class SFTRole(Role):
    """The SFT workers as the one role of a placement: always enabled, colocated, an :class:`SFTWorker`
    built with the run's engine and loss. Not registered: ``rlplat run`` never builds it."""

    movable = False

    def enabled(self, run: RunContext) -> bool:
        return True

    def settings(self, run: RunContext, name: str) -> RoleConfig:
        return RoleConfig()

    def worker(self, run: RunContext) -> Any:
        from rlplat.controller.host import WorkerSpec
        from rlplat_sft.worker import SFTWorker

        config = run.config
        return WorkerSpec(SFTWorker, {"engine": config.actor.engine, "engine_config": sft_engine_node(config, run.total_steps),
                                      "loss_agg_mode": config.loss.loss_agg_mode})


class SFTTrainer:
    """Runs ``config`` (from :func:`rlplat_sft.config.load_sft_config`) to the end: ``SFTTrainer(config).fit()``."""

    def __init__(self, config: DictConfig, *, evaluate: Evaluate | None = None):
        from transformers import AutoTokenizer

        validate_sft_config(config)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        self.train_loader, self.val_set = build_sft_data(config.data, self.tokenizer)
        self.val_batches = validation_batches(self.val_set, config.data.val_batch_size) if self.val_set is not None else []
        self.total_steps = training_steps(config, self.train_loader.rows_per_epoch)
        self.run_dir = Path(config.trainer.output_dir).absolute()
        self.export_dir = Path(config.trainer.export_dir or self.run_dir / "hf_model").absolute()
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.trainer.keep_last)
        self.evaluate = evaluate
        self.group: Any = None
        self.placement: Any = None
        self.step = 0
        self.metrics: dict[str, float] = {}
        """The current step's metrics (what ``evaluate`` may read)."""

    # -- workers ---------------------------------------------------------------------------------------

    def build_workers(self) -> None:
        """One :class:`~rlplat_sft.worker.SFTWorker` group on the run's cluster, placed by core's
        :func:`rlplat.trainer.placement.place` as ``rlplat run``'s actor is (one role, colocated)."""
        from rlplat.contracts.role import RunContext
        from rlplat.trainer.placement import place

        run = RunContext(self.config, algorithm=None, total_steps=self.total_steps)
        self.placement = place({"actor": SFTRole()}, run)
        self.group = self.placement.groups["actor"]
        self.group.init_model()

    def shutdown(self) -> None:
        if self.placement is not None:
            self.placement.shutdown()
            self.placement = None
        self.group = None

    # -- the loop ----------------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps`` (resuming per ``trainer.resume``), export the model; returns the last
        step's metrics."""
        check_machine(self.config)
        prepare_run_directory(self.config.trainer)
        (self.run_dir / RUN_CONFIG_FILE).write_text(OmegaConf.to_yaml(self.config, resolve=True))
        self.build_workers()
        self.resume()
        trainer = self.config.trainer
        metrics: dict[str, float] = {}
        finished = self.step >= self.total_steps
        with Tracker(self.run_dir, trainer.logger, total_steps=self.total_steps, start_step=first_logged_step(self.step),
                     project=trainer.project_name, experiment=trainer.experiment_name or self.run_dir.name,
                     config=OmegaConf.to_container(self.config, resolve=True)) as tracker, graceful_interrupt() as interrupt:
            if self.step == 0 and trainer.val_before_train and self.val_batches:
                tracker.log(self.validate(), step=0)
            while self.step < self.total_steps:
                self.step += 1
                metrics = self.metrics = self.train_step()
                stop = False
                due = (trainer.test_freq and self.step % trainer.test_freq == 0) or self.step == self.total_steps
                if due:
                    started = time.perf_counter()
                    if self.val_batches:
                        metrics.update(self.validate())
                    if self.evaluate is not None:
                        extra, stop = self.evaluate(self, self.step)
                        metrics.update(extra)
                    metrics["timing_s/validate"] = time.perf_counter() - started
                tracker.log(metrics, step=self.step)
                finished = stop or self.step == self.total_steps
                if (trainer.save_freq and self.step % trainer.save_freq == 0) or finished or interrupt.requested:
                    self.save()
                if stop or interrupt.requested:
                    break
        if finished:
            self.export()
        return metrics

    def train_step(self) -> dict[str, float]:
        started = time.perf_counter()
        batch = self.train_loader.next_batch()
        output = self.group.train_step(batch)
        worker = {key: first_value(value) for key, value in output.meta_info["metrics"].items()}
        elapsed = time.perf_counter() - started
        tokens = float(batch.batch["attention_mask"].sum())
        trained = float(batch.batch["response_mask"].sum())
        metrics = {"train/loss": worker["sft/loss"], "train/grad_norm": worker["grad_norm"], "train/lr": worker["lr"],
                   "train/tokens": trained, "train/epoch": float(self.train_loader.epoch),
                   "timing_s/step": elapsed, "perf/throughput": tokens / elapsed / max(self.group.world_size, 1)}
        if worker.get("sft/tokens"):
            metrics["train/nll_per_token"] = worker["sft/nll_sum"] / worker["sft/tokens"]
        if worker.get("skipped_step"):
            metrics["train/skipped_step"] = worker["skipped_step"]
        return metrics

    def validate(self) -> dict[str, float]:
        """``val/loss`` (mean NLL per trained token of the validation set) and ``val/perplexity`` (its exp)."""
        nll, tokens = 0.0, 0.0
        for batch in self.val_batches:
            output = self.group.evaluate(batch)
            nll += float(output.batch["nll_sum"].sum())
            tokens += float(output.batch["tokens"].sum())
        loss = nll / max(tokens, 1.0)
        return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 700.0))}

    def full_weights(self) -> dict[str, Any]:
        """The model's full weights (Hugging Face names, adapters merged in), gathered to the driver."""
        return next(part for part in self.group.full_weights() if part is not None)

    # -- checkpoints and export ----------------------------------------------------------------------------

    def save(self) -> Path:
        state = {"data": self.train_loader.state_dict(), "rng": capture_rng_state()}
        return self.checkpoints.save(self.step, lambda directory: self.group.save_checkpoint(str(directory)), state)

    def resume(self) -> None:
        path = self.checkpoints.resolve(self.config.trainer.resume)
        if path is None:
            return
        self.group.load_checkpoint(str(Path(path).absolute()))
        state = self.checkpoints.load_state(path)
        self.train_loader.load_state_dict(state["data"])
        restore_rng_state(state["rng"])
        self.step = int(state["step"])

    def export(self) -> Path:
        """The trained model, with its tokenizer, as a Hugging Face folder at ``trainer.export_dir``;
        written beside it and moved into place once complete."""
        out = self.export_dir
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        try:
            self.group.export_hf(str(partial))
            if not any((partial / name).is_file() for name in TOKENIZER_FILES):
                self.tokenizer.save_pretrained(str(partial))
            if out.exists():
                shutil.rmtree(out)
            partial.rename(out)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return out


def run_sft(config: DictConfig, *, evaluate: Evaluate | None = None) -> tuple[dict[str, float], Path]:
    """Train ``config`` to the end and export it; returns the last metrics and the exported folder."""
    trainer = SFTTrainer(config, evaluate=evaluate)
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    return metrics, trainer.export_dir


__all__ = ["SFTTrainer", "SFTRole", "run_sft", "first_value"]
