"""rlplat-engine-megatron: a :class:`rlplat.TrainingEngine` on megatron-core (tensor, pipeline and data
parallelism), Hugging Face checkpoints in and out through mbridge.

Registered as engine ``megatron`` through the ``rlplat`` entry point (:mod:`rlplat_engine_megatron.plugin`);
the engine lives in :mod:`rlplat_engine_megatron.engine` and is imported only when used.
"""
