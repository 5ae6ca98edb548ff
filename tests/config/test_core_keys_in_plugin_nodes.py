"""Keys rlplat puts into plugin-owned config nodes for itself (the policy loss's ``loss_mode``, the ``algorithm``
node's ``name``, ``adv_estimator`` and the loop's other keys) never fail a plugin's schema that does not
declare them, and the plugin still receives every key it declares."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from rlplat.config import ConfigError, algorithm_schema, load_config
from rlplat.config_node import read_config_node
from rlplat.contracts.algorithm import Algorithm, AlgorithmConfig, algorithm_node_schema


@dataclasses.dataclass
class KnobsOnly:
    """A policy loss's schema with its own knob and no ``loss_mode``."""

    temperature: float = 1.0


@dataclasses.dataclass
class AlgorithmKnobsOnly:
    """An algorithm's schema that does not extend AlgorithmConfig (no ``name``, no ``adv_estimator``)."""

    baseline_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.baseline_weight < 0:
            raise ValueError(f"baseline_weight must be >= 0, got {self.baseline_weight}")


def knobs_algorithm() -> Algorithm:
    return Algorithm(name="knobs_algo", adv_estimator="grpo", policy_loss="knobs_loss",
                     default_config={"baseline_weight": 0.25})


def knobs_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
    raise AssertionError("not called: these tests only load configs")


class KnobsPlugin:
    from rlplat import hookimpl

    @hookimpl
    def register_policy_losses(self, register):
        register("knobs_loss", knobs_loss, config_schema=KnobsOnly)

    @hookimpl
    def register_algorithms(self, register):
        register("knobs_algo", knobs_algorithm, config_schema=AlgorithmKnobsOnly)


@pytest.fixture
def knobs_plugin(register_temporary_plugin):
    return register_temporary_plugin(KnobsPlugin(), name="knobs-plugin")


def run_overrides(run_files, *more: str) -> list[str]:
    model, train = run_files
    return [f"model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]", *more]


def test_a_loss_schema_without_loss_mode_loads_and_the_loss_reads_only_its_own_knobs(knobs_plugin, run_files):
    config = load_config(None, run_overrides(run_files, "actor.loss.policy_loss.temperature=0.5"), algo="knobs_algo")
    node = config.actor.loss.policy_loss
    assert dict(node) == {"loss_mode": "knobs_loss", "temperature": 0.5}  # rlplat still selects the loss by it
    # what the loss does with the node it receives (rlplat.losses.PolicyLossConfig.policy_loss), as documented
    assert read_config_node(dict(node), KnobsOnly, "actor.loss.policy_loss") == KnobsOnly(temperature=0.5)


def test_a_misspelled_knob_is_still_an_unknown_key(knobs_plugin, run_files):
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.loss\.policy_loss\.temprature'.*Did you mean "
                                          r"'actor\.loss\.policy_loss\.temperature'"):
        load_config(None, run_overrides(run_files, "actor.loss.policy_loss.temprature=0.5"), algo="knobs_algo")


def test_an_algorithm_schema_without_the_loops_keys_loads_and_its_node_has_both(knobs_plugin, run_files):
    config = load_config(None, run_overrides(run_files, "algorithm.gamma=0.9"), algo="knobs_algo")
    node = read_config_node(dict(config.algorithm), algorithm_schema("knobs_algo"), "algorithm")  # as the trainer reads it
    assert isinstance(node, AlgorithmKnobsOnly) and isinstance(node, AlgorithmConfig)
    assert (node.baseline_weight, node.name, node.adv_estimator, node.gamma) == (0.25, "knobs_algo", "grpo", 0.9)


def test_the_algorithm_schemas_own_checks_and_keys_still_apply(knobs_plugin, run_files):
    with pytest.raises(ConfigError, match="baseline_weight must be >= 0, got -1"):
        load_config(None, run_overrides(run_files, "algorithm.baseline_weight=-1"), algo="knobs_algo")
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm\.baseline_weigth'"):
        load_config(None, run_overrides(run_files, "algorithm.baseline_weigth=1"), algo="knobs_algo")


def test_an_algorithm_node_pickles_as_its_values_and_reads_back_the_same():
    node = algorithm_node_schema(AlgorithmKnobsOnly)(baseline_weight=2.0, gamma=0.5)
    copy = pickle.loads(pickle.dumps(node))
    assert copy == node and isinstance(copy, AlgorithmKnobsOnly)


def test_schemas_that_extend_algorithm_config_or_none_are_read_as_they_are():
    @dataclasses.dataclass
    class Extended(AlgorithmConfig):
        extra: int = 1

    assert algorithm_node_schema(Extended) is Extended
    assert algorithm_node_schema(None) is AlgorithmConfig


def test_an_estimator_typing_the_node_with_its_own_schema_gets_its_keys():
    # an estimator written against plugin API 1.0 received the node as a mapping and typed its own knobs
    as_mapping = {"name": "knobs_algo", "adv_estimator": "grpo", "gamma": 0.9, "baseline_weight": 3.0}
    assert read_config_node(as_mapping, AlgorithmKnobsOnly, "algorithm") == AlgorithmKnobsOnly(baseline_weight=3.0)
    typed = algorithm_node_schema(AlgorithmKnobsOnly)(baseline_weight=3.0)  # what it receives now: already its type
    assert read_config_node(typed, AlgorithmKnobsOnly, "algorithm").baseline_weight == 3.0


def test_a_loss_that_declares_its_modes_refuses_another_at_load(register_temporary_plugin, run_files):
    from rlplat import hookimpl

    class FourModes:
        @hookimpl
        def register_policy_losses(self, register):
            register("four_modes_loss", knobs_loss, config_schema=KnobsOnly, metadata={
                "loss_agg_modes": ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]})

    register_temporary_plugin(FourModes(), name="four-modes")
    overrides = run_overrides(run_files, "actor.loss.policy_loss.loss_mode=four_modes_loss")
    assert load_config(None, [*overrides, "actor.loss.loss_agg_mode=seq-mean-token-mean"], algo="grpo")
    with pytest.raises(ConfigError, match=r"actor\.loss\.loss_agg_mode=token-sum: the policy loss policy_loss "
                                          r"'four_modes_loss' .* supports only token-mean, seq-mean-token-sum, "):
        load_config(None, [*overrides, "actor.loss.loss_agg_mode=token-sum"], algo="grpo")


def test_a_loss_of_a_plugin_declaring_api_1_0_supports_its_four_modes(register_temporary_plugin, run_files):
    from rlplat import hookimpl

    class Api10:
        RLPLAT_PLUGIN_API = ">=1.0,<2"

        @hookimpl
        def register_policy_losses(self, register):
            register("api10_loss", knobs_loss, config_schema=KnobsOnly)

    register_temporary_plugin(Api10(), name="api-1-0")
    overrides = run_overrides(run_files, "actor.loss.policy_loss.loss_mode=api10_loss", "actor.loss.loss_agg_mode=token-sum")
    with pytest.raises(ConfigError, match="supports only token-mean, seq-mean-token-sum, seq-mean-token-mean, "
                                          "seq-mean-token-sum-norm; choose one of them"):
        load_config(None, overrides, algo="grpo")


def test_a_loss_that_declares_nothing_is_not_checked_at_load(register_temporary_plugin, run_files):
    from rlplat import hookimpl

    class Undeclared:
        @hookimpl
        def register_policy_losses(self, register):
            register("undeclared_loss", knobs_loss, config_schema=KnobsOnly)

    register_temporary_plugin(Undeclared(), name="undeclared")
    overrides = run_overrides(run_files, "actor.loss.policy_loss.loss_mode=undeclared_loss", "actor.loss.loss_agg_mode=token-sum")
    assert load_config(None, overrides, algo="grpo").actor.loss.loss_agg_mode == "token-sum"


def test_an_algorithm_without_a_critic_loss_loads_and_refuses_a_critic(register_temporary_plugin, run_files):
    from rlplat import hookimpl

    class NoCriticLoss:  # plugin API 1.0 asked critic_loss=None of an algorithm that needs no critic
        @hookimpl
        def register_algorithms(self, register):
            register("no_critic_loss", lambda: Algorithm(name="no_critic_loss", adv_estimator="grpo", critic_loss=None))

    register_temporary_plugin(NoCriticLoss(), name="no-critic-loss")
    assert load_config(None, run_overrides(run_files), algo="no_critic_loss").algorithm.name == "no_critic_loss"
    with pytest.raises(ConfigError, match=r"algorithm 'no_critic_loss' defines no critic loss \(critic_loss=None\), so it "
                                          r"cannot train a critic: leave critic.enable unset"):
        load_config(None, run_overrides(run_files, "critic.enable=true"), algo="no_critic_loss")


def test_an_engine_schema_that_lists_only_its_own_keys_validates_and_still_checks_them(register_temporary_plugin, run_files):
    from rlplat import hookimpl

    @dataclasses.dataclass
    class OwnKeysOnly:  # does not extend EngineBuildConfig: core's model_path, lr, ... are not declared
        gradient_checkpointing: bool = False

    class Engine:
        @hookimpl
        def register_engines(self, register):
            register("own_keys_engine", "json:dumps", config_schema=OwnKeysOnly)

    register_temporary_plugin(Engine(), name="own-keys-engine")
    overrides = run_overrides(run_files, "actor.engine=own_keys_engine", "critic.engine=own_keys_engine")
    config = load_config(None, [*overrides, "actor.engine_config.gradient_checkpointing=true"], algo="grpo")
    assert config.actor.engine_config.gradient_checkpointing is True
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.engine_config\.gradient_checkpoint'"):
        load_config(None, [*overrides, "actor.engine_config.gradient_checkpoint=true"], algo="grpo")
    with pytest.raises(ConfigError, match=r"'actor\.engine_config\.lr' is set from actor\.optim\.lr: set that instead"):
        load_config(None, [*overrides, "actor.engine_config.lr=0.1"], algo="grpo")
