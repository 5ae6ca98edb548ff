"""The old home of the memory plan, until plugin API 1.4: the planner is the command line's
(:mod:`rlplat.cli.planner`), the memory types are the contracts' (:mod:`rlplat.contracts.memory`) and the
estimate helpers the memory kit (:mod:`rlplat.kits.memory`). Each old name here warns and resolves there;
``rlplat.plan.planner`` and ``rlplat.plan.estimate`` import as those modules (:mod:`rlplat.deprecation`)."""

from rlplat.deprecation import Deprecated, deprecated_names

_MOVED = {
    **{name: "rlplat.contracts.memory" for name in ("CALLS", "MemoryContext", "MemoryEstimate", "MemoryItem", "ModelShape")},
    **{name: "rlplat.cli.planner" for name in ("MEMORY_CHECKS", "PHASES", "PlanError", "RunPlan", "plan_run")},
    "human_bytes": "rlplat.kits.memory",
}

__getattr__ = deprecated_names(__name__, {name: Deprecated(f"{module}:{name}", "1.4") for name, module in _MOVED.items()})
