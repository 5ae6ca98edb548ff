"""Registers the ``sglang`` rollout; imports nothing heavy (sglang is only looked up, not imported)."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"

#: The environments of its own SGLang needs (``rlplat doctor`` reads them through the registry): the pins of the
#: project's constraint files, which tests/cli/test_doctor.py keeps equal to the files.
ENVIRONMENTS = [
    {"backend": "sglang", "constraints": "constraints/sglang.txt",
     "pins": {"sglang": "0.5.23", "torch": "2.14.1", "transformers": "5.19.0"}, "binds": ["torch", "transformers"]},
    # SGLang's CPU engine, recognised by the kernel stand-in only that environment installs
    {"backend": "sglang", "constraints": "constraints/sglang-cpu.txt",
     "pins": {"sglang": "0.5.23", "torch": "2.13.0+cpu", "transformers": "5.19.0", "tokenizers": "0.23.2",
              "setuptools": "84.2.1", "wheel": "0.48.0"},
     "binds": ["torch", "transformers"], "marker": "rlplat-sgl-kernel-cpu",
     "reason": "the SGLang-on-CPU environment (`make sglang-cpu-env`) installs sglang without its CUDA dependency list "
               "(torch 2.14.1, sglang-kernel, flashinfer, ...) beside the project's CPU torch; `pip check` fails there by construction"},
]


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
        metadata={"needs_gpu": "rlplat_rollout_sglang.platform:needs_gpu", "estimate_memory": "rlplat_rollout_sglang.memory:estimate",
                  "environments": ENVIRONMENTS},
        config_schema="rlplat_rollout_sglang.config:SGLangRolloutConfig",
    )
