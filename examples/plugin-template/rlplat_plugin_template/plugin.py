"""Hook implementations: what this plugin registers. Dotted paths only, so that listing plugins
(`rlplat plugins list`) imports no torch: a module is imported when its entry is first used."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"

PACKAGE = "rlplat_plugin_template"


@rlplat.hookimpl
def register_reward_scorers(register):
    register(
        "example_exact_match",
        f"{PACKAGE}.scorer:exact_match",
        description="1.0 when the response equals the ground truth (case and surrounding space ignored).",
    )


@rlplat.hookimpl
def register_advantage_estimators(register):
    register(
        "example_group_median",
        f"{PACKAGE}.estimators:group_median",
        description="Outcome score minus the median score of its group.",
    )


@rlplat.hookimpl
def register_policy_losses(register):
    register(
        "example_truncated_is",
        f"{PACKAGE}.policy_losses:truncated_is",
        description="REINFORCE with a detached importance weight truncated at ratio_cap.",
        config_schema=f"{PACKAGE}.config:TruncatedISConfig",
    )


@rlplat.hookimpl
def register_algorithms(register):
    register(
        "example_median_reinforce",
        f"{PACKAGE}.specs:median_reinforce",
        description="Group-median baseline with truncated-IS REINFORCE; no critic, no reference model.",
    )
