"""Mixture-of-experts models in the megatron engine: the experts' layout (expert parallelism), ``actor.moe``
(router replay, the router's auxiliary losses, :mod:`rlplat.config.moe`) and the experts' load.

megatron-core's ``TopKRouter`` picks each token's experts in ``topk_routing_with_score_function``, which asks
the router's ``router_replay`` object for the top-k when it has one. :class:`RouterTap` is that object (the
engine sets it on every router; megatron's own ``RouterReplay`` stays off), and it also wraps the router's
``routing`` to see the logits and the routing map. Per model call (one micro-batch through one model chunk)
the engine begins a :class:`MegatronCall` on the taps of that chunk:

* ``replay`` [T x b, layers, k] (long, ``-1``: route live): the token's experts are the recorded ones, their
  weights megatron's scores gathered there (the full softmax over the router logits, or the softmax of the
  gathered logits for a router that renormalises over its k: the same as ``rlplat.kits.moe``), so gradients
  reach every logit; with ``router_replay=r3`` every call replays the batch's ``routed_experts``, with ``r2``
  the update's calls do and ``forward`` records;
* ``record``: the experts each token went to, returned by ``forward`` as the ``routed_experts`` column;
* in an optimizer step: the experts' load (``actor/moe/*``, every rank's tokens) and, with gradients, the
  load-balancing loss and the z-loss of the fsdp2 engine's definition (per layer ``E * sum_e f_e * P_e`` and
  ``logsumexp^2`` over the call's valid tokens, averaged over the MoE layers, weighted by the call's share of
  the mini-batch's tokens). They are attached to the router's output with megatron's ``MoEAuxLossAutoScaler``
  (identity forward, the term's gradient in backward), so a router on any pipeline stage adds its term; the
  schedule sets the scaler's scale to 1 under per-token loss accounting, which the engine uses.

Tokens reach a router in megatron's ``[sequence, batch]`` order, flattened: token ``s * b + r`` is position
``s`` of row ``r`` of the left-aligned micro-batch (the engine's ``model_inputs``). megatron's MoE layers are
dropless here (no capacity factor), so no token is dropped.

Under context parallelism each rank's routers see its positions of the rows (``cp_tokens`` of the call: the
micro-batch's width, rows and valid tokens): recorded routes are gathered from the group, and the router losses
are the whole rows' on every rank (:func:`rlplat_engine_megatron.context_parallel.sum_over`); the load counts each
rank's own tokens, and what every rank of a group sees alike (the losses' figures, the pairs whose routes
matter) is counted by its first rank (``once_here``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rlplat.config.moe import MoEConfig
from rlplat.kits.moe import ROUTES, routing_metrics

#: the MoE shapes of the Hugging Face configs the engine converts: model_type -> (experts key, renormalises
#: over the k by default).
MOE_MODEL_TYPES = {"qwen2_moe": ("num_experts", False), "qwen3_moe": ("num_experts", True), "mixtral": ("num_local_experts", True)}


def moe_shape(hf_config: Any) -> dict[str, Any] | None:
    """``{experts, top_k, renormalize, shared}`` of a MoE Hugging Face config (None for a dense one); raises
    ``ValueError`` for a model with dense layers between its MoE layers (megatron's layer frequency is not
    mapped yet)."""
    kind = MOE_MODEL_TYPES.get(hf_config.model_type)
    if kind is None:
        return None
    key, default_renormalize = kind
    layers = hf_config.num_hidden_layers
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense_only = list(getattr(hf_config, "mlp_only_layers", None) or [])
    dense = [index for index in range(layers) if index in dense_only or (index + 1) % step]
    if dense:
        raise ValueError(f"the megatron engine converts MoE models whose every layer has experts; this {hf_config.model_type} "
                         f"model has dense layers {dense} (decoder_sparse_step={step}, mlp_only_layers={dense_only})")
    renormalize = getattr(hf_config, "norm_topk_prob", None)
    return {"experts": int(getattr(hf_config, key)), "top_k": int(hf_config.num_experts_per_tok),
            "renormalize": default_renormalize if renormalize is None else bool(renormalize),
            "shared": int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)}


def moe_overrides(shape: dict[str, Any], on_cpu: bool, expert_model_parallel_size: int) -> dict[str, Any]:
    """megatron's ``TransformerConfig`` settings for a model of MoE ``shape`` (:func:`moe_shape`): experts through
    the all-gather token dispatcher on CPU (its all-to-all one creates CUDA streams), all-to-all on GPU. megatron's
    own router losses and replay stay off: the engine's (:class:`MegatronRouting`) follow ``actor.moe``."""
    dispatcher = "allgather" if on_cpu else "alltoall"
    return dict(
        num_moe_experts=shape["experts"], moe_router_topk=shape["top_k"], moe_grouped_gemm=False,
        moe_router_pre_softmax=not shape["renormalize"], moe_router_score_function="softmax",
        moe_shared_expert_gate=bool(shape["shared"]), moe_shared_expert_overlap=False,
        moe_token_dispatcher_type=dispatcher, variable_seq_lengths=dispatcher == "alltoall",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_enable_routing_replay=False, moe_permute_fusion=False, moe_router_fusion=False,
        moe_expert_capacity_factor=None, expert_model_parallel_size=expert_model_parallel_size,
    )


class MegatronCall:
    """One model call's routing: ``tokens`` in megatron's order, ``valid`` [tokens] (bool), ``replay``
    [tokens, layers, k] or None, ``record``, ``share`` (the call's weight in the mini-batch's router losses;
    None: no router losses, not observed)."""

    def __init__(self, valid: torch.Tensor, replay: torch.Tensor | None, record: bool, share: float | None,
                 cp_tokens: tuple[int, int, int] | None = None):
        self.cp_tokens = cp_tokens  # context parallel: (the micro-batch's width, rows, valid tokens)
        self.valid = valid
        self.replay = replay
        self.record = record
        self.share = share
        self.recorded: dict[int, torch.Tensor] = {}


class RouterTap:
    """Set as a ``TopKRouter``'s ``router_replay``: its top-k under the current call, and the observation of
    its logits and routing map (see the module docstring). ``layer``: the router's MoE layer (0-based,
    global over pipeline stages)."""

    def __init__(self, routing: "MegatronRouting", router: Any):
        self.routing = routing
        self.router = router
        self.layer = int(router.layer_number) - 1
        self.experts = int(router.config.num_moe_experts)
        self.top_k = int(router.topk)
        self.original_routing = router.routing
        router.routing = self.wrapped_routing
        router.router_replay = self

    # megatron's hook for the top-k (router_replay.get_replay_topk's signature)
    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
                        default_compute_topk: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        call = self.routing.call
        if call is None:
            return values, indices
        if call.replay is not None:
            if self.layer >= call.replay.shape[1] or call.replay.shape[-1] < topk:
                raise ValueError(f"recorded routes hold {call.replay.shape[1]} MoE layers of {call.replay.shape[-1]} experts per "
                                 f"token; MoE layer {self.layer} picks {topk}: the routes are not this model's")
            if call.replay.shape[0] != scores.shape[0]:
                raise ValueError(f"recorded routes for {call.replay.shape[0]} tokens reach a router that sees {scores.shape[0]}")
            wanted = call.replay[:, self.layer, :topk].to(indices.device)
            replay_row = (wanted >= 0).all(-1)
            if bool(replay_row.any()):
                used = torch.where(replay_row[:, None], wanted, indices)
                if int(used.max()) >= self.experts:
                    raise ValueError(f"recorded routes name expert {int(used.max())}; MoE layer {self.layer} has {self.experts} "
                                     "experts: the routes are not this model's")
                if call.share is not None and self.routing.counts_here:  # kept on the device: one host copy per step
                    counted = replay_row & call.valid.to(replay_row.device)
                    same = (used.sort(-1).values == indices.sort(-1).values).all(-1)
                    self.routing.replayed = self.routing.replayed + counted.sum()
                    self.routing.agreeing = self.routing.agreeing + (same & counted).sum()
                indices = used
                values = scores.gather(1, indices)
        if call.record:
            recorded = indices.detach()
            if call.cp_tokens is not None:  # the group's tokens in sequence order
                from megatron.core import parallel_state

                from rlplat_engine_megatron.context_parallel import gather_tokens

                width, rows, _ = call.cp_tokens
                recorded = gather_tokens(recorded.int(), rows, width, parallel_state.get_context_parallel_group())
            call.recorded[self.layer] = recorded.to(torch.int16).cpu()
        return values, indices

    def wrapped_routing(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = self.original_routing(logits, *args, **kwargs)
        call = self.routing.call
        if call is not None and call.share is not None:
            probs = self.routing.observe(self, logits.reshape(-1, self.experts), routing_map, probs, call)
        return probs, routing_map


class MegatronRouting:
    """The taps of every router of the engine's model chunks and the step's load, replay and loss figures."""

    def __init__(self, chunks: list[torch.nn.Module], moe: MoEConfig, moe_layers: int, counts_here: bool, once_here: bool | None = None):
        from megatron.core.transformer.moe.router import TopKRouter

        self.moe = moe
        self.moe_layers = moe_layers
        self.counts_here = counts_here  # tensor-parallel rank 0: its figures stand for its tensor-parallel group's
        self.once_here = counts_here if once_here is None else once_here  # also context-parallel rank 0
        self.call: MegatronCall | None = None
        self.taps = [RouterTap(self, module) for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
        self.experts = max((tap.experts for tap in self.taps), default=0)
        self.start_step()

    def begin(self, call: MegatronCall) -> None:
        self.call = call

    def end(self) -> MegatronCall | None:
        call, self.call = self.call, None
        return call

    def observe(self, tap: RouterTap, logits: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                call: MegatronCall) -> torch.Tensor:
        valid = call.valid.to(logits.device)
        logits, routed = logits[valid], routing_map[valid]
        if logits.shape[0] == 0 and call.cp_tokens is None:  # under CP every rank joins the sums, tokens or not
            return probs
        counts = routed.sum(0).to(torch.float64)
        if self.counts_here:  # the step's figures stay on the model's device: one host copy per step, not per layer
            if self.counts.device != counts.device:
                self.counts = self.counts.to(counts.device)
            self.counts[tap.layer, : tap.experts] += counts.detach()
        sums = torch.cat([counts.float(), torch.softmax(logits.float(), dim=-1).sum(0),
                          torch.logsumexp(logits.float(), dim=-1).pow(2).sum()[None]])
        tokens = float(logits.shape[0])
        if call.cp_tokens is not None:  # the whole rows': summed over the group, each rank's gradient its own tokens'
            from megatron.core import parallel_state

            from rlplat_engine_megatron.context_parallel import sum_over

            sums, tokens = sum_over(sums, parallel_state.get_context_parallel_group()), float(call.cp_tokens[2])
        counts, probabilities, z = sums[: tap.experts].detach(), sums[tap.experts: 2 * tap.experts], sums[-1] / tokens
        balance = tap.experts * (counts / tokens * probabilities / tokens).sum()
        weight = call.share / self.moe_layers
        if self.once_here:
            self.aux_loss = self.aux_loss + balance.detach().double() * weight
            self.z_loss = self.z_loss + z.detach().double() * weight
        term = 0.0
        if self.moe.aux_loss_coef > 0:
            term = term + self.moe.aux_loss_coef * weight * balance
        if self.moe.z_loss_coef > 0:
            term = term + self.moe.z_loss_coef * weight * z
        if isinstance(term, torch.Tensor) and torch.is_grad_enabled():
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            probs = MoEAuxLossAutoScaler.apply(probs, term.to(probs.dtype))
        return probs

    def start_step(self) -> None:
        self.counts = torch.zeros(self.moe_layers, max(self.experts, 1), dtype=torch.float64)
        self.replayed = self.agreeing = self.needed = 0
        self.aux_loss = self.z_loss = 0.0

    def step_metrics(self, all_reduce_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """The step's figures over every rank (one all-reduce on every rank), then ready for the next step."""
        summed = all_reduce_sum([*self.counts.flatten().tolist(), float(self.replayed), float(self.agreeing),
                                 float(self.needed), float(self.aux_loss), float(self.z_loss)])
        counts = torch.tensor(summed[:-5], dtype=torch.float64).view(self.counts.shape)
        replayed, agreeing, needed, aux_loss, z_loss = summed[-5:]
        self.start_step()
        return {"actor/moe/aux_loss": aux_loss, "actor/moe/z_loss": z_loss,
                **routing_metrics(counts, dict.fromkeys(range(self.moe_layers), self.experts), self.moe.router_replay,
                                  replayed, agreeing, needed)}


def aligned_routes(routes: torch.Tensor, valid: torch.Tensor, columns: torch.Tensor, layers: int, top_k: int) -> torch.Tensor:
    """The batch's ``routed_experts`` [rows, T, layers, k] -> the routers' replay [T x rows, layers, k] of the
    rows left-aligned by ``columns`` (the engine's ``model_inputs``; ``valid``: the aligned rows' valid tokens),
    ``-1`` where a token routes live: padding, and each row's last token, whose output predicts nothing."""
    rows, width = valid.shape
    if routes.dim() != 4 or tuple(routes.shape[:3]) != (rows, width, layers) or routes.shape[3] < top_k:
        raise ValueError(f"{ROUTES} has shape {list(routes.shape)}; this model's routes are [rows, T, moe_layers, top_k] = "
                         f"{[rows, width, layers, top_k]}")
    routes = routes.long()
    aligned = routes.gather(1, columns[:, :, None, None].expand(-1, -1, *routes.shape[2:]))
    aligned[~valid] = -1
    counts = valid.sum(-1)
    present = (counts > 0).nonzero().squeeze(-1)
    aligned[present, counts[present] - 1] = -1
    return aligned.transpose(0, 1).reshape(width * rows, *routes.shape[2:]).contiguous()


def original_routes(recorded: dict[int, torch.Tensor], columns: torch.Tensor, attention_mask: torch.Tensor, layers: int,
                    top_k: int) -> torch.Tensor:
    """The routes recorded in one micro-batch (``{MoE layer: [T x rows, k]}``, a stage's layers, of the rows
    left-aligned by ``columns``) as the batch column [rows, T, layers, k] at the original positions, ``-1`` at
    padding and at layers of other stages."""
    rows, width = columns.shape
    routes = torch.full((rows, width, layers, top_k), -1, dtype=torch.int16)
    for layer, indices in recorded.items():
        aligned = indices.view(width, rows, top_k).transpose(0, 1)
        routes[:, :, layer].scatter_(1, columns[:, :, None].expand(-1, -1, top_k), aligned)
    routes[~attention_mask.bool()] = -1
    return routes
