"""The public loss kit: what an algorithm plugin composes instead of writing it again.

* **Aggregation** (:mod:`rlplat.losses.aggregation`): ``aggregate_loss`` in the field's five modes
  (``token-mean``, ``token-sum``, ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``),
  normalised by the mini-batch's *global* counts so that the sum of the micro-batch losses equals the
  loss of the unsplit mini-batch on every rank count; ``aggregate_with_settings`` reads the counts from a
  loss config; ``global_counts`` computes them; ``masked_mean`` / ``masked_sum`` / ``masked_var`` /
  ``masked_whiten``.
* **Metric contributions**: an engine *sums* each metric a loss function returns over micro-batches and
  ranks, so a mean over a micro-batch's tokens is reported times the micro-batch's token share
  (``token_share``, ``as_contributions``); globally normalised values are reported as they are.
* **Loss functions** (:class:`rlplat.contracts.engine.LossFunction`): :class:`ActorLoss` composes a
  registered policy loss with the KL loss and the entropy bonus; :class:`CriticLoss` is the clipped value
  loss. Both are plain picklable objects, built from the ``actor.loss`` / ``critic.loss`` node
  (:class:`PolicyLossConfig` / :class:`ValueLossConfig`); an algorithm without its own gets them.
* **Supervised fine-tuning** (:mod:`rlplat.losses.sft`): :class:`NLLLoss`, the negative log-likelihood of
  the tokens under ``response_mask`` (``rlplat sft``), and ``nll_loss``.
* **KL** (:mod:`rlplat.losses.kl`): per-token estimators (k1, k2, k3, abs and straight-through
  variants), the KL loss, the KL-in-reward step and its fixed and adaptive coefficient controllers.
* **Distillation** (:mod:`rlplat.losses.distillation`): the reverse KL to a teacher on sampled tokens and the
  reverse KL, forward KL and generalised JSD over a teacher's top-k tokens, as per-token divergences and as
  policy losses meant as terms of the actor loss (``actor.loss.terms``; registered by rlplat-distill).

Names are resolved lazily, so ``import rlplat.losses`` (and the torch-free :mod:`rlplat.losses.config`)
imports no torch until a function is used.
"""

from __future__ import annotations

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
    "sampled_divergence": "rlplat.losses.distillation",
    "topk_divergence": "rlplat.losses.distillation",
    "NLLLoss": "rlplat.losses.sft",
    "nll_loss": "rlplat.losses.sft",
}

__all__ = sorted(_LAZY_NAMES)

__getattr__, __dir__ = lazy_names('rlplat.losses', _LAZY_NAMES, globals())
