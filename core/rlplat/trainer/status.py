"""``run_dir/status.json``: where a run is, for scripts and monitors, rewritten atomically at the end of every
step, when it stops, and at a phase change once the file is a second old.

Readers get a whole file or the previous one, never a torn write (written to a temporary file in the same
directory, then renamed over). Its fields (``schema`` 1):

* ``state``: ``running``, ``finished``, ``failed`` (``error`` then holds the exception's type and message) or
  ``interrupted`` (a signal stopped it after a checkpoint);
* ``step`` (the step in progress, or the last one finished), ``total_steps``, ``phase`` (``gen``, ``reward``,
  ``old_log_prob``, ``ref``, ``values``, ``adv``, ``update_critic``, ``update_actor``, ``sync_weights``,
  ``validate``, ``save``, ...) and ``phase_started_at``;
* ``last_step_s``, ``throughput`` (tokens per second per actor process, ``perf/throughput``), ``eta_s`` (the
  steps left times the median of the last 20 step times; null before the first step);
* ``replicas``: ``role/rank`` -> ``healthy``, ``suspect`` (a weight or version fault in the last two steps) or
  ``stale`` (its engine restarted with stale weights in the last two steps and was refreshed before it served). A
  replica whose process died stops the run: ``state`` is then ``failed`` and ``error`` names the worker;
* ``sentinel``: the last events of the run sentinel (:mod:`rlplat.trainer.sentinel`): step, check, error,
  action (``stop`` or ``warn``), message, role, rank, figures;
* ``pid``, ``updated_at`` (Unix seconds).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlplat.contracts.observer import ObservedRun, StepObserver

STATUS_FILE = "status.json"
PHASE_WRITE_INTERVAL_S = 1.0
"""A phase change is written when the file is at least this old: a long phase shows up, short ones are not
each a write."""


class RunStatus:
    """Keeps ``run_dir/status.json`` current (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike[str], total_steps: int):
        self.path = Path(run_dir) / STATUS_FILE
        self.fields: dict[str, Any] = {"schema": 1, "state": "running", "step": 0, "total_steps": total_steps,
                                       "phase": "starting", "phase_started_at": time.time(), "last_step_s": None,
                                       "throughput": None, "eta_s": None, "replicas": {}, "sentinel": [],
                                       "pid": os.getpid()}
        self.step_times: list[float] = []

    def phase(self, name: str, step: int | None = None) -> None:
        """Phase ``name`` of ``step`` (default: the current one) starts now; written when the file is older than
        :data:`PHASE_WRITE_INTERVAL_S` (every step's end is written regardless), so short phases cost nothing."""
        if step is not None:
            self.fields["step"] = step
        now = time.time()
        self.fields.update(phase=name, phase_started_at=now)
        if now - self.fields.get("updated_at", 0.0) >= PHASE_WRITE_INTERVAL_S:
            self.write()

    def step_done(self, step: int, seconds: float, throughput: float | None, replicas: dict[str, str],
                  events: list[dict[str, Any]]) -> None:
        self.step_times = [*self.step_times[-19:], seconds]
        left = self.fields["total_steps"] - step
        self.fields.update(step=step, last_step_s=seconds, throughput=throughput, replicas=replicas, sentinel=events,
                           eta_s=left * statistics.median(self.step_times))
        self.write()

    def finish(self, state: str, error: BaseException | None = None, events: list[dict[str, Any]] | None = None) -> None:
        self.fields.update(state=state, phase=state, phase_started_at=time.time())
        if events is not None:
            self.fields["sentinel"] = events
        if error is not None:
            self.fields["error"] = {"type": type(error).__name__, "message": str(error)[:2000]}
        self.write()

    def write(self) -> None:
        self.fields["updated_at"] = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".status-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(handle, "w") as file:
                json.dump(self.fields, file, default=str)
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def read_status(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The run's ``status.json`` as a dict."""
    return json.loads((Path(run_dir) / STATUS_FILE).read_text())


class StatusObserver(StepObserver):
    """``status.json`` as a step observer (kind ``step_observer``, registered by rlplat): the phase, each step's
    figures and the replicas' health, the sentinel's events (from the ``sentinel`` observer, when there is one)."""

    order = 20

    def start(self, run: ObservedRun) -> None:
        self.run = run
        self.status = RunStatus(run.run_dir, run.total_steps)
        self.status.phase("build_workers")

    def on_phase(self, name: str) -> None:
        self.status.phase(name, self.run.step)

    def events(self) -> list[dict[str, Any]]:
        sentinel = self.run.observers.get("sentinel")
        return list(getattr(sentinel, "recent", ()))

    def on_stage(self, name: str, batch: Any, metrics: dict[str, Any]) -> None:
        if name != "step_end":
            return
        step, groups = self.run.step, self.run.groups
        rollout = groups.get("rollout") or groups.get("actor")
        replicas = [f"rollout/{rank}" for rank in range(rollout.world_size)] if rollout is not None else []
        sentinel = getattr(self.run.observers.get("sentinel"), "sentinel", None)
        health = sentinel.replica_health(step, replicas) if sentinel is not None else {name: "healthy" for name in replicas}
        self.status.step_done(step, metrics["timing_s/step"], metrics.get("perf/throughput"), health, self.events())

    def finish(self, state: str, error: BaseException | None = None) -> None:
        self.status.finish(state, error, self.events())


def observer(run: ObservedRun) -> StatusObserver:
    return StatusObserver()

