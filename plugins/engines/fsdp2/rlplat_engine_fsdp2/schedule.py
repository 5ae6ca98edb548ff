"""The learning-rate schedule: linear warm-up, then constant or cosine decay (verl's formulas)."""

from __future__ import annotations

import dataclasses
import math


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
