"""The algorithm ``example_median_reinforce``: which estimator and loss, and its defaults.

Everything else (the actor loss around the policy loss, the KL terms, the loop) is rlplat's default,
:class:`rlplat.Algorithm`'s. Torch-free.
"""

from __future__ import annotations

from rlplat import Algorithm


def median_reinforce() -> Algorithm:
    """Group-median baseline, truncated-IS REINFORCE, every response weighted alike; no critic, no KL
    (so no reference model)."""
    return Algorithm(
        name="example_median_reinforce",
        adv_estimator="example_group_median",
        policy_loss="example_truncated_is",
        default_config={"actor": {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": False}},
        description="Group-median baseline with truncated-importance-weight REINFORCE; no critic, no reference.",
    )
