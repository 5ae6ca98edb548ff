"""The ``teacher`` role: a worker group holding every teacher's model, scoring the policy's samples.

Each worker builds one training engine per teacher (forward only; the engine named by the teacher, the
actor's by default) and answers ``score(batch)`` for the teacher named in ``batch.meta_info["teacher"]``:
``teacher_log_probs`` [B, R], the teacher's log-prob of each sampled response token at the rollout's
temperature, and with ``top_k`` the teacher's ``k`` most likely tokens at each position
(``teacher_topk_log_probs``, ``teacher_topk_ids`` [B, R, k]).

:class:`TeacherRole` takes part in each step at the ``scored`` stage (after group filtering, so filtered-out
rows cost nothing): it routes every row by its ``distillation.teacher_key`` value, asks each teacher for its
rows, and joins the columns (:data:`rlplat_distill.losses.TEACHER_MASK` marks the response tokens a
teacher scored) with per-teacher metrics: ``distill/<teacher>/rows``, ``distill/<teacher>/reverse_kl``
(the k3 estimate of ``KL(student || teacher)`` averaged over its sampled tokens, the student's
log-probs from the rollout), ``distill/<teacher>/teacher_log_prob`` and ``timing_s/teacher``. Placement:
``roles.teacher.placement`` (colocated, the default, or a pool of its own).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Optional

from rlplat.contracts.role import Role, RunContext
from rlplat.controller.decorator import Dispatch, register
from rlplat.controller.host import WorkerSpec
from rlplat.controller.worker import Worker
from rlplat.protocol import DataProto

SCORE_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


@dataclasses.dataclass
class TeacherWorkerConfig:
    """What :class:`TeacherWorker` builds in its process."""

    teachers: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Per teacher: ``{"engine": name, "engine_config": node}`` or ``{"rollout": name, "rollout_config": node}``."""
    top_k: int = 0
    """The teacher's top-k per position (0: sampled tokens only)."""
    sleep: bool = True
    """Offload each teacher's parameters after a scoring call."""


class TeacherWorker(Worker):
    def __init__(self, config: Any):
        from rlplat.config_node import read_config_node

        super().__init__()
        self.config: TeacherWorkerConfig = read_config_node(config, TeacherWorkerConfig, "teacher worker config")
        self.engines: dict[str, Any] = {}
        self.rollouts: dict[str, Any] = {}

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build every teacher's engine; they must shard the same way (one data-parallel layout for the group)."""
        from rlplat.registry import EngineRegistry

        layout = None
        for name, teacher in self.config.teachers.items():
            if "rollout" in teacher:  # scored by a rollout: every process holds the whole model, one data-parallel rank each
                rollout = EngineRegistry("rollout").build(teacher["rollout"], dict(teacher["rollout_config"]))
                if not getattr(rollout, "scores_tokens", False):
                    raise ValueError(f"teacher {name}: rollout {teacher['rollout']!r} does not score given tokens")
                self.rollouts[name] = rollout
                continue
            engine = EngineRegistry("engine").build(teacher["engine"], dict(teacher["engine_config"]))
            if self.config.top_k and "top_k" not in getattr(engine, "features", frozenset()):
                raise ValueError(f"teacher {name}: engine {teacher['engine']!r} does not return top-k log-probs; "
                                 "distillation.top_k needs one that does (fsdp2, megatron)")
            engine.init_model()
            info = tuple(engine.data_parallel_info())
            if layout is not None and info != layout:
                raise ValueError(f"teacher {name}: its engine shards the data as {info} and another teacher's as {layout}; "
                                 "the teachers of one run share one data-parallel layout")
            layout = info
            if self.config.sleep:
                engine.offload()
            self.engines[name] = engine
        if self.rollouts:  # a rollout holds the whole model: each process is a data-parallel rank of its own
            import torch.distributed as dist

            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
            if layout is not None and layout != (rank, world, True):
                raise ValueError(f"the teachers served by rollouts take one data-parallel rank per process ({(rank, world, True)}), "
                                 f"and an engine teacher here shards the data as {layout}; serve them all the same way")
            layout = (rank, world, True)
        self.set_dispatch_info(*layout)

    @register(Dispatch.DP_MESH)
    def score(self, batch: DataProto) -> DataProto:
        """The teacher ``batch.meta_info["teacher"]``'s ``teacher_log_probs`` (and top-k columns) of the batch's
        response tokens at ``batch.meta_info["temperature"]``."""
        name = batch.meta_info.get("teacher")
        known = [*self.engines, *self.rollouts]
        if name not in known:
            raise KeyError(f"TeacherWorker.score(): unknown teacher {name!r}; the teachers are {', '.join(known)}"
                           if known else "TeacherWorker.score() needs the models: call init_model() first")
        inputs = batch.select(batch_keys=list(SCORE_INPUTS), meta_info_keys=[])
        arguments = {"temperature": float(batch.meta_info.get("temperature", 1.0))}
        if self.config.top_k:
            arguments["top_k"] = self.config.top_k
        if name in self.rollouts:
            scored = self.rollouts[name].score_tokens(inputs, **arguments).batch
        else:
            engine = self.engines[name]
            if self.config.sleep:
                engine.onload()
            scored = engine.forward(inputs, **arguments).batch
            if self.config.sleep:
                engine.offload()
        columns = {"teacher_log_probs": scored["log_probs"]}
        if self.config.top_k:
            columns["teacher_topk_log_probs"] = scored["top_k_log_probs"]
            columns["teacher_topk_ids"] = scored["top_k_ids"]
        return DataProto.from_dict(columns)


class TeacherRole(Role):
    """The teachers' worker group, when ``distillation.teachers`` names one."""

    settings_cache: Any = None

    def enabled(self, run: RunContext) -> bool:
        from rlplat_distill.config import read_distillation

        self.settings_cache = read_distillation(run.config)
        self.temperature = float(run.config.rollout.temperature)
        return self.settings_cache.enabled

    def worker(self, run: RunContext) -> WorkerSpec:
        from rlplat_distill.config import read_distillation, teacher_component

        settings = read_distillation(run.config)
        self.settings_cache = settings
        self.temperature = float(run.config.rollout.temperature)
        colocated = self.settings(run, "teacher").placement == "colocated"
        teachers = {}
        for name, teacher in settings.teachers.items():
            kind, registered, node = teacher_component(run.config, teacher, run.total_steps)
            teachers[name] = {kind: registered, f"{kind}_config": node}
        return WorkerSpec(TeacherWorker, {"teachers": teachers, "top_k": settings.top_k,
                                          "sleep": settings.sleep and colocated})

    def on_stage(self, stage: str, group: Any, batch: DataProto) -> Optional[DataProto]:
        if stage != "scored":
            return None
        return score_batch(group, batch, self.settings_cache, self.temperature)


def route(batch: DataProto, settings: Any) -> tuple[dict[str, list[int]], list[Any]]:
    """Rows by teacher (``teacher_key`` value in its ``data_sources``, else the default teacher) and the
    values no teacher serves."""
    key = settings.teacher_key
    values = batch.non_tensor_batch.get(key)
    if values is None:
        raise KeyError(f"distillation.teacher_key={key!r}: the batch has no such field (its fields: "
                       f"{', '.join(sorted(batch.non_tensor_batch)) or 'none'}); name a column of the data")
    owner = {source: name for name, teacher in settings.teachers.items() for source in teacher.data_sources or []}
    default = next((name for name, teacher in settings.teachers.items() if teacher.data_sources is None), None)
    rows: dict[str, list[int]] = {name: [] for name in settings.teachers}
    unrouted = []
    for index, value in enumerate(values):
        name = owner.get(str(value), default)
        if name is None:
            unrouted.append(value)
        else:
            rows[name].append(index)
    return rows, unrouted


def score_batch(group: Any, batch: DataProto, settings: Any, temperature: float) -> DataProto:
    """The teachers' columns for every row of ``batch`` and their metrics (see the module docstring)."""
    import torch

    from rlplat_distill.losses import (TEACHER_LOG_PROBS, TEACHER_MASK, TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS,
                                            sampled_divergence)

    started = time.perf_counter()
    rows, unrouted = route(batch, settings)
    if unrouted and settings.unrouted == "error":
        missing = sorted({str(value) for value in unrouted})
        raise ValueError(f"distillation: {len(unrouted)} row(s) have {settings.teacher_key} {', '.join(missing)}, which no "
                         "teacher serves and there is no default teacher (a teacher without data_sources); add one, or "
                         "set distillation.unrouted=skip to leave such rows out of the distillation terms")
    tensors = batch.batch
    response_mask = tensors["response_mask"] if "response_mask" in tensors.keys() else tensors["attention_mask"][:, -tensors["responses"].shape[1]:]
    size, width = response_mask.shape
    log_probs = torch.zeros(size, width, dtype=torch.float32)
    mask = torch.zeros(size, width, dtype=torch.float32)
    top_k = settings.top_k
    topk_log_probs = torch.zeros(size, width, top_k, dtype=torch.float32) if top_k else None
    topk_ids = torch.zeros(size, width, top_k, dtype=torch.long) if top_k else None
    student = tensors["rollout_log_probs"] if "rollout_log_probs" in tensors.keys() else None
    metrics: dict[str, float] = {}
    for name, indices in rows.items():
        metrics[f"distill/{name}/rows"] = float(len(indices))
        if not indices:
            continue
        part = batch.select_idxs(indices).select(batch_keys=list(SCORE_INPUTS), meta_info_keys=[])
        part.meta_info.update({"teacher": name, "temperature": temperature})
        scored = group.score(part).batch
        index = torch.tensor(indices, dtype=torch.long)
        own_mask = response_mask[index].to(torch.float32)
        log_probs[index] = scored["teacher_log_probs"].to(torch.float32)
        mask[index] = own_mask
        if top_k:
            topk_log_probs[index] = scored["teacher_topk_log_probs"].to(torch.float32)
            topk_ids[index] = scored["teacher_topk_ids"].to(torch.long)
        tokens = max(float(own_mask.sum()), 1.0)
        metrics[f"distill/{name}/teacher_log_prob"] = float((log_probs[index] * own_mask).sum()) / tokens
        if student is not None:
            estimate = sampled_divergence(student[index].to(torch.float32), log_probs[index], "k3") * own_mask
            metrics[f"distill/{name}/reverse_kl"] = float(estimate.sum()) / tokens
    metrics["distill/unrouted_rows"] = float(len(unrouted))
    metrics["timing_s/teacher"] = time.perf_counter() - started
    columns = {TEACHER_LOG_PROBS: log_probs, TEACHER_MASK: mask}
    if top_k:
        columns[TEACHER_TOPK_LOG_PROBS], columns[TEACHER_TOPK_IDS] = topk_log_probs, topk_ids
    return DataProto.from_dict(columns, meta_info={"metrics": metrics})


def teacher_role() -> Role:
    return TeacherRole()
