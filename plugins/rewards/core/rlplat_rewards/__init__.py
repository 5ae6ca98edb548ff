"""rlplat-rewards: rule-based reward scorers (gsm8k, math, a user's function) and reward managers
(naive, batch, dapo). Registered through the ``rlplat`` entry point (see :mod:`rlplat_rewards.plugin`)."""
