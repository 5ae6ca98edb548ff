"""The run sentinel: faults that would otherwise train silently, reported by name within two steps.

The checks (``trainer.sentinel``, on by default; each cheap next to a step):

* ``weight_sync``: a step's rows were sampled from an older policy version than the trainer synced (a skipped
  or lost weight sync); the driver reads each row's ``policy_version``.
* ``weight_checksum``: after a sync, a tensor the rollout holds differs from what was sent (the worker
  compares fingerprints, :mod:`rlplat.kits.weights`, when the rollout offers them).
* ``policy_version``: the rollout sampled from a version whose apply it never acknowledged (a version counter
  bumped without the weights).
* ``replica``: a rollout engine restarted since its last acknowledged sync (``RolloutEngine.instance_id``) and
  held stale weights; the worker refreshed it from the actor before it served (one that cannot be refreshed in
  its process refuses to serve: ``StaleReplicaError``).
* ``scorer``: a reward scorer overran its deadline and was killed (the reward manager's event).
* ``template``: a multi-turn chat template's rendering drifted from what was sampled (the agent driver's event).
* ``non_finite``: NaN or Inf in the advantages, or in a loss or gradient norm of an update.
* ``collapse``: the policy's entropy or mean response length fell below a fraction of its value over the
  run's first steps (a warning by default).
* ``sync_probe``: :mod:`rlplat.trainer.sync_probe`'s log-prob comparison (raised by the probe itself).

Components far from the driver report through health events (:mod:`rlplat.contracts.health`); the sentinel
turns each into its named :class:`~rlplat.contracts.health.RunHealthError` and applies
``trainer.sentinel.policy``: ``stop`` raises it (the step's work is not saved; checkpoints already written
stay), ``warn`` logs it and goes on, ``off`` ignores it. Every event is counted in ``sentinel/<check>`` and
kept for ``status.json`` (:mod:`rlplat.trainer.status`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import numbers
import time
from typing import Any, Dict, Mapping

from rlplat.contracts.health import HEALTH_EVENTS, CollapseWarning, NonFiniteError, RunHealthError, WeightSyncSkippedError, health_events
from rlplat.contracts.observer import ObservedRun, StepObserver

log = logging.getLogger("rlplat.sentinel")

POLICIES = ("stop", "warn", "off")

#: check -> what the sentinel does by default.
DEFAULT_POLICY: dict[str, str] = {
    "weight_sync": "stop", "weight_checksum": "stop", "policy_version": "stop", "replica": "warn", "scorer": "warn",
    "template": "warn", "non_finite": "stop", "collapse": "warn", "sync_probe": "stop",
}


@dataclasses.dataclass
class SentinelConfig:
    """The ``trainer.sentinel`` node."""

    enabled: bool = True
    """Run the checks (see :mod:`rlplat.trainer.sentinel`)."""
    policy: Dict[str, str] = dataclasses.field(default_factory=dict)
    """Check -> ``stop``, ``warn`` or ``off``, over the defaults: stop on ``weight_sync``, ``weight_checksum``,
    ``policy_version``, ``non_finite`` and ``sync_probe``; warn on ``replica`` (a restarted replica, refreshed
    before it served), ``scorer``, ``template`` and ``collapse``."""
    weight_checks: bool = True
    """Fingerprint every weight sync (one extra read of the weights on each side)."""
    collapse_ratio: float = 0.05
    """``collapse``: warn when ``actor/entropy`` or ``response_length/mean`` falls below this fraction of its
    largest value over the run's first ``baseline_steps`` steps."""
    baseline_steps: int = 3
    """Steps whose values set the ``collapse`` baseline."""
    events_kept: int = 20
    """The last events ``status.json`` shows."""

    def __post_init__(self) -> None:
        # YAML reads an unquoted `off` as false
        self.policy = {check: "off" if action in (False, "False", "false") else action for check, action in self.policy.items()}
        unknown = sorted(set(self.policy) - set(DEFAULT_POLICY))
        bad = {check: action for check, action in self.policy.items() if action not in POLICIES}
        if unknown or bad:
            raise ValueError(
                (f"unknown checks {unknown} (the checks: {', '.join(DEFAULT_POLICY)}); " if unknown else "")
                + (f"policies must be one of {', '.join(POLICIES)}, got {bad}" if bad else ""))
        if not 0 <= self.collapse_ratio < 1 or self.baseline_steps < 1 or self.events_kept < 0:
            raise ValueError(f"collapse_ratio must be in [0, 1), baseline_steps >= 1 and events_kept >= 0; got "
                             f"{self.collapse_ratio}, {self.baseline_steps}, {self.events_kept}")


#: The update metrics whose non-finite value is a ``non_finite`` fault (suffixes of ``actor/`` and ``critic/``).
WATCHED_UPDATE_METRICS = ("loss", "pg_loss", "vf_loss", "grad_norm", "kl_loss", "entropy_loss")
COLLAPSE_METRICS = ("actor/entropy", "response_length/mean")


class Sentinel:
    """Applies the checks and the policy of one run (see the module docstring)."""

    def __init__(self, settings: SentinelConfig):
        self.settings = settings
        self.policy = {**DEFAULT_POLICY, **settings.policy}
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=settings.events_kept)
        self.counts: collections.Counter[str] = collections.Counter()
        self.baseline: dict[str, list[float]] = {}
        self.suspects: dict[str, tuple[int, str]] = {}  # "role/rank" -> (step, state) of its last weight or version fault

    def report(self, error: RunHealthError) -> None:
        """Apply the policy of ``error.check`` to ``error``: raise it, log it, or ignore it."""
        action = self.policy.get(error.check, "stop") if self.settings.enabled else "off"
        if action == "off":
            return
        self.counts[error.check] += 1
        self.recent.append({"time": time.time(), "step": error.step, "check": error.check, "error": type(error).__name__,
                            "action": action, "message": str(error), "role": error.role, "rank": error.rank,
                            "figures": error.figures})
        if error.check in ("weight_sync", "weight_checksum", "policy_version", "replica") and error.rank is not None:
            state = "stale" if error.check == "replica" else "suspect"
            self.suspects[f"{error.role}/{error.rank}"] = (error.step if error.step is not None else -1, state)
        if action == "stop":
            raise error
        log.warning("%s: %s", type(error).__name__, error)

    def take_events(self, meta_info: dict[str, Any], step: int) -> None:
        """Report (and remove) the health events a batch carries in ``meta_info``."""
        events = health_events(meta_info)
        meta_info.pop(HEALTH_EVENTS, None)
        for event in events:
            self.report(event.error(step))

    def check_versions(self, versions: Any, step: int, lag: int) -> None:
        """``weight_sync``: every row of step ``step`` sampled from version ``step - 1 - lag`` or later
        (``versions``: each row's oldest ``policy_version``; ``lag``: the staleness the mode allows)."""
        if not self.settings.enabled or versions is None or len(versions) == 0:
            return
        oldest, expected = int(versions.min()), step - 1 - lag
        if oldest < expected:
            self.report(WeightSyncSkippedError(
                f"rows of this step were sampled from policy version {oldest}, but the trainer had synced version "
                f"{step - 1}{f' (staleness allows {expected})' if lag else ''}: a weight sync did not reach the rollout",
                step=step, role="rollout", figures={"oldest_version": oldest, "expected_at_least": expected,
                                                    "stale_rows": int((versions < expected).sum())}))

    def check_advantages(self, advantages: Any, mask: Any, step: int) -> None:
        """``non_finite``: NaN or Inf among the advantages of valid response tokens."""
        if not self.settings.enabled:
            return
        import torch

        bad = ~torch.isfinite(advantages) & mask.bool()
        if bool(bad.any()):
            rows = bad.any(-1).nonzero().flatten().tolist()
            self.report(NonFiniteError(f"{int(bad.sum())} advantages of valid tokens are NaN or Inf (rows {rows[:8]})",
                                       step=step, role="driver", figures={"tokens": int(bad.sum()), "rows": rows[:32]}))

    def check_update(self, metrics: Mapping[str, Any], step: int) -> None:
        """``non_finite`` in an update's losses or gradient norms (a value, or one per rank)."""
        if not self.settings.enabled:
            return
        watched = {name: _numbers(value) for name, value in metrics.items()
                   if name.split("/", 1)[0] in ("actor", "critic") and name.rsplit("/", 1)[-1] in WATCHED_UPDATE_METRICS}
        bad = {name: values for name, values in watched.items() if not all(math.isfinite(v) for v in values)}
        if bad:
            self.report(NonFiniteError(f"non-finite update metrics: {bad}", step=step,
                                       role="critic" if all(name.startswith("critic/") for name in bad) else "actor",
                                       figures=bad))

    def check_collapse(self, metrics: Mapping[str, Any], step: int) -> None:
        """``collapse`` of the entropy or the mean response length (see :class:`SentinelConfig`)."""
        if not self.settings.enabled:
            return
        for name in COLLAPSE_METRICS:
            values = _numbers(metrics.get(name))
            if not values or not all(math.isfinite(v) for v in values):
                continue
            value = sum(values) / len(values)
            seen = self.baseline.setdefault(name, [])
            if len(seen) < self.settings.baseline_steps:
                seen.append(value)
                continue
            bound = self.settings.collapse_ratio * max(seen)
            if value < bound:
                self.report(CollapseWarning(f"{name} is {value:.4g}, below {self.settings.collapse_ratio:g} x its early "
                                            f"value {max(seen):.4g}", step=step, role="actor",
                                            figures={"metric": name, "value": value, "baseline": max(seen)}))

    def step_metrics(self) -> dict[str, float]:
        """``sentinel/events`` and ``sentinel/<check>`` since the last call (then reset)."""
        metrics = {f"sentinel/{check}": float(count) for check, count in self.counts.items()}
        metrics["sentinel/events"] = float(sum(self.counts.values()))
        self.counts.clear()
        return metrics

    def replica_health(self, step: int, replicas: list[str]) -> dict[str, str]:
        """Per ``role/rank``: ``healthy``; ``suspect`` (a weight or version fault in the last two steps); ``stale``
        (restarted with stale weights in the last two steps, refreshed before it served)."""
        return {name: self.suspects[name][1] if name in self.suspects and step - self.suspects[name][0] <= 2 else "healthy"
                for name in replicas}


class SentinelObserver(StepObserver):
    """The sentinel as a step observer (kind ``step_observer``, registered by rlplat): it takes each batch's
    health events and runs its checks at the stages of every step, and adds ``sentinel/*`` to the step's metrics."""

    order = 10

    def __init__(self, run: ObservedRun):
        from rlplat.config.modes import AsyncSettings
        from rlplat.config_node import read_config_node

        self.run = run
        self.sentinel = Sentinel(read_config_node(run.node["trainer"]["sentinel"], SentinelConfig, "trainer.sentinel"))
        settings = AsyncSettings.of(run.config.trainer)
        self.lag = settings.max_staleness if settings.asynchronous else 0

    @property
    def recent(self) -> list[dict[str, Any]]:
        """The events kept for ``status.json`` and the profile's trace."""
        return list(self.sentinel.recent)

    def on_stage(self, name: str, batch: Any, metrics: dict[str, Any]) -> None:
        step = self.run.step
        if name == "generated":
            self.sentinel.take_events(batch.meta_info, step)
            if "policy_version" in batch.batch.keys():
                from rlplat.trainer.pipeline import row_versions

                self.sentinel.check_versions(row_versions(batch), step, self.lag)
        elif name in ("probed", "validation"):
            self.sentinel.take_events(batch.meta_info, step)
        elif name == "prepared":
            self.sentinel.check_advantages(batch.batch["advantages"], batch.batch["response_mask"], step)
        elif name == "updated":
            self.sentinel.check_update(metrics, step)
        elif name == "trained":
            self.sentinel.check_collapse(metrics, step)
        elif name == "step_end":
            metrics.update(self.sentinel.step_metrics())


def observer(run: ObservedRun) -> SentinelObserver:
    return SentinelObserver(run)


def _numbers(value: Any) -> list[float]:
    """A metric's value as floats: a number, or a list of numbers (one per rank); [] for anything else."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [float(v) for v in values if isinstance(v, numbers.Real) and not isinstance(v, bool)]
