"""The ``calculator`` tool (kind ``tool``) and the tools file.

The tools file (``agent.tools_config``) is YAML in verl's shape::

    tools:
      - name: calculator            # a registered tool (kind ``tool``) ...
        config: {}                  # ... its node, read with the tool's config_schema
        tool_schema:                # optional: the OpenAI function schema offered (default: the tool's)
          type: function
          function: {name: calculator, description: ..., parameters: {...}}
      - class_name: my_package.tools.MyTool   # ... or a class by import path: a Tool subclass,
        config: {type: native}                #     or a tool written for verl (its BaseTool shape)

A row may narrow the offer with ``extra_info.tools`` (a list of names) and pass per-row arguments to a
tool in ``extra_info.tools_kwargs[name]`` (verl's ``{"create_kwargs": {...}}`` is unwrapped).

**Tools written for verl** run unchanged. A class at ``class_name`` that is not a :class:`Tool` but has
verl's ``BaseTool`` shape (``__init__(self, config, tool_schema)`` and async ``create``, ``execute`` and
``release``; verl need not be installed) is built as verl builds it, ``Class(config=..., tool_schema=...)``
with the entry's schema as an object with attribute access (``tool_schema.function.name``; verl's own
pydantic ``OpenAIFunctionToolSchema`` when verl is imported), and wrapped in :class:`VerlToolAdapter`:
``create`` when a conversation starts (the row's ``create_kwargs`` as keyword arguments), ``execute``
for each call (its text, image and video answer as the tool message's text, its step reward in
:attr:`ToolResult.reward`, its numeric metrics in :attr:`ToolResult.metrics`), ``release`` when the
conversation ends. Anything else at ``class_name`` is refused at load, naming the entry and both shapes.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from rlplat.config_node import ConfigError
from rlplat.contracts.agent import Tool, ToolConfig, ToolResult


# -- calculator -----------------------------------------------------------------------------------------

class CalculatorTool(Tool):
    """Arithmetic on one ``expression`` (``+ - * / // % **`` and parentheses), computed by parsing,
    never by evaluating code (:mod:`rlplat_agents.calculator`)."""

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {"type": "object", "properties": {
                "expression": {"type": "string", "description": "the expression, e.g. 37*48"}},
                "required": ["expression"]}}}

    async def call(self, arguments: Mapping[str, Any], state: Any) -> ToolResult:
        from rlplat_agents.calculator import CalculatorError, evaluate, format_number

        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return ToolResult("error: calculator needs 'expression', a string", error=True)
        try:
            return ToolResult(format_number(evaluate(expression)))
        except CalculatorError as error:
            return ToolResult(f"error: {error}", error=True)


# -- the tools file ---------------------------------------------------------------------------------------

RLPLAT_SHAPE = "an rlplat tool (a subclass of rlplat.contracts.agent.Tool, built as Class(config, schema=...))"
VERL_SHAPE = ("a tool written for verl (its BaseTool shape: __init__(self, config, tool_schema) with async create, "
              "execute and release)")


@dataclasses.dataclass
class ToolSpec:
    """One entry of the tools file, resolved: how to build the tool."""

    label: str
    factory: Any
    schema_class: Any
    config: dict[str, Any]
    tool_schema: dict[str, Any] | None

    def build(self) -> Tool:
        try:
            tool = self.factory(self.config, schema=self.tool_schema)
        except ConfigError:
            raise
        except Exception as error:  # the user's constructor: named by its entry, not a traceback
            raise ConfigError(f"{self.label}: building the tool raised {type(error).__name__}: {error}") from None
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
        raise ConfigError(f"agent.tools_config: {file} must hold a list under 'tools' (see rlplat_agents.tools)")
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
        label = f"{label} ({schema['function']['name']})"
    if "name" in entry:
        from rlplat.config import entry_schema

        factory_name = entry["name"]
        schema_class, owner = entry_schema("tool", factory_name, label)
        factory = registry.get("tool", factory_name)
        label = f"{label} ({owner})"
    else:
        class_name = str(entry["class_name"])
        module_name, _, attribute = class_name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except Exception as error:  # the user's module: its error named by the entry, not a traceback
            raise ConfigError(f"{label}: class_name {class_name!r} cannot be imported: {type(error).__name__}: {error}") from None
        factory = class_factory(found, class_name, config, label)
        schema_class = None
    if schema_class is not None:
        read_config_node(config, schema_class, f"{label}.config")
    return ToolSpec(label, factory, schema_class, dict(config), dict(schema) if schema is not None else None)


def class_factory(found: Any, class_name: str, config: Mapping[str, Any], label: str) -> Any:
    """What ``class_name`` names, as a factory ``factory(config, schema=...)`` of rlplat tools: a
    :class:`Tool` subclass (or a function with that signature) as it is, a verl-shaped class through
    :class:`VerlToolAdapter`; :class:`ConfigError` naming both shapes for anything else."""
    if isinstance(found, type) and issubclass(found, Tool):
        return found
    if is_verl_tool_class(found):
        kind = config.get("type", "native")
        if kind != "native":
            raise ConfigError(f"{label}: config.type {kind!r}: rlplat builds native tools only (verl's MCP tools need "
                              "verl's MCP client); wrap the service in a native tool")
        return verl_tool_factory(found, label)
    if callable(found) and not isinstance(found, type) and accepts(found, {}, schema=None):
        return found
    raise ConfigError(f"{label}: class_name {class_name!r} ({describe(found)}) is neither {RLPLAT_SHAPE} nor {VERL_SHAPE}")


def accepts(function: Any, *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def describe(found: Any) -> str:
    """What ``found`` is, for the refusal: a class says what it lacks of verl's shape."""
    if not isinstance(found, type):
        return f"a {type(found).__name__}"
    missing = missing_verl_parts(found)
    return f"a class without {', '.join(missing)}" if missing else "a class"


# -- tools written for verl --------------------------------------------------------------------------

VERL_ASYNC_METHODS = ("create", "execute", "release")


def missing_verl_parts(candidate: type) -> list[str]:
    """What ``candidate`` lacks of verl's ``BaseTool`` shape (empty: it has the shape)."""
    missing = []
    try:
        parameters = inspect.signature(candidate.__init__).parameters
    except (TypeError, ValueError):
        parameters = {}
    keywords = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    if not keywords and not {"config", "tool_schema"} <= set(parameters):
        missing.append("__init__(self, config, tool_schema)")
    missing += [f"async {name}" for name in VERL_ASYNC_METHODS if not inspect.iscoroutinefunction(getattr(candidate, name, None))]
    return missing


def is_verl_tool_class(candidate: Any) -> bool:
    """Whether ``candidate`` is a class in verl's ``BaseTool`` shape (and not an rlplat :class:`Tool`)."""
    return isinstance(candidate, type) and not issubclass(candidate, Tool) and not missing_verl_parts(candidate)


class ToolSchema(dict):
    """An OpenAI function schema that also reads by attribute (``schema.function.name``), as verl's
    pydantic ``OpenAIFunctionToolSchema`` does, with its ``model_dump``: what a tool written for verl is
    given when verl is not imported."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(f"the tool schema has no {name!r}") from None
        return ToolSchema(value) if isinstance(value, Mapping) and not isinstance(value, ToolSchema) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return json.loads(json.dumps(self))

    def model_dump_json(self, **_: Any) -> str:
        return json.dumps(self)


def verl_schema_object(schema: Mapping[str, Any] | None) -> Any:
    """``schema`` as a tool written for verl reads it: verl's own pydantic class when verl's tools are
    imported already (the tool's module imported them), else a :class:`ToolSchema`."""
    if schema is None:
        return None
    verl_schemas = sys.modules.get("verl.tools.schemas")
    if verl_schemas is not None and hasattr(verl_schemas, "OpenAIFunctionToolSchema"):
        return verl_schemas.OpenAIFunctionToolSchema.model_validate(dict(schema))
    return ToolSchema(schema)


def plain_schema(schema: Any) -> Any:
    """A schema object (pydantic or mapping) as plain JSON data."""
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    if isinstance(schema, Mapping):
        return json.loads(json.dumps(schema, default=str))
    return schema


def verl_tool_factory(tool_class: type, label: str) -> Any:
    def build(config: Mapping[str, Any], schema: Mapping[str, Any] | None = None) -> "VerlToolAdapter":
        return VerlToolAdapter(tool_class(config=dict(config), tool_schema=verl_schema_object(schema)), label)

    return build


class VerlToolAdapter(Tool):
    """A tool written for verl (``BaseTool`` shape) as an rlplat :class:`Tool`. One instance of the verl
    class serves every conversation of a worker, told apart by the instance id its ``create`` returns.

    * :meth:`open` (a conversation starts): ``await create(**create_kwargs)``, the row's
      ``extra_info.tools_kwargs[name].create_kwargs`` as keyword arguments as verl's SGLang rollout passed
      them, and also as ``create_kwargs=`` when ``create`` takes that keyword or ``**kwargs``, as verl's tool
      agent loop passes them; either ``(instance_id, response)`` (verl 0.5 on) or an instance id (before).
    * :meth:`call`: ``await execute(instance_id, arguments)`` -> ``(response, reward, metrics)``: the
      response (verl's ``ToolResponse``, a mapping with ``text``/``image``/``video``, or a string) becomes
      the text; ``reward`` goes to :attr:`ToolResult.reward`, the numeric ``metrics`` to
      :attr:`ToolResult.metrics`.
    * :meth:`close` (the conversation ended, also after an error): ``await release(instance_id)``.

    ``calc_reward`` is not called: verl's loop does not call it either (a tool calls it from ``execute``).
    verl's tool agent loop creates and releases an instance around every call; rlplat keeps one per
    conversation, as verl's SGLang rollout did, so a tool's state (earlier answers) lasts the conversation.
    """

    def __init__(self, tool: Any, label: str = "verl tool"):
        self.verl_tool = tool
        schema = getattr(tool, "tool_schema", None)
        if schema is None and callable(getattr(tool, "get_openai_tool_schema", None)):
            schema = tool.get_openai_tool_schema()
        if schema is None:
            raise ConfigError(f"{label}: the tool has no schema: give tool_schema in the tools file")
        try:
            super().__init__(getattr(tool, "config", None), plain_schema(schema))
        except ValueError as error:
            raise ConfigError(f"{label}: {error}") from None

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        raise TypeError("a verl tool's schema is its tools-file entry's tool_schema or its get_openai_tool_schema()")

    async def open(self, row_kwargs: Mapping[str, Any]) -> Any:
        create = self.verl_tool.create
        created = await create(**create_arguments(create, row_kwargs))
        return created[0] if isinstance(created, tuple) else created

    async def call(self, arguments: Mapping[str, Any], state: Any) -> ToolResult:
        outcome = await self.verl_tool.execute(state, dict(arguments))
        parts = tuple(outcome) if isinstance(outcome, tuple) else (outcome,)
        response = parts[0]
        reward = parts[1] if len(parts) > 1 else None
        metrics = parts[2] if len(parts) > 2 else None
        return ToolResult(response_text(response), reward=number(reward), metrics=numeric_metrics(metrics))

    async def close(self, state: Any) -> None:
        await self.verl_tool.release(state)


def create_arguments(create: Any, row_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a verl tool's ``create`` for a row's ``create_kwargs``: each as a keyword (verl's
    SGLang rollout) and all of them as ``create_kwargs=`` (verl's tool agent loop), as far as ``create``
    takes them; a ``create`` that names neither ``**kwargs`` nor ``create_kwargs`` gets each as a keyword."""
    arguments = dict(row_kwargs)
    parameters = inspect.signature(create).parameters
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    if "create_kwargs" in arguments or not (takes_any or "create_kwargs" in parameters):
        return arguments
    if not takes_any:
        arguments = {key: value for key, value in arguments.items() if key in parameters}
    return {**arguments, "create_kwargs": dict(row_kwargs)}


def response_text(response: Any) -> str:
    """verl's ``ToolResponse`` (an object or a mapping with ``text``, ``image``, ``video``) or a string as
    the tool message's text; images and videos, which rlplat's text-only conversations cannot carry, are
    named in it."""
    if response is None or isinstance(response, str):
        return response or ""
    if isinstance(response, Mapping):
        fields = {name: response.get(name) for name in ("text", "image", "video")}
    elif any(hasattr(response, name) for name in ("text", "image", "video")):
        fields = {name: getattr(response, name, None) for name in ("text", "image", "video")}
    else:
        return str(response)
    text = str(fields["text"] or "")
    media = [f"{len(value) if isinstance(value, (list, tuple)) else 1} {name}(s)"
             for name in ("image", "video") if (value := fields[name]) is not None and value != []]
    if media:
        text += ("\n" if text else "") + f"[the tool also returned {' and '.join(media)}, which a text conversation cannot show]"
    return text


def number(value: Any) -> Optional[float]:
    """A finite float, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def numeric_metrics(metrics: Any) -> dict[str, float]:
    """The numeric entries of a tool's metrics mapping (others are dropped: rlplat's metrics are numbers)."""
    if not isinstance(metrics, Mapping):
        return {}
    kept = {str(key): number(value) for key, value in metrics.items()}
    return {key: value for key, value in kept.items() if value is not None}


# -- per row -----------------------------------------------------------------------------------------------


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
