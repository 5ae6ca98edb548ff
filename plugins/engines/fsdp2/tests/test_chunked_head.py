"""The chunked output layer: where a micro-batch's float32 logits would exceed KEEP_FLOAT32_BYTES, the engine
applies the model's output layer a chunk of tokens at a time inside its forward, so the logits never exist
whole; log-probs, entropy, gathered log-probs, top-k and the gradients equal the whole-logits path, padded and
packed, and the update's peak holds one chunk's logits."""

from __future__ import annotations

import pytest
import torch

from rlplat.protocol import DataProto
from rlplat_engine_fsdp2 import modeling
from rlplat_engine_fsdp2.engine import FSDP2Engine

MODEL = dict(model_type="qwen2", vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


def batch(rows: int = 4, prompt: int = 6, response: int = 24, vocab: int = 4096) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -5:] = 0
    ids = ids * mask
    return DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt:], "response_mask": mask[:, prompt:].float(),
        "advantages": torch.randn(rows, response, generator=generator),
        "gather": torch.randint(0, vocab, (rows, response, 3), generator=generator),
    })


class Loss:
    gather_ids = "gather"
    needs_entropy = True

    def __call__(self, outputs, micro_batch):
        data = micro_batch.batch
        mask = data["response_mask"]
        loss = -(data["advantages"] * outputs["log_probs"] * mask).sum() - 0.01 * (outputs["entropy"] * mask).sum()
        loss = loss + 0.1 * (outputs["gathered_log_probs"].sum(-1) * mask).sum()
        return loss / micro_batch.meta_info["global_token_count"], {}


def engine(remove_padding: bool, chunk: int) -> FSDP2Engine:
    built = FSDP2Engine({"model_config": MODEL, "seed": 3, "dtype": "float32", "lr": 1e-2, "micro_batch_size_per_gpu": 4,
                         "logprob_chunk_size": chunk, "use_remove_padding": remove_padding, "ppo_mini_batch_size": None})
    built.init_model()
    return built


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_the_chunked_head_equals_the_whole_logits(monkeypatch, remove_padding):
    data = batch()
    mask = data.batch["response_mask"].bool()
    results = {}
    original = modeling.ChunkedHead.__call__
    for name, keep in (("whole", 1 << 40), ("chunked", 0)):
        monkeypatch.setattr(modeling, "KEEP_FLOAT32_BYTES", keep)
        built = engine(remove_padding, chunk=20)
        calls = []
        monkeypatch.setattr(modeling.ChunkedHead, "__call__", lambda self, hidden: calls.append(1) or original(self, hidden))
        forward = built.forward(data, calculate_entropy=True, top_k=4).batch
        results[name] = (forward, built.train_batch(data, Loss()), calls)
    (whole, whole_step, whole_calls), (chunked, chunked_step, chunked_calls) = results["whole"], results["chunked"]
    assert not whole_calls and chunked_calls  # the chunked path ran only where asked
    for key in ("log_probs", "entropy"):
        assert float((whole[key] - chunked[key])[mask].abs().max()) <= 1e-6, key
    assert float((whole["top_k_log_probs"] - chunked["top_k_log_probs"])[mask].abs().max()) <= 1e-6
    assert torch.equal(whole["top_k_ids"][mask], chunked["top_k_ids"][mask])
    # the update through the engine (the loss reads log-probs, entropy and gathered log-probs): the same loss and
    # gradient norm (the gradients themselves: the next test)
    assert chunked_step["loss"] == pytest.approx(whole_step["loss"], rel=1e-6, abs=1e-7)
    assert chunked_step["grad_norm"] == pytest.approx(whole_step["grad_norm"], rel=1e-6)


def test_gradients_of_the_chunked_head_equal_the_whole_logits(monkeypatch):
    """The gradients themselves (not an optimizer step): of log-probs, entropy and gathered log-probs."""
    data = batch()
    grads = {}
    for name, keep in (("whole", 1 << 40), ("chunked", 0)):
        monkeypatch.setattr(modeling, "KEEP_FLOAT32_BYTES", keep)
        built = engine(False, chunk=20)
        model = built.module
        inputs = {key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")}
        outputs = modeling.run_model(model, inputs, value_model=False, temperature=0.7, chunk_tokens=20, calculate_entropy=True,
                                     gather_ids=data.batch["gather"])
        mask = data.batch["response_mask"]
        total = (outputs["log_probs"] * mask).sum() + (outputs["entropy"] * mask).sum() + outputs["gathered_log_probs"].sum()
        total.backward()
        grads[name] = {key: parameter.grad.clone() for key, parameter in model.named_parameters()}
    for key, gradient in grads["whole"].items():
        # the output layer's weight gradient is a float32 sum over the tokens, split at other places: a few ulps
        # of its largest entry (seen: 4.8e-6 on entries up to 11.6, 4e-7 relative)
        difference = float((grads["chunked"][key] - gradient).abs().max())
        assert difference <= 1e-6 * max(1.0, float(gradient.abs().max())), (key, difference)
    assert grads["whole"]["model.embed_tokens.weight"].abs().sum() > 0


def test_entropy_not_asked_for_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(modeling, "KEEP_FLOAT32_BYTES", 0)
    built = engine(False, chunk=20)
    data = batch()
    inputs = {key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")}
    outputs = modeling.run_model(built.module, inputs, value_model=False, temperature=1.0, chunk_tokens=20, calculate_entropy=False)
    with pytest.raises(KeyError, match="needs_entropy"):
        outputs["entropy"]


def peak_of_an_update(vocabulary: int, chunk: int, vocabulary_chunk: int | None) -> int:
    """Peak live tensor bytes of one forward and backward of log-probs and entropy, 8 rows x 256 response tokens."""
    from rlplat.testing.memory import TensorMemoryMeter

    data = batch(rows=8, prompt=4, response=256, vocab=vocabulary)
    inputs = {key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")}
    with TensorMemoryMeter() as meter:
        with meter.phase("update"):
            built = FSDP2Engine({"model_config": {**MODEL, "vocab_size": vocabulary}, "seed": 3, "dtype": "float32"})
            built.init_model()
            outputs = modeling.run_model(built.module, inputs, value_model=False, temperature=1.0, chunk_tokens=chunk,
                                         calculate_entropy=True, vocabulary_chunk=vocabulary_chunk)
            (outputs["log_probs"].sum() + outputs["entropy"].sum()).backward()
            del outputs
    return meter.peaks()["update"]


def test_the_updates_peak_holds_a_chunks_logits_not_the_whole():
    """What the logits add to the peak, measured as the growth of the peak from a vocabulary of 4096 to one of
    8192 (the rest of the model barely changes): the whole logits' float32 copies (2048 tokens) without
    chunking; with 256-token chunks at most 2 x chunk x added vocabulary x 4 B (the chunk's logits and their
    gradient, formed in place); taking the vocabulary 4096 rows at a time, at most chunk x vocabulary x 4 B
    (the issue's bound); plus the embedding's own growth (weight, gradient and the gradient being formed:
    4096 x 32 x 4 B each)."""
    parameters = 4 * 4096 * 32 * 4
    growth = {name: peak_of_an_update(8192, chunk, vocabulary_chunk) - peak_of_an_update(4096, chunk, vocabulary_chunk)
              for name, chunk, vocabulary_chunk in (("whole", 1 << 20, None), ("chunked", 256, None), ("both", 256, 4096))}
    assert growth["whole"] >= 2048 * 4096 * 4, growth
    assert growth["chunked"] <= 2 * 256 * 4096 * 4 + parameters, growth
    assert growth["both"] <= parameters, growth  # the per-chunk buffers are 256 x 4096 at both vocabularies
    assert peak_of_an_update(8192, 256, 4096) <= peak_of_an_update(8192, 1 << 20, None) / 4
