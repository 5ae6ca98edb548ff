"""On-policy distillation terms of the loss kit: the student samples, a teacher scores the sampled
tokens, and the student moves towards the teacher's distribution at every response position.

Per-token divergences (``[B, R]``):

``sampled_divergence``
    a single-sample estimate of the reverse KL ``KL(student || teacher)`` from the sampled token's two
    log-probs, with an estimator of :mod:`rlplat.losses.kl` (``k1`` ``s - t``, ``k2``, ``k3`` ``exp(t - s) -
    (t - s) - 1``, ``abs``): unbiased for ``k1`` and ``k3`` because the token was sampled from the student.
``topk_divergence``
    the divergence between the two distributions restricted to ``k`` token ids per position (the teacher's
    top ``k``): ``reverse`` ``sum p_s (log p_s - log p_t)``, ``forward`` ``sum p_t (log p_t - log p_s)``, or
    ``jsd`` with ``beta`` (the generalised Jensen-Shannon divergence of GKD as TRL defines it: the mixture
    ``m = (1 - beta) p_s + beta p_t``, ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``; ``beta = 0`` is the
    forward KL, ``beta = 1`` the reverse KL). Both distributions are renormalised over the ``k`` ids first
    (``renormalize``), so with ``k`` the vocabulary size each form is the full one.

Policy losses (kind ``policy_loss``, registered by this plugin; signature of
:class:`rlplat.contracts.algorithm.PolicyLoss`) built on them: :func:`reverse_kl_loss` (sampled tokens),
:func:`reverse_kl_topk_loss`, :func:`forward_kl_topk_loss` and :func:`jsd_topk_loss`. They read the teacher's
columns through ``config.inputs`` (:class:`rlplat.losses.functions.LossInputs`) and are meant as weighted
terms of the actor loss (``actor.loss.terms``), or as its policy loss for pure distillation. Each is
aggregated over its own mask, :data:`TEACHER_MASK` (the response tokens of rows a teacher scored), with
that mask's own global counts (``config.global_counts``, which the engine computes for every mask a loss
function declares in ``count_masks``), so that a term never dilutes or is diluted by another.

Gradients: the ``topk`` forms differentiate through the student's log-probs at the ``k`` ids (the engine's
``gathered_log_probs``). The sampled-token form with ``use_policy_gradient`` (the default) is the
per-token policy gradient of the reverse KL: the advantage of each token is minus its estimate (detached)
and the surrogate is PPO's clipped one on ``old_log_probs``, so its value is the estimate and its gradient
``(s - t) * grad s`` at the sampling policy; without it the estimate itself is differentiated (``k1``'s
gradient does not depend on the teacher, so that pair is refused). When the teacher is the student every
form is 0 and so is its gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlplat.losses.aggregation import aggregate_loss, masked_sum
from rlplat.losses.kl import kl_estimate
from rlplat_distill.terms import SAMPLED_ESTIMATORS

#: Columns of the training batch the teacher role fills (rlplat_distill.teacher), and what the engine adds.
TEACHER_LOG_PROBS = "teacher_log_probs"
"""[B, R] the teacher's log-prob of each sampled response token (0 where it scored none)."""
TEACHER_MASK = "teacher_mask"
"""[B, R] 1 at the response tokens of rows a teacher scored: the mask every distillation term aggregates over."""
TEACHER_TOPK_IDS = "teacher_topk_ids"
"""[B, R, k] int64: the teacher's ``k`` most likely token ids at each response position."""
TEACHER_TOPK_LOG_PROBS = "teacher_topk_log_probs"
"""[B, R, k] the teacher's log-probs of those ids."""
GATHERED_LOG_PROBS = "gathered_log_probs"
"""[b, R, k] the student's log-probs at the ids of the loss function's ``gather_ids`` column (engine output)."""

TOPK_KINDS = ("reverse", "forward", "jsd")


def sampled_divergence(log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(student || teacher)`` from the sampled tokens' log-probs (see the module)."""
    if estimator not in SAMPLED_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r} of the sampled-token reverse KL; choose one of {', '.join(SAMPLED_ESTIMATORS)}")
    return kl_estimate(log_prob, teacher_log_prob, estimator)


def topk_divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str = "reverse", *, beta: float = 0.5,
                    renormalize: bool = True) -> torch.Tensor:
    """Per-position divergence ``[..., k] -> [...]`` between the student's and the teacher's log-probs at the
    same ``k`` token ids (see the module docstring for ``kind`` and ``beta``)."""
    if kind not in TOPK_KINDS:
        raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(TOPK_KINDS)}")
    if student.shape != teacher.shape:
        raise ValueError(f"student log-probs {tuple(student.shape)} and teacher log-probs {tuple(teacher.shape)} must "
                         "have the same shape (the same k ids at each position)")
    student, teacher = student.float(), teacher.float()
    if renormalize:
        student = student - student.logsumexp(-1, keepdim=True)
        teacher = teacher - teacher.logsumexp(-1, keepdim=True)
    if kind == "jsd" and not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    if kind == "forward" or (kind == "jsd" and beta == 0.0):
        return kl_of(teacher, student)
    if kind == "reverse" or (kind == "jsd" and beta == 1.0):
        return kl_of(student, teacher)
    mixture = torch.logsumexp(torch.stack([student + math.log(1.0 - beta), teacher + math.log(beta)]), dim=0)
    return beta * kl_of(teacher, mixture) + (1.0 - beta) * kl_of(student, mixture)


def kl_of(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` summed over the last dimension, from log-probs; a zero-probability entry of ``p``
    contributes 0 (never ``0 * inf``)."""
    probabilities = first.exp()
    return torch.where(probabilities > 0, probabilities * (first - second), torch.zeros_like(first)).sum(-1)


# -- policy losses ----------------------------------------------------------------------------------


def term_inputs(config: Any, *names: str) -> list[torch.Tensor]:
    """The columns ``names`` of the micro-batch (or the engine's outputs) a distillation term reads."""
    inputs = getattr(config, "inputs", None)
    if inputs is None:
        raise ValueError("distillation loss: it reads the teacher's columns through config.inputs, which only the actor "
                         "loss sets (use it as a term of actor.loss.terms or as actor.loss.policy_loss)")
    missing = [name for name in names if name not in inputs]
    if missing:
        raise ValueError(f"distillation loss: the micro-batch has no {', '.join(missing)}; a teacher role fills them "
                         "(distillation.teachers, rlplat-distill) and the engine gathers the student's log-probs at the "
                         "teacher's top-k ids")
    return [inputs[name] for name in names]


def aggregate_term(loss_mat: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, config: Any) -> torch.Tensor:
    """``loss_mat`` aggregated over ``mask`` with that mask's own global counts (``config.global_counts``)."""
    counts = (getattr(config, "global_counts", None) or {}).get(TEACHER_MASK) or {}
    return aggregate_loss(loss_mat, mask, loss_agg_mode, global_token_count=counts.get("tokens"),
                          global_sequence_count=counts.get("sequences"), loss_scale_factor=config.loss_scale_factor)


def term_metrics(name: str, per_token: torch.Tensor, mask: torch.Tensor, loss: torch.Tensor, config: Any) -> dict[str, float]:
    """``distill/<name>``: the aggregated term; ``distill/<name>_token_mean``: its mean over the term's tokens,
    as a contribution (this micro-batch's sum over the mask's global token count)."""
    counts = (getattr(config, "global_counts", None) or {}).get(TEACHER_MASK) or {}
    tokens = max(float(counts.get("tokens") or mask.sum()), 1.0)
    return {f"distill/{name}": float(loss.detach()),
            f"distill/{name}_token_mean": float(masked_sum(per_token.detach(), mask)) / tokens}


def knob(config: Any, key: str, default: Any) -> Any:
    """A term's own setting: its entry in ``actor.loss.terms`` (or ``actor.loss.policy_loss``)."""
    return (getattr(config, "policy_loss", None) or {}).get(key, default)


def clamped(per_token: torch.Tensor, config: Any) -> torch.Tensor:
    bound = knob(config, "loss_max_clamp", None)
    return per_token if bound is None else per_token.clamp(min=-float(bound), max=float(bound))


def reverse_kl_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: Any, response_mask: torch.Tensor,
                    loss_agg_mode: str, config: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Reverse KL to the teacher on the sampled tokens (knobs: ``estimator`` k3, ``use_policy_gradient`` true,
    ``loss_max_clamp`` none, the actor loss's ``clip_ratio_low`` / ``clip_ratio_high`` for the surrogate)."""
    teacher_log_prob, mask = term_inputs(config, TEACHER_LOG_PROBS, TEACHER_MASK)
    mask = mask.to(log_prob.dtype) * response_mask.to(log_prob.dtype)
    estimator = str(knob(config, "estimator", "k3"))
    use_policy_gradient = bool(knob(config, "use_policy_gradient", True))
    if not use_policy_gradient and estimator in ("k1", "kl"):
        raise ValueError("reverse_kl: the k1 estimate differentiated directly has a gradient that does not depend on the "
                         "teacher; use use_policy_gradient=true or another estimator (k3, k2)")
    estimate = clamped(sampled_divergence(log_prob, teacher_log_prob.to(log_prob.dtype), estimator), config)
    if use_policy_gradient:
        advantage = -estimate.detach()
        ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
        low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
        high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
        per_token = torch.maximum(-advantage * ratio, -advantage * torch.clamp(ratio, 1.0 - low, 1.0 + high))
    else:
        per_token = estimate
    loss = aggregate_term(per_token, mask, loss_agg_mode, config)
    return loss, term_metrics("reverse_kl", estimate, mask, loss, config)


def topk_loss(kind: str, log_prob: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
              config: Any) -> tuple[torch.Tensor, dict[str, float]]:
    student, teacher, mask = term_inputs(config, GATHERED_LOG_PROBS, TEACHER_TOPK_LOG_PROBS, TEACHER_MASK)
    mask = mask.to(log_prob.dtype) * response_mask.to(log_prob.dtype)
    per_token = topk_divergence(student, teacher.to(student.dtype), kind, beta=float(knob(config, "beta", 0.5)),
                                renormalize=bool(knob(config, "renormalize", True)))
    per_token = clamped(per_token, config)
    loss = aggregate_term(per_token, mask, loss_agg_mode, config)
    name = {"reverse": "reverse_kl_topk", "forward": "forward_kl_topk", "jsd": "jsd_topk"}[kind]
    return loss, term_metrics(name, per_token, mask, loss, config)


def reverse_kl_topk_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: Any, response_mask: torch.Tensor,
                         loss_agg_mode: str, config: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Reverse KL over the teacher's top-k ids at each position (knobs: ``renormalize`` true, ``loss_max_clamp``)."""
    return topk_loss("reverse", log_prob, response_mask, loss_agg_mode, config)


def forward_kl_topk_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: Any, response_mask: torch.Tensor,
                         loss_agg_mode: str, config: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL over the teacher's top-k ids at each position (knobs: ``renormalize`` true, ``loss_max_clamp``)."""
    return topk_loss("forward", log_prob, response_mask, loss_agg_mode, config)


def jsd_topk_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: Any, response_mask: torch.Tensor,
                  loss_agg_mode: str, config: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Generalised JSD over the teacher's top-k ids (knobs: ``beta`` 0.5, ``renormalize`` true, ``loss_max_clamp``)."""
    return topk_loss("jsd", log_prob, response_mask, loss_agg_mode, config)


for _loss in (reverse_kl_loss, reverse_kl_topk_loss, forward_kl_topk_loss, jsd_topk_loss):
    _loss.count_masks = (TEACHER_MASK,)  # type: ignore[attr-defined]
for _loss in (reverse_kl_topk_loss, forward_kl_topk_loss, jsd_topk_loss):
    _loss.gather_ids = TEACHER_TOPK_IDS  # type: ignore[attr-defined]
