"""``rlplat plan`` (and the check ``rlplat run`` makes before it starts anything): the run's memory plan: which roles go on which devices, and what one device of each pool holds in
each phase of a step, from the resolved config and the models' ``config.json`` alone.

:func:`plan_run` asks each component (the actor's, reference's, critic's and reward model's training
engine, the rollout) for its :class:`~rlplat.contracts.memory.MemoryEstimate` through the function its
registration names (``metadata={"estimate_memory": "module:function"}``, imported without the engine's
module and so without torch) or else the optional ``estimate_memory`` classmethod of its contract
(:func:`estimate_function`), maps the calls of each item to the step's phases by
the component's role (:data:`ROLE_PHASES`), and sums per phase the items of the components that share a
device. The phase with the largest sum sets the pool's peak.

Device memory (:func:`device_memory`): ``cluster.device_memory_gib`` when set; else, with
``cluster.use_gpu`` and a GPU visible to this process, CUDA's total memory of device 0; else unknown.
On CPU it stays unknown unless set: worker processes share the machine's RAM with each other and with
everything else on it, and the operating system swaps rather than failing an allocation, so no fixed
per-process limit exists to refuse against. ``rlplat run`` refuses a plan whose peak exceeds a known
device memory (``cluster.memory_check``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

# what rlplat.plan offered before the planner joined the command line (plugin API 1.3) stays importable here
from rlplat.contracts.memory import (CALLS, MemoryContext, MemoryEstimate, MemoryItem, ModelShape,  # noqa: F401
                                     PlannedComponent)
from rlplat.kits.memory import GIB, human_bytes

#: The phases of a step in order, and the issue's name of each kind.
PHASES = {
    "generation": "generation",
    "reward_model": "log-prob pass (reward model scores)",
    "teacher": "log-prob pass (distillation teachers score)",
    "old_log_prob": "log-prob pass (actor, old log-probs)",
    "ref_log_prob": "log-prob pass (reference)",
    "values": "log-prob pass (critic values)",
    "update_critic": "update (critic)",
    "update_actor": "update (actor)",
    "weight_sync": "weight sync and wake-up",
}

#: role -> {call of an estimate item -> the phase it happens in}, for core's roles; a plugin role's component
#: names its one phase (:class:`PlannedComponent`).
ROLE_PHASES = {
    "actor": {"forward": "old_log_prob", "update": "update_actor", "export": "weight_sync"},
    "reference": {"forward": "ref_log_prob"},
    "critic": {"forward": "values", "update": "update_critic"},
    "rollout": {"generate": "generation", "wake_up": "weight_sync"},
}

MEMORY_CHECKS = ("refuse", "warn", "skip")


class PlanError(ValueError):
    """The plan cannot be made (no ``config.json``, an unreadable node); the message says where."""


@dataclasses.dataclass
class Component:
    """One role's engine or rollout on one device of its pool."""

    role: str
    plugin: str
    pool: str
    model_path: str
    estimate: Optional[MemoryEstimate]
    unknown_reason: str = ""
    resident_phases: Optional[tuple[str, ...]] = None
    """Phases its resident items are on the device, when not all (a sleeping reward model)."""
    phase: Optional[str] = None
    """A plugin role's component: the one phase every call of it happens in (:class:`PlannedComponent`)."""

    def phases_of(self, item: MemoryItem, phases: list[str]) -> list[str]:
        if "resident" in item.calls:
            return list(self.resident_phases or phases)
        if self.phase is not None:
            return [self.phase] if self.phase in phases else []
        mapping = ROLE_PHASES[self.role]
        return [phase for phase in phases if any(mapping.get(call) == phase for call in item.calls)]


@dataclasses.dataclass
class Pool:
    """Devices that hold the same roles: the actor's colocated pool, or a separate role's own."""

    name: str
    devices: int
    source: str
    roles: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunPlan:
    device: str
    device_memory: Optional[int]
    device_memory_source: str
    pools: list[Pool]
    components: list[Component]
    phases: list[str]
    unplanned: list[str] = dataclasses.field(default_factory=list)
    """Enabled roles without a component in the plan (their memory is not counted)."""

    @property
    def devices_needed(self) -> int:
        return sum(pool.devices for pool in self.pools)

    def totals(self, pool: str) -> dict[str, int]:
        """Bytes one device of ``pool`` holds in each phase."""
        totals = {phase: 0 for phase in self.phases}
        for component, item, phases in self.held(pool):
            for phase in phases:
                totals[phase] += item.bytes
        return totals

    def held(self, pool: str) -> list[tuple[Component, MemoryItem, list[str]]]:
        return [(component, item, component.phases_of(item, self.phases))
                for component in self.components if component.pool == pool and component.estimate is not None
                for item in component.estimate.items]

    def peak(self, pool: str) -> tuple[str, int, Optional[tuple[Component, MemoryItem]]]:
        """``(phase, bytes, (component, its largest item in that phase))`` of the pool's peak."""
        totals = self.totals(pool)
        phase = max(self.phases, key=lambda name: totals[name])
        present = [(component, item) for component, item, phases in self.held(pool) if phase in phases]
        largest = max(present, key=lambda pair: pair[1].bytes) if present else None
        return phase, totals[phase], largest

    def problems(self) -> list[str]:
        """Why the run cannot fit: a pool's peak beyond the device memory, or a component's own problems."""
        problems = [problem for component in self.components if component.estimate is not None
                    for problem in component.estimate.problems]
        if self.device_memory is None:
            return problems
        for pool in self.pools:
            phase, total, largest = self.peak(pool.name)
            if total > self.device_memory:
                component, item = largest
                problems.append(
                    f"the {PHASES.get(phase, phase)} phase needs {human_bytes(total)} on each device of the {pool.name} pool "
                    f"({', '.join(pool.roles)}), more than the {human_bytes(self.device_memory)} of a device "
                    f"({self.device_memory_source}); its largest part is the {component.role}'s {item.name}: "
                    f"{human_bytes(item.bytes)} ({item.detail})")
        return problems

    def notes(self) -> list[str]:
        notes = [f"{component.role} ({component.plugin}): {note}" for component in self.components
                 if component.estimate is not None for note in component.estimate.notes]
        notes += [f"{component.role} ({component.plugin}): unknown, {component.unknown_reason}; not counted"
                  for component in self.components if component.estimate is None]
        notes += [f"role {name}: the plan has no estimate for it; not counted" for name in self.unplanned]
        return notes

    def to_dict(self) -> dict[str, Any]:
        pools = []
        for pool in self.pools:
            phase, total, largest = self.peak(pool.name)
            pools.append({
                "name": pool.name, "devices": pool.devices, "source": pool.source, "roles": pool.roles,
                "components": [{
                    "role": component.role, "plugin": component.plugin, "model_path": component.model_path,
                    "known": component.estimate is not None, "unknown_reason": component.unknown_reason,
                    "items": [{"name": item.name, "bytes": item.bytes, "calls": list(item.calls),
                               "phases": component.phases_of(item, self.phases), "detail": item.detail}
                              for item in (component.estimate.items if component.estimate else ())],
                } for component in self.components if component.pool == pool.name],
                "phases": self.totals(pool.name),
                "peak": {"phase": phase, "bytes": total,
                         "component": largest[0].role if largest else None, "item": largest[1].name if largest else None},
            })
        problems = self.problems()
        return {"device": self.device, "device_memory": self.device_memory, "device_memory_source": self.device_memory_source,
                "devices_needed": self.devices_needed, "phases": {phase: PHASES.get(phase, phase) for phase in self.phases},
                "pools": pools, "fits": None if self.device_memory is None and not problems else not problems,
                "problems": problems, "notes": self.notes()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        """The plan as text for people."""
        memory = human_bytes(self.device_memory) if self.device_memory is not None else "unknown"
        lines = [f"Devices needed: {self.devices_needed} ({self.device}; memory per device: {memory}, {self.device_memory_source})",
                 "", "Placement:"]
        for pool in self.pools:
            lines.append(f"  {pool.name} pool: {pool.devices} device(s) ({pool.source}): {', '.join(pool.roles)}")
        for pool in self.pools:
            lines += ["", f"One device of the {pool.name} pool:"]
            for component, item, phases in self.held(pool.name):
                when = "all phases" if len(phases) == len(self.phases) else ", ".join(phases) or "-"
                lines.append(f"  {component.role:<12} {item.name:<22} {human_bytes(item.bytes):>10}  [{when}]  {item.detail}")
            totals = self.totals(pool.name)
            lines.append("  per phase:")
            for phase in self.phases:
                lines.append(f"    {phase:<14} {human_bytes(totals[phase]):>10}  {PHASES.get(phase, phase)}")
            phase, total, largest = self.peak(pool.name)
            share = f", {100 * total / self.device_memory:.0f}% of the device" if self.device_memory else ""
            lines.append(f"  peak: {human_bytes(total)} in {phase}{share}"
                         + (f" (largest part: {largest[0].role} {largest[1].name}, {human_bytes(largest[1].bytes)})" if largest else ""))
        notes, problems = self.notes(), self.problems()
        if notes:
            lines += ["", "Notes:"] + [f"  - {note}" for note in notes]
        lines.append("")
        if problems:
            lines += ["Does not fit:"] + [f"  - {problem}" for problem in problems]
        elif self.device_memory is None:
            lines.append("Fits: not checked (device memory unknown; set cluster.device_memory_gib to check)")
        else:
            lines.append("Fits: yes")
        return "\n".join(lines)


def read_model_config(path: Optional[str], key: str) -> dict[str, Any]:
    """The ``config.json`` of the model directory ``path`` (the value of ``key``) as a dict."""
    if path is None:
        raise PlanError(f"{key} is not set: the plan reads the model's config.json from it")
    file = Path(path) / "config.json"
    if not file.is_file():
        raise PlanError(f"{key}: {path} has no config.json (a local Hugging Face model directory is expected; weights are not needed)")
    try:
        return json.loads(file.read_text())
    except ValueError as error:
        raise PlanError(f"{key}: {file} is not valid JSON ({error})") from None


def device_memory(config: Any) -> tuple[Optional[int], str]:
    """``(bytes of one device or None, where the number comes from)``; see the module docstring."""
    cluster = config.cluster
    if cluster.get("device_memory_gib") is not None:
        return int(float(cluster.device_memory_gib) * GIB), "cluster.device_memory_gib"
    if cluster.use_gpu:
        import torch

        if torch.cuda.is_available():
            properties = torch.cuda.get_device_properties(0)
            return int(properties.total_memory), f"CUDA total memory of {properties.name}"
        return None, "no GPU visible to the driver; set cluster.device_memory_gib to check"
    return None, "CPU: not checked unless cluster.device_memory_gib is set"


#: The registration ``metadata`` key naming an engine's or rollout's estimate without its class.
ESTIMATE_KEY = "estimate_memory"


def estimate_function(entry: Any) -> tuple[Optional[Any], str]:
    """``(the estimate function of a registry entry, "")`` or ``(None, why)``.

    The entry's ``metadata["estimate_memory"]`` when the plugin registered one: a function with the
    signature of the contract's ``estimate_memory`` classmethod, or its ``"module:attribute"`` path,
    imported alone (the built-in engines and rollouts name their ``memory`` module, which needs no torch,
    so ``rlplat plan`` and the refusal of ``rlplat run`` import no torch). Otherwise the classmethod of
    the entry's class, which imports the class's module (a third party's engine that only defines the
    classmethod). Either is imported without checking the entry's optional dependencies (vllm,
    sglang): the estimate needs none of them."""
    from rlplat.registry import resolve_dotted_path

    named = entry.metadata.get(ESTIMATE_KEY)
    if named is not None:
        try:
            function = resolve_dotted_path(named) if isinstance(named, str) else named
        except Exception as error:
            return None, f"its {ESTIMATE_KEY} {named!r} cannot be imported ({type(error).__name__}: {error})"
        if not callable(function):
            return None, f"its {ESTIMATE_KEY} {named!r} is a {type(function).__name__}, not a function"
        return function, ""
    try:
        factory = resolve_dotted_path(entry.factory) if isinstance(entry.factory, str) else entry.factory
    except Exception as error:
        return None, f"its class cannot be imported ({type(error).__name__}: {error})"
    method = getattr(factory, "estimate_memory", None)
    if method is None:
        return None, f"{entry.kind} {entry.name!r} has no estimate_memory"
    return method, ""


def estimate_of(kind: str, name: str, node: dict[str, Any], model_config: dict[str, Any],
                context: MemoryContext) -> tuple[Optional[MemoryEstimate], str]:
    """The registered ``kind`` ``name``'s estimate (through :func:`estimate_function`), or ``(None, why)``."""
    from rlplat import registry
    from rlplat.registry import RegistryError

    try:
        entry = registry.entry(kind, name)
    except RegistryError as error:
        raise PlanError(str(error)) from None
    method, reason = estimate_function(entry)
    if method is None:
        return None, reason
    try:
        estimate = method(node, model_config, context)
    except (ValueError, TypeError, KeyError) as error:
        raise PlanError(f"{context.role} ({kind} {name!r}): {error}") from None
    if estimate is None:
        return None, f"{kind} {name!r} gives no memory estimate"
    return estimate, ""


def plan_run(config: Any, algorithm: Any = None) -> RunPlan:
    """The plan of a resolved run config (:func:`rlplat.config.load_config`); see the module docstring."""
    from omegaconf import OmegaConf

    from rlplat.config import algorithm_spec, engine_node, rollout_node, uses_critic
    from rlplat.contracts.role import read_role_config
    from rlplat.registry import resolve_dotted_path

    algorithm = algorithm or algorithm_spec(config.algorithm.name)
    cluster = config.cluster
    gpu = bool(cluster.use_gpu)
    memory, memory_source = device_memory(config)
    ray = cluster.backend == "ray"
    colocated = cluster.nnodes * cluster.devices_per_node if ray else 1
    colocated_source = "cluster.nnodes x cluster.devices_per_node" if ray else "cluster.backend=local: one process"
    pools = {"actor": Pool("actor", colocated, colocated_source)}

    def pool_of(role: str, placement: str, nnodes: Any, devices_per_node: Any, key: str) -> str:
        if placement != "separate":
            return "actor"
        devices = (nnodes or cluster.nnodes) * (devices_per_node or cluster.devices_per_node)
        pools[role] = Pool(role, devices, f"{key}.nnodes x {key}.devices_per_node")
        return role

    def roles_node(name: str) -> Any:
        return read_role_config(config, name)

    model_path = config.model.path
    policy = read_model_config(model_path, "model.path")
    steps = int(config.trainer.total_training_steps or 1_000_000)
    sequences = config.data.train_batch_size * config.rollout.n
    lora_rank = int(OmegaConf.select(config, "actor.lora.rank", default=0) or 0)
    shape_keys = dict(device="cuda" if gpu else "cpu", prompt_length=config.data.max_prompt_length,
                      response_length=config.rollout.response_length, device_memory=memory,
                      free_between_phases=bool(config.rollout.free_between_phases), lora_rank=lora_rank)
    components = []

    def add(kind: str, name: str, role: str, pool: str, node: dict[str, Any], model: dict[str, Any], path: str, **extra: Any) -> Component:
        processes = pools[pool].devices
        context = MemoryContext(role=role, processes=processes, sequences_per_process=-(-sequences // processes), **shape_keys, **extra)
        estimate, reason = estimate_of(kind, name, node, model, context)
        component = Component(role, f"{kind} {name}", pool, path, estimate, reason)
        pools[pool].roles.append(role)
        components.append(component)
        return component

    actor_node = engine_node(config, "actor", steps)
    add("engine", config.actor.engine, "actor", "actor", actor_node, policy, model_path)
    rollout_settings = roles_node("rollout")
    separate_rollout = rollout_settings.placement == "separate" or config.trainer.mode == "separate_async"
    rollout_pool = pool_of("rollout", "separate" if separate_rollout else "colocated", rollout_settings.nnodes,
                           rollout_settings.devices_per_node, "roles.rollout")
    actor_loss = OmegaConf.to_container(config.actor.loss, resolve=True)
    shares = (not separate_rollout and bool(config.rollout.share_weights) and pools["actor"].devices == 1 and not lora_rank
              and not actor_node.get("param_offload", False))
    add("rollout", config.rollout.name, "rollout", rollout_pool, rollout_node(config), policy, model_path,
        shares_actor_weights=shares and rollout_dtype_matches(config, actor_node, gpu))
    if algorithm.uses_reference(actor_loss, OmegaConf.to_container(config.algorithm, resolve=True)) and not lora_rank:
        add("engine", config.actor.engine, "reference", "actor", actor_node, policy, model_path)
    phases = ["generation"]
    if uses_critic(config, algorithm):
        critic = roles_node("critic")
        pool = pool_of("critic", critic.placement, critic.nnodes, critic.devices_per_node, "roles.critic")
        add("engine", config.critic.engine, "critic", pool, engine_node(config, "critic", steps), policy, model_path)
    for entry in planned_role_entries():  # a plugin role's components (the reward model's engine)
        for item in resolve_dotted_path(entry.metadata["plan"])(config, gpu):
            pool = pool_of(item.role, item.placement, item.nnodes, item.devices_per_node, item.key)
            component = add(item.kind, item.name, item.role, pool, item.node,
                            read_model_config(item.model_path, f"{item.key}.path"), item.model_path)
            component.resident_phases, component.phase = item.resident_phases, item.phase
            if item.phase not in phases:
                phases.append(item.phase)
    roles = {component.role for component in components}
    unplanned = unplanned_roles(config, algorithm, steps)
    phases.append("old_log_prob")
    if "reference" in roles:
        phases.append("ref_log_prob")
    if "critic" in roles:
        phases += ["values", "update_critic"]
    phases += ["update_actor", "weight_sync"]
    return RunPlan("GPU" if gpu else "CPU", memory, memory_source, list(pools.values()), components, phases, unplanned)


#: The roles :func:`plan_run` builds components for (the rollout role is the rollout's pool); a plugin's
#: role is planned through the function its entry names in ``metadata["plan"]`` (:class:`PlannedComponent`).
PLANNED_ROLES = ("actor", "rollout", "critic")


def planned_role_entries() -> list:
    """The ``role`` entries that plan their own components (``metadata["plan"]``)."""
    from rlplat import registry

    return [entry for entry in registry.entries("role") if entry.metadata.get("plan")]


def unplanned_roles(config: Any, algorithm: Any, steps: int) -> list[str]:
    """Enabled roles (kind ``role``) the plan has no components for (a judge, a plugin's role), by name.
    Only those roles are built and asked (as :func:`rlplat.trainer.placement.enabled_roles` asks them): the
    modules of the planned ones hold their workers, which import torch."""
    from rlplat import registry
    from rlplat.contracts.role import RunContext

    run = RunContext(config, algorithm, steps)
    planned = set(PLANNED_ROLES) | {entry.name for entry in planned_role_entries()}
    others = [name for name in registry.names("role") if name not in planned]
    return [name for name in sorted(others) if registry.get("role", name)().enabled(run)]


def rollout_dtype_matches(config: Any, actor_node: dict[str, Any], gpu: bool) -> bool:
    """A rollout reads the actor's parameters in place only when the actor holds them whole (float32
    compute on CPU: the plain module) and the rollout serves float32 too."""
    from omegaconf import OmegaConf

    dtype = (OmegaConf.to_container(config.rollout.config, resolve=True) or {}).get("dtype", "float32")
    actor_dtype = actor_node.get("dtype", "auto")
    return not gpu and dtype == "float32" and actor_dtype in ("auto", "float32") and actor_node.get("reduce_dtype", "float32") == "float32"
