"""Helpers for the tests of core and cli: fake plugin distributions on disk, subprocess runs."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# tests/fixtures holds plugins and data the tests install or read; their own tests run where a test installs them
collect_ignore = ["fixtures"]


def write_distribution(
    site: Path, name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]
) -> Path:
    """Write an installed-looking distribution into ``site``: ``<name>.dist-info`` with METADATA and
    ``entry_points.txt`` (group ``rlplat``), and the given modules (dotted name -> source).

    importlib.metadata discovers it exactly like a pip-installed one once ``site`` is on the path.
    """
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[rlplat]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for dotted, source in modules.items():
        path = site.joinpath(*dotted.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return site


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A directory on ``sys.path`` (this process) for fake distributions."""
    directory = tmp_path / "site"
    directory.mkdir()
    monkeypatch.syspath_prepend(str(directory))
    return directory


@pytest.fixture(scope="session")
def write_distribution_to():
    """``write_distribution_to(site, name, version, entry_points, modules)``, usable from fixtures of any scope."""
    return write_distribution


@pytest.fixture
def write_dist(site):
    """``write_dist(name, version, entry_points, modules)``: a fake distribution in ``site``."""
    return lambda *args, **kwargs: write_distribution(site, *args, **kwargs)


@pytest.fixture
def run_files(tmp_path) -> tuple[Path, Path]:
    """``(model directory, train parquet)`` for a config that validates: an empty model folder (validation
    reads no weights) and one arithmetic row."""
    from rlplat.kits.data import write_parquet

    model = tmp_path / "model"
    model.mkdir()
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}]
    return model, write_parquet(rows, tmp_path / "train.parquet")



@pytest.fixture(scope="session")
def doubling_assets(tmp_path_factory) -> dict[str, str]:
    """:func:`rlplat.testing.runs.doubling_assets`, made once per test session."""
    from rlplat.testing.runs import doubling_assets

    return doubling_assets(tmp_path_factory.mktemp("doubling_assets"))
