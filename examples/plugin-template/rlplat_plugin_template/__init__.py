"""A template rlplat plugin: the reward scorer ``example_exact_match``, the advantage estimator
``example_group_median``, the policy loss ``example_truncated_is`` and the algorithm
``example_median_reinforce`` that uses both (see ``plugin.py`` for how they are registered)."""
