"""``FSDP2Engine.shared_weights``: one rank's full weights as views of the engine's own storage.

The two-rank case (None) is in test_packing_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlplat_engine_fsdp2.engine import FSDP2Engine


def built(config: dict, **overrides) -> FSDP2Engine:
    engine = FSDP2Engine(config, **overrides)
    engine.init_model()
    return engine


def policy_gradient(outputs, micro_batch):
    batch = micro_batch.batch
    return -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"], {}


def named_weights_of(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in engine.named_weights() for name, tensor in bucket}


@pytest.mark.parametrize("shard_one_rank", [False, True], ids=["plain module", "fully_shard"])
def test_shared_weights_are_the_storage_the_optimizer_updates(tiny_config, batch_of, shard_one_rank):
    engine = built(tiny_config, shard_one_rank=shard_one_rank)
    shared = engine.shared_weights()
    pointers = [tensor.data_ptr() for _, tensor in shared]
    before = {name: tensor.clone() for name, tensor in shared}
    assert [name for name, _ in shared] == list(named_weights_of(engine))
    for _ in range(2):
        engine.train_batch(batch_of(4), policy_gradient)
        engine.forward(batch_of(4))  # gathers copies of every parameter and frees them
        again = engine.shared_weights()
        assert [tensor.data_ptr() for _, tensor in again] == pointers
        expected = named_weights_of(engine)
        assert all(torch.equal(tensor, expected[name]) for name, tensor in shared)
    assert max(float((tensor - before[name]).abs().max()) for name, tensor in shared) > 1e-4


@pytest.mark.parametrize("shard_one_rank", [False, True], ids=["plain module", "fully_shard"])
def test_tied_embeddings_are_listed_once_and_the_output_layer_reads_that_storage(tiny_config, shard_one_rank):
    engine = built(tiny_config, shard_one_rank=shard_one_rank)
    shared = dict(engine.shared_weights())
    assert "model.embed_tokens.weight" in shared and "lm_head.weight" not in shared
    output_layer = engine.module.lm_head.weight
    local = output_layer.to_local() if isinstance(output_layer, DTensor) else output_layer
    assert local.data_ptr() == shared["model.embed_tokens.weight"].data_ptr()


def test_no_shared_weights_with_parameter_offload(tiny_config):
    assert built(tiny_config, param_offload=True).shared_weights() is None
