"""verifiers environments trained by rlplat (distribution rlplat-verifiers).

* :mod:`rlplat_verifiers.agent` — ``run``, the agent function of the ``blackbox`` loop: a verifiers
  environment's rollout and rubric per task, against the rollout worker's gateway;
* :mod:`rlplat_verifiers.arithmetic` — the demo task (``a+b=``) as a ``vf.SingleTurnEnv`` with a ``vf.Rubric``.

Importing this package imports nothing heavy; verifiers loads when a task runs.
"""
