"""LoRA adapters for the hf rollout: a ``peft`` adapter (its config as a dict and its tensors) read and
checked against the model, as one low-rank update per linear module.

The served weight of a targeted module is ``W_base + scale * lora_B @ lora_A`` with ``scale = lora_alpha
/ r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``): what ``peft`` computes in its forward, merged into
the weight. Features whose served function is not that (DoRA, biases, whole trained modules, per-module
ranks, routing, ...) are refused by name, so no adapter is served differently from how it was trained.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: peft ``LoraConfig`` keys whose feature is not a plain low-rank update of linear weights, with what
#: each is; an adapter with one of them set (not None, False or empty) is refused.
REFUSED_FEATURES = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained copies of whole modules",
    "trainable_token_indices": "trained embedding rows",
    "fan_in_fan_out": "transposed (Conv1D) base weights",
    "layer_replication": "replicated layers",
    "target_parameters": "LoRA on bare parameters (MoE experts)",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "use_qalora": "QALoRA (pooled inputs)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "megatron_config": "Megatron parallel linear layers",
}

PEFT_PREFIX = "base_model.model."
# <module>.lora_A.weight or <module>.lora_A.<adapter name>.weight (peft's state dict with the name)
TENSOR_NAME = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")
# tensors of the refused features, named so the error says what they are
REFUSED_TENSORS = {
    "lora_magnitude_vector": "DoRA (use_dora)",
    "lora_embedding_A": "LoRA on an embedding layer",
    "lora_embedding_B": "LoRA on an embedding layer",
    "modules_to_save": "a fully trained module copy (modules_to_save)",
    "lora_diag": "KaSA (kasa_config)",
}


class AdapterError(ValueError):
    """An adapter the hf rollout cannot serve exactly; the message says which key or tensor and why."""


@dataclasses.dataclass(frozen=True)
class LowRankUpdate:
    """One linear module's update: its served weight is ``base + scale * lora_B @ lora_A``."""

    module: str
    lora_A: torch.Tensor
    """[r, in_features]"""
    lora_B: torch.Tensor
    """[out_features, r]"""
    scale: float

    def delta(self, device: torch.device) -> torch.Tensor:
        """``scale * lora_B @ lora_A`` in float32 on ``device``."""
        lora_B = self.lora_B.to(device=device, dtype=torch.float32)
        return (lora_B @ self.lora_A.to(device=device, dtype=torch.float32)) * self.scale


def adapter_scale(config: Mapping[str, Any]) -> tuple[int, float]:
    """``(r, scale)`` of a peft LoRA config after checking it is a plain LoRA adapter."""
    if not isinstance(config, Mapping):
        raise AdapterError(f"hf rollout: load_adapter takes peft's adapter config as a dict, got {type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if str(getattr(peft_type, "value", peft_type)).upper() != "LORA":
        raise AdapterError(f"hf rollout: adapter peft_type is {peft_type!r}; only LORA adapters are served")
    used = [f"{key} ({what})" for key, what in REFUSED_FEATURES.items() if config.get(key) not in (None, False, {}, [], ())]
    if config.get("bias", "none") != "none":
        used.append(f"bias={config['bias']!r} (trained base-model biases)")
    if used:
        raise AdapterError("hf rollout: the adapter uses peft features the rollout does not serve: " + ", ".join(used)
                           + "; train a plain LoRA adapter (these keys unset, bias='none') or use actor.lora.sync=merged")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"hf rollout: adapter config 'r' must be a positive int, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"hf rollout: adapter config 'lora_alpha' must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def parse_tensor_name(name: str) -> tuple[str, str, str | None]:
    """``(module, 'lora_A' | 'lora_B', adapter name or None)`` of a peft tensor name."""
    stripped = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    match = TENSOR_NAME.match(stripped)
    if match is None:
        what = next((what for marker, what in REFUSED_TENSORS.items() if f".{marker}" in f".{stripped}"), None)
        if what is not None:
            raise AdapterError(f"hf rollout: adapter tensor {name!r} is {what}, which the rollout does not serve")
        raise AdapterError(f"hf rollout: adapter tensor {name!r} is not a LoRA weight; expected peft's "
                           f"'{PEFT_PREFIX}<module>.lora_A.weight' and '...lora_B.weight' (optionally "
                           "'.lora_A.<adapter>.weight')")
    return match["module"], match["part"], match["adapter"]


def read_adapter(config: Mapping[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
                 modules: Mapping[str, torch.nn.Module]) -> list[LowRankUpdate]:
    """The adapter as one :class:`LowRankUpdate` per module, everything checked before anything is used:
    each tensor names a linear module of ``modules`` (the model's ``named_modules()``), comes with its
    pair, and has the shape of rank ``r`` on that module. Raises :class:`AdapterError`."""
    rank, scale = adapter_scale(config)
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    adapter_names = set()
    for name, tensor in named_tensors:
        module, part, adapter = parse_tensor_name(name)
        adapter_names.add(adapter)
        if part in pairs.setdefault(module, {}):
            raise AdapterError(f"hf rollout: adapter tensors {pairs[module][part][0]!r} and {name!r} are both "
                               f"{part} of module {module!r}; one adapter is loaded at a time")
        pairs[module][part] = (name, tensor)
    if not pairs:
        raise AdapterError("hf rollout: load_adapter got no adapter tensors")
    if len(adapter_names) > 1:
        raise AdapterError(f"hf rollout: adapter tensors carry several adapter names {sorted(map(str, adapter_names))}; "
                           "one adapter is loaded at a time")
    updates = []
    for module, parts in pairs.items():
        missing = [part for part in ("lora_A", "lora_B") if part not in parts]
        if missing:
            given = next(iter(parts.values()))[0]
            raise AdapterError(f"hf rollout: adapter tensor {given!r} has no {missing[0]} partner; "
                               f"module {module!r} needs both lora_A and lora_B")
        layer = modules.get(module)
        if layer is None:
            close = difflib.get_close_matches(module, list(modules), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise AdapterError(f"hf rollout: adapter tensor {parts['lora_A'][0]!r} names module {module!r}, "
                               f"which the model does not have{hint}")
        if not isinstance(layer, torch.nn.Linear):
            raise AdapterError(f"hf rollout: adapter module {module!r} is a {type(layer).__name__}; "
                               "the rollout serves adapters on linear layers only")
        expected = {"lora_A": (rank, layer.in_features), "lora_B": (layer.out_features, rank)}
        for part, shape in expected.items():
            name, tensor = parts[part]
            if tuple(tensor.shape) != shape:
                raise AdapterError(f"hf rollout: adapter tensor {name!r} has shape {tuple(tensor.shape)}; rank "
                                   f"r={rank} on {module!r} ({layer.out_features} x {layer.in_features}) needs {shape}")
        updates.append(LowRankUpdate(module, parts["lora_A"][1], parts["lora_B"][1], scale))
    return updates
