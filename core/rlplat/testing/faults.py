"""Fault injection for tests of the run sentinel (:mod:`rlplat.trainer.sentinel`): each context manager here
makes one fault happen in a run trained inside it, so a test can expect the fault's named error.

Testing hooks, not production switches: they patch classes for the duration of the ``with`` block, nothing in
rlplat reads them, and they reach only workers in the test's own process (``cluster.backend=local``)::

    with faults.corrupted_rollout_tensor():
        with pytest.raises(WeightCorruptedError):
            fit_run(config)

``from_sync`` counts the weight syncs of the process's workers from 1 (a colocated rollout's first sync is at
start-up; a rollout in its own pool gets its first load when the run starts); ``at_step`` is a trainer step.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Iterator

def _sync_counter() -> Any:
    return itertools.count(1)


@contextlib.contextmanager
def _patched(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(owner, name)
    # wraps: a worker method keeps its @register mark (rlplat.controller.decorator), so groups still call it
    setattr(owner, name, functools.wraps(original)(replacement(original)))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def skipped_weight_sync(at_step: int = 2) -> Iterator[None]:
    """The trainer's weight sync after step ``at_step``'s update does nothing (a push that got lost): the next
    step samples from the previous version (``WeightSyncSkippedError``). Needs weights that are copied
    (``rollout.share_weights=false``); shared weights need no sync."""
    from rlplat.trainer import Trainer

    def replacement(original: Any) -> Any:
        def sync_weights(self: Any, full: bool = False) -> dict[str, float]:
            return {} if self.step == at_step else original(self, full)
        return sync_weights

    with _patched(Trainer, "sync_weights", replacement):
        yield


@contextlib.contextmanager
def corrupted_rollout_tensor(from_sync: int = 1, scale: float = 1.5) -> Iterator[None]:
    """From weight sync ``from_sync`` on, the first tensor of each sync reaches the rollout multiplied by
    ``scale`` (the rest arrive intact): ``WeightCorruptedError`` naming it."""
    from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

    syncs = _sync_counter()

    def replacement(original: Any) -> Any:
        def sync(self: Any, *args: Any, **kwargs: Any) -> Any:
            if next(syncs) < from_sync:
                return original(self, *args, **kwargs)
            rollout, corrupted = self.rollout, []

            def update_weights(named_tensors: Any) -> None:
                bucket = list(named_tensors)
                type(rollout).update_weights(rollout, bucket)
                if bucket and not corrupted:
                    name, tensor = bucket[0]
                    type(rollout).update_weights(rollout, [(name, tensor * scale)])
                    corrupted.append(name)

            rollout.update_weights = update_weights
            try:
                return original(self, *args, **kwargs)
            finally:
                del rollout.update_weights
        return sync

    with _patched(ActorRolloutRefWorker, "sync_weights", replacement), \
            _patched(ActorRolloutRefWorker, "load_weights", replacement):
        yield


@contextlib.contextmanager
def version_bumped_without_apply(from_sync: int = 2) -> Iterator[None]:
    """From weight sync ``from_sync`` on, a colocated sync advances the rollout's policy version and returns
    without sending a weight (a version counter bumped after a failed apply): ``PolicyVersionError``."""
    from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

    syncs = _sync_counter()

    def replacement(original: Any) -> Any:
        def sync_weights(self: Any) -> dict[str, float]:
            if next(syncs) < from_sync:
                return original(self)
            self.rollout_version = self.actor_version
            self.weights_shared = False
            return {"sync/bytes": 0.0, "sync/shared": 0.0}
        return sync_weights

    with _patched(ActorRolloutRefWorker, "sync_weights", replacement):
        yield


@contextlib.contextmanager
def non_finite_advantages(at_step: int = 2) -> Iterator[None]:
    """Step ``at_step``'s advantages get a NaN on the first valid token of row 0: ``NonFiniteError``."""
    from rlplat.trainer import Trainer

    def replacement(original: Any) -> Any:
        def compute_advantage(self: Any, batch: Any) -> Any:
            batch, metrics = original(self, batch)
            if self.step == at_step:
                first = int(batch.batch["response_mask"][0].nonzero()[0])
                batch.batch["advantages"][0, first] = float("nan")
            return batch, metrics
        return compute_advantage

    with _patched(Trainer, "compute_advantage", replacement):
        yield


@contextlib.contextmanager
def non_finite_loss(at_step: int = 2) -> Iterator[None]:
    """The actor update of step ``at_step`` reads a NaN advantage on the first valid token of row 0 (after the
    driver's own check of the advantages), so its loss and gradients are NaN: ``NonFiniteError`` from the
    update's metrics."""
    from rlplat.trainer import Trainer
    from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

    steps: list[int] = []

    def trainer_step(original: Any) -> Any:
        def train_step(self: Any) -> Any:
            steps.append(self.step)
            return original(self)
        return train_step

    def replacement(original: Any) -> Any:
        def update_actor(self: Any, batch: Any, loss_fn: Any = None) -> Any:
            if steps and steps[-1] == at_step:
                advantages = batch.batch["advantages"].clone()
                advantages[0, int(batch.batch["response_mask"][0].nonzero()[0])] = float("nan")
                batch.batch["advantages"] = advantages
            return original(self, batch, loss_fn)
        return update_actor

    with _patched(Trainer, "train_step", trainer_step), _patched(ActorRolloutRefWorker, "update_actor", replacement):
        yield


@contextlib.contextmanager
def restarted_rollout(at_generation: int = 3) -> Iterator[None]:
    """Before the worker's generation number ``at_generation`` (from 1), its rollout engine "restarts": it is
    given back the weights it held at the first generation (what a restarted server loads) and reports a new
    :meth:`~rlplat.contracts.rollout.RolloutEngine.instance_id`. The worker must refresh it before it serves
    (a ``replica`` event) or refuse (``StaleReplicaError``)."""
    from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

    calls = _sync_counter()
    first: list[tuple[str, Any]] = []

    def replacement(original: Any) -> Any:
        def generate_sequences(self: Any, prompts: Any) -> Any:
            number, rollout = next(calls), self.rollout
            if number == 1 and self.actor is not None:
                first.extend((name, tensor.clone()) for bucket in self.actor.named_weights() for name, tensor in bucket)
            if number == at_generation:
                type(rollout).update_weights(rollout, first)
                rollout.instance_id = lambda: f"restarted-before-generation-{at_generation}"
            return original(self, prompts)
        return generate_sequences

    with _patched(ActorRolloutRefWorker, "generate_sequences", replacement):
        yield

