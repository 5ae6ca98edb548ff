"""Step observers (kind ``step_observer``): what watches a run's steps without changing what they train.

The driver builds one observer per registered entry, in ``order`` (then name): the entry's factory is called
with the run (:class:`ObservedRun`) and returns a :class:`StepObserver`, or None when the run does not use it
(a rollout dump without ``trainer.rollout_dump_dir``). rlplat's own run parts are observers: the sentinel, the
``status.json`` writer, the rollout dump, the trained-prompts log, the profiler (``rlplat plugins list``).

An observer is told, in this order for each step ``run.step``:

``step``          the step begins (before its timeline span): ``batch`` None
``generated``     the step's batch is generated, scored and filtered (or read from a dump)
``prepared``      old log-probs, values and advantages are in, before the updates
``updated``       the updates ran; ``metrics`` holds theirs
``probed``        a sync probe ran after the weight sync: ``batch`` carries its ``meta_info`` only
``trained``       the roles saw the step; ``metrics`` holds the batch's and the roles' metrics
``validation``    a validation batch, generated and then scored (once each)
``step_end``      the step's metrics are complete (timings, validation), before they are logged
``step_done``     the step is logged and, when due, checkpointed (after its timeline span)

and ``on_phase(name)`` whenever the driver enters a timed phase (``gen``, ``reward``, ``update_actor``, ...).
An observer may add to ``metrics`` (they are logged) and may raise to stop the run (the sentinel's ``stop``
policy); it never changes ``batch``. ``finish(state, error)`` ends the run: ``finished``, ``interrupted`` or
``failed`` (with the error).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Optional

if TYPE_CHECKING:
    from rlplat.protocol import DataProto

STAGES = ("step", "generated", "prepared", "updated", "probed", "trained", "validation", "step_end", "step_done")


@dataclasses.dataclass
class ObservedRun:
    """What an observer sees of the run. ``groups`` (role -> worker group) fills in once the workers are built;
    ``step`` is the step being run (0 before the first); ``observers`` (name -> observer) lets one observer
    read another's state (the status file reports the sentinel's events)."""

    config: Any
    """The run's ``DictConfig``."""
    node: dict[str, Any]
    """The run config as plain containers (read a node with :func:`rlplat.read_config_node`)."""
    run_dir: Any
    """The run directory (a ``pathlib.Path``)."""
    total_steps: int
    groups: dict[str, Any] = dataclasses.field(default_factory=dict)
    observers: dict[str, "StepObserver"] = dataclasses.field(default_factory=dict)
    step: int = 0


class StepObserver:
    """Watches a run's steps (see the module docstring); every method does nothing unless overridden."""

    order: ClassVar[int] = 100
    """Lower first; rlplat's sentinel is 10, so observers after it see its metrics and events."""

    def start(self, run: ObservedRun) -> None:
        """The run starts (before its workers are built)."""

    def on_phase(self, name: str) -> None:
        """The driver enters the timed phase ``name`` of step ``run.step``."""

    def on_stage(self, name: str, batch: Optional["DataProto"], metrics: dict[str, Any]) -> None:
        """Stage ``name`` of step ``run.step`` (one of :data:`STAGES`)."""

    def finish(self, state: str, error: Optional[BaseException] = None) -> None:
        """The run ends: ``finished``, ``interrupted`` or ``failed`` (``error``)."""
