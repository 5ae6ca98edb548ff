"""The ``actor.moe`` node: router replay and the router's auxiliary losses of a mixture-of-experts policy.

Core reads and checks the node and hands it to the actor's engine as its build key ``moe`` (only when a
setting differs from the default, so an engine that knows nothing of MoE never sees it) and, for
``router_replay=r3``, asks the rollout to record routes (its build key ``record_routes``). An engine takes
the node when its registry entry's metadata says ``"moe": True``; a rollout records routes when its
entry's metadata says ``"records_routes": True`` (``"records_routes_reason"``: why one does not, for the
refusal). This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlplat.config_node import ConfigError, read_config_node

ROUTER_REPLAY_MODES = ("off", "r2", "r3")


@dataclasses.dataclass
class MoEConfig:
    router_replay: str = "off"
    """``off``: every forward routes live. ``r2``: the update replays the routes the engine's own
    old-log-prob forward took (no effect on steps that skip that pass, whose update is the old policy's
    forward). ``r3``: every forward of the actor replays the routes the rollout sampled with, recorded by
    the rollout (the batched generation path; not agent loops or partial rollouts yet)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss added to the actor's loss: per MoE layer ``E * sum_e f_e * P_e``
    (``f_e`` the tokens routed to expert ``e`` over the tokens, ``P_e`` its mean router probability; k
    when balanced), averaged over layers and over the mini-batch's tokens."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss, ``logsumexp(router logits)^2`` per token, averaged likewise."""

    def __post_init__(self) -> None:
        if self.router_replay not in ROUTER_REPLAY_MODES:
            raise ValueError(f"router_replay must be one of {', '.join(ROUTER_REPLAY_MODES)}, got {self.router_replay!r}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def default(self) -> bool:
        return self == MoEConfig()


def read_moe(node: Any, where: str = "actor.moe") -> MoEConfig:
    return read_config_node(node, MoEConfig, where)


def run_moe(config: Any) -> MoEConfig:
    """The run config's ``actor.moe``, read and checked (defaults where it has none)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(config, "actor.moe")
    return read_moe(OmegaConf.to_container(node, resolve=True) if node is not None else None)


def check_moe(config: Any) -> None:
    """Load-time checks of ``actor.moe`` against the engine and the rollout (their registry metadata)."""
    from rlplat import registry

    moe = run_moe(config)
    if moe.default:
        return
    engine = config.actor.engine
    if not registry.entry("engine", engine).metadata.get("moe"):
        raise ConfigError(f"actor.moe: engine {engine!r} does not train mixture-of-experts routing (router replay, "
                          "router losses; its registry metadata has no 'moe'); use the fsdp2 or megatron engine or leave actor.moe unset.")
    if moe.router_replay != "r3":
        return
    rollout = config.rollout.name
    metadata = registry.entry("rollout", rollout).metadata
    if not metadata.get("records_routes"):
        why = metadata.get("records_routes_reason") or "its registry metadata has no 'records_routes'"
        raise ConfigError(f"actor.moe.router_replay=r3 replays the routes the rollout sampled with, and rollout {rollout!r} "
                          f"does not record them ({why}); use the hf rollout, or router_replay=r2 (the engine's own "
                          "old-log-prob routes).")
    from rlplat.config import rollout_driver
    from rlplat.config.modes import partial_mode

    driver, partial = rollout_driver(config), partial_mode(config.trainer)
    if driver is not None or partial != "off":
        what = f"rollout driver {driver!r}" if driver is not None else f"trainer.partial_rollout={partial}"
        raise ConfigError(f"actor.moe.router_replay=r3: the {what} generates through generate_tokens, which records no "
                          "routes yet (only the rollout's batched generate does); use router_replay=r2.")


def moe_build_keys(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the actor engine's extra build keys, the rollout's): ``moe`` and ``record_routes``, only where set."""
    moe = run_moe(config)
    if moe.default:
        return {}, {}
    return {"moe": dataclasses.asdict(moe)}, ({"record_routes": True} if moe.router_replay == "r3" else {})
