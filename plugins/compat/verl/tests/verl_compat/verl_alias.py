"""pytest plugin for ``make test-verl-compat``: run verl's DataProto tests against rlplat's DataProto.

Loaded with ``-p verl_alias`` before any test module is imported. It

1. installs ``verl_protocol`` (a re-export of ``rlplat.protocol``) as ``verl.protocol`` and only then
   imports the real ``verl`` package (installed without dependencies into ``.verl-compat/``), whose
   ``from .protocol import DataProto`` therefore binds rlplat's class;
2. refuses to run unless ``verl.DataProto``, ``verl.protocol.DataProto`` and the ``DataProto`` that
   every collected test module holds are ``rlplat.protocol.DataProto`` — so a pass can never come
   from verl's own implementation;
3. marks the tests of behaviours rlplat changes on purpose as strict expected failures, each with
   its reason (docs/verl-dataproto.md lists them): they must keep failing, and every other test
   must pass.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import rlplat.protocol

EXPECTED_DIFFERENCES = {
    "test_chunk_concat": (
        "chunk(5) of 6 rows: verl raises, rlplat returns 5 near-equal parts (np.array_split's rule); "
        "docs/verl-dataproto.md, 'Chunking a length that does not divide'"
    ),
    "test_dataproto_unfold_column_chunks": (
        "from_dict keeps a list per row as one object, where verl's np.array(dtype=object) makes a 2-D "
        "array of equal-length rows; docs/verl-dataproto.md, 'Lists per row stay lists'"
    ),
}


def install_alias() -> None:
    for name in ("verl", "verl.protocol"):
        if name in sys.modules:
            raise pytest.UsageError(f"{name} was imported before the rlplat alias was installed")
    alias = importlib.import_module("verl_protocol")
    sys.modules["verl.protocol"] = alias
    verl = importlib.import_module("verl")
    verl.protocol = alias
    expected = rlplat.protocol.DataProto
    for where, found in (("verl.DataProto", verl.DataProto), ("verl.protocol.DataProto", alias.DataProto)):
        if found is not expected:
            raise pytest.UsageError(f"{where} is {found.__module__}.{found.__qualname__}, not rlplat's DataProto")


install_alias()


def pytest_report_header(config) -> list[str]:
    import verl

    return [
        f"verl-compat: DataProto under test = {rlplat.protocol.DataProto.__module__}.DataProto "
        f"from {Path(rlplat.protocol.__file__).resolve()}",
        f"verl-compat: verl.protocol = {Path(sys.modules['verl.protocol'].__file__).resolve()} "
        f"(verl's tests and utilities from {Path(verl.__file__).resolve().parent})",
    ]


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module_class = getattr(item.module, "DataProto", None)
        if module_class is not rlplat.protocol.DataProto:
            raise pytest.UsageError(f"{item.nodeid}: the module's DataProto is {module_class!r}, not rlplat's")
        reason = EXPECTED_DIFFERENCES.get(item.originalname)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
