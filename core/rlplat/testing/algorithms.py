"""Conformance suite for algorithm specs (kind ``algorithm``)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from rlplat.contracts.algorithm import Algorithm
from rlplat.testing.api_levels import implementation_api, skip_unless_asked


class AlgorithmConformance:
    """Fixture to provide: ``algorithm`` (what the registered factory returns). Optional:
    ``registered_name``, ``plugin_api`` (the plugin API range it is written for; found from its plugin by
    default, see :mod:`rlplat.testing.api_levels`). The estimator and loss it names must be registered in
    the process-wide registry, so install the plugins that provide them."""

    @pytest.fixture
    def registered_name(self) -> str | None:
        return None

    @pytest.fixture
    def plugin_api(self, algorithm, registered_name) -> str | None:
        return implementation_api(algorithm, "algorithm", registered_name)

    def test_is_an_algorithm_with_a_name(self, algorithm):
        assert isinstance(algorithm, Algorithm)
        assert isinstance(algorithm.name, str) and algorithm.name

    def test_names_a_registered_estimator_and_loss(self, algorithm):
        from rlplat import registry

        assert callable(registry.get("advantage_estimator", algorithm.adv_estimator))
        assert callable(registry.get("policy_loss", algorithm.policy_loss))

    def test_declares_its_needs_as_booleans(self, algorithm):
        assert isinstance(algorithm.needs_critic, bool)
        assert isinstance(algorithm.needs_reference, bool)

    def test_default_config_is_a_mapping_of_plain_values(self, algorithm):
        assert isinstance(algorithm.default_config, Mapping)
        for key in algorithm.default_config:
            assert isinstance(key, str)

    def test_builds_its_actor_loss_from_its_default_actor_config(self, algorithm):
        assert callable(algorithm.build_loss("actor", algorithm.default_nodes()["actor"]["loss"]))

    def test_builds_its_critic_loss_from_its_default_critic_config(self, algorithm, plugin_api):
        if not algorithm.needs_critic:  # every algorithm gets a critic with critic.enable=true (API 1.1)
            skip_unless_asked(plugin_api, "1.1", "a critic loss of an algorithm that needs no critic")
        assert callable(algorithm.build_loss("critic", algorithm.default_nodes().get("critic", {}).get("loss")))

    def test_its_default_nodes_fit_the_schemas_they_are_checked_against(self, algorithm, registered_name):
        from rlplat.config_node import read_config_node, resolve_schema
        from rlplat.contracts.algorithm import algorithm_node_schema

        nodes = algorithm.default_nodes()
        for role in ("actor", "critic"):
            schema = algorithm.loss_schema(role)
            if schema is not None:
                read_config_node(nodes.get(role, {}).get("loss"), schema, f"{role}.loss")
        schema = None
        if registered_name is not None:
            from rlplat import registry

            schema = resolve_schema(registry.entry("algorithm", registered_name).config_schema)
        read_config_node(nodes["algorithm"], algorithm_node_schema(schema), "algorithm")

    def test_says_whether_its_default_config_reads_the_reference(self, algorithm):
        nodes = algorithm.default_nodes()
        assert isinstance(algorithm.uses_reference(nodes["actor"]["loss"], nodes["algorithm"]), bool)

    def test_registered_name_matches_the_spec(self, algorithm, registered_name):
        if registered_name is None:
            pytest.skip("the subclass names no registered_name")
        from rlplat import registry

        assert registry.get("algorithm", registered_name)().name == algorithm.name
