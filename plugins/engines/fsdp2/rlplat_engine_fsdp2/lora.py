"""LoRA adapters on the engine's model (``actor.lora``, :class:`rlplat.lora.LoraConfig`), through ``peft``.

``peft`` replaces each targeted ``nn.Linear`` of the Hugging Face model, in place, by a LoRA layer that
holds the original as ``base_layer`` and the adapter as ``lora_A`` / ``lora_B``; its parameters are then
named ``<module>.base_layer.weight`` and ``<module>.lora_A.default.weight``. The engine keeps calling,
sharding and checkpointing the Hugging Face model itself (the forward paths, packing and hooks do not
change), and holds the ``PeftModel`` around it only for what peft does on the whole: switching the
adapter off (the reference policy) and the adapter's config.

Names. :func:`hf_name` gives a parameter's plain Hugging Face name (``base_layer.`` dropped), the one
the merged weights carry; :func:`peft_name` gives an adapter parameter's name in peft's state dict and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``).

Merging. The rollout and the Hugging Face export get ``W + (B @ A) * scale`` computed from the full
tensors as they are read (:func:`merged_weight`, peft's own formula and order of operations, so it
equals ``merge_and_unload`` bit for bit); the training model is never merged in place.

:class:`LoraMethods`, a base class of :class:`~rlplat_engine_fsdp2.engine.FSDP2Engine`, holds the engine's
methods that exist for LoRA only: :meth:`~LoraMethods.adapter_disabled` (the base model, for the reference
policy), :meth:`~LoraMethods.adapter_weights` and :meth:`~LoraMethods.export_adapter`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlplat.lora import LoraConfig
from rlplat_engine_fsdp2.data_parallel import full_tensor

#: peft's name for the one adapter the engine trains.
ADAPTER = "default"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def attach_adapter(model: torch.nn.Module, lora: LoraConfig, seed: int, model_path: str | None) -> Any:
    """Wrap ``model`` (a Hugging Face causal LM) with a trainable LoRA adapter and return the ``PeftModel``:
    a fresh one drawn under ``seed`` (``lora_B`` zero, so the model computes what it did), or
    ``lora.adapter_path``'s. Only adapter parameters require gradients afterwards."""
    import peft

    torch.manual_seed(seed)  # lora_A's initialisation, the same on every rank
    if lora.adapter_path is not None:
        peft_model = peft.PeftModel.from_pretrained(model, lora.adapter_path, adapter_name=ADAPTER, is_trainable=True)
        check_loaded_adapter(peft_model.peft_config[ADAPTER], lora)
    else:
        peft_config = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.peft_target_modules,
            exclude_modules=list(lora.exclude_modules) or None,
        )
        if model_path is not None:
            peft_config.base_model_name_or_path = model_path
        try:
            peft_model = peft.get_peft_model(model, peft_config, adapter_name=ADAPTER)
        except ValueError as error:
            raise ValueError(f"actor.lora: peft could not place adapters on {type(model).__name__} "
                             f"(target_modules={lora.target_modules!r}, exclude_modules={lora.exclude_modules!r}): {error}") from None
    layers = adapter_layers(model)
    if not layers:
        raise ValueError(f"actor.lora: no module of {type(model).__name__} got an adapter "
                         f"(target_modules={lora.target_modules!r}, exclude_modules={lora.exclude_modules!r})")
    head = model.get_output_embeddings()
    wrong = [name for name, layer in layers.items() if not is_linear_adapter(layer) or layer is head or layer.get_base_layer() is head]
    if wrong:
        raise ValueError(f"actor.lora: the fsdp2 engine trains adapters on linear layers other than the output head only; "
                         f"{wrong} are not; leave them out of actor.lora.target_modules or add them to exclude_modules")
    return peft_model


def check_loaded_adapter(loaded: Any, lora: LoraConfig) -> None:
    """The adapter at ``adapter_path`` must have the rank and alpha ``actor.lora`` names (its own target
    modules decide where it sits)."""
    if loaded.r != lora.rank or float(loaded.lora_alpha) != float(lora.alpha):
        raise ValueError(
            f"actor.lora.adapter_path: the adapter at {lora.adapter_path} has rank {loaded.r} and alpha "
            f"{loaded.lora_alpha}, actor.lora says rank {lora.rank} and alpha {lora.alpha}; set them to the adapter's"
        )
    if getattr(loaded, "use_dora", False) or getattr(loaded, "use_rslora", False):
        raise ValueError(f"actor.lora.adapter_path: the adapter at {lora.adapter_path} uses DoRA or rsLoRA, "
                         "which the fsdp2 engine does not merge; give a plain LoRA adapter")


def is_linear_adapter(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import Linear

    return isinstance(module, Linear)


def adapter_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The LoRA layers of ``model`` by module name (``model.layers.0.self_attn.q_proj``)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def is_adapter_parameter(name: str) -> bool:
    return ".lora_" in name


def hf_name(name: str) -> str:
    """``model.layers.0.mlp.up_proj.base_layer.weight`` -> ``model.layers.0.mlp.up_proj.weight``."""
    return name.replace(".base_layer.", ".")


def peft_name(name: str) -> str:
    """``model.layers.0.mlp.up_proj.lora_A.default.weight`` -> peft's state-dict name
    ``base_model.model.model.layers.0.mlp.up_proj.lora_A.weight``."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def base_weight_owner(name: str) -> str | None:
    """The LoRA layer whose base weight ``name`` is (``...q_proj.base_layer.weight`` -> ``...q_proj``), else None."""
    suffix = ".base_layer.weight"
    return name[: -len(suffix)] if name.endswith(suffix) else None


def merged_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, fan_in_fan_out: bool = False) -> torch.Tensor:
    """``W + (B @ A) * scale`` in ``W``'s dtype, as peft's merge computes it (the matmul in float32 when the
    adapter is in a half dtype); a new tensor."""
    half = lora_B.dtype in (torch.float16, torch.bfloat16)
    delta = (lora_B.float() @ lora_A.float()) if half else lora_B @ lora_A
    if fan_in_fan_out:
        delta = delta.T
    delta = delta * scale
    return weight + delta.to(weight.dtype)


def merged_weights(named: list[tuple[str, torch.Tensor]], layers: dict[str, torch.nn.Module],
                   merge: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, full detached tensor)`` of ``named`` (a LoRA model's parameters and buffers)
    without the adapter's own, one at a time: the base weight of each of ``layers`` (:func:`adapter_layers`)
    with its adapter merged in when ``merge``, else as it is. A collective (sharded tensors are gathered)."""
    for name, tensor in named:
        if is_adapter_parameter(name):
            continue
        full = full_tensor(tensor).detach()
        owner = base_weight_owner(name)
        if owner in layers and merge:
            layer = layers[owner]
            full = merged_weight(
                full, full_tensor(layer.lora_A[ADAPTER].weight).detach(), full_tensor(layer.lora_B[ADAPTER].weight).detach(),
                layer.scaling[ADAPTER], layer.fan_in_fan_out,
            )
        yield hf_name(name), full


def adapter_config_dict(peft_model: Any) -> dict[str, Any]:
    """The adapter's ``peft.LoraConfig.to_dict()`` as JSON values (sets as sorted lists, enums as their
    strings), with ``inference_mode`` True as peft writes it to ``adapter_config.json``."""
    config = dict(peft_model.peft_config[ADAPTER].to_dict())
    config["inference_mode"] = True
    return json.loads(json.dumps(config, default=lambda value: sorted(value) if isinstance(value, (set, frozenset)) else str(value)))


def write_adapter(path: str, config: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """``adapter_config.json`` and ``adapter_model.safetensors`` into ``path`` (created): the folder
    ``peft.PeftModel.from_pretrained(base, path)`` loads."""
    from safetensors.torch import save_file

    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    (target / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}, str(target / ADAPTER_WEIGHTS_FILE),
              metadata={"format": "pt"})


class LoraMethods:
    """The engine's methods for LoRA; they read the engine's ``lora`` (its :class:`LoraConfig`, None without
    LoRA), ``peft_model``, ``adapter_off``, ``module`` and ``rank``."""

    def require_lora(self, method: str) -> Any:
        self.require_model(method)
        if self.peft_model is None:
            raise RuntimeError(f"FSDP2Engine.{method}(): this engine trains full weights (its config has no lora); "
                               "LoRA adapters exist only with actor.lora.rank > 0")
        return self.peft_model

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Inside, :meth:`forward` runs the base model with the adapter switched off (peft's
        ``disable_adapter``): the reference policy of a LoRA run. Training inside is refused. Raises
        without LoRA."""
        peft_model = self.require_lora("adapter_disabled")
        if self.adapter_off:
            yield
            return
        with peft_model.disable_adapter():
            self.adapter_off = True
            try:
                yield
            finally:
                self.adapter_off = False

    def adapter_weights(self) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]] | None:
        """``(the adapter's peft config as JSON values, [(peft state-dict name, full tensor)])``; None
        without LoRA. A collective."""
        if self.lora is None:
            return None
        self.require_model("adapter_weights")
        self.onload_parameters()
        tensors = [(peft_name(name), full_tensor(parameter).detach())
                   for name, parameter in self.module.named_parameters() if is_adapter_parameter(name)]
        self.offload_parameters_if_configured()
        return adapter_config_dict(self.peft_model), tensors

    def export_adapter(self, path: str) -> None:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (rank 0), the folder
        ``peft.PeftModel.from_pretrained(base, path)`` loads. A collective; raises without LoRA."""
        self.require_lora("export_adapter")
        config, tensors = self.adapter_weights()
        if self.rank == 0:
            write_adapter(path, config, tensors)
        dist.barrier()
