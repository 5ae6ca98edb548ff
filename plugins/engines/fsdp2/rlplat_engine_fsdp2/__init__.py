"""rlplat-engine-fsdp2: a :class:`rlplat.TrainingEngine` on PyTorch FSDP2 (``fully_shard``).

Registered as engine ``fsdp2`` through the ``rlplat`` entry point (see :mod:`rlplat_engine_fsdp2.plugin`);
the engine itself lives in :mod:`rlplat_engine_fsdp2.engine` and is imported only when used.
"""
