"""Registers the ``vllm`` rollout; imports nothing heavy (vllm is only looked up, not imported)."""

import rlplat


@rlplat.hookimpl
def register_rollouts(register):
    register(
        "vllm",
        "rlplat_rollout_vllm.rollout:VLLMRollout",
        description="vLLM 0.33 generation: in-process beside the training engine (hybrid) or an HTTP server",
        requires=("vllm",),
        install_hint="pip install 'rlplat-rollout-vllm[vllm]'; vllm pins torch 2.14.0, so give it an environment of its own",
        metadata={"needs_gpu": True, "estimate_memory": "rlplat_rollout_vllm.memory:estimate"},  # the plan's estimate without importing the rollout
        config_schema="rlplat_rollout_vllm.config:VLLMRolloutConfig",
    )
