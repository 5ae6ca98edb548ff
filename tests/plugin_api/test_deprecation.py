"""Deprecation, not breakage: a renamed or removed public name, config key or contract method keeps working
for one minor version of the plugin API, with a DeprecationWarning naming its replacement and the version it
goes away in."""

from __future__ import annotations

import abc
import dataclasses
import sys
import types
import warnings

import pytest

from rlplat.config_node import ConfigError, read_config_node
from rlplat.deprecation import (Deprecated, RenamedKey, RenamedMethod, adopt_renamed_methods, deprecated_names,
                                next_minor, rename_config_keys)


def test_what_is_deprecated_now_goes_one_minor_version_later():
    assert next_minor("1.1.0") == "1.2"
    assert next_minor("2.0.3") == "2.1"


@pytest.fixture
def module_with_a_renamed_function(monkeypatch):
    module = types.ModuleType("acme_kit")

    def read_node(node):
        return dict(node)

    module.read_node = read_node
    module.__getattr__ = deprecated_names("acme_kit", {
        "read_config": Deprecated("read_node", "1.2"),
        "legacy_reader": Deprecated("json:loads", "1.2", replacement="acme_kit.read_node (it takes a mapping)"),
    })
    monkeypatch.setitem(sys.modules, "acme_kit", module)
    return module


def test_an_old_name_of_a_module_gives_the_new_object_and_a_warning_naming_both(module_with_a_renamed_function):
    with pytest.warns(DeprecationWarning) as caught:
        found = module_with_a_renamed_function.read_config
    assert found is module_with_a_renamed_function.read_node
    assert str(caught[0].message) == ("acme_kit.read_config is deprecated and is removed in rlplat plugin API 1.2: "
                                      "use acme_kit.read_node instead")
    assert caught[0].filename == __file__  # the warning points at the code that used the old name


def test_a_removed_name_can_live_elsewhere_and_say_what_to_do_instead(module_with_a_renamed_function):
    import json

    with pytest.warns(DeprecationWarning, match=r"acme_kit.legacy_reader is deprecated .* use acme_kit.read_node "
                                                r"\(it takes a mapping\) instead"):
        assert module_with_a_renamed_function.legacy_reader is json.loads


def test_an_unknown_name_is_still_an_attribute_error(module_with_a_renamed_function):
    with pytest.raises(AttributeError, match="module 'acme_kit' has no attribute 'nothing'"):
        module_with_a_renamed_function.nothing


def test_other_names_go_to_the_fallback():
    getattr_ = deprecated_names("acme_lazy", {}, fallback=lambda name: f"lazy {name}")
    assert getattr_("DataProto") == "lazy DataProto"


@dataclasses.dataclass
class KnobsV2:
    """A plugin's node whose ``clip`` knob was called ``clip_range`` before."""

    RENAMED_KEYS = {"clip_range": RenamedKey("clip", "1.2")}
    clip: float = 0.2


def test_an_old_key_of_a_plugin_node_is_read_as_the_new_one_with_a_warning_naming_both():
    with pytest.warns(DeprecationWarning) as caught:
        knobs = read_config_node({"clip_range": 0.3}, KnobsV2, "actor.loss.policy_loss")
    assert knobs == KnobsV2(clip=0.3)
    assert str(caught[0].message) == ("the config key actor.loss.policy_loss.clip_range is deprecated and is removed in "
                                      "rlplat plugin API 1.2: use actor.loss.policy_loss.clip instead")


def test_setting_a_key_under_both_names_is_an_error():
    with pytest.raises(ConfigError, match=r"actor.loss.policy_loss.clip_range and actor.loss.policy_loss.clip are both "
                                          r"set; .* keep only actor.loss.policy_loss.clip"):
        read_config_node({"clip_range": 0.3, "clip": 0.1}, KnobsV2, "actor.loss.policy_loss")


def test_the_new_key_alone_reads_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_config_node({"clip": 0.1}, KnobsV2, "actor.loss.policy_loss") == KnobsV2(clip=0.1)


def test_a_renamed_key_of_rlplats_config_is_moved_in_the_file_and_the_overrides(monkeypatch, tmp_path):
    from rlplat import deprecation
    from rlplat.config import load_config

    monkeypatch.setitem(deprecation.RENAMED_CONFIG_KEYS, "trainer.checkpoint_every", RenamedKey("trainer.save_freq", "1.2"))
    with pytest.warns(DeprecationWarning, match=r"the config key trainer.checkpoint_every \(overrides\) is deprecated "
                                                r"and is removed in rlplat plugin API 1.2: use trainer.save_freq instead"):
        config = load_config(None, ["trainer.checkpoint_every=7"], validate=False)
    assert config.trainer.save_freq == 7 and "checkpoint_every" not in config.trainer
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("trainer:\n  checkpoint_every: 9\n")
    with pytest.warns(DeprecationWarning, match=rf"\(--config {yaml_file}\)"):
        assert load_config(yaml_file, [], validate=False).trainer.save_freq == 9


def test_a_renamed_key_of_rlplats_config_set_under_both_names_is_an_error():
    from omegaconf import OmegaConf

    node = OmegaConf.from_dotlist(["trainer.checkpoint_every=7", "trainer.save_freq=8"])
    with pytest.raises(ConfigError, match="overrides: trainer.checkpoint_every and trainer.save_freq are both set"):
        rename_config_keys(node, "overrides", {"trainer.checkpoint_every": RenamedKey("trainer.save_freq", "1.2")})


class Engine(abc.ABC):
    """A contract whose ``save`` was called ``save_checkpoint`` in the previous minor version."""

    save_checkpoint = RenamedMethod("save", "1.2")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        adopt_renamed_methods(cls)

    @abc.abstractmethod
    def save(self, path: str) -> str:
        """Write a checkpoint to ``path``."""


def test_a_caller_of_the_old_method_name_reaches_the_new_method_with_a_warning():
    class Current(Engine):
        def save(self, path):
            return f"saved {path}"

    with pytest.warns(DeprecationWarning) as caught:
        assert Current().save_checkpoint("/tmp/a") == "saved /tmp/a"
    assert str(caught[0].message) == ("Engine.save_checkpoint() is deprecated and is removed in rlplat plugin API 1.2: "
                                      "use Engine.save() instead")


def test_an_implementation_of_the_old_method_name_is_called_under_the_new_one():
    with pytest.warns(DeprecationWarning) as caught:
        class Old(Engine):
            def save_checkpoint(self, path):
                return f"old saved {path}"

    assert str(caught[0].message) == ("Old.save_checkpoint() (Engine's old name) is deprecated and is removed in rlplat "
                                      "plugin API 1.2: use Old.save() instead")
    assert caught[0].filename == __file__  # the warning points at the class statement

    assert Old().save("/tmp/b") == "old saved /tmp/b"  # not abstract: save is the old implementation


def test_a_1_0_estimator_reading_the_algorithm_node_as_a_mapping_still_works_with_a_warning():
    from rlplat.contracts.algorithm import AlgorithmConfig

    node = AlgorithmConfig(gamma=0.9)
    with pytest.warns(DeprecationWarning, match=r"config\['gamma'\] on the algorithm node .* use config.gamma instead"):
        assert node["gamma"] == 0.9
    with pytest.warns(DeprecationWarning, match=r"use config.lam instead"):
        assert node.get("lam") == 1.0
    with pytest.warns(DeprecationWarning):
        assert node.get("missing", 3) == 3
    with pytest.warns(DeprecationWarning):
        assert "gamma" in node
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        node["missing"]
