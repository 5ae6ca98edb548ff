"""What rlplat itself registers, through the same hooks as any plugin: the dispatch modes, the worker
roles of every run (``actor``, ``rollout``, ``critic``), the default reward scorer and core's ``rlplat``
commands. Every optional feature is a distribution of its own under ``plugins/``.

It is loaded first by every :class:`rlplat.registry.Registry` (it cannot be disabled by the plugin
switches, since worker groups and the CLI need it) and listed as plugin ``rlplat``.
"""

from rlplat.hookspecs import hookimpl

DISPATCH_MODES = {
    "ONE_TO_ALL": ("OneToAll", "every worker gets the same arguments; returns the list of outputs"),
    "ALL_TO_ALL": ("AllToAll", "argument i of each sequence goes to worker i; returns the list of outputs"),
    "DP_COMPUTE_PROTO": ("DataParallelProto", "DataProto split over all workers with padding; outputs concatenated"),
    "RANK_ZERO": ("RankZero", "only rank 0 runs; returns its output"),
    "DP_MESH": ("DataParallelMesh", "DataProto split over declared data-parallel ranks; one output per DP group"),
}

COMMANDS = {
    "run": ("rlplat.cli.run:run", "Train a policy (no arguments: the default preset, rlplat-demo's demo)."),
    "plan": ("rlplat.cli.plan:plan", "Predict a run's memory per device and phase, and its placement, from config.json alone."),
    "config": ("rlplat.cli.config:app", "Inspect the resolved run config and what its keys mean."),
    "plugins": ("rlplat.cli.plugins:app", "List the installed plugins and what they register."),
    "plot": ("rlplat.cli.plot:plot", "Write a run's metrics as PNG charts."),
    "export": ("rlplat.cli.export:export", "Write a run's checkpoint as a Hugging Face model (LoRA merged) or its adapter."),
    "doctor": ("rlplat.cli.doctor:doctor", "Versions, devices, plugins and known-bad version combinations (exit 1 on one)."),
}

ROLES = {
    "actor": "the policy's engine, its reference model and (colocated) its rollout",
    "rollout": "the rollout in a resource pool of its own (roles.rollout.placement=separate)",
    "critic": "the value model (PPO, or critic.enable=true)",
}


@hookimpl
def register_dispatch_modes(register):
    for name, (attribute, description) in DISPATCH_MODES.items():
        register(name, f"rlplat.controller.dispatch:{attribute}", description=description)


@hookimpl
def register_roles(register):
    for name, description in ROLES.items():
        register(name, f"rlplat.workers.roles:{name}", description=description,
                 config_schema="rlplat.contracts.role:RoleConfig")


@hookimpl
def register_reward_scorers(register):
    register("exact_match", "rlplat.scorers:exact_match", metadata={"safe": True},
             description="1 when the response equals the ground truth (whitespace stripped), else 0; the default.")


#: What ``rlplat export`` reads of a command's runs (see :mod:`rlplat.cli.export`): its run config's nodes
#: (core's defaults with every plugin-owned node) and the function that builds the actor engine's node.
RUN_METADATA = {"run": {"run_config": "rlplat.config:base_config", "engine_node": "rlplat.cli.export:actor_engine_node"}}


@hookimpl
def register_commands(register):
    for name, (target, description) in COMMANDS.items():
        register(name, target, description=description, metadata=RUN_METADATA.get(name))
