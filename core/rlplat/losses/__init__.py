"""The public loss kit: what an algorithm plugin composes instead of writing it again.

* **Aggregation** (:mod:`rlplat.losses.aggregation`): ``aggregate_loss`` in the field's five modes
  (``token-mean``, ``token-sum``, ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``),
  normalised by the mini-batch's *global* counts so that the sum of the micro-batch losses equals the
  loss of the unsplit mini-batch on every rank count; ``aggregate_with_settings`` reads the counts from a
  loss config; ``global_counts`` computes them; ``masked_mean`` / ``masked_sum`` / ``masked_var`` /
  ``masked_whiten``.
* **Metric contributions**: an engine *sums* each metric a loss function returns over micro-batches and
  ranks, so a mean over a micro-batch's tokens is reported times the micro-batch's token share
  (``token_share``, ``as_contributions``); globally normalised values are reported as they are. ``metric(value)``
  gives a float, or inside an engine's ``deferred_metrics()`` a detached 0-dim tensor read after its micro-batch
  loop, so computing a metric never waits on the device.
* **Loss functions** (:class:`rlplat.contracts.engine.LossFunction`): :class:`ActorLoss` composes a
  registered policy loss with the KL loss and the entropy bonus; :class:`CriticLoss` is the clipped value
  loss. Both are plain picklable objects, built from the ``actor.loss`` / ``critic.loss`` node
  (:class:`PolicyLossConfig` / :class:`ValueLossConfig`); an algorithm without its own gets them.
* **KL** (:mod:`rlplat.losses.kl`): per-token estimators (k1, k2, k3, abs and straight-through
  variants), the KL loss, the KL-in-reward step and its fixed and adaptive coefficient controllers.
* A loss function's needs (:func:`loss_needs`): the masks whose global counts its terms read and the id
  column whose log-probs they gather (the distillation terms of rlplat-distill, whose losses live there since
  plugin API 1.3, like the SFT loss in rlplat-sft: the old names here warn until 1.4).

Names are resolved lazily, so ``import rlplat.losses`` (and the torch-free :mod:`rlplat.losses.config`)
imports no torch until a function is used.
"""

from __future__ import annotations

from rlplat.deprecation import Deprecated, deprecated_names
from rlplat.lazy_names import lazy_names


_LAZY_NAMES: dict[str, str] = {
    "PolicyLossConfig": "rlplat.losses.config",
    "ValueLossConfig": "rlplat.losses.config",
    "LOSS_AGG_MODES": "rlplat.losses.config",
    "aggregate_loss": "rlplat.losses.aggregation",
    "aggregate_with_settings": "rlplat.losses.aggregation",
    "global_counts": "rlplat.losses.aggregation",
    "masked_sum": "rlplat.losses.aggregation",
    "masked_mean": "rlplat.losses.aggregation",
    "masked_var": "rlplat.losses.aggregation",
    "masked_whiten": "rlplat.losses.aggregation",
    "metric": "rlplat.losses.aggregation",
    "deferred_metrics": "rlplat.losses.aggregation",
    "ActorLoss": "rlplat.losses.functions",
    "CriticLoss": "rlplat.losses.functions",
    "as_contributions": "rlplat.losses.functions",
    "token_share": "rlplat.losses.functions",
    "sequence_share": "rlplat.losses.functions",
    "with_global_counts": "rlplat.losses.functions",
    "value_loss": "rlplat.losses.value",
    "kl_estimate": "rlplat.losses.kl",
    "kl_loss": "rlplat.losses.kl",
    "apply_kl_penalty": "rlplat.losses.kl",
    "build_kl_controller": "rlplat.losses.kl",
    "LossInputs": "rlplat.losses.functions",
    "loss_needs": "rlplat.losses.functions",
}

#: Moved into their plugins at plugin API 1.3.
_MOVED_NAMES = {
    "sampled_divergence": Deprecated("rlplat_distill.losses:sampled_divergence", "1.4"),
    "topk_divergence": Deprecated("rlplat_distill.losses:topk_divergence", "1.4"),
    "NLLLoss": Deprecated("rlplat_sft.loss:NLLLoss", "1.4"),
    "nll_loss": Deprecated("rlplat_sft.loss:nll_loss", "1.4"),
}

__all__ = sorted(_LAZY_NAMES)

_lazy_getattr, __dir__ = lazy_names('rlplat.losses', _LAZY_NAMES, globals())
__getattr__ = deprecated_names(__name__, _MOVED_NAMES, _lazy_getattr)
