"""Conformance suite for worker roles (kind ``role``, contract :class:`rlplat.contracts.role.Role`).

A plugin subclasses :class:`RoleConformance` and provides the ``role`` fixture (what its registered
factory returns); ``run_context`` defaults to the default preset's resolved config with GRPO (the built-in
demo's, from rlplat-demo) and may be overridden. The suite checks what the trainer relies on without
starting any process: the answers of :meth:`Role.enabled` and :meth:`Role.worker`, a worker class whose
driver-callable methods are registered, and a placement the role's node accepts.
"""

from __future__ import annotations

import pytest

from rlplat.contracts.role import PLACEMENTS, Role, RunContext


class RoleConformance:
    """Fixture to provide: ``role``. Optional: ``run_context`` (a :class:`RunContext`)."""

    @pytest.fixture
    def run_context(self) -> RunContext:
        from rlplat import presets, registry
        from rlplat.config import load_config

        default = presets.default_name()
        if default is None:
            pytest.fail(f"RoleConformance.run_context reads the default preset's config, and no plugin registers one: "
                        f"override the run_context fixture, or {presets.INSTALL_HINT}")
        config = load_config(None, presets.overrides(default), algo="grpo")
        return RunContext(config, registry.get("algorithm", "grpo")(), total_steps=1)

    def test_is_a_role(self, role):
        assert isinstance(role, Role)

    def test_says_whether_the_run_needs_it_as_a_boolean(self, role, run_context):
        assert isinstance(role.enabled(run_context), bool)

    def test_builds_a_worker_spec_of_a_worker_class_with_registered_methods(self, role, run_context):
        from rlplat.controller.decorator import registered_methods
        from rlplat.controller.host import WorkerSpec
        from rlplat.controller.worker import Worker

        spec = role.worker(run_context)
        assert isinstance(spec, WorkerSpec)
        assert isinstance(spec.cls, type) and issubclass(spec.cls, Worker)
        assert registered_methods(spec.cls), f"{spec.cls.__name__} registers no method the driver could call"

    def test_its_default_placement_is_a_known_one(self, role):
        assert role.default_placement in PLACEMENTS
        assert isinstance(role.movable, bool)

    def test_takes_no_part_in_a_stage_it_does_not_know(self, role):
        assert role.on_stage("no-such-stage", group=None, batch=None) is None
