"""``rlplat plan``: the memory and placement of a run, predicted per device and per phase before anything
starts, from the config and the models' ``config.json`` alone.

* :mod:`rlplat.plan.estimate`: what an engine's or rollout's ``estimate_memory`` returns
  (:class:`MemoryEstimate` of :class:`MemoryItem`), the :class:`MemoryContext` it receives and the
  model shapes (:class:`ModelShape`) read from ``config.json``. No torch.
* :mod:`rlplat.plan.planner`: :func:`plan_run` (the :class:`RunPlan` of a resolved config: pools,
  components, bytes per phase, the peak and what sets it, the problems that refuse a run).
* :mod:`rlplat.testing.memory`: :class:`TensorMemoryMeter`, live tensor bytes measured on CPU.
"""

from rlplat.plan.estimate import CALLS, MemoryContext, MemoryEstimate, MemoryItem, ModelShape, human_bytes
from rlplat.plan.planner import MEMORY_CHECKS, PHASES, PlanError, RunPlan, plan_run

__all__ = ["CALLS", "PHASES", "MEMORY_CHECKS", "MemoryContext", "MemoryEstimate", "MemoryItem", "ModelShape", "PlanError",
           "RunPlan", "human_bytes", "plan_run"]
