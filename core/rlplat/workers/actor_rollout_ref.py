"""The hybrid worker: the policy's training engine, its rollout engine and the reference model.

Each role is optional (``config.roles``): all three in one process is HybridFlow's colocated layout,
where weights move from the engine to the rollout inside the process, bucket by bucket. With the rollout
in its own worker group, the driver chains ``export_weights`` of the actor group into ``load_weights``
of the rollout group, and the buckets travel through the object store, not through the driver.

**Policy versions.** The worker counts the updates applied to its actor's weights (``actor_version``)
and knows which of them its rollout holds (``rollout_version``: set when a sync or a load brings
weights in; always the actor's when the rollout reads the engine's parameters in place). Every
generated row carries that version on each response token (``policy_version``), and
``meta_info["metrics"]`` the wall-clock window the generation ran in (``async/generation_start`` and
``async/generation_end``), which the driver's asynchronous modes read (:mod:`rlplat.trainer.pipeline`).

**Acknowledged applies.** A sync or load counts a policy version as applied (``acked_version``) only when
the rollout then holds what was sent (``weight_checks``: the fingerprints of :mod:`rlplat.kits.weights`,
where the rollout offers :meth:`~RolloutEngine.weight_fingerprints`), or reads the engine's parameters in
place. A mismatch, or a generation from a version never acknowledged, is not raised here: it travels to the
driver's sentinel as a health event in the output's ``meta_info["health_events"]``
(:mod:`rlplat.contracts.health`), which applies the run's policy.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import torch

from rlplat.contracts.health import HEALTH_EVENTS, HealthEvent
from rlplat.contracts.rollout import SamplingParams
from rlplat.controller.decorator import Dispatch, register
from rlplat.controller.worker import Worker, without_padding_weight
from rlplat.kits.moe import ROUTES
from rlplat.kits.rollout_batch import ABORTED_KEY, MIN_VERSION, generate_through_tokens, pad_and_eos_token_ids
from rlplat.kits.weights import pack_bucket, unpack_bucket
from rlplat.losses.rollout_correction import log_prob_mismatch  # noqa: F401 (importable here too)
from rlplat.protocol import DataProto
from rlplat.registry import EngineRegistry
from rlplat.config_node import read_config_node
from rlplat.workers.config import ActorRolloutRefConfig

SAMPLING_KEYS = {field.name for field in dataclasses.fields(SamplingParams)}


ROW_INDEX = "rlplat_row_index"
NOT_ACKED = object()  # no sync acknowledged yet: no engine instance to compare with


def check_engine_features(engine: Any, loss_fn: Any, engine_name: str) -> None:
    """Refuse a loss function that needs what the engine does not list in ``features`` (``count_masks``,
    ``gather_ids``): the run stops at build time, not at its first update."""
    features = getattr(engine, "features", frozenset())
    needed = [name for name in ("count_masks", "gather_ids") if getattr(loss_fn, name, None)]
    missing = [name for name in needed if name not in features]
    if missing:
        raise ValueError(f"the actor loss needs {', '.join(missing)} of its engine (count_masks: a term's own token "
                         "counts; gather_ids: the student's log-probs at a teacher's top-k ids), and engine "
                         f"{engine_name!r} does not list it (its features: {sorted(features) or 'none'}); use an engine "
                         "that does (fsdp2, megatron), or a term that needs less (reverse_kl reads the sampled tokens only)")


class OldLogProbsFromForward:
    """A loss function around ``loss_fn`` for a strictly on-policy update (one epoch, one mini-batch):
    before the optimizer step every row's forward runs on the weights that sampled nothing since, so
    its detached log-probs *are* ``old_log_probs``. Each micro-batch gets them as that column before
    ``loss_fn`` reads it, and they are kept by row (``ROW_INDEX``) for the driver: the separate pass
    they replace is one forward fewer per step."""

    def __init__(self, loss_fn: Any, rows: int):
        self.loss_fn = loss_fn
        self.needs_entropy = bool(getattr(loss_fn, "needs_entropy", False))
        self.count_masks = getattr(loss_fn, "count_masks", ())
        self.gather_ids = getattr(loss_fn, "gather_ids", None)
        # kept where the engine computes (no wait on the device between micro-batches), read by result()
        self.old_log_probs: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.rows = rows
        self.entropy_sum: Any = 0.0
        self.entropy_tokens: Any = 0.0

    def __call__(self, outputs: Any, micro_batch: DataProto) -> Any:
        log_probs = outputs["log_probs"].detach()
        rows = micro_batch.batch[ROW_INDEX].to(log_probs.device)
        if self.old_log_probs is None:
            self.old_log_probs = torch.zeros(self.rows, log_probs.shape[1], dtype=log_probs.dtype, device=log_probs.device)
            self.seen = torch.zeros(self.rows, dtype=torch.bool, device=log_probs.device)
        fresh = ~self.seen[rows]  # the first forward of a row counts (an engine may repeat a stand-in row)
        if self.needs_entropy:  # computed for the loss anyway: report it as the separate pass would (actor/entropy)
            mask = micro_batch.batch["response_mask"].to(log_probs.dtype)
            first = fresh.to(mask.device, mask.dtype)[:, None]
            # each micro-batch's sum as before, added in float64 as Python floats were
            self.entropy_sum = self.entropy_sum + (outputs["entropy"].detach() * mask * first).sum().double()
            self.entropy_tokens = self.entropy_tokens + (mask * first).sum().double()
        micro_batch.batch["old_log_probs"] = log_probs
        # rows not yet seen take this forward's values (an index_put with a mask: no host-side selection)
        self.old_log_probs[rows] = torch.where(fresh[:, None], log_probs, self.old_log_probs[rows])
        self.seen[rows] = True
        return self.loss_fn(outputs, micro_batch)

    def entropy(self) -> float | None:
        """The mean entropy of the rows' first forwards (None when the loss did not ask for entropy)."""
        tokens = float(self.entropy_tokens)
        return float(self.entropy_sum) / tokens if tokens else None

    def result(self) -> torch.Tensor:
        if self.old_log_probs is None or not bool(self.seen.all()):
            missing = int((~self.seen).sum())
            raise RuntimeError(
                f"update_actor: the engine's update never passed {missing} of {self.rows} rows to the loss "
                "function, so their old_log_probs are unknown; run compute_log_prob before update_actor "
                "(actor.recompute_old_log_prob=always)"
            )
        return self.old_log_probs.cpu()


class ActorRolloutRefWorker(Worker):
    """See the module docstring. Methods read and write verl's DataProto keys."""

    def __init__(self, config: Any):
        super().__init__()
        self.config: ActorRolloutRefConfig = read_config_node(config, ActorRolloutRefConfig, "actor worker config")
        self.actor = self.rollout = self.reference = None
        self.actor_loss = None
        self.rollout_asleep = False
        self.driver = None  # the rollout driver (agent loops, ...), built at the first batch that needs it
        self.actor_version = 0  # updates applied to the actor's weights
        self.rollout_version = 0  # the actor version whose weights the rollout holds
        self.weights_shared = False  # the rollout reads the engine's parameters in place
        self.reference_from_actor = False  # LoRA: the reference policy is the actor with its adapter off
        self.base_synced = False  # LoRA adapter sync: the rollout holds the base weights
        self.acked_version: int | None = None  # the last policy version whose apply was acknowledged
        self.acked_instance: Any = NOT_ACKED  # the rollout engine's instance_id() at that acknowledgement
        self.health_events: list[HealthEvent] = []  # for the driver, with the next generation's output
        self.weights_verified = 0.0  # 1: the rollout's weights are known to be those sent (checked, or shared)
        # partial rollouts: generations and a weight load run on threads of their own; this orders a load
        # against the version a generation starts from
        self.weights_lock = threading.Lock()
        self.weights_loaded = threading.Condition(self.weights_lock)  # notified after each load

    def has(self, role: str) -> bool:
        return role in self.config.roles

    def close(self) -> None:
        """Stop the rollout's engine (its server or engine processes; an in-process vLLM destroys the
        process groups it made), called by the host before the process group goes."""
        if self.driver is not None:
            driver, self.driver = self.driver, None
            driver.close()
        close = getattr(self.rollout, "close", None)
        if callable(close):
            self.rollout = None
            close()

    def require(self, role: str, method: str) -> Any:
        engine = {"actor": self.actor, "rollout": self.rollout, "ref": self.reference}[role]
        if engine is None:
            state = "is not one of this worker's roles" if not self.has(role) else "is not built yet: call init_model() first"
            raise RuntimeError(f"{method}() needs the {role} role, which {state} (roles: {list(self.config.roles)})")
        return engine

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the roles' engines; a colocated rollout then takes the actor's weights."""
        config = self.config
        if self.has("actor"):
            self.actor = EngineRegistry("engine").build(config.engine, config.engine_config)
            self.actor.init_model()
            self.set_dispatch_info(*self.actor.data_parallel_info())
            from rlplat import registry

            algorithm = registry.get("algorithm", config.algorithm)()
            actor_node = config.actor if config.actor is not None else algorithm.default_nodes()["actor"]["loss"]
            self.actor_loss = algorithm.build_loss("actor", actor_node)
            check_engine_features(self.actor, self.actor_loss, config.engine)
        if self.has("ref"):
            if self.actor is not None and self.lora_sync() is not None and config.reference_engine_config is None:
                self.reference_from_actor = True  # the base model is the actor's with the adapter off: no second copy
            else:
                self.reference = EngineRegistry("engine").build(config.engine, config.reference_engine_config or config.engine_config)
                self.reference.init_model()
        if self.has("rollout"):
            self.rollout = EngineRegistry("rollout").build(config.rollout, config.rollout_config)
            if self.actor is not None:
                self.sync_weights()

    # -- rollout -----------------------------------------------------------------------------------

    def sampling_for(self, meta_info: dict) -> SamplingParams:
        values = {**self.config.sampling, **{k: v for k, v in meta_info.items() if k in SAMPLING_KEYS}}
        if values.get("seed") is not None:
            values["seed"] = int(values["seed"]) + 1_000_003 * self.rank  # ranks must not draw the same stream
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        return SamplingParams(**values)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts (left-padded ``input_ids``, ``attention_mask``, ``position_ids``) -> the rollout's
        output (see ``RolloutEngine.generate``); sampling from ``config.sampling`` and ``meta_info``."""
        rollout = self.require("rollout", "generate_sequences")
        sampling = self.sampling_for(prompts.meta_info)
        started, window_start = time.perf_counter(), time.time()
        if self.rollout_asleep and self.actor is not None:
            self.sync_weights()  # two generations in a row (validation, then a step): wake with the actor's weights
        self.check_instance(rollout)
        partial = self.config.partial_rollout != "off"
        with self.weights_lock:
            if partial and prompts.meta_info.get(MIN_VERSION) is not None:
                self.wait_for_version(int(prompts.meta_info[MIN_VERSION]))
            version, acked = self.sampling_version(), self.acked_version
            set_version = getattr(rollout, "set_weights_version", None)  # contract method since plugin API 1.2
            if set_version is not None:  # token outputs of a rollout that records versions carry this one
                set_version(version, self.config.partial_rollout) if partial else set_version(version)
        driver = self.rollout_driver()
        continuing = bool(prompts.meta_info.get("continue"))  # samples a checkpoint cut short, to go on with
        if driver is not None and driver.handles(prompts) and not continuing:
            output = driver.generate(prompts, sampling)
        elif partial or continuing:  # one generate_tokens call per sample: a load lands between two of their tokens
            output = generate_through_tokens(rollout, prompts, sampling, self.pad_token_id(rollout), version)
        else:
            output = rollout.generate(prompts, sampling)
        if self.config.free_rollout_between_phases:
            rollout.sleep()
            self.rollout_asleep, self.base_synced = True, False
        if "policy_version" in output.batch.keys():  # a driver's per-token versions; -1 where it sampled nothing
            versions = output.batch["policy_version"].long()
            output.batch["policy_version"] = torch.where(versions < 0, torch.full_like(versions, version), versions)
        else:
            output.batch["policy_version"] = torch.full(output.batch["responses"].shape, version, dtype=torch.long)
        if acked != version:  # as the generation started (a partial rollout's load may land during it)
            self.health_events.append(HealthEvent(
                "policy_version", f"the rollout sampled from policy version {version}, but the last weights whose "
                f"apply it acknowledged are version {acked}", role="rollout", rank=self.rank,
                figures={"version": version, "acked_version": acked}))
        # the sampling keys were settings of this call: outputs of different calls must concat cleanly
        meta = {key: value for key, value in output.meta_info.items() if key not in SAMPLING_KEYS and key != MIN_VERSION}
        if partial:
            versions, mask = output.batch["policy_version"], output.batch["response_mask"].bool()
            spans = [len(set(row[keep].tolist())) for row, keep in zip(versions, mask)]
            cut = float(output.batch[ABORTED_KEY].sum()) if ABORTED_KEY in output.batch.keys() else 0.0
            meta["metrics_partial"] = {"async/partial_samples": float(sum(count > 1 for count in spans)),
                                       "async/aborted_samples": cut}
        metrics = {"timing_s/generate_worker": time.perf_counter() - started,
                   "async/generation_start": window_start, "async/generation_end": time.time(),
                   "sentinel/weights_verified": self.weights_verified, **meta.pop("metrics_partial", {})}
        events = [*meta.pop(HEALTH_EVENTS, ()), *(event.as_dict() for event in self.health_events)]
        self.health_events = []
        return output.with_meta_info({**meta, "metrics": metrics, **({HEALTH_EVENTS: events} if events else {})})

    def wait_for_version(self, version: int, timeout_s: float = 600.0) -> None:
        """Holding ``weights_lock``: wait until the rollout holds policy version ``version`` or newer (partial
        rollouts: a load sent before this generation runs beside it, and the generation starts after it, as
        the staleness bound assumes)."""
        if not self.weights_loaded.wait_for(lambda: self.rollout_version >= version, timeout=timeout_s):
            raise TimeoutError(f"rollout rank {self.rank}: the weights of policy version {version}, sent before this "
                               f"generation, did not arrive within {timeout_s:.0f} s (it holds version {self.rollout_version})")

    def check_instance(self, rollout: Any) -> None:
        """A rollout engine that restarted since its last acknowledged sync (:meth:`RolloutEngine.instance_id`)
        holds stale weights: refresh it from the colocated actor before it serves (a ``replica`` event), or
        refuse to serve (:class:`StaleReplicaError`) when this process has no actor to refresh it from."""
        instance = rollout.instance_id()
        if self.acked_instance is NOT_ACKED or instance == self.acked_instance:
            return
        figures = {"instance": instance, "acked_instance": self.acked_instance, "acked_version": self.acked_version}
        if self.actor is None:
            from rlplat.contracts.health import StaleReplicaError

            raise StaleReplicaError(
                f"rollout engine restarted ({self.acked_instance} -> {instance}) since it was sent policy version "
                f"{self.acked_version}; it holds stale weights and serves nothing until the trainer sends it weights again",
                role="rollout", rank=self.rank, figures=figures)
        self.acked_version = None
        self.sync_weights()
        refreshed = self.acked_version == self.actor_version
        self.health_events.append(HealthEvent(
            "replica", f"the rollout engine restarted ({figures['acked_instance']} -> {instance}) with stale weights; "
            + ("refreshed with the actor's weights before serving" if refreshed else "its refresh was not acknowledged"),
            role="rollout", rank=self.rank, figures={**figures, "state": "stale", "refreshed": refreshed}))

    def sampling_version(self) -> int:
        """The policy version the rollout samples from now (see the module docstring)."""
        return self.actor_version if self.weights_shared and self.actor is not None else self.rollout_version

    @register(Dispatch.ONE_TO_ALL)
    def set_policy_version(self, version: int) -> None:
        """Number the actor's current weights ``version`` (the trainer's step, after a resume); a colocated
        rollout holding them takes the same number."""
        if self.actor is not None:
            if self.rollout is not None and self.rollout_version == self.actor_version:
                if self.acked_version == self.rollout_version:
                    self.acked_version = int(version)
                self.rollout_version = int(version)
            self.actor_version = int(version)
        elif self.rollout is not None:
            self.rollout_version = int(version)  # acknowledged by the load that follows

    def rollout_driver(self) -> Any:
        """The run's rollout driver (kind ``rollout_driver``) over this worker's rollout, built once; None
        when the run has none (batches go through the rollout's ``generate``)."""
        if self.driver is None and self.config.rollout_driver is not None:
            from rlplat import registry
            from rlplat.contracts.rollout import RolloutDriverContext

            context = RolloutDriverContext(
                engines=[self.rollout], node=dict(self.config.driver_node), tokenizer_path=self.config.tokenizer_path,
                prompt_length=self.config.prompt_length, template_kwargs=dict(self.config.template_kwargs),
                trajectory_scorer=self.trajectory_scorer(), policy_version=self.sampling_version)
            self.driver = registry.get("rollout_driver", self.config.rollout_driver)(context)
        return self.driver

    def trajectory_scorer(self) -> Any:
        """The run's reward manager's scorer of finished trajectories
        (:meth:`~rlplat.contracts.reward.RewardManager.trajectory_scorer`), built in this worker; None when
        the run has no manager here or the manager scores batches only."""
        node = dict(self.config.reward)
        if not node.get("manager"):
            return None
        from transformers import AutoTokenizer

        from rlplat import registry
        from rlplat.scorers import scorer_for

        custom = node.get("custom_function") or {}
        scorer = scorer_for(node.get("scorer"), custom.get("path"), custom.get("name") or "compute_score")
        tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path) if self.config.tokenizer_path else None
        manager = registry.get("reward_manager", node["manager"])(scorer, tokenizer, node.get("config") or {})
        return manager.trajectory_scorer()

    # -- log-probs ---------------------------------------------------------------------------------

    def temperature(self, batch: DataProto) -> float:
        return float(batch.meta_info.get("temperature", self.config.sampling.get("temperature", 1.0)))

    @register(Dispatch.DP_MESH)
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` [B, R] of ``responses`` under the actor, at the rollout's
        temperature."""
        actor = self.require("actor", "compute_log_prob")
        outputs = actor.forward(batch, temperature=self.temperature(batch), calculate_entropy=True)
        columns = {"old_log_probs": outputs.batch["log_probs"], "entropys": outputs.batch["entropy"]}
        if ROUTES in outputs.batch.keys():  # actor.moe.router_replay=r2: the routes the update replays
            columns[ROUTES] = outputs.batch[ROUTES]
        return DataProto.from_dict(columns)

    @register(Dispatch.DP_MESH)
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """``ref_log_prob`` [B, R] of ``responses`` under the reference model."""
        if self.reference_from_actor:
            actor = self.require("actor", "compute_ref_log_prob")
            with actor.adapter_disabled():
                outputs = actor.forward(batch, temperature=self.temperature(batch))
        else:
            outputs = self.require("ref", "compute_ref_log_prob").forward(batch, temperature=self.temperature(batch))
        return DataProto.from_dict({"ref_log_prob": outputs.batch["log_probs"]})

    def lora_sync(self) -> str | None:
        """``actor.lora.sync`` (``merged`` or ``adapter``) when the actor trains LoRA adapters, else None."""
        lora = dict(self.config.engine_config).get("lora")
        return (lora.get("sync") or "merged") if lora and lora.get("rank") else None

    # -- training ----------------------------------------------------------------------------------

    @register(Dispatch.DP_MESH)
    def update_actor(self, batch: DataProto, loss_fn: Any = None) -> DataProto:
        """One actor update on ``batch`` (reads ``responses``, ``response_mask``, ``old_log_probs``,
        ``advantages`` and ``ref_log_prob`` with a KL loss) with ``loss_fn``, a
        :class:`~rlplat.contracts.engine.LossFunction` built in the driver and shipped here by value
        (None: the algorithm's actor loss built from the ``actor`` node at ``init_model``).
        ``meta_info["metrics"]`` holds the engine's and the loss's metrics.

        A batch without ``old_log_probs`` gets a strictly on-policy update: one epoch of one mini-batch
        (one optimizer step), whose forward supplies them (:class:`OldLogProbsFromForward`); they come
        back as the result's one column. Otherwise the result has no rows."""
        actor = self.require("actor", "update_actor")
        loss_fn = loss_fn if loss_fn is not None else self.actor_loss
        meta = {"temperature": self.temperature(batch), "calculate_entropy": bool(getattr(loss_fn, "needs_entropy", False)),
                **batch.meta_info}
        started = time.perf_counter()
        batch = without_padding_weight(batch, self.padding_rows)
        from_forward = None
        if "old_log_probs" not in batch.batch.keys():
            from_forward = OldLogProbsFromForward(loss_fn, len(batch))
            tensors = batch.batch.clone(recurse=False)
            tensors.set(ROW_INDEX, torch.arange(len(batch)))
            batch, loss_fn = DataProto(tensors, batch.non_tensor_batch, batch.meta_info), from_forward
            meta.update(ppo_mini_batch_size=None, ppo_epochs=1)  # one optimizer step: every forward precedes it
        window_start = time.time()
        metrics = actor.train_batch(batch.with_meta_info(meta), loss_fn)
        self.actor_version += 1
        metrics = {f"actor/{k}" if "/" not in k else k: v for k, v in metrics.items()}
        metrics["timing_s/update_actor_worker"] = time.perf_counter() - started
        metrics.update({"async/update_start": window_start, "async/update_end": time.time()})
        if from_forward is None:
            return DataProto(meta_info={"metrics": metrics})
        entropy = from_forward.entropy()
        if entropy is not None and "actor/entropy" not in metrics:
            metrics["actor/entropy"] = entropy
        if not self.dispatch_info()[2]:
            # The driver takes this data-parallel group's output from another rank: an engine's rank that
            # computes no loss (a pipeline stage before the last) never sees the log-probs.
            return DataProto.from_dict({"old_log_probs": torch.zeros(len(batch), batch.batch["responses"].shape[1])},
                                       meta_info={"metrics": metrics})
        return DataProto.from_dict({"old_log_probs": from_forward.result()}, meta_info={"metrics": metrics})

    # -- weights -----------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict[str, float]:
        """Engine -> colocated rollout. Zero-copy where it can (``share_weights``; the engine holds whole
        parameters on the rollout's device and dtype): the rollout's weights become views of the engine's
        (:meth:`TrainingEngine.shared_weights`, :meth:`RolloutEngine.bind_weights`), so a sync copies
        nothing and the model exists once. Otherwise one bucket at a time (never a second full copy in
        flight). Returns ``sync/bytes`` copied and ``sync/shared``."""
        actor, rollout = self.require("actor", "sync_weights"), self.require("rollout", "sync_weights")
        started, moved = time.perf_counter(), 0
        if self.lora_sync() == "adapter":
            return self.sync_adapter(actor, rollout, started)
        if self.config.share_weights:
            shared = actor.shared_weights()
            if shared is not None and rollout.bind_weights(shared):
                self.rollout_asleep, self.weights_shared = False, True
                self.rollout_version = self.acked_version = self.actor_version  # the same tensors: nothing to check
                self.weights_verified, self.acked_instance = 1.0, rollout.instance_id()
                return {"timing_s/sync_weights": time.perf_counter() - started, "sync/bytes": 0.0, "sync/shared": 1.0}
        rollout.wake_up_weights()
        sent = self.sent_fingerprints()
        for bucket in actor.named_weights(self.config.weight_bucket_bytes):
            rollout.update_weights(bucket)
            moved += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            sent.add(bucket)
        rollout.wake_up_kv_cache()
        self.rollout_asleep, self.weights_shared = False, False
        self.rollout_version = self.actor_version
        self.acknowledge(sent, self.actor_version)
        return {"timing_s/sync_weights": time.perf_counter() - started, "sync/bytes": float(moved), "sync/shared": 0.0}

    def sent_fingerprints(self) -> "SentWeights":
        return SentWeights(self.config.weight_checks)

    def acknowledge(self, sent: "SentWeights", version: int) -> None:
        """Count ``version`` as applied when the rollout holds what ``sent`` saw (or cannot tell: then the
        check is counted as skipped); otherwise leave the acknowledged version as it was and record a
        ``weight_checksum`` event naming the tensors that differ."""
        held = self.rollout.weight_fingerprints() if sent.enabled else None
        if held is None:
            self.acked_version, self.weights_verified, self.acked_instance = version, 0.0, self.rollout.instance_id()
            return
        from rlplat.kits.weights import compare

        compared, problems = compare(sent.fingerprints, held)
        self.weights_verified = float(not problems and compared > 0)
        if problems or not compared:
            shown = dict(list(problems.items())[:3])
            self.health_events.append(HealthEvent(
                "weight_checksum", f"after the weight sync to version {version}, {len(problems)} of {compared} tensors "
                f"the rollout holds differ from what was sent: " + ("; ".join(f"{name}: {why}" for name, why in shown.items())
                                                                    or "no tensor name in common"),
                role="rollout", rank=self.rank, figures={"version": version, "compared": compared, "differ": len(problems),
                                                         "tensors": sorted(problems)[:20]}))
            return
        self.acked_version, self.acked_instance = version, self.rollout.instance_id()

    def sync_adapter(self, actor: Any, rollout: Any, started: float) -> dict[str, float]:
        """LoRA with ``sync=adapter``: the base weights once (the adapter off), then the adapter alone."""
        moved = 0
        rollout.wake_up_weights()
        if not self.base_synced:
            with actor.adapter_disabled():
                for bucket in actor.named_weights(self.config.weight_bucket_bytes):
                    rollout.update_weights(bucket)
                    moved += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            self.base_synced = True
        adapter_config, tensors = actor.adapter_weights()
        rollout.load_adapter(adapter_config, tensors)
        moved += sum(tensor.numel() * tensor.element_size() for _, tensor in tensors)
        rollout.wake_up_kv_cache()
        self.rollout_asleep, self.weights_shared = False, False
        self.rollout_version = self.acked_version = self.actor_version  # adapters are merged: not fingerprinted
        self.weights_verified, self.acked_instance = 0.0, rollout.instance_id()
        return {"timing_s/sync_weights": time.perf_counter() - started, "sync/bytes": float(moved), "sync/shared": 0.0}

    @register(Dispatch.ONE_TO_ALL)
    def export_weights(self, full: bool = False) -> dict[str, Any] | None:
        """The actor's weights with their policy version, from rank 0 (every rank takes part in
        gathering them), for a rollout in another worker group; chain the future into its
        ``load_weights``. ``{"version": v, "buckets": [...]}``: full weights (the adapter merged in), or
        with LoRA ``sync=adapter`` the adapter alone (``"adapter": (config, tensors)``), preceded by the
        base weights in ``buckets`` when ``full`` (the first sync of that rollout)."""
        actor = self.require("actor", "export_weights")
        payload: dict[str, Any] = {"version": self.actor_version, "buckets": []}
        if self.lora_sync() == "adapter":
            if full:
                with actor.adapter_disabled():
                    payload["buckets"] = [pack_bucket(bucket) for bucket in actor.named_weights(self.config.weight_bucket_bytes)]
            payload["adapter"] = actor.adapter_weights()
        else:
            payload["buckets"] = [pack_bucket(bucket) for bucket in actor.named_weights(self.config.weight_bucket_bytes)]
        return payload if self.rank == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, exported: list) -> None:
        """Load what ``export_weights`` produced (the result of a ONE_TO_ALL call: one entry per actor
        rank); the rollout then samples from the exported policy version. With partial rollouts it lands
        during the generations in flight: they pause at a token boundary, the weights change, and they go
        on with them in the configured mode, their tokens from then on numbered with the new version (a
        load older than the weights held, overtaken by a newer one, is skipped)."""
        rollout = self.require("rollout", "load_weights")
        weights = next(part for part in exported if part is not None)
        partial = self.config.partial_rollout != "off"
        with self.weights_lock:
            if partial and int(weights["version"]) < self.rollout_version:
                return
            if partial:
                rollout.pause_generation()
            try:
                rollout.wake_up_weights()
                sent = self.sent_fingerprints()
                for packed in weights["buckets"]:
                    bucket = unpack_bucket(packed)
                    rollout.update_weights(bucket)
                    sent.add(bucket)
                if weights.get("adapter") is not None:
                    rollout.load_adapter(*weights["adapter"])
                    sent.enabled = False  # adapters are merged into the served weights: not fingerprinted
                rollout.wake_up_kv_cache()
                self.rollout_asleep, self.rollout_version = False, int(weights["version"])
                if partial:
                    rollout.set_weights_version(self.rollout_version, self.config.partial_rollout)
            finally:
                if partial:
                    rollout.resume_generation()
            self.acknowledge(sent, self.rollout_version)
            self.weights_loaded.notify_all()

    @register(Dispatch.ONE_TO_ALL)
    def abort_generations(self) -> None:
        """End the generations in flight now (partial rollouts): each returns its samples with the tokens
        they have, those cut short marked in ``rollout_aborted``, for a checkpoint to store them. Not with a
        rollout driver: an agent's conversation cut short cannot go on from its tokens alone (its tools and
        environment have state), so its generations run to their end and the checkpoint waits for them."""
        rollout = self.require("rollout", "abort_generations")
        if self.config.rollout_driver is None:
            rollout.abort_generation()

    def pad_token_id(self, rollout: Any) -> int:
        """The rollout's pad token (its ``pad_token_id``), else the tokenizer's model's."""
        pad = getattr(rollout, "pad_token_id", None)
        if pad is None:
            pad, _ = pad_and_eos_token_ids(self.config.tokenizer_path, None, None, type(rollout).__name__)
        return int(pad)

    @register(Dispatch.ONE_TO_ALL)
    def sleep_rollout(self) -> None:
        self.require("rollout", "sleep_rollout").sleep()
        self.rollout_asleep, self.base_synced = True, False

    # -- checkpoints -------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The actor's resumable checkpoint under ``path/actor``."""
        self.require("actor", "save_checkpoint").save(str(Path(path) / "actor"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore ``path/actor``; a colocated rollout then takes the restored weights."""
        self.require("actor", "load_checkpoint").load(str(Path(path) / "actor"))
        if self.rollout is not None:
            self.sync_weights()


class SentWeights:
    """The fingerprints of the tensors one sync sends (nothing when ``enabled`` is False)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.fingerprints: dict[str, Any] = {}

    def add(self, bucket: Any) -> None:
        if self.enabled:
            from rlplat.kits.weights import fingerprint

            self.fingerprints.update((name, fingerprint(tensor)) for name, tensor in bucket)
