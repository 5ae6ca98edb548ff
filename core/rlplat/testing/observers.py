"""Conformance suite for step observers (kind ``step_observer``, contract
:class:`rlplat.contracts.observer.StepObserver`).

A plugin subclasses :class:`StepObserverConformance` and provides the ``observer_factory`` fixture (what its
registration names). ``observed_run`` defaults to an :class:`~rlplat.contracts.observer.ObservedRun` of core's
default run config (every registered node at its defaults) in a temporary run directory; override it to set
the keys that switch the observer on. The suite tells the observer a whole two-step run, every stage of
:data:`~rlplat.contracts.observer.STAGES` with a small trained batch, and checks what the trainer relies on: it
is a :class:`StepObserver` (or the factory says None: not for this run) with an integer ``order``, it never
changes a batch (its tensors, non-tensor columns and meta_info, health events aside: an observer may take
those), what it adds to the metrics is a number or a list of numbers, and it finishes a failed run.
"""

from __future__ import annotations

import copy
import numbers
from typing import Any, Callable

import pytest

from rlplat.contracts.observer import STAGES, ObservedRun, StepObserver

#: The metrics a step has when its observers see ``trained`` and ``step_end``.
STEP_METRICS = {"actor/pg_loss": -0.1, "actor/grad_norm": 0.5, "actor/entropy": 1.2, "response_length/mean": 3.0,
                "critic/score/mean": 0.5, "timing_s/step": 0.2, "perf/throughput": 100.0}


def trained_batch(step: int) -> Any:
    """A batch of 4 rows (2 prompts x 2 samples) as a step's stages see it, advantages included."""
    import torch

    from rlplat.protocol import DataProto

    generator = torch.Generator().manual_seed(step)
    responses = torch.randint(0, 50, (4, 3), generator=generator)
    prompts = torch.randint(0, 50, (4, 2), generator=generator)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.long)
    tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], -1),
               "attention_mask": torch.cat([torch.ones(4, 2, dtype=torch.long), mask], -1), "response_mask": mask,
               "token_level_scores": torch.zeros(4, 3), "old_log_probs": -torch.rand(4, 3, generator=generator),
               "advantages": torch.randn(4, 3, generator=generator) * mask,
               "policy_version": torch.full((4, 3), step - 1, dtype=torch.long)}
    import numpy as np

    non_tensors = {"uid": np.array([f"e0-i{step}a", f"e0-i{step}a", f"e0-i{step}b", f"e0-i{step}b"], dtype=object),
                   "data_source": np.array(["arith"] * 4, dtype=object)}
    return DataProto.from_dict(tensors, non_tensors, meta_info={"reward_metrics": {"reward/acc/mean": 0.5}})


def snapshot(batch: Any) -> tuple[dict, dict, dict]:
    from rlplat.contracts.health import HEALTH_EVENTS

    return ({key: batch.batch[key].clone() for key in batch.batch.keys()} if batch.batch is not None else {},
            copy.deepcopy(dict(batch.non_tensor_batch)),
            {key: copy.deepcopy(value) for key, value in batch.meta_info.items() if key != HEALTH_EVENTS})


def differences(before: tuple[dict, dict, dict], batch: Any) -> list[str]:
    import numpy as np
    import torch

    tensors, non_tensors, meta = before
    after_tensors, after_non_tensors, after_meta = snapshot(batch)
    found = []
    if set(tensors) != set(after_tensors):
        found.append(f"tensor columns {sorted(tensors)} became {sorted(after_tensors)}")
    found += [f"tensor column {key!r} changed" for key in set(tensors) & set(after_tensors)
              if not torch.equal(tensors[key], after_tensors[key])]
    if set(non_tensors) != set(after_non_tensors):
        found.append(f"non-tensor columns {sorted(non_tensors)} became {sorted(after_non_tensors)}")
    found += [f"non-tensor column {key!r} changed" for key in set(non_tensors) & set(after_non_tensors)
              if not np.array_equal(non_tensors[key], after_non_tensors[key])]
    if meta != after_meta:
        found.append(f"meta_info {meta} became {after_meta}")
    return found


def default_run(tmp_path: Any, **overrides: Any) -> ObservedRun:
    """An :class:`ObservedRun` of core's default run config (every registered node at its defaults) with
    ``overrides`` (dotted key -> value), run directory ``tmp_path / "run"``, two steps."""
    from omegaconf import OmegaConf

    from rlplat.config import base_config

    config = base_config()
    for key, value in {"trainer.output_dir": str(tmp_path / "run"), **overrides}.items():
        OmegaConf.update(config, key, value, merge=False)
    (tmp_path / "run").mkdir(exist_ok=True)
    return ObservedRun(config, OmegaConf.to_container(config, resolve=True), tmp_path / "run", total_steps=2)


class StepObserverConformance:
    """Fixture to provide: ``observer_factory``. Optional: ``observed_run`` (an :class:`ObservedRun`, e.g.
    :func:`default_run` with the keys that switch the observer on)."""

    @pytest.fixture
    def observed_run(self, tmp_path) -> ObservedRun:
        return default_run(tmp_path)

    @pytest.fixture
    def observer(self, observer_factory: Callable[[ObservedRun], Any], observed_run: ObservedRun) -> StepObserver:
        built = observer_factory(observed_run)
        if built is None:
            pytest.skip("the factory returns None for this run (override observed_run with the keys that switch it on)")
        return built

    def drive(self, observer: StepObserver, run: ObservedRun, check: Callable[[str, Any, dict], None]) -> None:
        """A two-step run, every stage once per step (``validation`` twice), through ``observer``."""
        from rlplat.protocol import DataProto

        run.observers = {"observed": observer}
        observer.start(run)
        for step in (1, 2):
            run.step = step
            metrics: dict[str, Any] = {}
            for stage in STAGES:
                if stage in ("generated", "validation"):
                    observer.on_phase("gen")
                batch = DataProto(meta_info={"seed": step}) if stage == "probed" else (
                    None if stage in ("step", "step_end", "step_done") else trained_batch(step))
                if stage in ("trained", "step_end"):
                    metrics.update(STEP_METRICS)
                before = snapshot(batch) if batch is not None else None
                observer.on_stage(stage, batch, metrics)
                check(stage, (before, batch), metrics)
        observer.finish("finished")

    def test_is_a_step_observer_with_an_integer_order(self, observer):
        assert isinstance(observer, StepObserver)
        assert isinstance(observer.order, int) and not isinstance(observer.order, bool)

    def test_watches_a_whole_run_without_changing_a_batch(self, observer, observed_run):
        changed = []

        def check(stage: str, seen: Any, metrics: dict) -> None:
            before, batch = seen
            if batch is not None:
                changed.extend(f"{stage}: {difference}" for difference in differences(before, batch))

        self.drive(observer, observed_run, check)
        assert changed == []

    def test_what_it_adds_to_the_metrics_are_numbers(self, observer, observed_run):
        added = {}

        def check(stage: str, seen: Any, metrics: dict) -> None:
            added.update({key: value for key, value in metrics.items() if key not in STEP_METRICS})

        self.drive(observer, observed_run, check)
        numeric = lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool)  # noqa: E731
        wrong = {key: value for key, value in added.items()
                 if not (numeric(value) or (isinstance(value, list) and all(map(numeric, value))))}
        assert wrong == {}, f"metrics must be numbers or lists of numbers: {wrong}"

    def test_finishes_a_failed_run_without_raising(self, observer, observed_run):
        observed_run.observers = {"observed": observer}
        observer.start(observed_run)
        observed_run.step = 1
        observer.on_stage("step", None, {})
        observer.finish("failed", RuntimeError("the step failed"))
