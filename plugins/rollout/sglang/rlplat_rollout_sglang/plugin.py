"""Registers the ``sglang`` rollout; imports nothing heavy (sglang is only looked up, not imported)."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"


@rlplat.hookimpl
def register_rollouts(register):
    register(
        "sglang",
        "rlplat_rollout_sglang.rollout:SGLangRollout",
        description="SGLang 0.5.23 generation (on GPUs, or its CPU engine): beside the training engine (hybrid) or an HTTP server",
        requires=("sglang",),
        install_hint="pip install 'rlplat-rollout-sglang[sglang]' (GPUs; sglang pins torch 2.14.1) in an environment of its own; "
                     "on CPUs, `make sglang-cpu-env` builds one (.venv-sglang-cpu)",
        # needs a GPU unless SGLang runs its CPU engine here; the plan's estimate without importing the rollout
        metadata={"needs_gpu": "rlplat_rollout_sglang.platform:needs_gpu", "estimate_memory": "rlplat_rollout_sglang.memory:estimate"},
        config_schema="rlplat_rollout_sglang.config:SGLangRolloutConfig",
    )
