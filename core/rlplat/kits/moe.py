"""Mixture-of-experts routing for engines and rollouts: finding a model's routers, recording the experts
each token was routed to, and replaying recorded routes in a later forward ("router replay").

A Hugging Face MoE causal LM (Qwen2-MoE, Qwen3-MoE, Mixtral and the models built like them) routes each
token in a router module of its own per MoE layer (``*TopKRouter``: a ``weight`` [experts, hidden], a
``top_k``) that returns ``(logits [N, E], weights [N, k], indices [N, k])`` for the ``N`` tokens of the call,
the weights ``softmax(logits)`` at the indices (renormalised over the k where the model does so). A
forward hook on each router is the whole seam: it reads the routes, and it can replace them.

**Replay** keeps the gradient path to the router: the replayed experts' weights are
``softmax(logits)`` gathered at the replayed indices from the full logits (renormalised as the model
does), never top-k probabilities of the live routing, which are zero for an expert the live routing
dropped. Tokens whose recorded route is ``-1`` (nothing was recorded: padding, a rollout's last sampled
token) route live.

**Routes in a batch** travel as :data:`ROUTES`, ``[rows, T, moe_layers, k]`` int16 aligned with
``input_ids`` (``-1`` where none was recorded).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

ROUTES = "routed_experts"
"""Batch column of recorded routes: ``[rows, T, moe_layers, top_k]`` int16, ``-1`` where none was recorded."""

ROUTER_REPLAY_MODES = ("off", "r2", "r3")
"""``off``: live routing; ``r2``: the update replays the routes of the engine's own old-log-prob forward;
``r3``: every forward of the engine replays the routes the rollout sampled with."""


@dataclasses.dataclass
class Router:
    """One MoE layer's router: ``layer`` is its index among the model's MoE layers."""

    layer: int
    name: str
    module: torch.nn.Module
    num_experts: int
    top_k: int
    renormalize: bool


def find_routers(model: torch.nn.Module) -> list[Router]:
    """The model's routers in forward order (empty for a dense model): modules whose class name ends in
    ``Router`` with a 2-D ``weight`` [experts, hidden] and an integer ``top_k``."""
    routers = []
    for name, module in model.named_modules():
        weight, top_k = getattr(module, "weight", None), getattr(module, "top_k", None)
        if not type(module).__name__.endswith("Router") or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if not isinstance(top_k, int) or not 0 < top_k <= weight.shape[0]:
            continue
        # Qwen-style routers renormalise when norm_topk_prob; Mixtral-style ones (no such attribute) always do
        renormalize = bool(getattr(module, "norm_topk_prob", True))
        routers.append(Router(len(routers), name, module, int(weight.shape[0]), top_k, renormalize))
    return routers


def routing_metrics(counts: torch.Tensor, experts: dict[int, int], router_replay: str, replayed: float, agreeing: float,
                    needed: float) -> dict[str, float]:
    """The ``actor/moe/*`` load and replay metrics of a step: ``counts`` [layers, E] (tokens routed to each
    expert, every rank's), ``experts`` ``{MoE layer: its expert count}``; with router replay, the (token, layer)
    pairs routed by a recorded route (``replayed``) of those whose route matters (``needed``), and how many of
    them the live routing would have routed alike (``agreeing``)."""
    metrics: dict[str, float] = {}
    imbalances = []
    for layer, count in experts.items():
        load = counts[layer, :count]
        if load.sum() <= 0:
            continue
        share = load / load.sum()
        imbalance = float(share.max() * count)  # busiest expert over a balanced expert's share
        imbalances.append(imbalance)
        metrics[f"actor/moe/load_imbalance/layer_{layer}"] = imbalance
        metrics[f"actor/moe/load_max/layer_{layer}"] = float(share.max())
        metrics[f"actor/moe/load_min/layer_{layer}"] = float(share.min())
    if imbalances:
        metrics["actor/moe/load_imbalance"] = sum(imbalances) / len(imbalances)
        metrics["actor/moe/load_imbalance_max"] = max(imbalances)
    if router_replay != "off":
        metrics["actor/moe/replayed_fraction"] = replayed / needed if needed else 0.0
        metrics["actor/moe/replay_agreement"] = agreeing / replayed if replayed else 1.0
    return metrics


def replayed_weights(router: Router, logits: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The routing weights of ``indices`` [N, k]: ``softmax(logits)`` [N, E] in float32 gathered there,
    renormalised over the k when the router does, in ``dtype`` (the router's own weights' dtype)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    if router.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(dtype)


class RoutingCall:
    """What the routers do in one model call of ``tokens`` tokens (the flattened ``[N]`` order the routers
    see): ``replay`` [N, layers, k] (long, ``-1``: route live) replaces their routes, ``record`` keeps the
    routes used, ``observe(router, logits, indices)`` sees every router's output (losses, statistics).

    A router called twice in one call (activation checkpointing recomputes the forward in backward) replays
    the same routes and is observed and recorded once."""

    def __init__(self, tokens: int, replay: torch.Tensor | None = None, record: bool = False,
                 observe: Callable[[Router, torch.Tensor, torch.Tensor], None] | None = None):
        self.tokens = tokens
        self.replay = replay
        self.record = record
        self.observe = observe
        self.recorded: dict[int, torch.Tensor] = {}
        self.seen: set[int] = set()
        self.replayed_tokens = 0  # (token, layer) pairs replayed
        self.agreeing_tokens = 0  # of those, where the live routing chose the same set of experts

    def __call__(self, router: Router, output: Any) -> Any:
        if not (isinstance(output, tuple) and len(output) == 3):
            raise TypeError(
                f"MoE router {router.name} ({type(router.module).__name__}) returned {type(output).__name__}; rlplat's "
                "routing reads routers that return (logits, weights, indices), as Qwen2-MoE, Qwen3-MoE and Mixtral's do"
            )
        logits, weights, indices = output
        if logits.shape[0] != self.tokens:
            raise ValueError(f"MoE router {router.name} saw {logits.shape[0]} tokens in a call of {self.tokens}: "
                             "the model's routers must see every token of the call once, in order")
        first = router.layer not in self.seen
        self.seen.add(router.layer)
        replaced = None
        if self.replay is not None:
            if router.layer >= self.replay.shape[1] or self.replay.shape[-1] < router.top_k:
                raise ValueError(f"recorded routes hold {self.replay.shape[1]} MoE layers of {self.replay.shape[-1]} experts "
                                 f"per token; router {router.name} is MoE layer {router.layer} and picks {router.top_k}: "
                                 "the routes are not this model's")
            wanted = self.replay[:, router.layer, : router.top_k].to(indices.device)
            replay_row = (wanted >= 0).all(-1)
            if bool(replay_row.any()):
                used = torch.where(replay_row[:, None], wanted.long(), indices)
                if int(used.max()) >= router.num_experts:
                    raise ValueError(f"recorded routes name expert {int(used.max())}, router {router.name} has "
                                     f"{router.num_experts}: the routes are not this model's")
                if first:
                    same = (used.sort(-1).values == indices.sort(-1).values).all(-1)
                    self.replayed_tokens += int(replay_row.sum())
                    self.agreeing_tokens += int((same & replay_row).sum())
                replaced = (logits, replayed_weights(router, logits, used, weights.dtype), used)
                indices = used
        if first:
            if self.record:
                self.recorded[router.layer] = indices.detach().to(torch.int16)
            if self.observe is not None:
                self.observe(router, logits, indices)
        return replaced


class RouteHooks:
    """Forward hooks on a model's routers, inert until :meth:`begin` sets the call they serve (and after
    :meth:`end`). The call stays set until the next ``begin`` or ``end``, so a backward that recomputes
    the forward (activation checkpointing) sees the same routes."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.call: RoutingCall | None = None
        self.handles = [router.module.register_forward_hook(self.hook_for(router)) for router in self.routers]

    def hook_for(self, router: Router) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            return None if self.call is None else self.call(router, output)

        return hook

    @property
    def top_k(self) -> int:
        return max((router.top_k for router in self.routers), default=0)

    def begin(self, call: RoutingCall) -> RoutingCall:
        self.call = call
        return call

    def end(self) -> None:
        self.call = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.call = None

    def stacked(self, call: RoutingCall) -> torch.Tensor:
        """``call``'s recorded routes as ``[N, layers, k]`` int16 (``-1`` for a layer that recorded nothing;
        a router with fewer experts per token than the widest leaves its last columns ``-1``)."""
        routes = torch.full((call.tokens, len(self.routers), self.top_k), -1, dtype=torch.int16)
        for layer, indices in call.recorded.items():
            routes[:, layer, : indices.shape[-1]] = indices.cpu()
        return routes
