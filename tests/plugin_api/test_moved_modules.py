"""Old names of modules that moved (out of core, or within it) keep importing for one minor version of the plugin
API, with a warning, as the same module object (rlplat.deprecation.MOVED_MODULES); then they are gone."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from rlplat import deprecation
from rlplat.deprecation import Moved

#: The names plugin API 1.2 moved, announced as removed in 1.3: gone now.
REMOVED_AT_1_3 = ("rlplat.demo.scorer", "rlplat.agent", "rlplat.agent.sandbox", "rlplat.cli.check_template", "rlplat.judge",
                  "rlplat.judge_parsers", "rlplat.reward_model", "rlplat.workers.reward_model", "rlplat.reward_loop",
                  "rlplat.plan.measure", "rlplat.sft", "rlplat.cli.sft", "rlplat.demo", "rlplat.verl_keys",
                  "rlplat.config_components", "rlplat.config_explain", "rlplat.trainer_config", "rlplat.pipeline",
                  "rlplat.sync_probe", "rlplat.placement", "rlplat.checkpoint", "rlplat.tracking", "rlplat.engine_kit",
                  "rlplat.rollout_batch", "rlplat.rollout_server", "rlplat.reward_kit", "rlplat.advantages", "rlplat.aio")


def fresh_import(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_an_old_name_is_the_new_module_itself_with_a_warning_naming_both():
    result = fresh_import("import rlplat.doctor as old, rlplat.cli.doctor as new\n"
                          "assert old is new, (old, new)\n"
                          "print(old.normalise('Megatron_Core'))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "megatron-core"
    assert "rlplat.doctor moved to rlplat.cli.doctor" in result.stderr
    assert "removed in rlplat plugin API 1.4" in result.stderr


def test_the_names_plugin_api_1_2_moved_are_gone_at_1_3():
    assert not set(REMOVED_AT_1_3) & set(deprecation.MOVED_MODULES)
    result = fresh_import("import importlib, sys\n"
                          f"for name in {REMOVED_AT_1_3!r}:\n"
                          "    try:\n"
                          "        importlib.import_module(name)\n"
                          "    except ModuleNotFoundError:\n"
                          "        continue\n"
                          "    sys.exit(name + ' still imports')")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "DeprecationWarning" not in result.stderr


def test_every_moved_name_goes_one_minor_version_after_this_one():
    assert deprecation.MOVED_MODULES
    assert {entry.removed_in for entry in deprecation.MOVED_MODULES.values()} == {deprecation.next_minor()}


def test_a_submodule_of_a_moved_package_is_never_loaded_twice(monkeypatch, tmp_path):
    package = tmp_path / "moved_target_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "leaf.py").write_text("VALUE = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(deprecation.MOVED_MODULES, "rlplat.old_feature",
                        Moved("rlplat.old_feature", "moved_target_pkg", "moved-target", "1.4"))
    with pytest.warns(DeprecationWarning, match="rlplat.old_feature.leaf moved to moved_target_pkg.leaf"):
        old = importlib.import_module("rlplat.old_feature.leaf")
    assert old is importlib.import_module("moved_target_pkg.leaf")
    for name in ("rlplat.old_feature", "rlplat.old_feature.leaf"):
        sys.modules.pop(name, None)


def test_an_old_name_whose_distribution_is_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(deprecation.MOVED_MODULES, "rlplat.gone_feature",
                        Moved("rlplat.gone_feature", "no_such_package_here", "rlplat-gone", "1.4"))
    with pytest.warns(DeprecationWarning), pytest.raises(ModuleNotFoundError, match="pip install rlplat-gone"):
        importlib.import_module("rlplat.gone_feature")
    sys.modules.pop("rlplat.gone_feature", None)


@pytest.mark.parametrize("old", sorted(deprecation.MOVED_MODULES))
def test_every_moved_module_imports_under_its_old_name(old):
    new = deprecation.MOVED_MODULES[old].new
    result = fresh_import(f"import importlib\nassert importlib.import_module({old!r}) is importlib.import_module({new!r})")
    assert result.returncode == 0, result.stderr
    assert f"{old} moved to {new}" in result.stderr


def test_the_names_moved_out_of_modules_warn_and_resolve():
    code = ("import warnings\n"
            "import rlplat.losses, rlplat.data, rlplat_sft.loss, rlplat.kits.data\n"
            "assert rlplat.losses.NLLLoss is rlplat_sft.loss.NLLLoss\n"
            "assert rlplat.data.left_padded is rlplat.kits.data.left_padded\n")
    result = fresh_import(code)
    assert result.returncode == 0, result.stderr
    assert "rlplat.losses.NLLLoss is deprecated and is removed in rlplat plugin API 1.4: use rlplat_sft.loss.NLLLoss" in result.stderr
    assert "rlplat.data.left_padded is deprecated and is removed in rlplat plugin API 1.4: use rlplat.kits.data.left_padded" in result.stderr
