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
