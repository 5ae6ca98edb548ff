"""Mixture-of-experts policies in the fsdp2 engine: ``actor.moe`` (router replay and the router's
auxiliary losses, :mod:`rlplat.config.moe`) and the experts' load, through forward hooks on the routers
(:mod:`rlplat.kits.moe`).

One :class:`EngineRouting` per engine, built at ``init_model`` when the model has routers. Each model call
of ``forward`` or of an optimizer step begins a :class:`~rlplat.kits.moe.RoutingCall`:

* the tokens it counts are the call's valid ones (packed: all of them; padded: ``attention_mask``);
* with ``router_replay=r3`` every call replays the batch's ``routed_experts`` (the rollout's routes); with
  ``r2`` the update's calls replay them, and ``forward`` records the routes it took and returns them as
  that column (the worker's ``compute_log_prob`` passes it on, so the update replays the old policy's);
* in an optimizer step the call observes each router: the experts' load (``actor/moe/*`` metrics over the
  step, every rank's tokens) and, with gradients, the load-balancing loss and the z-loss, weighted by the
  call's share of the mini-batch's tokens so that the step's sum is their mean over the mini-batch.

With Ulysses sequence parallelism (``sequence_parallel``) each rank's routers see its slice of the padded pack:
the call's tokens, replayed routes and token mask are the slice's, recorded routes are gathered from the group,
and the router losses are those of the group's whole pack on every rank (the experts' counts and token counts
summed over the group, the probabilities and z-loss terms through a differentiable sum whose gradient reaches
each rank's own tokens). The load metrics sum every rank's tokens; the pairs whose routes matter are counted by
the group's first rank.

Hugging Face's MoE layers route every token to its k experts (no capacity, so no token is dropped).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rlplat.config.moe import MoEConfig, read_moe
from rlplat.kits.moe import ROUTES, RouteHooks, RoutingCall, find_routers, routing_metrics
from rlplat_engine_fsdp2 import ulysses


class EngineCall(RoutingCall):
    """A :class:`RoutingCall` with the tokens it counts (``token_mask``, None: all), the router losses its
    observer collected (``terms``) and the (token, layer) pairs whose routes matter (``needed``: every
    valid token but each row's last, whose output predicts nothing)."""

    def __init__(self, tokens: int, token_mask: torch.Tensor | None, needed: int, sequence_parallel: Any = None,
                 pack_tokens: int = 0, **options: Any):
        super().__init__(tokens, **options)
        self.token_mask = token_mask
        self.needed = needed
        self.sequence_parallel = sequence_parallel  # ulysses.SequenceParallel: the routers see this rank's slice
        self.pack_tokens = pack_tokens  # the whole pack's tokens, under sequence parallelism
        self.terms: list[tuple[torch.Tensor, torch.Tensor]] = []


def build_routing(model: torch.nn.Module, moe_node: Any) -> EngineRouting | None:
    """The routing of ``model`` under ``moe_node`` (the engine config's ``moe``: None for the defaults); None for a
    dense model, which is refused with ``moe`` set."""
    moe = read_moe(moe_node, "moe") if moe_node is not None else MoEConfig()
    if find_routers(model):
        return EngineRouting(model, moe)
    if not moe.default:
        raise ValueError(f"fsdp2 engine: actor.moe is set ({moe_node}), but {type(model).__name__} has no "
                         "mixture-of-experts routers (router replay and router losses are for MoE models)")
    return None


class EngineRouting:
    def __init__(self, model: torch.nn.Module, moe: MoEConfig):
        self.moe = moe
        self.hooks = RouteHooks(model)
        self.routers = self.hooks.routers
        self.experts = max((router.num_experts for router in self.routers), default=0)
        self.start_step()

    # -- one model call ------------------------------------------------------------------------------------

    def begin(self, batch: Any, packed: bool, *, update: bool, counted: bool = True, sequence_parallel: Any = None) -> EngineCall:
        """The routing of one model call on ``batch`` (a micro-batch's TensorDict); ``update``: a call of an
        optimizer step (observed; replays under r2 and r3), else of ``forward`` (replays under r3, records
        under r2); ``counted``: False for a stand-in micro-batch whose loss is dropped; ``sequence_parallel``:
        this rank runs its slice of the (packed) call's tokens."""
        valid = batch["attention_mask"].bool()
        tokens = int(valid.sum()) if packed else valid.numel()
        sp = sequence_parallel
        replays = self.moe.router_replay == "r3" or (self.moe.router_replay == "r2" and update)
        replay = None
        if replays:
            routes = batch[ROUTES] if ROUTES in batch.keys() else None
            if routes is None and self.moe.router_replay == "r3":
                raise KeyError(f"actor.moe.router_replay=r3: the batch has no {ROUTES!r} column, so the rollout recorded "
                               "no routes (rollout.config.record_routes, set by the trainer for r3 runs of the hf rollout)")
            if routes is not None:
                expected = (*valid.shape, len(self.routers))
                if tuple(routes.shape[:3]) != expected or routes.shape[3] < self.hooks.top_k:
                    raise ValueError(f"{ROUTES} has shape {list(routes.shape)}; this model's routes are "
                                     f"[rows, T, moe_layers, top_k] = {[*expected, self.hooks.top_k]}")
                # each row's last token predicts nothing, so its route never matters: it routes live
                routes = routes.long()
                rows = valid.any(-1).nonzero().squeeze(-1)
                last = valid.shape[1] - 1 - valid.flip(-1).int().argmax(-1)
                routes[rows, last[rows]] = -1
                replay = routes[valid] if packed else routes.flatten(0, 1)
        needed = (int(valid.sum()) - int(valid.any(-1).sum())) * len(self.routers) if counted else 0
        token_mask = None if packed else valid.flatten()
        if sp is not None:  # this rank's slice of the pack padded to a multiple of the group (ulysses.shard)
            step = ulysses.padded_length(tokens, sp.size) // sp.size
            start = sp.rank * step
            if replay is not None:
                replay = torch.cat([replay, replay.new_full((step * sp.size - tokens, *replay.shape[1:]), -1)])[start:start + step]
            token_mask = torch.arange(start, start + step, device=valid.device) < tokens
            needed = needed if sp.rank == 0 else 0
        call = EngineCall(step if sp is not None else tokens, token_mask, needed, sequence_parallel=sp, pack_tokens=tokens,
                          replay=replay, record=self.moe.router_replay == "r2" and not update)
        if update and counted:
            call.observe = self.observer(call)
        return self.hooks.begin(call)

    def observer(self, call: EngineCall) -> Callable:
        def observe(router: Any, logits: torch.Tensor, indices: torch.Tensor) -> None:
            mask, sp = call.token_mask, call.sequence_parallel
            if mask is not None:
                mask = mask.to(logits.device)
                logits, indices = logits[mask], indices[mask]
            if logits.shape[0] == 0 and sp is None:  # under SP every rank joins the sums, tokens or not
                return
            counts = torch.bincount(indices.flatten().long(), minlength=router.num_experts).to(logits.dtype)
            if self.counts.device != counts.device:  # kept where the model runs: no copy to the host per layer
                self.counts = self.counts.to(counts.device)
            self.counts[router.layer, : router.num_experts] += counts.detach().double()
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.moe.aux_loss_coef > 0):
                probabilities = torch.softmax(logits.float(), dim=-1).sum(0)
                if sp is not None:
                    counts, probabilities = ulysses.sum_over(counts.float(), sp), ulysses.sum_over(probabilities, sp)
                tokens = float(call.pack_tokens) if sp is not None else float(logits.shape[0])
                balance = router.num_experts * (counts.float() / tokens * probabilities / tokens).sum()
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.moe.z_loss_coef > 0):
                z = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()
                z = (ulysses.sum_over(z, sp) if sp is not None else z) / tokens
            call.terms.append((balance, z))

        return observe

    def loss_term(self, call: EngineCall, weight: float) -> tuple[torch.Tensor | float, dict[str, float]]:
        """The router losses of ``call`` (averaged over its MoE layers) times their coefficients and
        ``weight`` (the call's share of the mini-batch's tokens), and their metric contributions."""
        if not call.terms:
            return 0.0, {}
        balance = torch.stack([term[0] for term in call.terms]).mean()
        z = torch.stack([term[1] for term in call.terms]).mean()
        term = 0.0
        if self.moe.aux_loss_coef > 0:
            term = term + self.moe.aux_loss_coef * weight * balance
        if self.moe.z_loss_coef > 0:
            term = term + self.moe.z_loss_coef * weight * z
        return term, {"actor/moe/aux_loss": float(balance.detach()) * weight, "actor/moe/z_loss": float(z.detach()) * weight}

    def recorded(self, call: EngineCall, batch: Any, packed: bool) -> torch.Tensor:
        """``call``'s recorded routes as the batch column ``[rows, T, moe_layers, top_k]`` (``-1`` at padding)."""
        valid = batch["attention_mask"].bool().cpu()
        stacked = self.hooks.stacked(call)
        if call.sequence_parallel is not None:  # the group's slices, in pack order, without the padding
            stacked = ulysses.gather_slices(stacked.int(), call.sequence_parallel)[: call.pack_tokens].to(torch.int16)
        routes = torch.full((*valid.shape, *stacked.shape[1:]), -1, dtype=torch.int16)
        if packed:
            routes[valid] = stacked
        else:
            routes.copy_(stacked.view(routes.shape))
            routes[~valid] = -1
        return routes

    def end(self) -> None:
        self.hooks.end()

    # -- one optimizer step ----------------------------------------------------------------------------------

    def start_step(self) -> None:
        self.counts = torch.zeros(len(self.routers), self.experts, dtype=torch.float64)
        self.replayed = self.agreeing = self.needed = 0

    def count_replay(self, call: EngineCall) -> None:
        self.replayed += call.replayed_tokens
        self.agreeing += call.agreeing_tokens
        self.needed += call.needed

    def step_metrics(self, all_reduce_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """The step's load metrics over every rank's tokens (one all-reduce), then ready for the next step."""
        summed = all_reduce_sum([*self.counts.flatten().tolist(), float(self.replayed), float(self.agreeing), float(self.needed)])
        counts = torch.tensor(summed[:-3], dtype=torch.float64).view(self.counts.shape)
        replayed, agreeing, needed = summed[-3:]
        self.start_step()
        return routing_metrics(counts, {router.layer: router.num_experts for router in self.routers}, self.moe.router_replay,
                               replayed, agreeing, needed)
