"""What rlplat-judge registers: the ``judge`` reward manager, the ``judge`` role that serves the judge model,
and the judge parsers (``number``, ``tagged``, ``yes_no``). Only dotted paths: listing imports nothing heavy."""

from rlplat.hookspecs import hookimpl

RLPLAT_PLUGIN_API = ">=1.2,<2"

JUDGE_PARSERS = {
    "number": ("NumberParser", "NumberParserConfig", "the last (or first) number of the answer, optionally within [min, max]"),
    "tagged": ("TaggedParser", "TaggedParserConfig", "the number inside <score>...</score> (or a configured pattern's group)"),
    "yes_no": ("YesNoParser", "YesNoParserConfig", "a verdict word: yes -> 1, no -> 0 (words and scores configurable)"),
}


@hookimpl
def register_reward_managers(register):
    register("judge", "rlplat_judge.manager:JudgeRewardManager", config_schema="rlplat_judge.manager:JudgeConfig",
             description="asks a judge model (the judge role's rollout) with a prompt template and parses its score")


@hookimpl
def register_roles(register):
    register("judge", "rlplat_judge.manager:role", config_schema="rlplat.contracts.role:RoleConfig",
             metadata={"check": "rlplat_judge.manager:check_run"},
             description="the judge model's rollout (reward.manager=judge), colocated or in a pool of its own")


@hookimpl
def register_judge_parsers(register):
    for name, (parser, schema, description) in JUDGE_PARSERS.items():
        register(name, f"rlplat_judge.parsers:{parser}", config_schema=f"rlplat_judge.parsers:{schema}",
                 description=description)
