"""The contracts plugins implement, one module per kind, each importing torch only for type checking.

Names are resolved lazily, so ``from rlplat.contracts import TrainingEngine`` imports nothing heavy:

* :mod:`~rlplat.contracts.engine`: ``TrainingEngine``, ``EngineBuildConfig``, ``LossFunction``,
  ``DataParallelInfo``
* :mod:`~rlplat.contracts.rollout`: ``RolloutEngine``, ``RolloutBuildConfig``, ``SamplingParams``,
  ``TokenOutput``, ``Fingerprint``
* :mod:`~rlplat.contracts.memory` (the memory plan's types, what ``estimate_memory`` and a role's
  ``metadata["plan"]`` return): ``MemoryEstimate``, ``MemoryContext``, ``MemoryItem``, ``ModelShape``,
  ``PlannedComponent``
* :mod:`~rlplat.contracts.reward`: ``RewardManager``, ``RewardScorer``, ``JudgeParser``, ``split_score``
* :mod:`~rlplat.contracts.algorithm`: ``Algorithm``, ``AlgorithmConfig``, ``KLControlConfig``,
  ``AdvantageEstimator``, ``PolicyLoss``
* :mod:`~rlplat.contracts.role`: ``Role``, ``RoleConfig``, ``RunContext``, ``STAGES``
* :mod:`~rlplat.contracts.agent`: ``AgentLoop``, ``AgentLoopConfig``, ``AgentContext``, ``Trajectory``,
  ``TokenClient``, ``Tool``, ``ToolConfig``, ``ToolResult``, ``ToolCall``,
  ``ToolCallParser``, ``ParsedTurn``, ``Environment``, ``EnvStep``
* :mod:`~rlplat.contracts.health`: ``RunHealthError`` and its named faults, ``HealthEvent``
* :mod:`~rlplat.contracts.observer`: ``StepObserver``, ``ObservedRun``
"""

from __future__ import annotations

from rlplat.deprecation import Deprecated, deprecated_names
from rlplat.lazy_names import lazy_names


_LAZY_NAMES: dict[str, str] = {
    **dict.fromkeys(("TrainingEngine", "EngineBuildConfig", "LossFunction", "DataParallelInfo"), "rlplat.contracts.engine"),
    **dict.fromkeys(("RolloutEngine", "RolloutBuildConfig", "SamplingParams", "TokenOutput", "Fingerprint"),
                    "rlplat.contracts.rollout"),
    **dict.fromkeys(("MemoryEstimate", "MemoryContext", "MemoryItem", "ModelShape", "PlannedComponent"), "rlplat.contracts.memory"),
    **dict.fromkeys(("RewardManager", "RewardScorer", "JudgeParser", "split_score"), "rlplat.contracts.reward"),
    **dict.fromkeys(("Algorithm", "AlgorithmConfig", "KLControlConfig", "AdvantageEstimator", "PolicyLoss"),
                    "rlplat.contracts.algorithm"),
    **dict.fromkeys(("Role", "RoleConfig", "RunContext", "STAGES"), "rlplat.contracts.role"),
    **dict.fromkeys(("AgentLoop", "AgentLoopConfig", "AgentContext", "Trajectory", "TokenClient",
                     "Tool", "ToolConfig", "ToolResult", "ToolCall", "ToolCallParser", "ParsedTurn", "Environment",
                     "EnvStep"), "rlplat.contracts.agent"),
    **dict.fromkeys(("StepObserver", "ObservedRun"), "rlplat.contracts.observer"),
    **dict.fromkeys(("RunHealthError", "HealthEvent", "WeightSyncSkippedError", "WeightCorruptedError",
                     "StaleReplicaError", "PolicyVersionError", "ScorerHungError", "TemplateDriftError",
                     "NonFiniteError", "CollapseWarning"), "rlplat.contracts.health"),
}

__all__ = sorted(_LAZY_NAMES)

_lazy_getattr, __dir__ = lazy_names('rlplat.contracts', _LAZY_NAMES, globals())
# a helper, not a contract: the agent kit's since plugin API 1.3
__getattr__ = deprecated_names(__name__, {"TrajectoryBuilder": Deprecated("rlplat.kits.agent:TrajectoryBuilder", "1.4")},
                               _lazy_getattr)
