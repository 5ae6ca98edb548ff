"""Run presets (kind ``preset``): named settings a plugin ships, put before the user's own overrides by
``rlplat run --demo NAME`` (and ``rlplat plan``, ``rlplat config``).

A preset's factory takes no arguments and returns dotted overrides. Its registration's metadata says
which algorithm it implies (``{"algorithm": "grpo"}``, used when ``--algo`` is not given) and whether it
is the preset a command runs when given neither ``model.path`` nor ``--config`` (``{"default": True}``,
one at most). rlplat registers none; the built-in demo's are rlplat-demo's (:data:`INSTALL_HINT`).
Nothing here imports a preset's plugin until its overrides are asked for.
"""

from __future__ import annotations

from rlplat.config_node import ConfigError
from rlplat.registry import did_you_mean

KIND = "preset"
INSTALL_HINT = "pip install rlplat-demo"
"""What gives a fresh installation the built-in demo's presets."""


def names() -> list[str]:
    """The registered presets, sorted."""
    from rlplat import registry

    return [entry.name for entry in registry.entries(KIND)]


def default_name() -> str | None:
    """The preset marked ``default`` (None when no plugin marks one); :class:`ConfigError` when several are."""
    from rlplat import registry

    marked = [entry for entry in registry.entries(KIND) if entry.metadata.get("default")]
    if len(marked) > 1:
        raise ConfigError("several presets are marked as the default: " + ", ".join(
            f"{entry.name!r} ({entry.origin})" for entry in marked) + "; disable one plugin (RLPLAT_PLUGINS) or "
            "give model.path or --demo NAME")
    return marked[0].name if marked else None


def describe() -> str:
    """The registered presets for a help text: ``arith (the default), tools, ...``, or what to install."""
    from rlplat import registry

    listed = [f"{entry.name} (the default)" if entry.metadata.get("default") else entry.name
              for entry in registry.entries(KIND)]
    return ", ".join(listed) if listed else f"none registered ({INSTALL_HINT} for the built-in demo's)"


def entry(name: str):
    """The registry entry of preset ``name``; :class:`ConfigError` naming the registered ones otherwise."""
    from rlplat import registry

    known = names()
    if name not in known:
        if not known:
            raise ConfigError(f"--demo {name}: no preset is registered; {INSTALL_HINT} for the built-in demo's "
                              "(rlplat plugins list shows what is installed)")
        raise ConfigError(f"--demo {name}: unknown preset; the registered presets are {', '.join(known)}."
                          f"{did_you_mean(name, known)}")
    return registry.entry(KIND, name)


def algorithm(name: str) -> str | None:
    """The algorithm preset ``name`` implies (its ``metadata["algorithm"]``), or None."""
    return entry(name).metadata.get("algorithm")


def overrides(name: str) -> list[str]:
    """Preset ``name``'s dotted overrides (its factory's answer, checked to be a list of strings)."""
    found = entry(name)
    settings = found.load()()
    if not isinstance(settings, (list, tuple)) or not all(isinstance(setting, str) for setting in settings):
        raise ConfigError(f"preset {name!r} from {found.origin} returned {type(settings).__name__}, not a list of "
                          "key=value strings")
    return list(settings)
