"""The Tinker API's loss functions on rlplat's engines: each a :class:`rlplat.contracts.engine.LossFunction` over rows
built by :mod:`rlplat_tinker.datums`.

Tinker's losses are *sums* over every token of every datum (no mean): ``forward_backward`` calls add up exactly,
however a client splits its data. The log-probs are those of each datum's ``target_tokens`` (the engine's
``gathered_log_probs`` at the ``tinker_targets`` ids); ``response_mask`` marks the datum's positions (padding 0).

* ``cross_entropy``: ``-(logp * weights).sum()`` (weights may be any real numbers: a client-side custom loss sends
  its gradient as weights);
* ``importance_sampling``: ``-(exp(logp - q) * advantages).sum()``, ``q`` the sampler's log-probs;
* ``ppo``: ``-min(r * A, clip(r, low, high) * A).sum()``, thresholds 0.8 and 1.2 unless ``loss_fn_config`` says;
* ``cispo``: ``-(clip(r, low, high).detach() * logp * A).sum()``, thresholds 0.0 and 4.0 by default;
* ``dro``: ``-(logp * A - beta / 2 * (logp - q) ** 2).sum()``, ``beta`` required.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

TARGETS, WEIGHTS, ADVANTAGES, SAMPLED = "tinker_targets", "tinker_weights", "tinker_advantages", "tinker_sampling_logprobs"

#: per loss: the loss_fn_inputs it reads (besides target_tokens), and its loss_fn_config keys with their defaults
#: (None: required)
LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float | None]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": (("logprobs", "advantages"), {"beta": None}),
}


class RequestError(ValueError):
    """A request the service refuses: its HTTP status (4xx) and the reason."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def loss_settings(name: str, config: Mapping[str, Any] | None) -> dict[str, float]:
    """``loss_fn_config`` checked against the loss's keys, with its defaults filled in."""
    if name not in LOSSES:
        raise RequestError(f"unknown loss_fn {name!r}; this service has {', '.join(LOSSES)}")
    defaults = LOSSES[name][1]
    config = dict(config or {})
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise RequestError(f"loss_fn_config of {name!r}: unknown key(s) {', '.join(unknown)} (known: {', '.join(defaults) or 'none'})")
    settings = {}
    for key, default in defaults.items():
        value = config.get(key, default)
        if value is None:
            raise RequestError(f"loss_fn {name!r} needs loss_fn_config[{key!r}]")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        settings[key] = float(value)
    if "clip_low_threshold" in settings and not 0 <= settings["clip_low_threshold"] <= settings["clip_high_threshold"]:
        raise RequestError(f"loss_fn_config of {name!r}: need 0 <= clip_low_threshold <= clip_high_threshold, got {settings}")
    return settings


class TinkerLoss:
    """One of Tinker's losses (see the module docstring), summed; picklable (it travels to the workers)."""

    gather_ids = TARGETS

    def __init__(self, name: str, config: Mapping[str, Any] | None = None):
        self.name = name
        self.settings = loss_settings(name, config)

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        batch = micro_batch.batch
        mask = batch["response_mask"].to(torch.float32)
        logp = outputs["gathered_log_probs"][..., 0]
        per_token = self.elementwise(logp, batch) * mask
        loss = per_token.sum()
        return loss, {"loss:sum": float(loss.detach()), "num_tokens:sum": float(mask.sum())}

    def elementwise(self, logp: torch.Tensor, batch: Any) -> torch.Tensor:
        if self.name == "cross_entropy":
            return -logp * batch[WEIGHTS]
        advantages, sampled = batch[ADVANTAGES], batch[SAMPLED]
        if self.name == "dro":
            return -(logp * advantages - 0.5 * self.settings["beta"] * (logp - sampled) ** 2)
        ratio = torch.exp(logp - sampled)
        if self.name == "importance_sampling":
            return -ratio * advantages
        clipped = ratio.clamp(self.settings["clip_low_threshold"], self.settings["clip_high_threshold"])
        if self.name == "ppo":
            return -torch.minimum(ratio * advantages, clipped * advantages)
        return -clipped.detach() * logp * advantages  # cispo
