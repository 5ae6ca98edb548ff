"""Registers the ``hf`` rollout; imports nothing heavy."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"


@rlplat.hookimpl
def register_rollouts(register):
    register(
        "hf",
        "rlplat_rollout_hf.rollout:HFRollout",
        description="transformers generation with a KV cache (CPU or one GPU per worker)",
        config_schema="rlplat_rollout_hf.config:HFRolloutConfig",
        # the plan's estimate without importing the rollout (torch); records_routes: MoE routes for router replay r3
        metadata={"estimate_memory": "rlplat_rollout_hf.memory:estimate", "records_routes": True},
    )
