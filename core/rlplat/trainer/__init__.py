"""The RL trainer: the driver loop (:mod:`rlplat.trainer.loop`, :class:`Trainer`) and what a run is made of
around it: generations running ahead in the asynchronous modes (:mod:`~rlplat.trainer.pipeline`), the check
after weight syncs (:mod:`~rlplat.trainer.sync_probe`), worker groups from roles
(:mod:`~rlplat.trainer.placement`), checkpoints (:mod:`~rlplat.trainer.checkpoint`) and metrics
(:mod:`~rlplat.trainer.tracking`). Importing this package imports none of them; ``Trainer`` and the loop's
helpers resolve on first access."""

from __future__ import annotations

from rlplat.lazy_names import lazy_names

_NAMES = {name: "rlplat.trainer.loop" for name in ("Trainer", "batch_metrics", "balanced_order", "timed",
                                                     "driver_batch_metrics")}

__getattr__, __dir__ = lazy_names("rlplat.trainer", _NAMES, globals())
