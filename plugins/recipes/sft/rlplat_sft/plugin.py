"""What rlplat-sft registers: the ``rlplat sft`` command. Dotted paths only: listing plugins imports no
torch.

The command's metadata tells ``rlplat export`` how to read the runs it writes: ``run_config``, the
dataclass of its resolved config (the export recognises an SFT run by its nodes), and ``engine_node``,
the function that builds the actor engine's build config from such a config and a step count.
"""

import rlplat

RLPLAT_PLUGIN_API = ">=1.2,<2"


@rlplat.hookimpl
def register_commands(register):
    register("sft", "rlplat_sft.command:sft",
             description="Supervised fine-tuning on the same engines; its export is `rlplat run`'s model.path.",
             metadata={"run_config": "rlplat_sft.config:SFTConfig", "engine_node": "rlplat_sft.config:sft_engine_node"})
