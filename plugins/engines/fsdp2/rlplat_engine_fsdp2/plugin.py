"""What rlplat-engine-fsdp2 registers. Only dotted paths: listing plugins imports no torch."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"


@rlplat.hookimpl
def register_engines(register):
    register(
        "fsdp2",
        "rlplat_engine_fsdp2.engine:FSDP2Engine",
        description="PyTorch FSDP2 (fully_shard per decoder layer): policy or value model, gloo on CPU, NCCL on GPU.",
        config_schema="rlplat_engine_fsdp2.config:FSDP2EngineConfig",
        # the plan's estimate without importing the engine (torch); moe: it takes actor.moe (router replay, router losses)
        metadata={"estimate_memory": "rlplat_engine_fsdp2.memory:estimate", "moe": True},
    )
