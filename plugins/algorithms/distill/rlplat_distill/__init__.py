"""rlplat-distill: on-policy distillation. Teachers as a role (:mod:`rlplat_distill.teacher`) scoring the
policy's samples, the ``distillation`` node (:mod:`rlplat_distill.config`), and the distillation losses of
the loss kit (:mod:`rlplat.losses.distillation`) registered as policy losses: ``reverse_kl``,
``reverse_kl_topk``, ``forward_kl_topk``, ``jsd_topk``."""
