"""What rlplat-verifiers registers: nothing yet. The adapter is an agent function of the ``blackbox`` loop
(``agent.loops.blackbox.agent=rlplat_verifiers.agent:run``), named by path, not a registry entry; this module
declares the plugin API it was written against so ``rlplat plugins list`` shows the distribution."""

RLPLAT_PLUGIN_API = ">=1.2,<2"
