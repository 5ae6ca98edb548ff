"""What the fsdp2 engine does for distillation losses (its ``features``): ``forward(top_k=k)`` returns the
k largest log-probs per response position and their ids; a loss function's ``gather_ids`` gets the
log-probs at given ids with gradients; ``count_masks`` gets each mask's global counts. Padded and packed
agree. Reference: the log-softmax of a direct ``transformers`` forward (float32; tolerance 1e-5 as for the
engine's log-probs in test_packing)."""

from __future__ import annotations

import pytest
import torch

from rlplat import DataProto
from rlplat_engine_fsdp2.engine import FSDP2Engine

K = 5
TINY_GQA_QWEN2 = dict(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128,
)


def spread_batch(rows: int, seed: int, max_prompt: int = 20, max_response: int = 20) -> DataProto:
    """Rows in verl's layout (left-padded prompt, right-padded response) of random lengths; row 1 has an
    empty response."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, max_prompt + 1, (rows,), generator=generator)
    response_lengths = torch.randint(1, max_response + 1, (rows,), generator=generator)
    response_lengths[1] = 0
    columns = torch.arange(max_prompt + max_response)
    prompt_valid = columns[None, :max_prompt] >= max_prompt - prompt_lengths[:, None]
    response_valid = columns[None, :max_response] < response_lengths[:, None]
    attention_mask = torch.cat([prompt_valid, response_valid], dim=1).long()
    input_ids = torch.randint(1, 64, attention_mask.shape, generator=generator) * attention_mask
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, max_prompt:], "response_mask": response_valid.float(),
    })


def built(*, packed: bool, **overrides) -> FSDP2Engine:
    config = dict(model_config=dict(TINY_GQA_QWEN2), seed=3, lr=1e-3, dtype="float32", micro_batch_size_per_gpu=7)
    engine = FSDP2Engine(config, use_remove_padding=packed, **overrides)
    engine.init_model()
    return engine


@pytest.fixture(scope="module")
def batch():
    return spread_batch(rows=12, seed=4)


def direct_log_softmax(engine: FSDP2Engine, batch, temperature: float) -> torch.Tensor:
    """[B, R, V] log-probs of each response position from one plain forward of the engine's module."""
    tensors = batch.batch
    with torch.no_grad():
        logits = engine.module(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                               position_ids=tensors["position_ids"]).logits
    width = tensors["responses"].shape[1]
    return (logits[:, -width - 1 : -1].float() / temperature).log_softmax(-1)


@pytest.mark.parametrize("packed", [False, True])
def test_forward_top_k_returns_the_largest_log_probs_and_their_ids(batch, packed):
    engine = built(packed=packed)
    out = engine.forward(batch, temperature=0.7, top_k=K).batch
    full = direct_log_softmax(engine, batch, 0.7)
    mask = batch.batch["response_mask"].bool()
    expected = full.topk(K, dim=-1)
    assert out["top_k_ids"].shape == (12, batch.batch["responses"].shape[1], K) and out["top_k_ids"].dtype == torch.long
    assert torch.allclose(out["top_k_log_probs"][mask], expected.values[mask], atol=1e-5)
    assert torch.allclose(out["top_k_log_probs"][mask], full.gather(-1, out["top_k_ids"])[mask], atol=1e-5)
    assert torch.allclose(out["log_probs"][mask], full.gather(-1, batch.batch["responses"].unsqueeze(-1))[..., 0][mask], atol=1e-5)


def test_forward_refuses_a_top_k_outside_the_vocabulary(batch):
    with pytest.raises(ValueError, match="between 1 and the vocabulary size"):
        built(packed=False).forward(batch, top_k=TINY_GQA_QWEN2["vocab_size"] + 1)


class GatherLoss:
    """Sums the gathered log-probs over a mask, normalised by that mask's global token count."""

    count_masks = ("half_mask",)
    gather_ids = "ids"

    def __init__(self):
        self.seen: list[dict] = []

    def __call__(self, outputs, micro_batch):
        mask = micro_batch.batch["half_mask"] * micro_batch.batch["response_mask"]
        counts = micro_batch.meta_info["global_counts"]["half_mask"]
        self.seen.append(dict(counts))
        loss = (outputs["gathered_log_probs"].sum(-1) * mask).sum() / counts["tokens"]
        return loss, {}


@pytest.mark.parametrize("packed", [False, True])
def test_a_loss_gets_log_probs_at_its_ids_with_gradients_and_its_masks_global_counts(batch, packed):
    rows, width = batch.batch["responses"].shape
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, TINY_GQA_QWEN2["vocab_size"], (rows, width, 3), generator=generator)
    half = torch.zeros(rows, width)
    half[: rows // 2] = 1
    data = batch.union(DataProto.from_dict({"ids": ids, "half_mask": half})).with_meta_info({"ppo_mini_batch_size": rows})
    reference = built(packed=False, grad_clip=None)
    full = direct_log_softmax(reference, data, 1.0)
    response_mask = data.batch["response_mask"]
    own = half * response_mask
    expected_loss = float((full.gather(-1, ids).sum(-1) * own).sum() / own.sum())
    engine = built(packed=packed, grad_clip=None)
    loss_fn = GatherLoss()
    metrics = engine.train_batch(data, loss_fn)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["grad_norm"] > 1e-3
    assert all(seen == {"tokens": float(own.sum()), "sequences": int((own.sum(-1) > 0).sum())} for seen in loss_fn.seen)


def test_the_engine_lists_what_it_does_for_distillation():
    assert {"count_masks", "gather_ids", "top_k"} <= FSDP2Engine.features
