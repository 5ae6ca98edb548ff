"""The asynchronous modes' keys of the ``trainer`` node (``trainer.mode``, ``max_staleness``,
``staleness_policy``, ``rollout_ahead``, ``rollout_dispatch``, ``partial_rollout``): their values, how they fit
the placement and the rollout, and :class:`AsyncSettings`, what the driver's pipeline
(:mod:`rlplat.trainer.pipeline`) and the rollout role read of them. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MODES = ("sync", "colocate_async", "separate_async")
POLICIES = ("wait", "drop")
DISPATCHES = ("split", "replica")
PARTIAL_MODES = ("off", "keep", "recompute")


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    mode: str
    max_staleness: int
    policy: str
    ahead: int

    @classmethod
    def of(cls, trainer: Any) -> "AsyncSettings":
        """The settings of ``trainer``; in ``sync`` mode nothing runs ahead and the bound is 0 (a buffer
        restored from an asynchronous run's checkpoint is trained first, regenerated where stale)."""
        if trainer.mode == "sync":
            return cls("sync", 0, "wait", 0)
        ahead = trainer.rollout_ahead if trainer.rollout_ahead is not None else trainer.max_staleness + 1
        return cls(trainer.mode, int(trainer.max_staleness), trainer.staleness_policy, int(ahead))

    @property
    def asynchronous(self) -> bool:
        return self.mode != "sync"


def check_trainer_mode(config: Any) -> None:
    """The ``trainer.mode`` keys and how they fit the placement; raises :class:`ConfigError`."""
    from rlplat.config_node import ConfigError, did_you_mean

    trainer = config.trainer
    if trainer.mode not in MODES:
        raise ConfigError(f"trainer.mode must be one of {', '.join(MODES)}, got {trainer.mode!r}.{did_you_mean(str(trainer.mode), MODES)}")
    if isinstance(trainer.max_staleness, bool) or not isinstance(trainer.max_staleness, int) or trainer.max_staleness < 0:
        raise ConfigError(f"trainer.max_staleness must be an int >= 0 (policy versions), got {trainer.max_staleness!r}.")
    if trainer.staleness_policy not in POLICIES:
        raise ConfigError(f"trainer.staleness_policy must be wait or drop, got {trainer.staleness_policy!r}.")
    ahead = trainer.rollout_ahead
    if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1):
        raise ConfigError(f"trainer.rollout_ahead must be an int >= 1 or null (max_staleness + 1), got {ahead!r}.")
    if ahead is not None and trainer.staleness_policy == "wait" and ahead > trainer.max_staleness + 1:
        raise ConfigError(
            f"trainer.rollout_ahead={ahead} with trainer.staleness_policy=wait: a generation started {ahead} steps "
            f"ahead would be trained {ahead - 1} versions stale, beyond trainer.max_staleness={trainer.max_staleness}; "
            "lower rollout_ahead, raise max_staleness, or set staleness_policy=drop (stale samples are then generated again)."
        )
    given = ((config.get("roles") or {}).get("rollout") or {}).get("placement")
    if trainer.mode == "separate_async":
        if config.cluster.backend != "ray":
            raise ConfigError("trainer.mode=separate_async gives the rollout a resource pool of its own, which needs "
                              "cluster.backend=ray (the local backend has one process); use colocate_async or sync.")
        if given == "colocated":
            raise ConfigError("trainer.mode=separate_async runs the rollout in a pool of its own, but "
                              "roles.rollout.placement=colocated; drop that key or use trainer.mode=colocate_async.")
    if trainer.rollout_dispatch not in DISPATCHES:
        raise ConfigError(f"trainer.rollout_dispatch must be split or replica, got {trainer.rollout_dispatch!r}.")
    if trainer.rollout_dispatch == "replica" and trainer.mode != "separate_async":
        raise ConfigError("trainer.rollout_dispatch=replica runs whole generations on single processes of the rollout's own "
                          "pool, which only trainer.mode=separate_async has.")
    if trainer.mode == "colocate_async" and given == "separate":
        raise ConfigError("trainer.mode=colocate_async keeps the rollout in the actor's processes, but "
                          "roles.rollout.placement=separate; use trainer.mode=separate_async.")
    check_partial_rollout(config)


def partial_mode(trainer: Any) -> str:
    """``trainer.partial_rollout`` as a mode name: ``off`` also when YAML read it as the boolean false (which
    the typed node then holds as ``"False"``)."""
    value = trainer.get("partial_rollout", "off")
    return "off" if value in (None, False, "False", "false") else value


def check_partial_rollout(config: Any) -> None:
    """``trainer.partial_rollout``: a known mode, with ``separate_async`` and a rollout that can do it."""
    from rlplat import registry
    from rlplat.config_node import ConfigError

    trainer = config.trainer
    mode = partial_mode(trainer)
    if mode not in PARTIAL_MODES:
        raise ConfigError(f"trainer.partial_rollout must be one of {', '.join(PARTIAL_MODES)}, got {mode!r}.")
    if mode == "off":
        return
    if trainer.mode != "separate_async":
        why = ("its generations run in the actor's processes, which run one call at a time: a weight update never "
               "lands during a generation" if trainer.mode == "colocate_async" else "nothing generates while the weights change")
        raise ConfigError(f"trainer.partial_rollout={mode} carries generations in flight over weight updates, which only "
                          f"trainer.mode=separate_async has; with trainer.mode={trainer.mode} {why}. Set "
                          "trainer.mode=separate_async or trainer.partial_rollout=off.")
    if config.rollout.get("free_between_phases"):
        raise ConfigError(f"trainer.partial_rollout={mode} with rollout.free_between_phases=true: a rollout that frees its "
                          "weights after each generation drops the generations in flight; set rollout.free_between_phases=false.")
    try:
        rollout = registry.get("rollout", config.rollout.name)
    except Exception:  # an unknown rollout is named by the config check of rollout.name
        return
    modes = tuple(getattr(rollout, "partial_rollout_modes", ()) or ())
    if mode not in modes:
        can = f"it can do {', '.join(modes)}" if modes else "it cannot carry generations over new weights at all"
        raise ConfigError(f"trainer.partial_rollout={mode}: rollout {config.rollout.name!r} does not list {mode!r} in its "
                          f"partial_rollout_modes ({can}); use " + (f"trainer.partial_rollout={modes[0]}, " if modes else "")
                          + "trainer.partial_rollout=off or a rollout that can (hf: keep, recompute).")
