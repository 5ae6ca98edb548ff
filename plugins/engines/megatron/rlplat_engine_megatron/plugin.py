"""What rlplat-engine-megatron registers. Only dotted paths: listing plugins imports no torch or megatron."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"


@rlplat.hookimpl
def register_engines(register):
    register(
        "megatron",
        "rlplat_engine_megatron.engine:MegatronEngine",
        description="megatron-core GPT model (tensor, pipeline, expert, data parallel; distributed optimizer), HF Qwen2/Llama "
                    "and Qwen2-MoE/Qwen3-MoE/Mixtral via mbridge; gloo on CPU, NCCL on GPU.",
        config_schema="rlplat_engine_megatron.config:MegatronEngineConfig",
        # the plan's estimate without importing the engine (torch); moe: it takes actor.moe (router replay, router losses)
        metadata={"estimate_memory": "rlplat_engine_megatron.memory:estimate", "moe": True},
    )
