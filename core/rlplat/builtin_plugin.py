"""What rlplat itself registers, through the same hooks as any plugin: the dispatch modes, the worker
roles of every run (``actor``, ``rollout``, ``critic``), the default reward scorer, core's ``rlplat``
commands, the step observers that watch every run (the sentinel, ``status.json``, the rollout dump, the
trained-prompts log, the profiler) and the nodes of the run's parts (``trainer.sentinel``, ``trainer.profile``, ``rollout.sync_probe``:
the run config reads them as it reads any plugin's node, so it imports none of the trainer's modules). Every
optional feature is a distribution of its own under ``plugins/``.

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


#: The nodes of the run's parts: key -> (schema, description). Reading a node checks it whole (each schema's
#: ``__post_init__``), so the check after reading has nothing to add (:func:`read_is_the_check`).
CONFIG_NODES = {
    "trainer.sentinel": ("rlplat.trainer.sentinel:SentinelConfig",
                         "the run sentinel: named errors for silent faults (weight syncs, policy versions, scorers, "
                         "templates, NaN or Inf, collapse) and what to do on each"),
    "trainer.profile": ("rlplat.trainer.profile:ProfileConfig", "Chrome-trace timelines of chosen steps"),
    "rollout.sync_probe": ("rlplat.trainer.sync_probe:SyncProbeConfig",
                           "after weight syncs, check that the rollout serves the trainer's weights"),
}


def read_is_the_check(node, config) -> None:
    """The check of a node whose schema checks every value as it is read (nothing across nodes)."""


@hookimpl
def register_config_nodes(register):
    for name, (schema, description) in CONFIG_NODES.items():
        register(name, "rlplat.builtin_plugin:read_is_the_check", config_schema=schema, description=description)


#: The run parts that only watch a step: name -> (factory, description).
STEP_OBSERVERS = {
    "sentinel": ("rlplat.trainer.sentinel:observer", "named errors for silent faults, per trainer.sentinel"),
    "status": ("rlplat.trainer.status:observer", "status.json: the phase, each step's figures, replica health"),
    "rollout_dump": ("rlplat.trainer.rollout_dump:observer", "each step's batch to trainer.rollout_dump_dir"),
    "trained_prompts": ("rlplat.trainer.pipeline:trained_prompts_observer", "trained_prompts.jsonl: each step's prompt uids"),
    "profile": ("rlplat.trainer.profile:observer", "Chrome-trace timelines of the steps trainer.profile.steps names"),
}


@hookimpl
def register_step_observers(register):
    for name, (factory, description) in STEP_OBSERVERS.items():
        register(name, factory, description=description)


#: What ``rlplat export`` reads of a command's runs (see :mod:`rlplat.cli.export`): its run config's nodes
#: (core's defaults with every plugin-owned node) and the function that builds the actor engine's node.
RUN_METADATA = {"run": {"run_config": "rlplat.config:base_config", "engine_node": "rlplat.cli.export:actor_engine_node"}}


@hookimpl
def register_commands(register):
    for name, (target, description) in COMMANDS.items():
        register(name, target, description=description, metadata=RUN_METADATA.get(name))
