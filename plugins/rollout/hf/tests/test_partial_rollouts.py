"""Generations in flight carried over new weights at a token boundary (the hf rollout's token batcher):
``recompute`` continues exactly as a fresh generation with the new weights from the same prefix, ``keep``
records the version of every token."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat.testing.tiny_models import save_tiny_model
from rlplat_rollout_hf.batching import RunningBatch, TokenRequest
from rlplat_rollout_hf.sampling import choose_per_row

PROMPT = [3, 5, 7, 9, 11]
NEW_TOKENS, SWITCH_AT = 12, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("partial") / "model", seed=0)


def engine_for(model_dir):
    from rlplat_rollout_hf.rollout import HFRollout

    return HFRollout({"model_path": model_dir, "dtype": "float32"})


def next_weights(engine, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, tensor.detach() + 0.05 * torch.randn(tensor.shape, generator=generator))
            for name, tensor in engine.model.state_dict().items()]


def sampling(seed: int = 4) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_new_tokens=NEW_TOKENS)


def request() -> TokenRequest:
    return TokenRequest(list(PROMPT), sampling(), frozenset())


@torch.no_grad()
def reference(model, tokens: list[int], start: int, count: int, key: int) -> list[int]:
    """``count`` tokens after ``tokens`` from full forward passes without a cache, token ``start + i`` of
    stream ``key``: a fresh generation from that prefix, drawing where the interrupted one left off."""
    tokens = list(tokens)
    out = []
    for index in range(start, start + count):
        logits = model(input_ids=torch.tensor([tokens])).logits[:, -1, :]
        token, _ = choose_per_row(logits, sampling(), [key], [index], torch.Generator())
        tokens.append(int(token[0]))
        out.append(int(token[0]))
    return out


def run_switching(engine, mode: str) -> TokenRequest:
    row = request()
    batch = RunningBatch(engine.model, engine.device, engine.pad_token_id, row.key, version=0)
    batch.admit([row])
    for _ in range(SWITCH_AT):
        batch.step(engine.generator)
    engine.update_weights(next_weights(engine))
    batch.continue_with(1, mode)
    while batch.rows:
        batch.step(engine.generator)
    return row


def test_recompute_continues_as_a_fresh_generation_with_the_new_weights(model_dir):
    engine = engine_for(model_dir)
    before = reference(engine.model, PROMPT, 0, SWITCH_AT, request().stream_key)
    row = run_switching(engine, "recompute")
    assert len(row.token_ids) == NEW_TOKENS and row.token_ids[:SWITCH_AT] == before
    after = reference(engine.model, PROMPT + row.token_ids[:SWITCH_AT], SWITCH_AT, NEW_TOKENS - SWITCH_AT, row.stream_key)
    assert row.token_ids[SWITCH_AT:] == after
    assert row.versions == [0] * SWITCH_AT + [1] * (NEW_TOKENS - SWITCH_AT)


def test_keep_records_the_version_of_every_token(model_dir):
    engine = engine_for(model_dir)
    row = run_switching(engine, "keep")
    assert row.versions == [0] * SWITCH_AT + [1] * (NEW_TOKENS - SWITCH_AT)
    assert row.output().versions == row.versions
    assert len(row.token_ids) == NEW_TOKENS


def test_a_paused_generation_takes_new_weights_and_goes_on(model_dir):
    engine = engine_for(model_dir)
    params = SamplingParams(temperature=1.0, seed=9, max_new_tokens=200)
    result = {}

    def generate():
        result["output"] = asyncio.run(engine.generate_tokens(PROMPT, params))

    thread = threading.Thread(target=generate)
    thread.start()
    engine.pause_generation()
    engine.update_weights(next_weights(engine))
    engine.set_weights_version(1, "recompute")
    engine.resume_generation()
    thread.join(timeout=60)
    versions = result["output"].versions
    assert len(versions) == len(result["output"].token_ids) and versions == sorted(versions)
    assert set(versions) <= {0, 1} and versions[-1] == 1
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.set_weights_version(2, "discard")


def abort_after(engine, steps: int) -> None:
    """Make the engine's token batcher abort everything after ``steps`` decoding steps (from its own thread, so
    the point is exact)."""
    serve_step, done = engine.batcher.serve_step, [0]

    def counted(batch, admitted):
        done[0] += 1
        if done[0] == steps:
            engine.abort_generation()
        return serve_step(batch, admitted)

    engine.batcher.serve_step = counted


def test_abort_ends_every_request_with_its_tokens_so_far_and_later_requests_are_served(model_dir):
    engine = engine_for(model_dir)
    engine.eos_token_ids = ()  # nothing ends early: only the abort does
    abort_after(engine, 20)

    async def requests() -> list:
        return await asyncio.gather(*(engine.generate_tokens(PROMPT[:length], SamplingParams(seed=length, max_new_tokens=200))
                                      for length in (3, 4, 5)))

    outputs = asyncio.run(requests())
    assert [output.finish_reason for output in outputs] == ["abort"] * 3
    assert [len(output.token_ids) for output in outputs] == [20] * 3
    assert all(len(output.log_probs) == len(output.versions) == 20 for output in outputs)
    after = asyncio.run(engine.generate_tokens(PROMPT, SamplingParams(seed=1, max_new_tokens=4)))
    assert after.finish_reason == "length" and len(after.token_ids) == 4


def test_a_batch_cut_short_is_continued_to_its_full_length_with_the_versions_of_both_parts(model_dir):
    from rlplat.kits.rollout_batch import ABORTED_KEY, generate_through_tokens
    from rlplat.protocol import DataProto

    engine = engine_for(model_dir)
    engine.eos_token_ids = ()
    prompts = DataProto.from_dict(tensors={
        "input_ids": torch.tensor([[0, 0, 3, 5, 7], [9, 11, 3, 5, 7]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
        "position_ids": torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])})
    params = SamplingParams(n=2, seed=8, max_new_tokens=150)
    engine.set_weights_version(3, "recompute")
    abort_after(engine, 30)
    first = generate_through_tokens(engine, prompts, params, 0, 3)
    assert first.batch[ABORTED_KEY].tolist() == [1] * 4
    assert first.batch["response_mask"].sum(-1).tolist() == [30] * 4  # every sample cut short, with what it had
    engine.update_weights(next_weights(engine))
    engine.set_weights_version(4, "recompute")
    done = generate_through_tokens(engine, first.with_meta_info({"continue": True}), params, 0, 4)
    assert not done.batch[ABORTED_KEY].any()
    assert done.batch["response_mask"].sum(-1).tolist() == [150] * 4
    for row in range(4):
        assert torch.equal(done.batch["responses"][row, :30], first.batch["responses"][row, :30])  # kept as it was
        assert done.batch["policy_version"][row].tolist() == [3] * 30 + [4] * 120
    assert torch.equal(done.batch["prompts"], first.batch["prompts"])
    assert torch.equal(done.batch["input_ids"][:, 5:], done.batch["responses"])
