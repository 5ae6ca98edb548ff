"""What rlplat-tinker registers: the ``rlplat serve`` command. Dotted paths only: listing plugins imports no torch."""

import rlplat

RLPLAT_PLUGIN_API = ">=1.2,<2"


@rlplat.hookimpl
def register_commands(register):
    register("serve", "rlplat_tinker.command:serve",
             description="A Tinker-compatible training service: the tinker SDK's loops run their steps on rlplat's engines.")
