"""Conformance suite for reward managers (kind ``reward_manager``), and helpers to build its inputs.

A plugin's test provides the manager and a batch it can score; :func:`word_tokenizer` and
:func:`reward_batch` build both from plain words, locally (no hub)::

    class TestMyManager(RewardManagerConformance):
        @pytest.fixture
        def tokenizer(self):
            return word_tokenizer(["the", "answer", "is", "4", "5"])

        @pytest.fixture
        def reward_manager(self, tokenizer):
            return MyManager(my_scorer, tokenizer, {})

        @pytest.fixture
        def reward_batch(self, tokenizer):
            return reward_batch(tokenizer, ["the answer is 4", "5"], ground_truths=["4", "4"])
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from rlplat.contracts.reward import RewardManager

SPECIAL_TOKENS = ("<pad>", "<unk>", "<eos>")


def word_tokenizer(words: Sequence[str]) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` over ``words`` (whitespace split) plus ``<pad>`` (0),
    ``<unk>`` (1) and ``<eos>`` (2), built in memory."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(dict.fromkeys([*SPECIAL_TOKENS, *words]))}
    backend = Tokenizer(WordLevel(vocab=vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def reward_batch(
    tokenizer: Any,
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    data_source: str = "test",
    width: int | None = None,
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    end_with_eos: bool = True,
) -> Any:
    """A DataProto as a rollout and the data loader leave it for the reward step: ``responses`` right
    padded to ``width`` (default: the longest, plus its EOS), ``response_mask`` 1 up to and including
    the EOS, non-tensor ``data_source``, ``reward_model`` (``{"ground_truth": ...}``) and ``extra_info``."""
    from rlplat.protocol import DataProto

    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in responses]
    if end_with_eos:
        encoded = [ids + [tokenizer.eos_token_id] for ids in encoded]
    width = width or max(1, max(len(ids) for ids in encoded))
    tokens = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for row, ids in enumerate(encoded):
        ids = ids[:width]
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[row, : len(ids)] = 1
    return DataProto.from_dict(
        tensors={"responses": tokens, "response_mask": mask},
        non_tensors={
            "data_source": [data_source] * len(encoded),
            "reward_model": [{"ground_truth": truth} for truth in ground_truths],
            "extra_info": list(extra_infos) if extra_infos is not None else [None] * len(encoded),
        },
    )


def last_valid_token(response_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last position where the mask is 1 (-1 for an empty row)."""
    positions = torch.arange(response_mask.shape[1]).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values


def snapshot(batch: Any) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]], dict[str, Any]]:
    tensors = {key: batch.batch[key].clone() for key in batch.batch.keys()}
    return tensors, {k: copy.deepcopy(list(v)) for k, v in batch.non_tensor_batch.items()}, copy.deepcopy(batch.meta_info)


class RewardManagerConformance:
    """Fixtures to provide: ``reward_manager`` (a built manager) and ``reward_batch`` (a DataProto with
    at least two rows it can score). Optional: ``expected_scores`` (one float per row of
    ``reward_batch``, the sum of each row's ``token_level_scores``; None skips that check)."""

    @pytest.fixture
    def expected_scores(self) -> Sequence[float] | None:
        return None

    def test_is_a_reward_manager(self, reward_manager):
        assert isinstance(reward_manager, RewardManager)

    def test_returns_float32_token_level_scores_of_the_response_shape(self, reward_manager, reward_batch):
        scores = reward_manager(reward_batch).batch["token_level_scores"]
        assert isinstance(scores, torch.Tensor)
        assert scores.dtype == torch.float32
        assert scores.shape == reward_batch.batch["responses"].shape
        assert torch.isfinite(scores).all()

    def test_scores_sit_on_the_last_valid_response_token_only(self, reward_manager, reward_batch):
        scores = reward_manager(reward_batch).batch["token_level_scores"]
        last = last_valid_token(reward_batch.batch["response_mask"])
        elsewhere = torch.ones_like(scores, dtype=torch.bool)
        rows = torch.nonzero(last >= 0).flatten()
        elsewhere[rows, last[rows]] = False
        assert (scores[elsewhere] == 0).all(), "a score was written off the last valid response token"

    def test_scores_match_the_expected_ones(self, reward_manager, reward_batch, expected_scores):
        if expected_scores is None:
            pytest.skip("the subclass gives no expected_scores")
        totals = reward_manager(reward_batch).batch["token_level_scores"].sum(dim=-1)
        assert totals.tolist() == pytest.approx(list(expected_scores))

    def test_extra_fields_are_columns_of_the_batch_length(self, reward_manager, reward_batch):
        output = reward_manager(reward_batch)
        for key, column in output.non_tensor_batch.items():
            assert isinstance(column, np.ndarray), key
            assert len(column) == len(reward_batch), key

    def test_reward_metrics_are_floats(self, reward_manager, reward_batch):
        metrics = reward_manager(reward_batch).meta_info.get("reward_metrics")
        assert isinstance(metrics, Mapping), "meta_info['reward_metrics'] must be a dict of floats"
        assert "reward/errors" in metrics
        for key, value in metrics.items():
            assert isinstance(key, str)
            assert isinstance(value, (int, float)) and not isinstance(value, bool), f"metric {key!r} is {value!r}"

    def test_does_not_modify_its_input(self, reward_manager, reward_batch):
        tensors, non_tensors, meta_info = snapshot(reward_batch)
        reward_manager(reward_batch)
        assert set(reward_batch.batch.keys()) == set(tensors)
        for key, value in tensors.items():
            assert torch.equal(reward_batch.batch[key], value), key
        assert {k: list(v) for k, v in reward_batch.non_tensor_batch.items()} == non_tensors
        assert reward_batch.meta_info == meta_info

    def test_is_deterministic(self, reward_manager, reward_batch):
        first = reward_manager(reward_batch).batch["token_level_scores"]
        second = reward_manager(reward_batch).batch["token_level_scores"]
        assert torch.equal(first, second)

    def test_permuting_rows_permutes_the_scores(self, reward_manager, reward_batch):
        order = np.arange(len(reward_batch))[::-1].copy()
        scores = reward_manager(reward_batch).batch["token_level_scores"]
        permuted = reward_manager(reward_batch.select_idxs(order)).batch["token_level_scores"]
        assert torch.equal(permuted, scores[torch.from_numpy(order)])
