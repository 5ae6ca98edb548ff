"""Registers the ``hf`` rollout; imports nothing heavy."""

import rlplat


@rlplat.hookimpl
def register_rollouts(register):
    register(
        "hf",
        "rlplat_rollout_hf.rollout:HFRollout",
        description="transformers generation with a KV cache (CPU or one GPU per worker)",
        config_schema="rlplat_rollout_hf.config:HFRolloutConfig",
    )
