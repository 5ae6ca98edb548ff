"""Registers the ``sglang`` rollout; imports nothing heavy (sglang is only looked up, not imported)."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"


@rlplat.hookimpl
def register_rollouts(register):
    register(
        "sglang",
        "rlplat_rollout_sglang.rollout:SGLangRollout",
        description="SGLang 0.5.23 generation: in-process beside the training engine (hybrid) or an HTTP server",
        requires=("sglang",),
        install_hint="pip install 'rlplat-rollout-sglang[sglang]'; sglang pins torch 2.14.1, so give it an environment of its own",
        metadata={"needs_gpu": True, "estimate_memory": "rlplat_rollout_sglang.memory:estimate"},  # the plan's estimate without importing the rollout
        config_schema="rlplat_rollout_sglang.config:SGLangRolloutConfig",
    )
