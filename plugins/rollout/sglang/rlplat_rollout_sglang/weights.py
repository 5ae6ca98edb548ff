"""What a weight update may name: the model's parameters in Hugging Face naming, with their shapes, checked on
the rollout's side before a bucket reaches SGLang.

SGLang 0.5.23 ignores a tensor whose name its model does not have (the update "succeeds" and the rollout samples
from stale weights), and a tensor of the wrong shape fails an assertion inside its scheduler, whose SIGQUIT
handler then kills the process that owns the engine: the trainer's worker in hybrid mode (measured on its CPU
engine). Both are refused here instead, with the name.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Mapping

import torch


def expected_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every weight of the model in ``model_path`` (its ``config.json``), as a
    transformers ``state_dict`` names them (a tied output layer under both names), built on the meta device:
    nothing is allocated or read but the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_bucket(bucket: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming every tensor of ``bucket`` the model has no weight for (with the closest
    name) or whose shape differs from the model's."""
    problems = []
    for name, tensor in bucket:
        shape = shapes.get(name)
        if shape is None:
            closest = difflib.get_close_matches(name, list(shapes), n=1)
            problems.append(f"{name!r} is not a weight of the model" + (f" (did you mean {closest[0]!r}?)" if closest else ""))
        elif tuple(tensor.shape) != shape:
            problems.append(f"{name!r} has shape {tuple(tensor.shape)}; the model's is {shape}")
    if problems:
        raise ValueError("sglang rollout: update_weights refused before SGLang saw it (SGLang skips unknown names and its "
                         "scheduler dies on a wrong shape): " + "; ".join(problems))
