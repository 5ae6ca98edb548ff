"""Reading a component's config node into its typed dataclass: the dataclass itself, a mapping or an
OmegaConf node; an unknown key is an error that names the known ones."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def read_config_node(config: Any, cls: type[T], what: str | None = None) -> T:
    """``config`` as ``cls``. Tuple-typed fields given as lists become tuples. ``what`` names the node in
    errors (default: the class name)."""
    if isinstance(config, cls):
        return config
    if config is None:
        return cls()
    if not isinstance(config, Mapping):
        try:
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(config, resolve=True)
        except Exception as error:
            raise TypeError(f"{what or cls.__name__}: expected a mapping, got {type(config).__name__}") from error
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(f"{what or cls.__name__}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
    values = dict(config)
    for name, value in values.items():
        if isinstance(value, list) and str(fields[name].type).startswith("tuple"):
            values[name] = tuple(value)
    return cls(**values)
