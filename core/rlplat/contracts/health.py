"""Run health: the named faults a run's sentinel reports (:mod:`rlplat.trainer.sentinel`), and how any part of a
run (a worker, a rollout, a reward manager) reports one.

A fault is a :class:`RunHealthError` subclass, one per check, carrying the step, role, rank and the figures
that show it. A component that notices a fault where raising would lose the step's work (a scorer killed at
its deadline, a replica found stale) does not raise: it records a :class:`HealthEvent` in its output's
``meta_info["health_events"]`` (a list of plain dicts, :meth:`HealthEvent.as_dict`), and the sentinel in the
driver turns it into the named error or a warning per ``trainer.sentinel.policy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

HEALTH_EVENTS = "health_events"
"""The ``meta_info`` key under which a batch carries :class:`HealthEvent` dicts to the driver (``DataProto.concat``
joins them: ``rlplat.protocol.values.HEALTH_EVENTS_KEY``, the same string, kept there so this module imports no torch)."""


class RunHealthError(RuntimeError):
    """A fault of a running run. ``check`` names the sentinel check (the key of ``trainer.sentinel.policy``)."""

    check = "health"

    def __init__(self, message: str, *, step: int | None = None, role: str | None = None, rank: int | None = None,
                 figures: Mapping[str, Any] | None = None):
        where = ", ".join(f"{name} {value}" for name, value in (("step", step), ("role", role), ("rank", rank))
                          if value is not None)
        super().__init__(f"{self.check}: {message}" + (f" ({where})" if where else ""))
        self.step, self.role, self.rank = step, role, rank
        self.figures = dict(figures or {})


class WeightSyncSkippedError(RunHealthError):
    """The rollout sampled a step from a policy version other than the one the trainer synced to it."""

    check = "weight_sync"


class WeightCorruptedError(RunHealthError):
    """A tensor the rollout holds after a weight sync differs from the one the trainer sent."""

    check = "weight_checksum"


class StaleReplicaError(RunHealthError):
    """A rollout replica serves (or was asked to serve) weights older than the trainer's after a restart."""

    check = "replica"


class PolicyVersionError(RunHealthError):
    """A policy version was counted as applied without the rollout acknowledging the weights."""

    check = "policy_version"


class ScorerHungError(RunHealthError):
    """A reward scorer overran its deadline and had to be killed (or could not be)."""

    check = "scorer"


class TemplateDriftError(RunHealthError):
    """A multi-turn chat template's rendering of a history is no longer a prefix of what was sampled."""

    check = "template"


class NonFiniteError(RunHealthError):
    """NaN or Inf in the loss, the gradients or the advantages."""

    check = "non_finite"


class CollapseWarning(RunHealthError):
    """The policy's entropy or its response length fell beyond the configured bound (a warning by default)."""

    check = "collapse"


#: check name -> its error class (what :class:`HealthEvent` dicts name).
HEALTH_ERRORS: dict[str, type[RunHealthError]] = {
    cls.check: cls for cls in (WeightSyncSkippedError, WeightCorruptedError, StaleReplicaError, PolicyVersionError,
                               ScorerHungError, TemplateDriftError, NonFiniteError, CollapseWarning)
}


@dataclasses.dataclass
class HealthEvent:
    """One fault a component noticed without raising; see the module docstring."""

    check: str
    message: str
    role: str | None = None
    rank: int | None = None
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def error(self, step: int | None = None) -> RunHealthError:
        """The named error of this event at ``step``."""
        cls = HEALTH_ERRORS.get(self.check, RunHealthError)
        return cls(self.message, step=step, role=self.role, rank=self.rank, figures=self.figures)


def health_events(meta_info: Mapping[str, Any]) -> list[HealthEvent]:
    """The :class:`HealthEvent` records in a batch's ``meta_info`` (see :data:`HEALTH_EVENTS`)."""
    return [HealthEvent(**event) for event in meta_info.get(HEALTH_EVENTS) or ()]
