"""Worker roles (kind ``role``): the worker groups a run builds, and where their processes go.

The trainer asks every registered role whether the run needs it (:meth:`Role.enabled`), builds the
worker group of each enabled one from :meth:`Role.worker` and places it by its ``roles.<name>`` node
(:class:`RoleConfig`): **colocated** roles share the actor's processes (one process per device of
``cluster.nnodes`` x ``cluster.devices_per_node``, each role a worker object in it), a **separate** role
gets a resource pool of its own with its own process count. rlplat's own roles are entries of this kind
too (``actor``: the policy's engine with its rollout and reference; ``rollout``: the rollout in its own
pool; ``critic``), registered by rlplat through the same hook as a plugin's.

The driver loop calls the built-in roles itself (generation, log-probs, updates). Any role takes part in
the loop through :meth:`Role.on_stage`, called at each stage of every step with the role's worker group
and the batch; the columns it returns join the batch. :meth:`Role.start` runs once after the group is built (the
worker's ``init_model`` by default), :meth:`Role.save_checkpoint` / :meth:`Role.load_checkpoint` with
every checkpoint of the run.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from rlplat.contracts.algorithm import Algorithm
    from rlplat.controller.host import WorkerSpec
    from rlplat.controller.worker_group import WorkerGroup
    from rlplat.protocol import DataProto

PLACEMENTS = ("colocated", "separate")

#: The stages of a step at which :meth:`Role.on_stage` is called, in order:
#: ``generated`` (responses sampled, before rewards), ``scored`` (``token_level_scores`` in, groups
#: filtered), ``prepared`` (log-probs, values and advantages in, before the updates), ``updated``
#: (after the updates and the weight sync; columns returned here are not used).
STAGES = ("generated", "scored", "prepared", "updated")


@dataclasses.dataclass
class RoleConfig:
    """The ``roles.<name>`` node: where a role's processes go. A role with settings of its own registers
    a subclass as its entry's ``config_schema``; ``load_config`` checks the node against it."""

    placement: str = "colocated"
    """``colocated``: in the actor's processes (one worker object per process); ``separate``: a resource
    pool of its own (Ray backend only)."""
    nnodes: Optional[int] = None
    """``separate`` only: machines of the role's pool (None: ``cluster.nnodes``)."""
    devices_per_node: Optional[int] = None
    """``separate`` only: processes per machine of the role's pool, GPUs with ``cluster.use_gpu``
    (None: ``cluster.devices_per_node``)."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        for name in ("nnodes", "devices_per_node"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {value}")
        if self.placement == "colocated" and (self.nnodes is not None or self.devices_per_node is not None):
            raise ValueError("nnodes and devices_per_node apply to placement=separate only (a colocated role uses the actor's processes)")


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a role sees of the run: the resolved config, the algorithm spec and the number of steps."""

    config: Any
    """The resolved run config (an OmegaConf node, as :func:`rlplat.config.load_config` returns it)."""
    algorithm: "Algorithm"
    """The run's algorithm spec."""
    total_steps: int
    """Training steps of the run."""

    def role_config(self, name: str) -> RoleConfig:
        """The ``roles.<name>`` node of this run (see :func:`read_role_config`)."""
        return read_role_config(self.config, name)


def read_role_config(config: Any, name: str) -> RoleConfig:
    """The ``roles.<name>`` node of a run config read with the schema the role's registry entry declares
    (default :class:`RoleConfig`; its defaults when the config has no such node)."""
    from rlplat import registry
    from rlplat.config_node import read_config_node, resolve_schema

    schema = resolve_schema(registry.entry("role", name).config_schema) or RoleConfig
    roles = config.get("roles") or {}
    return read_config_node(roles.get(name), schema, f"roles.{name}")


class Role(abc.ABC):
    """A kind of worker group. The registered factory takes no arguments and returns the role."""

    #: Placement when ``roles.<name>.placement`` is not given.
    default_placement: str = "colocated"
    #: Whether ``roles.<name>.placement`` may change it (the actor's role anchors the colocated pool).
    movable: bool = True

    @abc.abstractmethod
    def enabled(self, run: RunContext) -> bool:
        """Whether this run needs the role (e.g. the critic: the algorithm or ``critic.enable``)."""

    def settings(self, run: RunContext, name: str) -> RoleConfig:
        """Where this run puts the role's processes: its ``roles.<name>`` node, with
        :attr:`default_placement` when the node sets no placement. A role with a node of its own elsewhere
        (the reward model's ``reward.model.placement``) overrides this."""
        settings = run.role_config(name)
        given = run.config.get("roles") or {}
        if "placement" not in (given.get(name) or {}) and settings.placement != self.default_placement:
            settings = dataclasses.replace(settings, placement=self.default_placement)
        return settings

    def concurrent_calls(self, run: RunContext) -> int:
        """How many calls one process of the role runs at once when the role has a pool of its own (each on a
        thread of its own): 1, the default, runs them one at a time in the order they were made. More lets a
        call land while others run (a weight update during generations: ``trainer.partial_rollout``)."""
        return 1

    @abc.abstractmethod
    def worker(self, run: RunContext) -> "WorkerSpec":
        """The worker class and its constructor arguments, built in each of the role's processes."""

    def on_stage(self, stage: str, group: "WorkerGroup", batch: "DataProto") -> "DataProto | None":
        """Called at each stage of :data:`STAGES` of every training step with this role's worker group and
        the step's batch; return a DataProto of new columns (one row per batch row) to join the batch, or
        None. Floats in its ``meta_info["metrics"]`` join the step's metrics (not the batch). The default
        takes no part."""
        return None

    def rule_scores_needed(self, run: RunContext, validation: bool) -> bool:
        """Whether a step (or validation) still needs the reward manager's scores while this role scores
        responses itself (:meth:`join_scores`); False lets the trainer skip the manager (a reward model
        whose rule weight is 0, in training). The default: True."""
        return True

    def join_scores(self, group: "WorkerGroup", batch: "DataProto", scored: "DataProto", *, validation: bool,
                    timing: "dict[str, float] | None" = None) -> "DataProto":
        """A role that scores responses (a reward model) joins its scores to ``scored`` (the reward
        manager's output for ``batch``: ``token_level_scores``, non-tensor fields, ``meta_info
        ["reward_metrics"]``) and returns the result, adding its time to ``timing`` when given. Called
        for training steps and validation. The default returns ``scored`` unchanged."""
        return scored

    def start(self, group: "WorkerGroup") -> None:
        """Called once after the group is built: calls the worker's ``init_model`` when it registers one."""
        if "init_model" in group.method_names:
            group.init_model()

    def save_checkpoint(self, group: "WorkerGroup", path: str) -> None:
        """Write the role's resumable state into the checkpoint folder ``path`` (a sub-folder of the role's
        choosing). The default saves nothing."""

    def load_checkpoint(self, group: "WorkerGroup", path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote under ``path``. The default restores nothing."""
