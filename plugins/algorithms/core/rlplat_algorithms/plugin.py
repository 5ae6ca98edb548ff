"""What rlplat-algorithms registers. Only dotted paths: listing plugins imports no torch."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.1,<2"

_PACKAGE = "rlplat_algorithms"
_ALGORITHM_CONFIG = "rlplat.contracts.algorithm:AlgorithmConfig"
# The schema of ``actor.loss.policy_loss`` (the loss's own knobs), checked when a run's config loads.
_LOSS_MODE_CONFIG = f"{_PACKAGE}.config:LossModeConfig"
# Algorithms whose ``algorithm`` node has keys of its own.
_ALGORITHM_SCHEMAS = {"dapo": f"{_PACKAGE}.config:DAPOConfig"}

ADVANTAGE_ESTIMATORS = {
    "gae": "GAE from a critic's values, whitened over the batch; masked spans are skipped.",
    "grpo": "Group-normalised outcome score: (score - mean) / (unbiased std + 1e-6); a group of one gets its score.",
    "dr_grpo": "Group-centred outcome score, no std division (Dr. GRPO).",
    "rloo": "Leave-one-out group baseline (RLOO).",
    "reinforce_plus_plus": "Discounted return-to-go whitened over the batch (REINFORCE++).",
    "reinforce_plus_plus_baseline": "Group-centred score whitened over the batch (REINFORCE++ with baseline).",
    "remax": "Return-to-go minus the greedy response's score (ReMax); needs reward_baselines.",
    "opo": "Length-weighted group mean as baseline (OPO).",
    "grpo_passk": "Only the group's best response gets best - second best (Pass@k).",
    "gpg": "Group-centred score scaled by B / #non-zero scores (GPG).",
}

POLICY_LOSSES = {
    "vanilla": "PPO clipped surrogate with low/high clip ranges and dual clip.",
    "gspo": "Sequence-level importance ratio, clipped (GSPO).",
    "cispo": "Clipped, detached importance weight times log-prob (CISPO).",
    "clip_cov": "PPO clip plus detaching high-covariance tokens (Clip-Cov).",
    "kl_cov": "Surrogate plus |log ratio| on the highest-covariance tokens (KL-Cov).",
    "reinforce": "Plain policy gradient -A * log_prob, no ratio, no clipping.",
}

# name -> (module, needs_critic, needs_reference with its default config, description); a test checks
# these against the specs.
ALGORITHMS = {
    "ppo": ("specs", True, False, "PPO: GAE with a critic, clipped surrogate."),
    "grpo": ("specs", False, True, "GRPO: group-normalised advantages, k3 KL loss, no critic."),
    "dr_grpo": ("specs", False, False, "Dr. GRPO: no std division, constant-normaliser aggregation."),
    "rloo": ("specs", False, True, "RLOO: leave-one-out baseline, KL in the reward."),
    "reinforce_pp": ("specs", False, True, "REINFORCE++: whitened returns, k2 KL loss."),
    "remax": ("remax", False, True, "ReMax: greedy-rollout baseline (one extra greedy rollout per prompt)."),
    "dapo": ("dapo", False, False, "DAPO: clip-higher, token-mean, dynamic sampling, overlong shaping."),
    "gspo": ("specs", False, False, "GSPO: sequence-level ratio with GRPO advantages."),
}


@rlplat.hookimpl
def register_advantage_estimators(register):
    for name, description in ADVANTAGE_ESTIMATORS.items():
        register(name, f"{_PACKAGE}.estimators:{name}", description=description, config_schema=_ALGORITHM_CONFIG)


@rlplat.hookimpl
def register_policy_losses(register):
    for name, description in POLICY_LOSSES.items():
        register(name, f"{_PACKAGE}.policy_losses:{name}", description=description, config_schema=_LOSS_MODE_CONFIG)


@rlplat.hookimpl
def register_algorithms(register):
    for name, (module, needs_critic, needs_reference, description) in ALGORITHMS.items():
        register(
            name,
            f"{_PACKAGE}.{module}:{name}",
            description=description,
            config_schema=_ALGORITHM_SCHEMAS.get(name, _ALGORITHM_CONFIG),
            metadata={"needs_critic": needs_critic, "needs_reference": needs_reference},
        )
