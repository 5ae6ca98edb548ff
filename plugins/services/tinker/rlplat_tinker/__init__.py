"""rlplat-tinker: ``rlplat serve``, a training and sampling service that speaks the Tinker API over rlplat's engines
and rollouts (:mod:`rlplat_tinker.serve`)."""
