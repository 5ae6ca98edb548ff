"""Rollout correction: importance weights and rejection between the rollout's and the trainer's log-probs.

The rollout engine and the training engine never compute exactly the same probabilities (other
kernels, other precision), so the samples come from a policy ``pi_rollout`` slightly off the
``pi_old`` the PPO ratio assumes. With ``algorithm.rollout_correction`` (:class:`RolloutCorrectionConfig`,
verl's names and presets), per step, on ``l = old_log_probs - rollout_log_probs`` (log pi_old - log
pi_rollout) over valid response tokens:

* **importance weights** (``rollout_is``): token level ``w_t = exp(clamp(l_t, -20, 20))``, sequence level
  ``w = exp(clamp(sum_t l_t, -20, 20))`` on every token of the row; 0 at padding; truncated above at
  ``rollout_is_threshold`` (TIS) and detached; optionally rescaled to mean 1 over the batch. The actor
  loss multiplies each token's policy loss by its weight before aggregation.
* **rejection** (``rollout_rs``, comma-separated, combined by AND): a per-token statistic of the log ratio,
  ``k1 = -l``, ``k2 = l^2 / 2``, ``k3 = exp(l) - 1 - l`` (``l`` clamped to +-20), at token level or
  aggregated per sequence (``seq_sum``, ``seq_mean``, ``seq_max``); k1 is kept inside ``[log lower,
  log upper]`` (``"lower_upper"``, or one value ``u`` for ``[1/u, u]``), k2 and k3 below their threshold.
  Rejected tokens (or whole sequences) leave ``response_mask`` (MIS: masked, not truncated).
* **bypass mode**: the rollout's log-probs serve as ``old_log_probs`` (no forward pass for them), and
  the actor loss does the correction itself, per micro-batch (:func:`bypass_correction`), on
  ``l = log pi_theta - log pi_rollout`` from the update's own forward (detached): the same weights and
  rejection as above, the rejection narrowing only the policy loss's mask. ``loss_type`` picks the loss:
  ``ppo_clip`` (the configured policy loss, whose ratio is then ``pi_theta / pi_rollout`` itself, so no
  weights: rejection only) or ``reinforce`` (the policy gradient ``-A * w * log pi_theta``, ``w`` the
  detached truncated weight, 1 without ``rollout_is``; no ratio, no clipping). The loss reports the
  ``rollout_corr/*`` metrics of its micro-batches. As in verl, every micro-batch of every mini-batch and
  epoch is measured against the policy of that moment (after the first optimizer step ``l`` includes the
  update's own move), and ``rollout_is_batch_normalize`` normalises over the micro-batch.

:func:`offpolicy_metrics` is the always-on telemetry (KL k1 and k3, log-perplexity difference, chi-squared,
effective sample size) whenever rollout log-probs exist, correction or not.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")
BYPASS_PG_LOSS = "reinforce"
"""The registered policy loss (kind ``policy_loss``) of ``loss_type: reinforce``: ``-A * log_prob``, each
token's loss times its ``rollout_is_weights`` through the aggregation."""


@dataclasses.dataclass
class RolloutCorrectionConfig:
    """The ``algorithm.rollout_correction`` node (verl's keys). ``preset`` fills the others from a named
    preset (:data:`PRESETS`); keys given next to it override the preset's."""

    preset: Optional[str] = None
    """A named preset (verl's): ``decoupled_token_is``, ``decoupled_seq_is``, ``decoupled_seq_is_rs``,
    ``decoupled_geo_rs``, ``decoupled_geo_rs_seq_tis``, ``decoupled_geo_rs_token_tis``, ``decoupled_k3_rs``,
    ``decoupled_k3_rs_seq_tis``, ``decoupled_k3_rs_token_tis``, ``bypass_ppo_clip``, ``bypass_ppo_clip_geo_rs``,
    ``bypass_ppo_clip_k3_rs``, ``bypass_pg_is``, ``bypass_pg_geo_rs``, ``bypass_pg_geo_rs_seq_tis``,
    ``bypass_pg_geo_rs_token_tis``, ``disabled``."""
    rollout_is: Optional[str] = None
    """Importance weights: ``token``, ``sequence`` or None (none)."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the weights (TIS)."""
    rollout_is_batch_normalize: bool = False
    """Rescale the truncated weights to mean 1 over the batch (token or sequence mean per ``rollout_is``)."""
    rollout_rs: Optional[str] = None
    """Rejection options, comma-separated (:data:`RS_OPTIONS`), combined by AND; None: no rejection."""
    rollout_rs_threshold: Optional[Union[str, float]] = None
    """One threshold per option, comma-separated, or one for all: ``"lower_upper"`` or ``upper`` for k1
    (lower 1/upper), a positive number for k2 and k3. Quote ``"lower_upper"`` in YAML and on the command
    line (``'"0.5_2"'``): unquoted, ``1_2`` reads as the number 12."""
    bypass_mode: bool = False
    """Use the rollout's log-probs as ``old_log_probs`` (one forward pass fewer per step); weights and
    rejection are then computed inside the actor loss, per micro-batch, against the current policy."""
    loss_type: str = "ppo_clip"
    """The loss in bypass mode: ``ppo_clip`` (the configured policy loss, its ratio taken against the
    rollout policy; rejection only, no weights) or ``reinforce`` (policy gradient ``-A * w * log_prob``
    with the detached weights ``w``, no ratio, no clipping)."""

    staleness_decay: Optional[float] = None
    """Weight each token's policy loss by ``staleness_decay ** s``, ``s`` the policy versions between the one that
    sampled it (the batch's per-token ``policy_version``) and the one trained: with partial rollouts a sample's
    tokens come from several versions, and the older ones count less. In (0, 1]; None: no such weight. Applied in
    decoupled mode, on top of ``rollout_is`` (whose token-level ratio already compares each token with the policy
    that sampled it) or alone (rlplat's key, not verl's)."""

    allow_uncorrected: bool = False
    """Train an asynchronous run whose samples may be stale (``trainer.max_staleness`` > 0) with no weights,
    rejection or bypass: refused at load otherwise, since its PPO ratio then ignores the policies that
    sampled (rlplat's key, not verl's)."""

    def __post_init__(self) -> None:
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(f"unknown rollout correction preset {self.preset!r}; the presets are {', '.join(PRESETS)}")
        problems = []
        if self.rollout_is is not None and self.rollout_is not in ("token", "sequence"):
            problems.append(f"rollout_is must be token, sequence or null, got {self.rollout_is!r}")
        if not self.rollout_is_threshold > 0:
            problems.append(f"rollout_is_threshold must be > 0, got {self.rollout_is_threshold}")
        if self.loss_type not in LOSS_TYPES:
            problems.append(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        elif self.loss_type == "reinforce" and not self.bypass_mode:
            problems.append("loss_type=reinforce is the loss of bypass mode (decoupled mode trains with "
                            "actor.loss.policy_loss): set bypass_mode to true, or loss_type to ppo_clip")
        if self.bypass_mode and self.loss_type == "ppo_clip" and self.rollout_is is not None:
            problems.append("bypass_mode applies no weights with loss_type=ppo_clip (its ratio already is pi_theta / "
                            "pi_rollout): set rollout_is to null, or loss_type to reinforce")
        if self.staleness_decay is not None:
            if isinstance(self.staleness_decay, bool) or not 0 < float(self.staleness_decay) <= 1:
                problems.append(f"staleness_decay must be in (0, 1] or null, got {self.staleness_decay!r}")
            elif self.bypass_mode:
                problems.append("staleness_decay weights the loss in decoupled mode; bypass_mode corrects inside the loss "
                                "per micro-batch: set bypass_mode to false, or staleness_decay to null")
        if problems:
            raise ValueError("; ".join(problems))
        if self.rollout_rs is not None:
            rejection_specs(self)  # raises on bad options or thresholds

    @property
    def enabled(self) -> bool:
        """Whether it changes training (weights, rejection or bypass); metrics are computed either way."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode or self.staleness_decay is not None

    @property
    def compares_log_probs(self) -> bool:
        """Whether it reads the rollout's log-probs against ``old_log_probs`` (weights or rejection)."""
        return self.rollout_is is not None or self.rollout_rs is not None


PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "decoupled_seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "decoupled_seq_is_rs": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
                            "rollout_rs_threshold": "0.5_2.0"},
    "decoupled_geo_rs": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_geo_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                 "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_geo_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                                   "rollout_rs_threshold": "0.999_1.001"},
    "decoupled_k3_rs": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3",
                                "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3",
                                  "rollout_rs_threshold": 0.01},
    "bypass_ppo_clip": {"bypass_mode": True, "loss_type": "ppo_clip"},
    "bypass_ppo_clip_geo_rs": {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "seq_mean_k1",
                               "rollout_rs_threshold": "0.999_1.001"},
    "bypass_ppo_clip_k3_rs": {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "seq_mean_k3",
                              "rollout_rs_threshold": 0.01},
    "bypass_pg_is": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "bypass_pg_geo_rs": {"bypass_mode": True, "loss_type": "reinforce", "rollout_rs": "seq_mean_k1",
                         "rollout_rs_threshold": "0.999_1.001"},
    "bypass_pg_geo_rs_seq_tis": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence",
                                 "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "bypass_pg_geo_rs_token_tis": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token",
                                   "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "disabled": {},
}
"""verl's presets that rlplat implements, as the fields each sets (the others keep their defaults)."""


def read_rollout_correction(node: Any) -> Optional[RolloutCorrectionConfig]:
    """The node typed, its preset's fields under the keys given; None when the node is absent or null."""
    from rlplat.config_node import read_config_node

    if node is None:
        return None
    values = dict(node)
    preset = values.get("preset")
    if preset is not None and preset in PRESETS:
        values = {**PRESETS[preset], **values}
    return read_config_node(values, RolloutCorrectionConfig, "algorithm.rollout_correction")


@dataclasses.dataclass(frozen=True)
class RejectionSpec:
    option: str
    lower: Optional[float]
    """k1 only: the lower bound of the ratio-like statistic (its log is the bound of -l)."""
    upper: float


def rejection_specs(config: RolloutCorrectionConfig) -> list[RejectionSpec]:
    """The rejection options of ``config`` with their thresholds, checked."""
    options = list(dict.fromkeys(part.strip() for part in str(config.rollout_rs).split(",") if part.strip()))
    if not options:
        raise ValueError("rollout_rs is empty; give options such as seq_mean_k1 or null")
    unknown = [option for option in options if option not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"rollout_rs: unknown option(s) {unknown}; the options are {', '.join(RS_OPTIONS)}")
    if config.rollout_rs_threshold is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = [part.strip() for part in str(config.rollout_rs_threshold).split(",")]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_rs_threshold gives {len(specs)} thresholds for {len(options)} options; give one or one each")
    out = []
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            parts = spec.split("_")
            try:
                values = [float(part) for part in parts]
            except ValueError:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: a number or 'lower_upper'") from None
            if len(values) == 1:
                lower, upper = 1.0 / values[0] if values[0] > 0 else -1.0, values[0]
            elif len(values) == 2:
                lower, upper = values
            else:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: a number or 'lower_upper'")
            if not (lower > 0 and upper > 0 and lower <= upper):
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: bounds must be > 0 with lower <= upper")
            out.append(RejectionSpec(option, lower, upper))
        else:
            try:
                upper = float(spec)
            except ValueError:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: one positive number (k2 and k3 have no lower bound)") from None
            if not upper > 0:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: must be > 0")
            out.append(RejectionSpec(option, None, upper))
    return out


def _masked_mean(values: Any, mask: Any, dim: Any = None) -> Any:
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def importance_weights(log_ratio: Any, mask: Any, config: RolloutCorrectionConfig) -> tuple[Any, dict[str, float]]:
    """The truncated (and optionally normalised) weights ``[B, R]`` (0 at padding, detached) and the
    ``rollout_corr/rollout_is_*`` metrics (computed before truncation)."""
    import torch

    mask = mask.to(log_ratio.dtype)
    upper, lower = config.rollout_is_threshold, 1.0 / config.rollout_is_threshold
    if config.rollout_is == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
        valid = mask.bool()
        metrics = {"rollout_is_mean": float(_masked_mean(raw, mask)),
                   "rollout_is_max": float(raw[valid].max()) if valid.any() else 0.0,
                   "rollout_is_min": float(raw[valid].min()) if valid.any() else 0.0,
                   "rollout_is_ratio_fraction_high": float(_masked_mean((raw > upper).to(mask.dtype), mask)),
                   "rollout_is_ratio_fraction_low": float(_masked_mean((raw < lower).to(mask.dtype), mask))}
    else:
        total = (log_ratio * mask).sum(-1)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1) * mask
        rows = mask.sum(-1) > 0
        metrics = {"rollout_is_mean": float(_masked_mean(raw, mask)),
                   "rollout_is_max": float(torch.exp(total[rows].max().clamp(max=SAFETY_BOUND))) if rows.any() else 0.0,
                   "rollout_is_min": float(torch.exp(total[rows].min())) if rows.any() else 0.0,
                   "rollout_is_ratio_fraction_high": float((total[rows] > math.log(upper)).float().mean()) if rows.any() else 0.0,
                   "rollout_is_ratio_fraction_low": float((total[rows] < math.log(lower)).float().mean()) if rows.any() else 0.0}
    clamped = raw.clamp(lower, upper)
    mean = _masked_mean(clamped, mask)
    metrics["rollout_is_std"] = float((_masked_mean(clamped ** 2, mask) - mean ** 2).clamp(min=0).sqrt()) if mask.sum() > 1 else 0.0
    spread = _masked_mean((clamped / (mean + 1e-8)) ** 2, mask)
    metrics["rollout_is_eff_sample_size"] = float(1.0 / spread) if float(spread) > 0 else 0.0
    weights = raw.clamp(max=upper)
    if config.rollout_is_batch_normalize:
        if config.rollout_is == "token":
            norm = _masked_mean(weights, mask)
        else:
            rows = mask.sum(-1) > 0
            norm = _masked_mean(weights, mask, dim=-1)[rows].mean() if rows.any() else weights.new_tensor(0.0)
        if float(norm) > 1e-8:
            weights = weights / norm
            metrics["rollout_is_batch_norm_factor"] = float(norm)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return (weights * mask).detach(), {f"rollout_corr/{key}": value for key, value in metrics.items()}


def rejection_mask(log_ratio: Any, mask: Any, config: RolloutCorrectionConfig) -> tuple[Any, dict[str, float]]:
    """``mask`` with the rejected tokens (or sequences) set to 0, and the ``rollout_corr/rollout_rs_*``
    metrics (fractions of valid tokens and of sequences rejected, per option and overall)."""
    import torch

    valid = mask.to(log_ratio.dtype)
    clamped = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    statistics = {"k1": -clamped, "k2": 0.5 * clamped ** 2, "k3": torch.exp(clamped) - 1 - clamped}
    keep_all = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    rows = valid.sum(-1) > 0
    for spec in rejection_specs(config):
        kind = spec.option[-2:]
        token_stat = statistics[kind]
        if spec.option.startswith("token_"):
            stat = token_stat
        elif spec.option.startswith("seq_sum_"):
            stat = (token_stat * valid).sum(-1, keepdim=True).expand_as(valid)
        elif spec.option.startswith("seq_mean_"):
            stat = _masked_mean(token_stat, valid, dim=-1).unsqueeze(-1).expand_as(valid)
        else:  # seq_max
            stat = torch.where(valid.bool(), token_stat, torch.full_like(token_stat, -math.inf)).max(-1, keepdim=True).values
            stat = torch.where(rows.unsqueeze(-1), stat, torch.zeros_like(stat)).expand_as(valid)
        if kind == "k1":
            keep = (stat >= math.log(spec.lower)) & (stat <= math.log(spec.upper))
        else:
            keep = stat <= spec.upper
        keep = keep.to(valid.dtype)
        keep_all = keep_all * keep
        rejected = (1 - keep) * valid
        metrics[f"rollout_rs_{spec.option}_mean"] = float(_masked_mean(stat, valid))
        metrics[f"rollout_rs_{spec.option}_masked_fraction"] = float(_masked_mean(1 - keep, valid))
        metrics[f"rollout_rs_{spec.option}_seq_masked_fraction"] = float((rejected.sum(-1)[rows] > 0).float().mean()) if rows.any() else 0.0
    rejected = (1 - keep_all) * valid
    metrics["rollout_rs_masked_fraction"] = float(_masked_mean(1 - keep_all, valid))
    # over the rows with a valid token, like each option's: a micro-batch may hold rows of dispatch padding
    metrics["rollout_rs_seq_masked_fraction"] = float((rejected.sum(-1)[rows] > 0).float().mean()) if rows.any() else 0.0
    return (mask * keep_all.to(mask.dtype)), {f"rollout_corr/{key}": value for key, value in metrics.items()}


def log_prob_mismatch(batch: Any, mask: Any = None) -> dict[str, float]:
    """How far the engine's ``old_log_probs`` are from the rollout's ``rollout_log_probs`` on valid
    response tokens (``mask``, default ``response_mask``): the health metric of a weight sync (both come
    from the same weights and tokens)."""
    mask = (batch.batch["response_mask"] if mask is None else mask).bool()
    difference = (batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"]).abs()[mask]
    if difference.numel() == 0:
        return {"rollout/log_prob_diff_max": 0.0, "rollout/log_prob_diff_mean": 0.0}
    return {"rollout/log_prob_diff_max": float(difference.max()), "rollout/log_prob_diff_mean": float(difference.mean())}


def offpolicy_metrics(train_log_probs: Any, rollout_log_probs: Any, mask: Any) -> dict[str, float]:
    """How far the rollout's policy is from the trainer's on the valid tokens: ``kl`` (k1, E[log pi_rollout
    - log pi_train]), ``k3_kl`` (E[exp(l) - l - 1]), per-sequence log-perplexities and their difference,
    chi-squared at token and sequence level, and the effective sample size of the token ratios (a fraction
    in (0, 1]). Names ``rollout_corr/*``, verl's."""
    import torch

    valid = mask.to(train_log_probs.dtype)
    rows = valid.sum(-1) > 0
    if not rows.any():
        return {}
    ratio_log = train_log_probs - rollout_log_probs
    train_mean = _masked_mean(train_log_probs, valid, dim=-1)[rows]
    rollout_mean = _masked_mean(rollout_log_probs, valid, dim=-1)[rows]
    difference = rollout_mean - train_mean
    token_ratio = torch.exp(ratio_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    sequence_log = (ratio_log * valid).sum(-1)[rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    mean_ratio = _masked_mean(token_ratio, valid)
    metrics = {
        "training_log_ppl": float((-train_mean).mean()), "training_ppl": float(torch.exp(-train_mean).mean()),
        "rollout_log_ppl": float((-rollout_mean).mean()), "rollout_ppl": float(torch.exp(-rollout_mean).mean()),
        "kl": float(_masked_mean(rollout_log_probs - train_log_probs, valid)),
        "k3_kl": float(_masked_mean(torch.exp(ratio_log) - ratio_log - 1, valid)),
        "log_ppl_diff": float(difference.mean()), "log_ppl_abs_diff": float(difference.abs().mean()),
        "log_ppl_diff_max": float(difference.max()), "log_ppl_diff_min": float(difference.min()),
        "ppl_ratio": float(torch.exp(difference).mean()),
        "chi2_token": float(_masked_mean(token_ratio ** 2, valid) - 1),
        "chi2_seq": float(torch.exp(2 * sequence_log).mean() - 1),
        "eff_sample_size": float(1.0 / _masked_mean((token_ratio / (mean_ratio + 1e-8)) ** 2, valid)),
    }
    return {f"rollout_corr/{key}": value for key, value in metrics.items()}


def apply(batch: Any, config: RolloutCorrectionConfig, trained_version: Optional[int] = None) -> dict[str, float]:
    """Decoupled correction of ``batch`` in place (it holds ``old_log_probs`` and ``rollout_log_probs``):
    rejection narrows ``response_mask``, importance weights go to ``rollout_is_weights``, times
    ``staleness_decay`` to the power of each token's staleness (``trained_version`` minus its
    ``policy_version``) when set. Returns the metrics (computed on the mask before rejection)."""
    tensors = batch.batch
    metrics: dict[str, float] = {}
    if config.compares_log_probs:
        metrics.update(apply_log_ratio(tensors, config))
    if config.staleness_decay is not None:
        metrics.update(apply_staleness_decay(tensors, config.staleness_decay, trained_version))
    return metrics


def apply_staleness_decay(tensors: Any, decay: float, trained_version: Optional[int]) -> dict[str, float]:
    import torch

    if "policy_version" not in tensors.keys() or trained_version is None:
        raise RuntimeError("algorithm.rollout_correction.staleness_decay needs each token's policy_version and the "
                           "version trained; this batch has no policy_version")
    mask = tensors["response_mask"]
    staleness = (int(trained_version) - tensors["policy_version"]).clamp(min=0)
    weights = torch.pow(torch.full_like(staleness, float(decay), dtype=torch.float32), staleness) * mask.to(torch.float32)
    if "rollout_is_weights" in tensors.keys():
        weights = tensors["rollout_is_weights"] * weights.to(tensors["rollout_is_weights"].dtype)
    tensors["rollout_is_weights"] = weights
    valid = mask.bool()
    return {"rollout_corr/token_staleness_mean": float(staleness[valid].float().mean()) if valid.any() else 0.0,
            "rollout_corr/staleness_weight_mean": float(torch.pow(torch.tensor(float(decay)), staleness[valid].float()).mean())
            if valid.any() else 1.0}


def apply_log_ratio(tensors: Any, config: RolloutCorrectionConfig) -> dict[str, float]:
    log_ratio = (tensors["old_log_probs"] - tensors["rollout_log_probs"]).to(tensors["old_log_probs"].dtype)
    mask = tensors["response_mask"]
    metrics: dict[str, float] = {}
    if config.rollout_is is not None:
        weights, is_metrics = importance_weights(log_ratio, mask, config)
        metrics.update(is_metrics)
    if config.rollout_rs is not None:
        mask, rs_metrics = rejection_mask(log_ratio, mask, config)
        metrics.update(rs_metrics)
        tensors["response_mask"] = mask
    if config.rollout_is is not None:
        tensors["rollout_is_weights"] = weights * mask.to(weights.dtype)
    return metrics


def bypass_correction(log_prob: Any, rollout_log_prob: Any, response_mask: Any,
                      config: RolloutCorrectionConfig) -> tuple[Optional[Any], Any, dict[str, float]]:
    """Bypass mode's correction of one micro-batch, inside the actor loss: on ``l = log_prob -
    rollout_log_prob`` (the update's forward, detached, against the rollout's; 0 outside the mask),
    the importance weights of ``rollout_is`` (None without it; 0 at padding and at rejected tokens) and
    ``response_mask`` narrowed by ``rollout_rs``, with the ``rollout_corr/*`` metrics: the weights' and
    the rejection's (:func:`importance_weights`, :func:`rejection_mask`) and the off-policy diagnostics
    (:func:`offpolicy_metrics`, on the mask before rejection). Returns ``(weights, policy_mask, metrics)``.
    """
    import torch

    with torch.no_grad():
        valid = response_mask.bool()
        current = torch.where(valid, log_prob.detach(), torch.zeros_like(log_prob))
        rollout = torch.where(valid, rollout_log_prob.to(current.dtype), torch.zeros_like(current))
        log_ratio = current - rollout
        metrics: dict[str, float] = {}
        weights = None
        if config.rollout_is is not None:
            weights, is_metrics = importance_weights(log_ratio, response_mask, config)
            metrics.update(is_metrics)
        policy_mask = response_mask
        if config.rollout_rs is not None:
            policy_mask, rs_metrics = rejection_mask(log_ratio, response_mask, config)
            metrics.update(rs_metrics)
        if weights is not None:
            weights = weights * policy_mask.to(weights.dtype)
        metrics.update(offpolicy_metrics(current, rollout, response_mask))
    return weights, policy_mask, metrics


PER_SEQUENCE_DIAGNOSTICS = frozenset(f"rollout_corr/{name}" for name in (
    "training_log_ppl", "training_ppl", "rollout_log_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff",
    "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_seq"))
PER_SEQUENCE_WEIGHT_METRICS = frozenset(f"rollout_corr/rollout_is_{name}" for name in (
    "max", "min", "ratio_fraction_high", "ratio_fraction_low", "batch_norm_factor"))


def is_per_sequence(name: str, config: RolloutCorrectionConfig) -> bool:
    """Whether the metric ``name`` of :func:`bypass_correction` is a mean over sequences (rows with a valid
    token) rather than over tokens: the per-sequence diagnostics, the rejection's ``*_seq_masked_fraction``
    and, with sequence weights, their extremes, fractions out of bounds and batch-normalisation factor."""
    return (name in PER_SEQUENCE_DIAGNOSTICS or name.endswith("_seq_masked_fraction")
            or (config.rollout_is == "sequence" and name in PER_SEQUENCE_WEIGHT_METRICS))


def actor_loss_node(loss_node: Any, correction_node: Any) -> dict[str, Any]:
    """The ``actor.loss`` node the actor's loss is built from: ``loss_node`` with ``rollout_correction``
    set to ``correction_node`` (the ``algorithm.rollout_correction`` node) when that is in bypass mode,
    where the loss corrects each micro-batch itself; otherwise ``loss_node`` as it is (decoupled
    correction happens before the update)."""
    node = dict(loss_node)
    correction = read_rollout_correction(correction_node)
    if correction is not None and correction.bypass_mode:
        node["rollout_correction"] = dict(correction_node)
    return node
