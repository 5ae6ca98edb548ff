"""The demo's presets as the registry calls them (kind ``preset``: a factory of no arguments returning
dotted overrides), one function per name of :data:`rlplat_demo.PRESETS`."""

from __future__ import annotations

from rlplat_demo import overrides as arith, preset

__all__ = ["arith", "reward_model", "tools", "retry", "retry_single", "tools_blackbox", "distill", "distill_rl"]


def reward_model() -> list[str]:
    return preset("reward-model")


def tools() -> list[str]:
    return preset("tools")


def retry() -> list[str]:
    return preset("retry")


def retry_single() -> list[str]:
    return preset("retry-single")


def tools_blackbox() -> list[str]:
    return preset("tools-blackbox")


def distill() -> list[str]:
    return preset("distill")


def distill_rl() -> list[str]:
    return preset("distill-rl")
