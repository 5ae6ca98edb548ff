"""Translating a command line and a YAML file in verl's keys into rlplat's, with the rules of
:mod:`rlplat_verl.table`: what ``rlplat run``, ``plan`` and ``config`` apply through the ``verl`` config
translator (:func:`translate_command_line`) before ``load_config`` sees the arguments.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlplat_verl.rules import VERBATIM, VERL_ONLY_ROOTS, Context, Item, format_value, parse_value, refused, unchanged
from rlplat_verl.table import find_rule


def parse_argument(argument: str, refusals: list[str]) -> Item | None:
    """One command-line argument -> an Item (None: not ``key=value``; it passes as written)."""
    key, sep, raw = argument.partition("=")
    if key.startswith("~"):
        refusals.append(f"{argument}: hydra's ~ deletes a key; rlplat's config has no deletion: leave the key out")
        return None
    if not sep:
        return None
    stripped = key.lstrip("+")
    return Item(stripped, parse_value(raw), raw, "overrides", key[: len(key) - len(stripped)])


def flatten(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves of a nested mapping as (dotted key, value); empty mappings and lists are leaves."""
    leaves = []
    for key, value in node.items():
        if isinstance(value, Mapping) and value:
            leaves.extend(flatten(value, f"{prefix}{key}."))
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves


def translate_items(items: Sequence[Item], algo: str | None, rollout: str | None,
                    notes: list[str], refusals: list[str]) -> list[list[tuple[str, Any]]]:
    """Each item's rlplat settings, in order; notes and refusals are appended to the lists given."""
    context = Context(items, algo, rollout)
    settings = []
    for item in items:
        rule = find_rule(item.key)
        if rule is not None:
            try:
                outcome = rule.handle(item, context)
            except (TypeError, ValueError) as error:
                outcome = refused(item, f"not a value this key takes ({error})")
        elif item.key.split(".")[0] in VERL_ONLY_ROOTS:
            outcome = refused(item, "no rlplat equivalent")
        else:
            outcome = unchanged(item)
        if outcome.refusal:
            refusals.append(outcome.refusal)
        if item.prefix:
            notes.append(f"hydra prefix '{item.prefix}' dropped from {item.prefix}{item.key}: every rlplat key exists, "
                         "so nothing is added")
        if outcome.note:
            notes.append(outcome.note)
        settings.append(outcome.settings)
    return settings


def raise_refusals(refusals: Sequence[str]) -> None:
    """One :class:`rlplat.config_node.ConfigError` listing every refusal, one per line."""
    if not refusals:
        return
    from rlplat.config_node import ConfigError

    lines = "\n".join(f"  {refusal}" for refusal in refusals)
    raise ConfigError(f"{len(refusals)} verl key(s) with no rlplat equivalent; remove them "
                      f"(plugins/compat/verl/docs/coming-from-verl.md says why):\n{lines}")


def translate_overrides(arguments: Sequence[str], *, algo: str | None = None, rollout: str | None = None) -> tuple[list[str], list[str]]:
    """Dotted ``key=value`` arguments, some in verl's keys, -> (the same in rlplat's keys, one note per
    translation). ``algo`` and ``rollout`` are the CLI's ``--algo`` and ``--rollout`` (some keys depend on
    them). Raises :class:`rlplat.config_node.ConfigError` listing every key rlplat has no equivalent for."""
    _, translated, notes = translate_command_line(None, arguments, algo=algo, rollout=rollout)
    return translated, notes


def translate_mapping(mapping: Mapping[str, Any], *, algo: str | None = None, rollout: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """A nested config in verl's layout (top-level ``actor_rollout_ref``, ...) -> (rlplat's nested config,
    notes). Same rules and errors as :func:`translate_overrides`; hydra's ``_target_`` keys are dropped
    and a value ``???`` (verl's "required") counts as not given."""
    notes: list[str] = []
    refusals: list[str] = []
    items = file_items(mapping, notes, refusals)
    settings = translate_items(items, algo, rollout, notes, refusals)
    raise_refusals(refusals)
    return nest(items, settings), notes


def file_items(mapping: Mapping[str, Any], notes: list[str], refusals: list[str]) -> list[Item]:
    if "defaults" in mapping:
        refusals.append("defaults: hydra's defaults list composes other files, which rlplat does not; write the keys out")
    leaves = [(key, value) for key, value in flatten(mapping) if key != "defaults"]
    targets = [key for key, _ in leaves if key.split(".")[-1] == "_target_"]
    if targets:
        notes.append(f"dropped {len(targets)} _target_ key(s): verl's class paths mean nothing to rlplat")
    return [Item(key, value, None, "file") for key, value in leaves if key not in targets and value != "???"]


def nest(items: Sequence[Item], settings: Sequence[Sequence[tuple[str, Any]]]) -> dict[str, Any]:
    node = OmegaConf.create({})
    for item, pairs in zip(items, settings):
        for key, value in pairs:
            OmegaConf.update(node, key, item.value if value is VERBATIM else value, merge=True)
    return OmegaConf.to_container(node)


def translate_command_line(
    config_file: str | os.PathLike | None, overrides: Sequence[str], *, algo: str | None = None, rollout: str | None = None,
) -> tuple[str | None, list[str], list[str]]:
    """What ``rlplat run`` and ``rlplat config show`` do before ``load_config``: the overrides and the
    ``--config`` file translated together (a key may depend on another in either place). Returns
    (config file to load, overrides, notes): the file as given when nothing in it changes, else its
    translation written to the temporary directory, which a note names. Raises
    :class:`rlplat.config_node.ConfigError` listing every refused key of both."""
    notes: list[str] = []
    refusals: list[str] = []
    parsed = [(argument, parse_argument(argument, refusals)) for argument in overrides]
    file_node = read_yaml(config_file)
    file_part = file_items(file_node, notes, refusals) if file_node is not None else []
    items = file_part + [item for _, item in parsed if item is not None]
    settings = translate_items(items, algo, rollout, notes, refusals)
    raise_refusals(refusals)
    file_settings, override_settings = settings[: len(file_part)], iter(settings[len(file_part):])
    if any(pairs != [(item.key, VERBATIM)] for item, pairs in zip(file_part, file_settings)):
        handle, path = tempfile.mkstemp(prefix=f"{Path(config_file).stem}.rlplat-", suffix=".yaml")
        with os.fdopen(handle, "w") as stream:
            stream.write(OmegaConf.to_yaml(OmegaConf.create(nest(file_part, file_settings))))
        notes.append(f"--config {config_file} has verl keys: its rlplat translation is {path}")
        config_file = path
    arguments: list[str] = []
    for argument, item in parsed:
        if item is None:
            arguments.append(argument)
            continue
        for key, value in next(override_settings):
            arguments.append(f"{key}={item.raw if value is VERBATIM else format_value(value)}")
    return (None if config_file is None else str(config_file)), arguments, notes


def read_yaml(config_file: str | os.PathLike | None) -> dict[str, Any] | None:
    """The file's mapping, interpolations resolved where they can be; None when there is no file or it is
    not a YAML mapping (``load_config`` reports that)."""
    if config_file is None or not Path(config_file).is_file():
        return None
    try:
        node = OmegaConf.load(config_file)
    except Exception:
        return None
    if not OmegaConf.is_dict(node):
        return None
    try:
        return OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    except Exception:
        return OmegaConf.to_container(node, resolve=False)
