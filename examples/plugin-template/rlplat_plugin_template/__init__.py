"""A template rlplat plugin providing the reward scorer ``example_exact_match``."""
