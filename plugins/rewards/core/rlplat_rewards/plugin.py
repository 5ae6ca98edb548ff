"""What rlplat-rewards registers. Only dotted paths: listing plugins imports no torch."""

import rlplat

# The plugin API versions this plugin is written for (rlplat.api_version); rlplat refuses to load it outside them.
RLPLAT_PLUGIN_API = ">=1.2,<2"

_CONFIG = "rlplat_rewards.config:RewardManagerConfig"

REWARD_SCORERS = {
    "gsm8k": ("gsm8k:score", "GSM8K, strict: the last '#### <number>' must equal the answer (commas, $ ignored)."),
    "gsm8k_flexible": ("gsm8k:score_flexible", "GSM8K, flexible: the last number in the response must equal the answer."),
    "math": ("hendrycks_math:score", "MATH: the last \\boxed{} answer, equivalent after the benchmark's normalisation."),
    "math_verify": ("math_verify_scorer:score", "Math answers in LaTeX or plain text, extracted and compared by math-verify (sympy): 0.5 = 1/2, sets, intervals."),
}
# Scorers known to return promptly on any input (metadata "safe": True), so reward.config.isolation=auto scores
# them in-process: string operations and linear regular expressions only. Not math_verify: its parsing and
# sympy can spend minutes inside one C call (a regular expression, a big-integer operation) that its own
# watchdog, raising between bytecodes, cannot interrupt; a scorer process costs little next to its ~10 ms a call.
SAFE = {"gsm8k", "gsm8k_flexible", "math"}
# The data sources each scorer claims when no reward.scorer is named (verl's default_compute_score's).
DATA_SOURCES = {
    "gsm8k": ["openai/gsm8k"],
    "math": ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"],
}

REWARD_MANAGERS = {
    "naive": ("managers:NaiveRewardManager", "One scorer call per sample, with a per-sample timeout."),
    "batch": ("managers:BatchRewardManager", "One vectorised scorer call per batch (lists in, list out)."),
    "dapo": ("managers:DAPORewardManager", "Per sample, plus DAPO's overlong penalty min(-(len - expected) / buffer * factor, 0)."),
}


@rlplat.hookimpl
def register_reward_scorers(register):
    for name, (target, description) in REWARD_SCORERS.items():
        register(name, f"rlplat_rewards.{target}", description=description,
                 metadata={"data_sources": DATA_SOURCES.get(name, []), "safe": name in SAFE})


@rlplat.hookimpl
def register_reward_managers(register):
    for name, (target, description) in REWARD_MANAGERS.items():
        register(name, f"rlplat_rewards.{target}", description=description, config_schema=_CONFIG)
    register("async", "rlplat_rewards.reward_loop:AsyncRewardManager", config_schema="rlplat_rewards.reward_loop:RewardLoopConfig",
             description="per-sample scoring with a concurrency bound, a timeout, retries and a default score; overlaps with agent loops")
