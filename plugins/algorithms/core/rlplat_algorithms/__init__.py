"""rlplat-algorithms: advantage estimators, policy losses, KL, loss aggregation and algorithm specs.

Registered through the ``rlplat`` entry point (see :mod:`rlplat_algorithms.plugin`); the numerics
follow verl's ``core_algos`` and each module's docstring says where a definition has variants.
"""
