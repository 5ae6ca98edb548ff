"""What rlplat-reward-model registers: the ``reward.model`` config node and the ``reward_model`` role."""

from rlplat.hookspecs import hookimpl

RLPLAT_PLUGIN_API = ">=1.2,<2"


@hookimpl
def register_config_nodes(register):
    register("reward.model", "rlplat_reward_model.config:check", config_schema="rlplat_reward_model.config:RewardModelConfig",
             metadata={"nodes": "rlplat_reward_model.config:reward_model_nodes"},
             description="a reward model scoring each response and how its score joins the rule score")


@hookimpl
def register_roles(register):
    register("reward_model", "rlplat_reward_model.worker:reward_model", config_schema="rlplat.contracts.role:RoleConfig",
             metadata={"plan": "rlplat_reward_model.config:plan"},
             description="the reward model scoring each response (reward.model.path), colocated or in a pool of its own")
