"""The ``python`` tool: the model's code run in a sandboxed child process (:mod:`rlplat_python_tool.sandbox`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from rlplat.contracts.agent import Tool, ToolConfig, ToolResult


@dataclasses.dataclass
class PythonToolConfig(ToolConfig):
    """The ``python`` tool's node: the sandbox's limits (:class:`rlplat_python_tool.sandbox.SandboxLimits`)."""

    cpu_seconds: float = 5.0
    """CPU time of the code."""
    wall_seconds: float = 10.0
    """Wall time; the process group and every process it started are killed after it."""
    memory_bytes: int = 512 * 1024 * 1024
    """Address space of the code's process."""
    max_processes: int = 32
    """Processes and threads the sandbox user may run at once (Linux's per-user count)."""
    output_bytes: int = 16 * 1024
    """Bytes of stdout and of stderr; a run that prints more is stopped and its output cut there."""
    file_size_bytes: int = 1024 * 1024
    """Largest file the code may write."""
    python: Optional[str] = None
    """Interpreter of the code. None: this Python when the sandbox user may run it, else the system's
    ``python3`` (standard library only)."""


class PythonTool(Tool):
    """Runs the model's ``code`` in a sandboxed child process (:mod:`rlplat_python_tool.sandbox`: resource
    limits, wall timeout killing every process it started, an empty working directory, a private ``/tmp``
    per call, a scrubbed environment, an unprivileged user when rlplat runs as root) and returns its output."""

    def __init__(self, config: Any = None, schema: Mapping[str, Any] | None = None):
        from rlplat.config_node import read_config_node

        super().__init__(read_config_node(config, PythonToolConfig, "tools[python].config"), schema)
        from rlplat_python_tool.sandbox import SandboxLimits

        values = dataclasses.asdict(self.config)
        self.limits = SandboxLimits(**{k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(SandboxLimits)}})

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": "python",
            "description": "Run Python 3 code and return what it prints (stdout and stderr).",
            "parameters": {"type": "object", "properties": {
                "code": {"type": "string", "description": "the program; print the results you need"}},
                "required": ["code"]}}}

    async def call(self, arguments: Mapping[str, Any], state: Any) -> ToolResult:
        from rlplat_python_tool.sandbox import run_python_async

        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("error: python needs 'code', a string", error=True)
        result = await run_python_async(code, self.limits)
        return ToolResult(result.to_text(), error=result.error is not None, timed_out=result.timed_out,
                          metrics={"sandbox_s": result.duration_s})


