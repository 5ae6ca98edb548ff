"""Asynchronous training: the rollout generates the next batches while the trainer works on this one.

``trainer.mode`` (see :class:`rlplat.config.TrainerConfig`):

``sync``
    Generate a batch, then train on it; every sample is on-policy (staleness 0).
``colocate_async``
    The rollout stays in the actor's processes. After each weight sync the driver starts the
    generations of the next steps without waiting for them, so the rollout works while the driver scores,
    runs the reward model and computes advantages. Calls on one process run in the order they were
    made, so the schedule (and the result) does not depend on timing.
``separate_async``
    The rollout has a worker group and resource pool of its own (the ``rollout`` role is placed
    ``separate``) and generates while the actor trains; after each update the actor's weights reach it
    through the object store, queued behind the generations already started.

**Versions and staleness.** The weights after ``v`` updates are policy version ``v``; step ``s``
trains version ``s - 1``. Every response token carries the version that sampled it
(``policy_version``, stamped by the rollout worker itself), and a sample's staleness at step ``s`` is
``s - 1`` minus the oldest version among its tokens. With ``trainer.max_staleness = K`` the pipeline
keeps ``trainer.rollout_ahead`` generations in flight (default ``K + 1``), each meant for one step and
seeded as that step would be in ``sync`` mode, so ``K = 0`` reproduces ``sync`` exactly. A sample older
than ``K`` when its step comes is never trained: it is dropped and its prompts generated again from the
current weights (``staleness_policy=drop`` lets the rollout run further ahead than ``K + 1`` at that
price; ``wait``, the default, never starts a generation that could end up beyond the bound).

**Partial rollouts** (``trainer.partial_rollout`` ``keep`` or ``recompute``, ``separate_async`` only). The
rollout's processes run several calls at once (:meth:`rlplat.contracts.role.Role.concurrent_calls`): the
generations in flight share forward passes, and a weight load lands during them at a token boundary (the
sequences go on with the new weights, keeping or recomputing their KV cache), so it never waits for a slow
tail. Every token records the version that sampled it, and a generation starts only once the newest weights
sent before it have arrived (``min_policy_version``), so the bound above holds per token. Loads are checked
once they finished (:meth:`DataFuture.done`).

**Lossless resume.** A checkpoint waits for the generations in flight and stores them, finished, with
their versions (``rollout_buffer/`` in the checkpoint); the data loader's position is already past
their prompts. With partial rollouts it first cuts them short (``abort_generations``): each is stored with
the tokens it has, and is sent again to go on from them (here, or in the run resumed from the checkpoint). A resumed run trains exactly the samples the uninterrupted run would have: every prompt
of an epoch once. ``trained_prompts.jsonl`` in the run directory records each step's prompt uids and
their staleness (lines past the resumed step are dropped on resume, like the metrics).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

# the keys' values, checks and settings live in the config (rlplat.config.modes); the names stay importable here
from rlplat.contracts.observer import ObservedRun, StepObserver
from rlplat.config.modes import (DISPATCHES, MODES, PARTIAL_MODES, POLICIES, AsyncSettings,  # noqa: F401
                                 check_partial_rollout, check_trainer_mode, partial_mode)

BUFFER_DIRECTORY = "rollout_buffer"
TRAINED_PROMPTS_FILE = "trained_prompts.jsonl"


def row_versions(batch: Any) -> Any:
    """Each row's oldest policy version over its sampled tokens (over the whole row when none is)."""
    import torch

    versions, mask = batch.batch["policy_version"], batch.batch["response_mask"].bool()
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(dim=-1).values
    return torch.where(mask.any(dim=-1), oldest, versions.min(dim=-1).values)


def merge_windows(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_seconds(window: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Seconds of ``window`` covered by the union of ``others``."""
    return sum(max(0.0, min(window[1], end) - max(window[0], start)) for start, end in merge_windows(others))


def pop_window(metrics: dict[str, Any], name: str) -> Optional[tuple[float, float]]:
    """Remove ``async/{name}_start`` and ``_end`` (one value per rank, or one) from ``metrics``; the
    window from the earliest start to the latest end."""
    start, end = metrics.pop(f"async/{name}_start", None), metrics.pop(f"async/{name}_end", None)
    if start is None or end is None:
        return None
    starts = start if isinstance(start, (list, tuple)) else [start]
    ends = end if isinstance(end, (list, tuple)) else [end]
    return float(min(starts)), float(max(ends))


@dataclasses.dataclass
class Generation:
    """A generation started ahead of the trainer, for ``step``."""

    step: int
    prompts: Any
    seed: int
    replica: int = 0
    """The rollout process that runs it (``trainer.rollout_dispatch=replica``); 0 otherwise."""
    number: int = 0
    """Calls made to that process before this one (weight loads queued earlier ran before it)."""
    future: Any = None
    result: Any = None
    continued: int = 0
    """Partial rollouts: samples a checkpoint cut short and this generation went on with afterwards."""

    def wait(self) -> Any:
        if self.result is None:
            self.result = self.future.get()
            self.future = None
        return self.result


class RolloutPipeline:
    """The generations in flight (oldest first) and the schedule that starts them.

    ``start(prompts, replica)`` sends one generation to the rollout without waiting and returns its
    future; ``regenerate(prompts, replica)`` generates and waits. With ``replicas`` > 1 each generation
    runs whole on one rollout process, step ``s`` on process ``s % replicas`` (so a resumed run uses the
    same one), and several run at once; otherwise every call goes to the whole group. ``seed_of(step)``
    is the sampling seed of a step's first generation, as ``sync`` mode uses it."""

    def __init__(self, settings: AsyncSettings, loader: Any, start: Callable[[Any, int], Any],
                 regenerate: Callable[[Any, int], Any], seed_of: Callable[[int], int], replicas: int = 1,
                 abort: Optional[Callable[[], None]] = None):
        self.settings = settings
        self.abort = abort
        """Partial rollouts: ends the generations in flight now, each returning what it has (checkpoints);
        None: generations run to the end, and a weight load comes after those started before it."""
        self.loader = loader
        self.start_generation, self.regenerate = start, regenerate
        self.seed_of = seed_of
        self.replicas = replicas
        self.queue: collections.deque[Generation] = collections.deque()
        self.update_windows: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)
        self.calls = [0] * replicas  # calls made to each rollout process, in order
        self.finished = [0] * replicas  # of those, how many are known to have finished
        self.loads: list[tuple[tuple[int, ...], Any]] = []  # weight loads not yet checked: (calls before it, future)
        self.sent_version: Optional[int] = None  # the policy version of the newest load sent

    def replica_of(self, step: int) -> int:
        return step % self.replicas

    def add_load(self, future: Any, version: Optional[int] = None) -> None:
        """A weight load (of policy ``version``) sent to every rollout process without waiting; its outcome
        is checked once a later call has finished on each of them (a process runs its calls in order; with
        partial rollouts, once it finished), never by waiting."""
        self.loads.append((tuple(self.calls), future))
        if version is not None:
            self.sent_version = int(version)
        self.calls = [count + 1 for count in self.calls]

    def settle_loads(self) -> None:
        """Raise the error of any load that every process has run by now (with partial rollouts, which
        land during generations: any load that finished)."""
        if self.abort is not None:
            finished = [future.done() for _, future in self.loads]
        else:
            finished = [all(b < f for b, f in zip(before, self.finished)) for before, _ in self.loads]
        done = [future for (_, future), over in zip(self.loads, finished) if over]
        self.loads = [load for load, over in zip(self.loads, finished) if not over]
        for future in done:
            future.get()

    def with_min_version(self, prompts: Any) -> Any:
        """Partial rollouts: ``prompts`` to start from the newest weights sent (their load runs beside the
        generations, not before them)."""
        from rlplat.kits.rollout_batch import MIN_VERSION

        if self.abort is None or self.sent_version is None:
            return prompts
        return prompts.with_meta_info({**prompts.meta_info, MIN_VERSION: self.sent_version})

    def submit(self, step: int, prompts: Any, seed: int) -> Generation:
        replica = self.replica_of(step)
        prompts = self.with_min_version(prompts)
        generation = Generation(step, prompts, seed, replica, self.calls[replica], future=self.start_generation(prompts, replica))
        self.calls[replica] += 1
        return generation

    def next_step(self, current: int) -> int:
        return self.queue[-1].step + 1 if self.queue else current + 1

    def continue_cut(self, generation: Generation) -> bool:
        """Send a generation that a checkpoint cut short (partial rollouts) to go on from the tokens it has;
        whether it was one."""
        from rlplat.kits.rollout_batch import ABORTED_KEY

        batch = generation.result
        if batch is None or ABORTED_KEY not in batch.batch.keys() or not bool(batch.batch[ABORTED_KEY].any()):
            return False
        generation.continued += int(batch.batch[ABORTED_KEY].sum())
        replica = self.replica_of(generation.step)
        batch = self.with_min_version(batch.with_meta_info({**batch.meta_info, "continue": True}))
        generation.future = self.start_generation(batch, replica)
        generation.result, generation.number = None, -1
        self.calls[replica] += 1
        return True

    def fill(self, current: int, total_steps: int) -> None:
        """Start generations for the steps after ``current`` until ``ahead`` are in flight (never past
        ``total_steps``), and continue those a checkpoint cut short."""
        for generation in self.queue:
            self.continue_cut(generation)
        while len(self.queue) < self.settings.ahead and self.next_step(current) <= total_steps:
            step = self.next_step(current)
            prompts = self.loader.next_batch()
            seed = self.seed_of(step)
            prompts = prompts.with_meta_info({**prompts.meta_info, "seed": seed})
            self.queue.append(self.submit(step, prompts, seed))

    def take(self, step: int, total_steps: int) -> tuple[Any, dict[str, float]]:
        """The generated batch for ``step`` (which trains policy version ``step - 1``) and its
        ``async/*`` metrics; a batch beyond ``max_staleness`` is generated again from current weights."""
        started = time.perf_counter()
        self.fill(step - 1, total_steps)
        generation = self.queue.popleft()
        batch = generation.wait()
        while self.continue_cut(generation):  # cut short by a checkpoint (of this run or the one resumed)
            batch = generation.wait()
        if generation.number >= 0:  # not one restored from a checkpoint
            self.finished[generation.replica] = max(self.finished[generation.replica], generation.number + 1)
        self.settle_loads()
        waited = time.perf_counter() - started
        metrics = dict(batch.meta_info.get("metrics") or {})
        window = pop_window(metrics, "generation")
        result: dict[str, float] = {"async/wait_s": waited, "async/samples_dropped": 0.0}
        if self.abort is not None:
            result["async/continued_samples"] = float(generation.continued)
        if window is not None and window[1] > window[0]:
            overlap = overlap_seconds(window, list(self.update_windows))
            result["async/overlap_s"] = overlap
            result["async/overlap_fraction"] = overlap / (window[1] - window[0])
        attempt = 0
        while int((step - 1) - row_versions(batch).min()) > self.settings.max_staleness:
            result["async/samples_dropped"] += len(batch)
            attempt += 1
            prompts = generation.prompts.with_meta_info({**generation.prompts.meta_info, "seed": generation.seed + 104_729 * attempt})
            prompts = self.with_min_version(prompts)
            replica = self.replica_of(step)
            self.calls[replica] += 1
            batch = self.regenerate(prompts, replica)
            self.finished[replica] = self.calls[replica]
            self.settle_loads()
        from rlplat.kits.rollout_batch import ABORTED_KEY

        if ABORTED_KEY in batch.batch.keys():
            batch.pop(batch_keys=[ABORTED_KEY])
        metrics = batch.meta_info.get("metrics") or {}
        for key in ("async/partial_samples", "async/aborted_samples"):
            if key in metrics:
                value = metrics[key]
                result[key] = float(sum(value) if isinstance(value, (list, tuple)) else value)
        batch.meta_info["metrics"] = {key: value for key, value in metrics.items()
                                      if not key.startswith(("async/generation_", "async/partial_", "async/aborted_"))}
        result["async/in_flight"] = float(len(self.queue))
        return batch, result

    def record_update(self, window: Optional[tuple[float, float]]) -> None:
        if window is not None:
            self.update_windows.append(window)

    # -- checkpoints -----------------------------------------------------------------------------

    def index(self) -> list[dict[str, Any]]:
        """What :meth:`write` stores, for the trainer state."""
        return [{"step": generation.step, "seed": generation.seed, "file": f"step_{generation.step}.pt",
                 "prompts": f"prompts_{generation.step}.pt"} for generation in self.queue]

    def write(self, directory: Path) -> None:
        """Wait for every generation in flight and write it, with its prompts, under
        ``directory/rollout_buffer``. With partial rollouts the generations are cut short first: each is
        stored with the tokens it has and their versions, and goes on from them afterwards (here, or in the
        run that resumes from this checkpoint)."""
        if not self.queue:
            return
        if self.abort is not None and any(generation.result is None for generation in self.queue):
            self.abort()
        folder = directory / BUFFER_DIRECTORY
        folder.mkdir()
        for generation, entry in zip(self.queue, self.index()):
            generation.wait().save_to_disk(folder / entry["file"])
            generation.prompts.save_to_disk(folder / entry["prompts"])
        for _, future in self.loads:
            future.get()
        self.loads, self.finished = [], list(self.calls)

    def load(self, directory: Path, index: list[dict[str, Any]]) -> None:
        """Restore the generations a checkpoint stored (finished, with their versions)."""
        from rlplat.protocol import DataProto

        self.queue.clear()
        for entry in index:
            folder = directory / BUFFER_DIRECTORY
            if not (folder / entry["file"]).is_file():
                raise FileNotFoundError(f"checkpoint {directory}: the stored generation for step {entry['step']} "
                                        f"({folder / entry['file']}) is missing; the checkpoint is incomplete")
            step = int(entry["step"])
            self.queue.append(Generation(step, DataProto.load_from_disk(folder / entry["prompts"]), int(entry["seed"]),
                                         self.replica_of(step), number=-1, result=DataProto.load_from_disk(folder / entry["file"])))


class TrainedPromptsLog:
    """``trained_prompts.jsonl``: one line per step with the uids of the prompts trained and the
    staleness of their samples."""

    def __init__(self, run_dir: Path, start_step: int):
        from rlplat.trainer.tracking import _drop_stale_lines

        self.path = run_dir / TRAINED_PROMPTS_FILE
        if self.path.exists():
            _drop_stale_lines(self.path, start_step)

    def write(self, step: int, batch: Any) -> None:
        import numpy as np

        uids = list(dict.fromkeys(str(uid) for uid in np.asarray(batch.non_tensor_batch["uid"]).tolist()))
        record: dict[str, Any] = {"step": step, "uids": uids}
        if "policy_version" in batch.batch.keys():
            staleness = (step - 1) - row_versions(batch)
            record["staleness_max"] = int(staleness.max())
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
            out.flush()


class TrainedPromptsObserver(StepObserver):
    """``trained_prompts.jsonl`` as a step observer (kind ``step_observer``, registered by rlplat): the log opens
    at the run's first step (dropping the lines a resumed run will write again) and records every trained step,
    before the sentinel's checks of it."""

    order = 5

    def __init__(self, run: ObservedRun):
        self.run = run
        self.log: TrainedPromptsLog | None = None

    def on_stage(self, name: str, batch: Any, metrics: dict[str, Any]) -> None:
        if name == "step" and self.log is None:
            self.log = TrainedPromptsLog(Path(self.run.run_dir), self.run.step)
        elif name == "trained" and self.log is not None:
            self.log.write(self.run.step, batch)


def trained_prompts_observer(run: ObservedRun) -> TrainedPromptsObserver:
    return TrainedPromptsObserver(run)

