"""What rlplat itself registers, through the same hooks as any plugin: the built-in dispatch modes.

It is loaded first by every :class:`rlplat.registry.Registry` (it cannot be disabled by the plugin
switches, since worker groups need it) and listed as plugin ``rlplat``.
"""

from rlplat.hookspecs import hookimpl

DISPATCH_MODES = {
    "ONE_TO_ALL": ("OneToAll", "every worker gets the same arguments; returns the list of outputs"),
    "ALL_TO_ALL": ("AllToAll", "argument i of each sequence goes to worker i; returns the list of outputs"),
    "DP_COMPUTE_PROTO": ("DataParallelProto", "DataProto split over all workers with padding; outputs concatenated"),
    "RANK_ZERO": ("RankZero", "only rank 0 runs; returns its output"),
    "DP_MESH": ("DataParallelMesh", "DataProto split over declared data-parallel ranks; one output per DP group"),
}


@hookimpl
def register_dispatch_modes(register):
    for name, (attribute, description) in DISPATCH_MODES.items():
        register(name, f"rlplat.controller.dispatch:{attribute}", description=description)
