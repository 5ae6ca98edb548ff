"""What rlplat-demo registers: the demo's presets (kind ``preset``; ``arith`` is the default, every one
implies GRPO) and the tool demo's scorer ``tool_demo``. Dotted paths only: listing plugins imports no
torch and reads no asset."""

import rlplat

from rlplat_demo import DEFAULT_PRESET, PRESETS

RLPLAT_PLUGIN_API = ">=1.2,<2"


@rlplat.hookimpl
def register_presets(register):
    for name, description in PRESETS.items():
        metadata = {"algorithm": "grpo", **({"default": True} if name == DEFAULT_PRESET else {})}
        register(name, f"rlplat_demo.presets:{name.replace('-', '_')}", description=description, metadata=metadata)


@rlplat.hookimpl
def register_reward_scorers(register):
    register("tool_demo", "rlplat_demo.tools:score", metadata={"data_sources": ["arith_tools", "arith_chat"]},
             description="the tool demo's tasks: the answer after the last tool response or feedback equals the ground truth.")
