"""Old names of modules that moved out of core keep importing, with a warning, as the same module object."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from rlplat import moved


def fresh_import(name: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_an_old_name_is_the_new_module_itself_with_a_warning_naming_both():
    result = fresh_import("rlplat.demo.scorer", (
        "import rlplat.demo.scorer as old, rlplat.scorers as new\n"
        "assert old is new, (old, new)\n"
        "print(old.exact_match('d', ' 7 ', 7))"))
    assert result.returncode == 0, result.stderr
    assert "rlplat.demo.scorer moved to rlplat.scorers" in result.stderr
    assert "removed in rlplat plugin API 1.3" in result.stderr


def test_a_submodule_of_a_moved_package_is_never_loaded_twice(monkeypatch, tmp_path):
    package = tmp_path / "moved_target_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "leaf.py").write_text("VALUE = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(moved.MOVED, "rlplat.old_feature", moved.Moved("rlplat.old_feature", "moved_target_pkg",
                                                                       "moved-target", "1.3"))
    with pytest.warns(DeprecationWarning, match="rlplat.old_feature.leaf moved to moved_target_pkg.leaf"):
        old = importlib.import_module("rlplat.old_feature.leaf")
    assert old is importlib.import_module("moved_target_pkg.leaf")
    for name in ("rlplat.old_feature", "rlplat.old_feature.leaf"):
        sys.modules.pop(name, None)


def test_an_old_name_whose_distribution_is_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(moved.MOVED, "rlplat.gone_feature", moved.Moved("rlplat.gone_feature", "no_such_package_here",
                                                                        "rlplat-gone", "1.3"))
    with pytest.warns(DeprecationWarning), pytest.raises(ModuleNotFoundError, match="pip install rlplat-gone"):
        importlib.import_module("rlplat.gone_feature")
    sys.modules.pop("rlplat.gone_feature", None)


@pytest.mark.parametrize("old", sorted(name for name, entry in moved.MOVED.items()
                                       if entry.new.startswith("rlplat.") and entry.distribution == "rlplat"))
def test_every_module_moved_within_core_imports_under_its_old_name(old):
    new = moved.MOVED[old].new
    result = fresh_import(old, f"import importlib\nassert importlib.import_module({old!r}) is importlib.import_module({new!r})")
    assert result.returncode == 0, result.stderr
    assert f"{old} moved to {new}" in result.stderr
