"""OpenEnv environments trained by rlplat (distribution rlplat-openenv).

* :mod:`rlplat_openenv.agent` — ``run``, the agent function of the ``blackbox`` loop: one episode of an
  OpenEnv environment per task, the policy's turns stepped as actions, the environment's rewards returned;
* :mod:`rlplat_openenv.server` — an environment's app served on 127.0.0.1 in this process (no container);
* :mod:`rlplat_openenv.arithmetic` — the demo task (``a+b=``, up to 3 attempts) as an OpenEnv environment.

Importing this package imports nothing heavy; OpenEnv loads when a task runs.
"""
