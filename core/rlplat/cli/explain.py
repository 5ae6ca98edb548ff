"""Every key of a run config with its type, default, current value, owner and docstring: what
``rlplat config explain [KEY]`` and ``rlplat config show --doc`` print.

Core's keys come from the dataclasses of :mod:`rlplat.config`; the keys of a plugin-owned node
(``actor.engine_config``, ``rollout.config``, ``reward.config``, ``actor.loss``, ``algorithm``, ...) from
the schema the chosen plugin declares, so the list always matches what the run would accept.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from rlplat.config_node import describe, field_docs, type_hints
from rlplat.losses.config import LOSS_SET_KEYS

CORE = "core (rlplat)"


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One key: dotted name, type in words, default, value in this config, owner and docstring."""

    key: str
    type: str
    default: Any
    value: Any
    owner: str
    doc: str

    def render(self, width: int = 100) -> str:
        head = f"{self.key}  ({self.type}; default {self.default!r}"
        head += f"; here {self.value!r})" if self.value != self.default else ")"
        body = textwrap.fill(self.doc or "(no description)", width, initial_indent="    ", subsequent_indent="    ")
        return f"{head}  [{self.owner}]\n{body}"


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return None


def schema_keys(schema: type, prefix: str, values: Any, owner: str) -> Iterator[KeyDoc]:
    """The keys of a dataclass schema, nested dataclasses flattened into dotted keys."""
    docs, hints = field_docs(schema), type_hints(schema)
    values = values if isinstance(values, dict) else {}
    for field in dataclasses.fields(schema):
        hint = hints.get(field.name, Any)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(hint):
            yield from schema_keys(hint, f"{key}.", values.get(field.name), owner)
            continue
        default = default_of(field)
        yield KeyDoc(key, describe(hint), default, values.get(field.name, default), owner, docs.get(field.name, ""))
        entry = mapped_schema(hint)
        if entry is not None:  # a mapping of named entries of one schema: its keys under <name>
            yield from schema_keys(entry, f"{key}.<name>.", {}, owner)


def mapped_schema(hint: Any) -> type | None:
    """The dataclass of the values of a ``Dict[str, Dataclass]`` annotation, else None."""
    import typing
    from collections.abc import Mapping

    arguments = typing.get_args(hint)
    if typing.get_origin(hint) in (dict, Mapping) and len(arguments) == 2 and dataclasses.is_dataclass(arguments[1]):
        return arguments[1]
    return None


def explain(config: DictConfig) -> list[KeyDoc]:
    """Every key of ``config`` (resolved by :func:`rlplat.config.load_config`), core's and the plugins'."""
    from rlplat.config import RLConfig, algorithm_spec, plugin_nodes, total_training_steps

    node = OmegaConf.to_container(config, resolve=True)
    algorithm = algorithm_spec(config.algorithm.name)
    owned = {item.key: item for item in plugin_nodes(config, algorithm, total_training_steps(config, 0) or 1)}
    keys: list[KeyDoc] = []

    def walk(schema: type, prefix: str, values: dict[str, Any]) -> None:
        docs, hints = field_docs(schema), type_hints(schema)
        for field in dataclasses.fields(schema):
            key, hint = f"{prefix}{field.name}", hints.get(field.name, Any)
            if key in owned:
                keys.extend(plugin_keys(owned[key]))
                keys.extend(doc for inner in owned.values() if inner.key.startswith(key + ".") for doc in plugin_keys(inner))
            elif dataclasses.is_dataclass(hint):
                walk(hint, f"{key}.", values.get(field.name) or {})
            elif key == "roles":
                keys.extend(role_keys(config))
            else:
                keys.append(KeyDoc(key, describe(hint), default_of(field), values.get(field.name), CORE, docs.get(field.name, "")))

    walk(RLConfig, "", node)
    listed = {doc.key for doc in keys}
    for item in owned.values():  # the nodes plugins own outside core's schema (kind config_node)
        keys.extend(doc for doc in plugin_keys(item) if doc.key not in listed)
    return keys


def plugin_keys(item: Any) -> list[KeyDoc]:
    """The keys a user may set in a plugin-owned node (core-filled build keys left out)."""
    if item.schema is None:
        return [KeyDoc(f"{item.key}.{key}", "any value", None, value, item.owner, "(the plugin declares no schema)")
                for key, value in item.values.items()]
    found = []
    for doc in schema_keys(item.schema, f"{item.key}.", item.values, item.owner):
        name = doc.key[len(item.key) + 1:].split(".")[0]
        if name in item.core_keys:
            continue
        if item.key == "actor.loss" and name == "policy_loss":
            continue  # listed with the policy loss's own schema (actor.loss.policy_loss)
        if name in LOSS_SET_KEYS:
            continue  # set per micro-batch or by the run, not a user setting
        found.append(doc)
    return found


def role_keys(config: DictConfig) -> list[KeyDoc]:
    from rlplat import registry
    from rlplat.config_node import resolve_schema
    from rlplat.contracts.role import RoleConfig

    found = []
    roles = OmegaConf.to_container(config.roles, resolve=True)
    for name in registry.names("role"):
        entry = registry.entry("role", name)
        schema = resolve_schema(entry.config_schema) or RoleConfig
        found.extend(schema_keys(schema, f"roles.{name}.", roles.get(name), f"role {name!r} from {entry.origin}"))
    return found


def render(keys: list[KeyDoc], prefix: str | None = None) -> str:
    """The keys under ``prefix`` (all when None), one block each."""
    chosen = [doc for doc in keys if prefix is None or doc.key == prefix or doc.key.startswith(prefix.rstrip(".") + ".")]
    return "\n".join(doc.render() for doc in chosen)
