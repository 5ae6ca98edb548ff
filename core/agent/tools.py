"""Built-in tools (kind ``tool``) and the tools file.

The tools file (``agent.tools_config``) is YAML in verl's shape::

    tools:
      - name: calculator            # a registered tool (kind ``tool``) ...
        config: {}                  # ... its node, read with the tool's config_schema
        tool_schema:                # optional: the OpenAI function schema offered (default: the tool's)
          type: function
          function: {name: calculator, description: ..., parameters: {...}}
      - class_name: my_package.tools.MyTool   # ... or a Tool subclass by import path

A row may narrow the offer with ``extra_info.tools`` (a list of names) and pass per-row arguments to a
tool in ``extra_info.tools_kwargs[name]`` (verl's ``{"create_kwargs": {...}}`` is unwrapped).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Mapping, Optional

from rlplat.config_node import ConfigError
from rlplat.contracts.agent import Tool, ToolConfig, ToolResult


# -- calculator -----------------------------------------------------------------------------------------

class CalculatorTool(Tool):
    """Arithmetic on one ``expression`` (``+ - * / // % **`` and parentheses), computed by parsing,
    never by evaluating code (:mod:`rlplat.agent.calculator`)."""

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {"type": "object", "properties": {
                "expression": {"type": "string", "description": "the expression, e.g. 37*48"}},
                "required": ["expression"]}}}

    async def call(self, arguments: Mapping[str, Any], state: Any) -> ToolResult:
        from rlplat.agent.calculator import CalculatorError, evaluate, format_number

        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return ToolResult("error: calculator needs 'expression', a string", error=True)
        try:
            return ToolResult(format_number(evaluate(expression)))
        except CalculatorError as error:
            return ToolResult(f"error: {error}", error=True)


# -- python ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PythonToolConfig(ToolConfig):
    """The ``python`` tool's node: the sandbox's limits (:class:`rlplat.agent.sandbox.SandboxLimits`)."""

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
    """Runs the model's ``code`` in a sandboxed child process (:mod:`rlplat.agent.sandbox`: resource
    limits, wall timeout killing every process it started, an empty temporary directory, a scrubbed
    environment, an unprivileged user when rlplat runs as root) and returns its output."""

    def __init__(self, config: Any = None, schema: Mapping[str, Any] | None = None):
        from rlplat.config_node import read_config_node

        super().__init__(read_config_node(config, PythonToolConfig, "tools[python].config"), schema)
        from rlplat.agent.sandbox import SandboxLimits

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
        from rlplat.agent.sandbox import run_python_async

        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("error: python needs 'code', a string", error=True)
        result = await run_python_async(code, self.limits)
        return ToolResult(result.to_text(), error=result.error is not None, timed_out=result.timed_out,
                          metrics={"sandbox_s": result.duration_s})


# -- the tools file ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class ToolSpec:
    """One entry of the tools file, resolved: how to build the tool."""

    label: str
    factory: Any
    schema_class: Any
    config: dict[str, Any]
    tool_schema: dict[str, Any] | None

    def build(self) -> Tool:
        tool = self.factory(self.config, schema=self.tool_schema)
        if not isinstance(tool, Tool):
            raise ConfigError(f"{self.label}: the factory returned {type(tool).__name__}, not an rlplat.contracts.agent.Tool")
        return tool


def read_tools_file(path: str | Path) -> list[ToolSpec]:
    """The tools of a tools file, each checked (registered or importable, config fits its schema,
    schema well formed); :class:`ConfigError` naming the file and the entry otherwise."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"agent.tools_config: no file at {str(file)!r}")
    try:
        content = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"agent.tools_config: {file} is not valid YAML: {error}") from None
    entries = content.get("tools") if isinstance(content, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"agent.tools_config: {file} must hold a list under 'tools' (see rlplat.agent.tools)")
    specs, names = [], set()
    for number, entry in enumerate(entries):
        label = f"agent.tools_config: {file}, tools[{number}]"
        spec = tool_spec(entry, label)
        tool = spec.build()
        if tool.name in names:
            raise ConfigError(f"{label}: a second tool named {tool.name!r}")
        names.add(tool.name)
        specs.append(spec)
    return specs


def tool_spec(entry: Any, label: str) -> ToolSpec:
    from rlplat import registry
    from rlplat.config_node import read_config_node
    from rlplat.contracts.agent import check_tool_schema

    if not isinstance(entry, dict):
        raise ConfigError(f"{label}: expected a mapping with 'name' (or 'class_name'), got {entry!r:.80}")
    unknown = set(entry) - {"name", "class_name", "config", "tool_schema"}
    if unknown:
        raise ConfigError(f"{label}: unknown keys {sorted(unknown)}; the keys are name, class_name, config, tool_schema")
    if ("name" in entry) == ("class_name" in entry):
        raise ConfigError(f"{label}: give exactly one of 'name' (a registered tool) and 'class_name' (module.Class)")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{label}: 'config' must be a mapping, got {config!r:.80}")
    schema = entry.get("tool_schema")
    if schema is not None:
        try:
            check_tool_schema(schema, label)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if "name" in entry:
        from rlplat.config import entry_schema

        factory_name = entry["name"]
        schema_class, owner = entry_schema("tool", factory_name, label)
        factory = registry.get("tool", factory_name)
        label = f"{label} ({owner})"
    else:
        module_name, _, attribute = str(entry["class_name"]).rpartition(".")
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError) as error:
            raise ConfigError(f"{label}: class_name {entry['class_name']!r} cannot be imported: {error}") from None
        schema_class = None
    if schema_class is not None:
        read_config_node(config, schema_class, f"{label}.config")
    try:
        return ToolSpec(label, factory, schema_class, dict(config), dict(schema) if schema is not None else None)
    except Exception as error:  # pragma: no cover - dataclass construction cannot fail on checked values
        raise ConfigError(f"{label}: {error}") from None


def row_tools(tools: Mapping[str, Tool], extra_info: Mapping[str, Any] | None, where: str) -> dict[str, tuple[Tool, dict]]:
    """The tools offered to one row and their per-row arguments (see the module docstring)."""
    extra_info = extra_info or {}
    names = extra_info.get("tools")
    if names is None:
        offered = dict(tools)
    else:
        unknown = [name for name in names if name not in tools]
        if unknown:
            raise ValueError(f"{where}: extra_info.tools names {unknown}, which the tools file does not define "
                             f"(it defines {sorted(tools)})")
        offered = {name: tools[name] for name in names}
    kwargs = extra_info.get("tools_kwargs") or {}
    result = {}
    for name, tool in offered.items():
        arguments = kwargs.get(name) or {}
        if isinstance(arguments, Mapping) and "create_kwargs" in arguments:
            arguments = arguments.get("create_kwargs") or {}
        if not isinstance(arguments, Mapping):
            raise ValueError(f"{where}: extra_info.tools_kwargs[{name!r}] must be a mapping, got {arguments!r:.80}")
        result[name] = (tool, dict(arguments))
    return result
