"""rlplat's own step observers (kind ``step_observer``: the sentinel, status.json, the rollout dump, the
trained-prompts log, the profiler) pass the step-observer suite, each switched on."""

from __future__ import annotations

import pytest

from rlplat import registry
from rlplat.builtin_plugin import STEP_OBSERVERS
from rlplat.testing import StepObserverConformance
from rlplat.testing.observers import default_run


class TestBuiltinStepObservers(StepObserverConformance):
    @pytest.fixture(params=sorted(STEP_OBSERVERS))
    def observer_factory(self, request):
        return registry.get("step_observer", request.param)

    @pytest.fixture
    def observed_run(self, tmp_path):
        return default_run(tmp_path, **{"trainer.rollout_dump_dir": str(tmp_path / "dump"), "trainer.profile.steps": [1]})


def test_every_builtin_observer_is_registered_by_rlplat():
    assert {entry.name for entry in registry.entries("step_observer") if entry.plugin == "rlplat"} == set(STEP_OBSERVERS)
