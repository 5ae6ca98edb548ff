"""The one config reader: a node of the run config (or any mapping) into its typed dataclass.

Core and every built-in plugin read their nodes with :func:`read_config_node`, and ``load_config``
uses the same function to check every plugin-owned node before a worker starts, so a node that loads
there loads the same way in a worker:

* **strict by default:** a key the dataclass does not declare is a :class:`ConfigError` naming the
  dotted key and the closest declared one (:func:`rlplat.registry.did_you_mean`, the one suggestion rule) (``strict=False`` ignores unknown keys, for a component
  that reads its part of a node another component owns);
* **typed:** each value is checked against the field's annotation (``int``, ``float``, ``bool``,
  ``str``, ``Optional``/unions, ``Literal``, lists, tuples, mappings, nested dataclasses, recursively)
  and converted where the conversion loses nothing (an ``int`` for a ``float``, ``1.0`` for an
  ``int``, a list for a tuple, an OmegaConf node for a dict);
* **the dataclass's own checks** (``__post_init__`` raising ``ValueError`` or ``TypeError``) become a
  :class:`ConfigError` that names the node;
* **keys rlplat sets in a plugin-owned node for its own use** (:data:`CORE_KEYS_OF_PLUGIN_NODES`: the
  ``loss_mode`` that selects the policy loss, the ``algorithm`` node's keys the loop reads) are left out when
  the dataclass does not declare them, so a plugin's schema lists only its own keys;
* **renamed keys** a dataclass lists in its ``RENAMED_KEYS`` class attribute (old name ->
  :class:`rlplat.deprecation.RenamedKey`) are read under their new names, with a ``DeprecationWarning``.

:func:`field_docs` returns the attribute docstrings of a dataclass (the string literal under each
field), which ``rlplat config explain`` prints. This module imports neither torch nor omegaconf.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from rlplat.registry import did_you_mean

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem, explained in one paragraph for the person who wrote the config."""


def read_config_node(config: Any, cls: type[T], where: str | None = None, *, strict: bool = True) -> T:
    """``config`` (a ``cls`` instance, another dataclass instance, a mapping, an OmegaConf node or
    None for the defaults) as a ``cls`` instance; see the module docstring for the rules.

    ``where`` is the node's dotted key in errors (``"actor.engine_config"``; default: the class name).
    Raises :class:`ConfigError`.
    """
    where = where or cls.__name__
    if isinstance(config, cls):
        return config
    values = as_mapping(config, where)
    fields = {field.name: field for field in dataclasses.fields(cls) if field.init}
    renames = getattr(cls, "RENAMED_KEYS", None)
    if renames:
        from rlplat.deprecation import renamed_keys

        values = renamed_keys(values, renames, where)
    for key in core_keys_of(where):
        if key not in fields:
            values.pop(key, None)
    unknown = [key for key in values if key not in fields]
    if unknown and strict:
        key = unknown[0]
        more = f" (and {len(unknown) - 1} more: {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""
        if " " in where:  # a description of the node, not its dotted key
            hint = did_you_mean(key, list(fields)) or f" Known keys: {', '.join(fields)}."
            raise ConfigError(f"{where}: unknown key '{key}'{more}.{hint}")
        hint = did_you_mean(key, list(fields), where + ".") or f" Known keys of {where}: {', '.join(fields)}."
        raise ConfigError(f"unknown config key '{where}.{key}'{more}.{hint}")
    hints = type_hints(cls)
    checked = {
        name: check_value(value, hints.get(name, Any), f"{where}.{name}")
        for name, value in values.items()
        if name in fields
    }
    try:
        return cls(**checked)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{where}: {error}") from None


#: Plugin-owned nodes (by dotted key) -> the keys rlplat puts in them for itself: ``loss_mode`` names the
#: policy loss the node belongs to; the ``algorithm`` node's keys are the loop's (the fields of
#: :class:`rlplat.contracts.algorithm.AlgorithmConfig`: ``name``, ``adv_estimator``, the KL settings, ...),
#: entered by that module when it is imported (it sits above this one).
CORE_KEYS_OF_PLUGIN_NODES: dict[str, tuple[str, ...]] = {
    "actor.loss.policy_loss": ("loss_mode",),
}


def core_keys_of(where: str) -> tuple[str, ...]:
    """The keys rlplat sets in the plugin-owned node ``where`` (none for other nodes)."""
    return CORE_KEYS_OF_PLUGIN_NODES.get(where, ())


def as_mapping(config: Any, where: str) -> dict[str, Any]:
    """A node as a plain dict: None -> {}, a dataclass instance -> its fields, an OmegaConf node -> its
    container (interpolations resolved)."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {field.name: getattr(config, field.name) for field in dataclasses.fields(config) if field.init}
    config = plain(config)
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(config).__name__}: {config!r:.80}")
    for key in config:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings, got {key!r}")
    return dict(config)


def plain(value: Any) -> Any:
    """OmegaConf containers as plain dicts and lists; anything else as it is."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    """The evaluated annotations of ``cls`` (``from __future__ import annotations`` resolved)."""
    return typing.get_type_hints(cls)


def describe(hint: Any) -> str:
    """A type annotation in words for messages (``"float"``, ``"list of int"``, ``"int or None"``)."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "any value"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("None" if argument is type(None) else describe(argument) for argument in arguments)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(argument) for argument in arguments)
    if origin in (list, Sequence) or hint in (list, Sequence):
        return f"list of {describe(arguments[0])}" if arguments else "list"
    if origin is tuple or hint is tuple:
        return f"list of {describe(arguments[0])}" if arguments else "list"
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return "mapping"
    if dataclasses.is_dataclass(hint):
        return f"mapping ({hint.__name__})"
    return getattr(hint, "__name__", str(hint))


def check_value(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the annotation ``hint`` (converted where nothing is lost); raises a
    :class:`ConfigError` that names ``where``, the expected type and what was given."""
    value = plain(value)
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in arguments:
            return None
        for argument in arguments:
            if argument is type(None):
                continue
            try:
                return check_value(value, argument, where)
            except ConfigError:
                continue
        raise mistyped(value, hint, where)
    if origin is typing.Literal:
        if value in arguments:
            return value
        raise mistyped(value, hint, where)
    if dataclasses.is_dataclass(hint):
        return read_config_node(value, hint, where)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise mistyped(value, hint, where)
    if hint is int:
        if isinstance(value, bool):
            raise mistyped(value, hint, where)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise mistyped(value, hint, where)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise mistyped(value, hint, where)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # OmegaConf's rule for a string field given a number (e.g. a run name)
        raise mistyped(value, hint, where)
    sequence_like = origin in (list, tuple, Sequence) or hint in (list, tuple, Sequence)
    if sequence_like:
        if not isinstance(value, (list, tuple)):
            raise mistyped(value, hint, where)
        if origin is tuple and len(arguments) == 2 and arguments[1] is Ellipsis:
            items = [check_value(item, arguments[0], f"{where}[{index}]") for index, item in enumerate(value)]
        elif origin is tuple and arguments:
            if len(arguments) != len(value):
                raise ConfigError(f"{where}: expected {len(arguments)} values, got {len(value)}: {value!r:.80}")
            items = [check_value(item, argument, f"{where}[{index}]") for index, (item, argument) in enumerate(zip(value, arguments))]
        elif arguments:
            items = [check_value(item, arguments[0], f"{where}[{index}]") for index, item in enumerate(value)]
        else:
            items = list(value)
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise mistyped(value, hint, where)
        value_hint = arguments[1] if len(arguments) == 2 else Any
        return {key: check_value(item, value_hint, f"{where}.{key}") for key, item in value.items()}
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise mistyped(value, hint, where)
    return value


def mistyped(value: Any, hint: Any, where: str) -> ConfigError:
    return ConfigError(f"{where}: expected {describe(hint)}, got {type(value).__name__} {value!r:.80}.")


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the attribute docstring under it, for ``cls`` and its dataclass bases (a subclass's
    docstring wins). Fields without one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        definition = next((node for node in tree.body if isinstance(node, ast.ClassDef)), None)
        if definition is None:
            continue
        body = definition.body
        for statement, following in zip(body, body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def resolve_schema(schema: Any) -> type | None:
    """A registry entry's ``config_schema`` (a dataclass or its ``"module:attribute"`` path) as the
    dataclass; None when there is none."""
    if schema is None:
        return None
    if isinstance(schema, str):
        from rlplat.registry import resolve_dotted_path

        schema = resolve_dotted_path(schema)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"a config schema must be a dataclass (or its dotted path), got {schema!r}")
    return schema
