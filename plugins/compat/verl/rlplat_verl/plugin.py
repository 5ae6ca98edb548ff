"""What rlplat-verl registers: the ``verl`` config translator. A dotted path only: listing plugins imports
nothing of the table."""

import rlplat

RLPLAT_PLUGIN_API = ">=1.2,<2"


@rlplat.hookimpl
def register_config_translators(register):
    register("verl", "rlplat_verl.translate:translate_command_line",
             description="verl's dotted keys (actor_rollout_ref.actor.optim.lr=...) and verl-layout YAML files become "
                         "rlplat's, with a note each; keys with no rlplat equivalent are refused together")
