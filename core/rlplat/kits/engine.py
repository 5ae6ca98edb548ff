"""Pieces every training engine needs, written once (``rlplat.kits.engine``; no torch at import):

* :class:`WarmupSchedule`: the learning-rate multiplier (linear warm-up, then constant or cosine decay:
  verl's formulas);
* :func:`fixed_size_partition`, :func:`balanced_partition`, :func:`token_budget_partition`: how a
  mini-batch's rows are grouped into micro-batches (a row count, or a token budget with a balanced
  partition, greedy longest-processing-time first);
* :func:`weight_buckets`: named tensors gathered into buckets of at most a byte budget, the shape of
  :meth:`rlplat.contracts.TrainingEngine.named_weights`;
* :func:`check_optimizer_settings`: the settings one :meth:`~rlplat.contracts.TrainingEngine.optimizer_step`
  takes, checked the same way for every engine;
* :func:`engine_config_problems`: the checks of the keys every engine config shares, which an engine's config
  runs before its own.

The partitions only plan (lists of row indices) and are deterministic, so every rank of a model replica
plans the same groups; an engine whose collectives need every rank to run the same number of forwards
agrees the count with the other ranks itself.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Iterable, Iterator, Sequence

LR_SCHEDULES = ("constant", "cosine")
"""The kinds of :class:`WarmupSchedule` (an engine config's ``lr_scheduler_type``)."""


@dataclasses.dataclass
class WarmupSchedule:
    """Multiplier of the peak learning rate at optimizer step ``step`` (``torch.optim.lr_scheduler.LambdaLR``).

    Warm-up: ``step / warmup_steps`` for ``step < warmup_steps`` (so step 0 trains with lr 0, as verl's
    and Hugging Face's schedules do). ``cosine`` then follows
    ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * progress)) / 2`` with
    ``progress = (step - warmup_steps) / (total_steps - warmup_steps)``, held at the floor afterwards.
    A plain object of numbers, so ``LambdaLR.state_dict`` records it and it loads with ``weights_only``.
    """

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def fixed_size_partition(rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter)."""
    return [list(range(start, min(start + micro_batch_size, rows))) for start in range(0, rows, micro_batch_size)]


def balanced_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """``parts`` groups of row indices whose weight sums are close: each row, heaviest first, goes to the
    lightest group so far (ties broken by group index, so the result is deterministic).

    Each group lists its rows in ascending order and groups are ordered by their first row; with more
    groups than rows the surplus groups are empty and come last.
    """
    if parts < 1:
        raise ValueError(f"balanced_partition needs at least one part, got {parts}")
    order = sorted(range(len(weights)), key=lambda row: (-weights[row], row))
    heap = [(0, 0, part) for part in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for row in order:
        load, count, part = heapq.heappop(heap)
        groups[part].append(row)
        heapq.heappush(heap, (load + weights[row], count + 1, part))
    filled = sorted((sorted(group) for group in groups if group), key=lambda group: group[0])
    return filled + [[] for _ in range(parts - len(filled))]


def token_budget_partition(weights: Sequence[int], budget: int, min_parts: int = 1) -> list[list[int]]:
    """The fewest balanced groups (at least ``min_parts``) whose weight sums each fit in ``budget``.

    Raises ``ValueError`` when one row alone exceeds the budget.
    """
    heaviest = max(weights, default=0)
    if heaviest > budget:
        row = list(weights).index(heaviest)
        raise ValueError(
            f"row {row} has {heaviest} tokens, more than max_token_len_per_gpu={budget}; raise the budget "
            "to at least the longest sequence (prompt + response)"
        )
    parts = max(min_parts, math.ceil(sum(weights) / budget), 1)
    while True:
        groups = balanced_partition(weights, parts)
        if all(sum(weights[row] for row in group) <= budget for group in groups):
            return groups
        parts += 1


def weight_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """``(name, tensor)`` pairs in buckets of at most ``bucket_bytes`` (a larger tensor alone), in order.
    The pairs are drawn one at a time, so a caller that gathers each tensor on demand holds at most one
    bucket beyond its own shards."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_folder(tokenizer_path: str | None, model_path: str | None) -> str | None:
    """The folder an engine's Hugging Face export copies the tokenizer from: ``tokenizer_path`` when set,
    else ``model_path`` when it holds a tokenizer, else None."""
    import os

    if tokenizer_path is not None:
        return tokenizer_path
    if model_path is not None and any(os.path.isfile(os.path.join(model_path, name)) for name in TOKENIZER_FILES):
        return model_path
    return None


OPTIMIZER_SETTINGS = ("lr", "betas", "eps", "weight_decay", "grad_clip")


def check_optimizer_settings(settings: Any) -> dict[str, Any]:
    """``settings`` of :meth:`rlplat.contracts.TrainingEngine.optimizer_step` (None: none) as a dict of floats
    (``betas`` a pair, ``grad_clip`` None for no clip), or a ValueError naming every bad entry."""
    if settings is None:
        return {}
    if not hasattr(settings, "items"):
        raise ValueError(f"optimizer settings must be a mapping of {', '.join(OPTIMIZER_SETTINGS)}; got {type(settings).__name__}")
    checked, problems = {}, []
    for key, value in settings.items():
        if key not in OPTIMIZER_SETTINGS:
            problems.append(f"unknown setting {key!r} (known: {', '.join(OPTIMIZER_SETTINGS)})")
        elif key == "grad_clip" and value is None:
            checked[key] = None
        elif key == "betas":
            pair = list(value) if isinstance(value, (list, tuple)) else []
            if len(pair) != 2 or not all(isinstance(beta, (int, float)) and 0 <= beta < 1 for beta in pair):
                problems.append(f"betas must be two numbers in [0, 1), got {value!r}")
            else:
                checked[key] = (float(pair[0]), float(pair[1]))
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (key in ("eps", "grad_clip") and value == 0):
            problems.append(f"{key} must be a finite number {'> 0' if key in ('eps', 'grad_clip') else '>= 0'}, got {value!r}")
        else:
            checked[key] = float(value)
    if problems:
        raise ValueError("invalid optimizer settings: " + "; ".join(problems))
    return checked


def engine_config_problems(config: Any, dtypes: Sequence[str], counts: Sequence[str] = (),
                           optional_counts: Sequence[str] = ()) -> list[str]:
    """What is wrong with the keys every engine config shares, one entry per problem naming its key (empty
    when nothing is): the model source (exactly one of ``model_path`` and ``model_config``, the latter with a
    ``model_type``), ``dtype`` (one of the engine's ``dtypes``), the learning-rate schedule
    (``lr_scheduler_type`` one of :data:`LR_SCHEDULES`, ``cosine`` with ``total_training_steps >
    lr_warmup_steps``), ``betas`` (two values), ``grad_clip`` (positive or None), ``ppo_epochs``,
    ``micro_batch_size_per_gpu``, ``max_token_len_per_gpu`` and the engine's ``counts`` (each >= 1), and
    ``ppo_mini_batch_size`` and the engine's ``optional_counts`` (each >= 1 or None).

    ``config`` is an engine's config dataclass: :class:`rlplat.contracts.engine.EngineBuildConfig`'s keys with
    ``model_config`` and ``dtype`` of its own. Its ``__post_init__`` adds its own problems to these and raises one
    ``ValueError`` that names the engine and lists them all, so a user sees every mistake of the node at once.
    """
    problems = []
    if (config.model_path is None) == (config.model_config is None):
        problems.append("give exactly one of model_path (a local Hugging Face directory) and model_config (a config dict)")
    if config.model_config is not None and "model_type" not in config.model_config:
        problems.append("model_config needs a 'model_type' key (e.g. 'qwen2')")
    if config.dtype not in dtypes:
        problems.append(f"dtype {config.dtype!r} is not one of {list(dtypes)}")
    if config.lr_scheduler_type not in LR_SCHEDULES:
        problems.append(f"lr_scheduler_type {config.lr_scheduler_type!r} is not one of {list(LR_SCHEDULES)}")
    if config.lr_scheduler_type == "cosine" and config.total_training_steps <= config.lr_warmup_steps:
        problems.append(
            f"lr_scheduler_type 'cosine' needs total_training_steps > lr_warmup_steps, got "
            f"{config.total_training_steps} and {config.lr_warmup_steps}"
        )
    if len(config.betas) != 2:
        problems.append(f"betas needs two values, got {list(config.betas)}")
    for name in ("ppo_epochs", "micro_batch_size_per_gpu", "max_token_len_per_gpu", *counts):
        if getattr(config, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(config, name)}")
    for name in ("ppo_mini_batch_size", *optional_counts):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            problems.append(f"{name} must be >= 1 or None, got {getattr(config, name)}")
    if config.grad_clip is not None and config.grad_clip <= 0:
        problems.append(f"grad_clip must be positive or None, got {config.grad_clip}")
    return problems
