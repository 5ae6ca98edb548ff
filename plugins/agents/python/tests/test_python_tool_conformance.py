"""The ``python`` tool passes the tool conformance suite, found through the registry."""

from __future__ import annotations

import pytest

from rlplat import registry
from rlplat.testing import ToolCase, ToolConformance


class TestPythonTool(ToolConformance):
    @pytest.fixture
    def tool(self):
        return registry.get("tool", "python")({"wall_seconds": 5, "cpu_seconds": 2})

    @pytest.fixture
    def tool_cases(self):
        return [ToolCase({"code": "print(6*7)"}, "42"), ToolCase({"code": "raise ValueError('no')"}, "ValueError", error=True)]
