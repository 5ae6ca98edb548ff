"""Mixture-of-experts weights by their checkpoint names: transformers 5 keeps each MoE layer's routed experts
fused (``mlp.experts.gate_up_proj`` [E, 2I, H], the gate's rows first, and ``mlp.experts.down_proj`` [E, H, I])
while checkpoints, megatron's export and vLLM name one tensor per expert and projection
(``mlp.experts.<e>.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2.weight`` and
``block_sparse_moe.gate.weight``). :func:`checkpoint_aliases` maps those names to the slice of the model's
tensor each one fills, so ``update_weights`` takes either naming."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

#: Architectures whose fused experts are ``cat(gate, up)`` per expert, as transformers' conversion builds them.
FUSED_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
#: Checkpoint projection names: (gate, up, down).
PROJECTIONS = {"qwen2_moe": ("gate_proj", "up_proj", "down_proj"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
               "mixtral": ("w1", "w3", "w2")}


class Alias(NamedTuple):
    """A checkpoint name's place in the model: ``target`` (a state-dict name), the expert, the rows (None: all)."""

    target: str
    expert: int | None
    rows: slice | None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is None:
            return tensor
        piece = tensor[self.expert]
        return piece if self.rows is None else piece[self.rows]


def checkpoint_aliases(model: torch.nn.Module) -> dict[str, Alias]:
    """``{checkpoint name: Alias}`` of ``model``'s fused experts (empty for other architectures)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return {}
    gate, up, down = PROJECTIONS[model_type]
    aliases: dict[str, Alias] = {}
    for name, module in model.named_modules():
        gate_up, down_proj = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down_proj, torch.Tensor) and gate_up.dim() == 3):
            continue
        half = gate_up.shape[1] // 2
        prefix = name.replace(".mlp.experts", ".block_sparse_moe.experts") if model_type == "mixtral" else name
        for expert in range(gate_up.shape[0]):
            aliases[f"{prefix}.{expert}.{gate}.weight"] = Alias(f"{name}.gate_up_proj", expert, slice(0, half))
            aliases[f"{prefix}.{expert}.{up}.weight"] = Alias(f"{name}.gate_up_proj", expert, slice(half, 2 * half))
            aliases[f"{prefix}.{expert}.{down}.weight"] = Alias(f"{name}.down_proj", expert, None)
        if model_type == "mixtral":
            router = name.rsplit(".experts", 1)[0] + ".gate.weight"
            aliases[router.replace(".mlp.", ".block_sparse_moe.")] = Alias(router, None, None)
    return aliases


def fused_to_checkpoint(model: torch.nn.Module, named: Any) -> dict[str, torch.Tensor]:
    """``named`` (``(state-dict name, tensor)`` pairs of ``model``) with every fused expert tensor split into its
    checkpoint names (the inverse of :func:`checkpoint_aliases`); other names unchanged."""
    named = dict(named)
    out: dict[str, torch.Tensor] = {}
    by_target: dict[str, list[tuple[str, Alias]]] = {}
    for checkpoint, alias in checkpoint_aliases(model).items():
        by_target.setdefault(alias.target, []).append((checkpoint, alias))
    for name, tensor in named.items():
        if name in by_target:
            for checkpoint, alias in by_target[name]:
                out[checkpoint] = alias.view(tensor).clone()
        else:
            out[name] = tensor
    return out
