"""What rlplat-distill registers: the distillation losses (kind ``policy_loss``, built on core's loss kit), the
``distillation`` config node and the ``teacher`` role. Only dotted paths: listing imports nothing heavy."""

from rlplat.hookspecs import hookimpl

RLPLAT_PLUGIN_API = ">=1.2,<2"

_AGGREGATION = {"loss_agg_modes": ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                   "seq-mean-token-sum-norm"]}

LOSSES = {
    "reverse_kl": ("reverse_kl_loss", "SampledTermConfig",
                   "reverse KL to a teacher on the sampled tokens (k3 estimate; its policy gradient, PPO-clipped)"),
    "reverse_kl_topk": ("reverse_kl_topk_loss", "TopKTermConfig", "reverse KL to a teacher over its top-k tokens per position"),
    "forward_kl_topk": ("forward_kl_topk_loss", "TopKTermConfig", "forward KL from a teacher over its top-k tokens per position"),
    "jsd_topk": ("jsd_topk_loss", "TopKTermConfig", "generalised Jensen-Shannon divergence (beta) over a teacher's top-k tokens"),
}


@hookimpl
def register_policy_losses(register):
    for name, (function, schema, description) in LOSSES.items():
        register(name, f"rlplat_distill.losses:{function}", config_schema=f"rlplat_distill.terms:{schema}",
                 metadata=_AGGREGATION, description=description)


@hookimpl
def register_config_nodes(register):
    register("distillation", "rlplat_distill.config:check", config_schema="rlplat_distill.config:DistillationConfig",
             metadata={"nodes": "rlplat_distill.config:distillation_nodes"},
             description="on-policy distillation: the teachers, which rows each scores, and their top-k")


@hookimpl
def register_roles(register):
    register("teacher", "rlplat_distill.teacher:teacher_role", config_schema="rlplat.contracts.role:RoleConfig",
             metadata={"plan": "rlplat_distill.config:plan"},
             description="the distillation teachers scoring the policy's samples (distillation.teachers), colocated or "
                         "in a pool of their own")
