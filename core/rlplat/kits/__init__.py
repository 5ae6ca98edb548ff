"""The kits: what plugins build their engines, rollouts, estimators and reward managers from.

- :mod:`rlplat.kits.engine`: the learning-rate schedule, micro-batch partitions, weight buckets.
- :mod:`rlplat.kits.rollout_batch`: prompts to token lists and samples back to a batch, pad and EOS ids,
  tied-layer aliases, request batching.
- :mod:`rlplat.kits.rollout_server`: starting, polling and stopping a rollout's HTTP server process.
- :mod:`rlplat.kits.advantages`: shape checks and grouping by ``uid`` for advantage estimators.
- :mod:`rlplat.kits.reward`: where a response's score goes (its last token).
- :mod:`rlplat.kits.aio`: running asyncio code from synchronous code.

The loss kit is :mod:`rlplat.losses` (its name since plugin API 1.0). Kits import the protocol, contracts and
controller, never the config or the trainer (``.importlinter``).
"""
