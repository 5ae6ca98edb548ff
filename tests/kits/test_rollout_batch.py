"""Prompt token lists from a padded batch, and the contract's batch from sampled token lists."""

from __future__ import annotations

import pytest
import torch

from rlplat.contracts.rollout import TokenOutput
from rlplat.kits.rollout_batch import assemble_rollout, finish_reason, prompt_token_lists, tied_weight_aliases, with_tied_aliases
from rlplat.testing import left_padded_prompts


def test_prompt_token_lists_drop_the_left_padding():
    prompts = left_padded_prompts([[1, 5, 6], [1, 4]], pad_token_id=0)
    assert prompt_token_lists(prompts, "test") == [[1, 5, 6], [1, 4]]


def test_missing_keys_and_empty_prompts_are_named():
    prompts = left_padded_prompts([[1, 5, 6], [1, 4]], pad_token_id=0)
    with pytest.raises(KeyError, match=r"test rollout: prompts lack \['position_ids'\]"):
        prompt_token_lists(prompts.select(batch_keys=["input_ids", "attention_mask"]), "test")
    prompts.batch["attention_mask"][1] = 0
    with pytest.raises(ValueError, match=r"prompt rows \[1\] have no token"):
        prompt_token_lists(prompts, "test")


def test_samples_become_right_padded_responses_with_masks_positions_and_log_probs():
    prompts = left_padded_prompts([[1, 5, 6], [1, 4]], pad_token_id=0, uids=["a", "b"])
    samples = [TokenOutput([7, 2], [-0.5, -0.25], "stop"), TokenOutput([8, 9, 9], [-1.0, -2.0, -3.0], "length"),
               TokenOutput([3], [-0.125], "stop"), TokenOutput([4, 4, 2], [-1.5, -0.5, -0.75], "stop")]
    out = assemble_rollout(prompts, samples, n=2, max_new_tokens=3, pad_token_id=0)
    assert out.batch["responses"].tolist() == [[7, 2, 0], [8, 9, 9], [3, 0, 0], [4, 4, 2]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    assert out.batch["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0], [-0.125, 0.0, 0.0], [-1.5, -0.5, -0.75]]
    assert out.batch["prompts"].tolist() == [[1, 5, 6], [1, 5, 6], [0, 1, 4], [0, 1, 4]]
    assert out.batch["position_ids"][2].tolist() == [0, 0, 1, 2, 3, 4]
    assert out.batch["attention_mask"][2].tolist() == [0, 1, 1, 1, 0, 0]
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], dim=1))
    assert out.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b"]


def test_a_wrong_number_of_samples_or_a_too_long_sample_is_an_error():
    prompts = left_padded_prompts([[1, 5]], pad_token_id=0)
    with pytest.raises(ValueError, match=r"expected 2 samples \(1 prompts x n=2\), got 1"):
        assemble_rollout(prompts, [TokenOutput([1], [-1.0], "stop")], n=2, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(ValueError, match="4 tokens and 4 log-probs"):
        assemble_rollout(prompts, [TokenOutput([1, 1, 1, 1], [-1.0] * 4, "length")], n=1, max_new_tokens=3, pad_token_id=0)


def test_finish_reasons():
    assert finish_reason([4, 2], [2], 8, "stop") == "stop"
    assert finish_reason([4, 2], [2], 8, None) == "stop"
    assert finish_reason([4, 5], [2], 2, None) == "length"
    with pytest.raises(RuntimeError, match="'abort'"):
        finish_reason([4], [2], 8, "abort")


def test_the_batcher_gathers_concurrent_requests_and_returns_each_its_own_result():
    import asyncio
    import threading

    from rlplat.kits.rollout_batch import RequestBatcher

    batches, release = [], threading.Event()

    def run_batch(items):
        release.wait(5)  # hold the first batch so the other requests queue up behind it
        batches.append(list(items))
        return [item * 10 for item in items]

    batcher = RequestBatcher(run_batch, "test-batcher")

    async def main():
        tasks = [asyncio.create_task(batcher.submit(number)) for number in range(5)]
        await asyncio.sleep(0.2)
        release.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == [0, 10, 20, 30, 40]
    assert sorted(item for batch in batches for item in batch) == [0, 1, 2, 3, 4]
    assert len(batches) <= 2  # the first request alone, then everything that queued meanwhile


def test_a_failing_batch_raises_in_every_caller():
    import asyncio

    from rlplat.kits.rollout_batch import RequestBatcher

    def run_batch(items):
        raise ValueError("engine died")

    batcher = RequestBatcher(run_batch, "test-batcher")

    async def main():
        return await asyncio.gather(*(batcher.submit(number) for number in range(3)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(result, ValueError) and str(result) == "engine died" for result in results)


def test_pad_and_eos_come_from_config_and_generation_config(tmp_path):
    import json

    from rlplat.kits.rollout_batch import pad_and_eos_token_ids
    from rlplat.testing.tiny_models import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", seed=0)
    assert pad_and_eos_token_ids(model_dir, None, None, "test") == (0, (2,))
    generation = tmp_path / "model" / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": [2, 17]}))
    assert pad_and_eos_token_ids(model_dir, None, None, "test") == (0, (2, 17))
    assert pad_and_eos_token_ids(model_dir, 5, (9,), "test") == (5, (9,))
    with pytest.raises(ValueError, match="test rollout: no pad_token_id and no EOS token known"):
        pad_and_eos_token_ids(None, None, None, "test")


def test_a_tied_output_layer_is_sent_under_both_names_once(tmp_path):
    from rlplat.testing.tiny_models import save_tiny_model

    aliases = tied_weight_aliases(save_tiny_model(tmp_path / "tied", seed=0))  # the demo's model ties its embeddings
    assert aliases == {"model.embed_tokens.weight": ("lm_head.weight",)}
    embedding, norm = torch.ones(2), torch.zeros(2)
    named = with_tied_aliases([("model.embed_tokens.weight", embedding), ("model.norm.weight", norm)], aliases)
    assert [name for name, _ in named] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert named[2][1] is embedding
    both = [("model.embed_tokens.weight", embedding), ("lm_head.weight", norm)]
    assert with_tied_aliases(both, aliases) == both  # already named: not twice
    assert with_tied_aliases([("model.norm.weight", norm)], aliases) == [("model.norm.weight", norm)]
    assert tied_weight_aliases(None) == {}


def test_an_untied_model_has_no_aliases(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, tie_word_embeddings=False).save_pretrained(tmp_path)
    assert tied_weight_aliases(str(tmp_path)) == {}
