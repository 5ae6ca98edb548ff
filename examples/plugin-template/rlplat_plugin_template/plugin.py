"""Hook implementations: what this plugin registers. Kept free of heavy imports."""

import rlplat


@rlplat.hookimpl
def register_reward_scorers(register):
    register(
        "example_exact_match",
        "rlplat_plugin_template.scorer:exact_match",
        description="1.0 when the response equals the ground truth (case and surrounding space ignored).",
    )
