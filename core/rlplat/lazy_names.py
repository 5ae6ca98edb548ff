"""PEP 562 lazy public names for a package: ``import rlplat`` (and ``rlplat.contracts``,
``rlplat.losses``, ``rlplat.testing``) stays free of torch, Ray and tensordict, and each name imports its
module on first access."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_names(package: str, names: Mapping[str, str | tuple[str, str | None]], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps a public name to its module (the attribute
    of the same name) or to ``(module, attribute)``, where attribute None means the module itself. A
    resolved name is cached in the package's ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = names[name]
        module_name, attribute = (target, name) if isinstance(target, str) else target
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
