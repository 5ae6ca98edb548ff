"""The samples the reward managers and the reward loop score: a batch's rows, or one finished
trajectory, decoded into :class:`ScoringSample` objects, and the name a scorer goes by in errors, logs
and health events (:func:`scorer_name`)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from rlplat.kits.reward import last_tokens

if TYPE_CHECKING:
    from rlplat.protocol import DataProto


@dataclasses.dataclass
class ScoringSample:
    """One response, ready for a scorer."""

    data_source: str
    solution_str: str
    """The response decoded up to its last valid token, special tokens skipped."""
    ground_truth: Any
    extra_info: Optional[Mapping[str, Any]]
    last_token: int
    """Index of the last valid response token, -1 when there is none."""
    tokens_hash: int
    """``hash`` of the response's token ids up to ``last_token``: ties a precomputed score to its tokens."""

    @property
    def length(self) -> int:
        """Response tokens up to and including the last valid one (tool spans inside count)."""
        return self.last_token + 1


ROW_KEYS = ("data_source", "reward_model", "ground_truth", "extra_info")
"""The non-tensor columns a sample is made of."""


def ground_truth_of(row: Mapping[str, Any]) -> Any:
    """``row["reward_model"]["ground_truth"]``, or a plain ``ground_truth`` column."""
    reward_model = row.get("reward_model")
    if isinstance(reward_model, Mapping):
        return reward_model.get("ground_truth")
    return row.get("ground_truth")


def sample_of(row: Mapping[str, Any], text: str, token_ids: Sequence[int], last_token: int) -> ScoringSample:
    """The sample of a row (its non-tensor columns) whose response ``token_ids`` decoded to ``text``."""
    data_source = row.get("data_source")
    return ScoringSample("" if data_source is None else data_source, text, ground_truth_of(row), row.get("extra_info"),
                         last_token, hash(tuple(int(token) for token in token_ids[: last_token + 1])))


def decode_samples(batch: "DataProto", tokenizer: Any) -> list[ScoringSample]:
    """The rows of ``batch`` as samples: ``responses`` and ``response_mask`` [B, R] decoded up to each
    row's last valid token, special tokens skipped; the non-tensor ``data_source``, ``reward_model``
    (or ``ground_truth``) and ``extra_info``."""
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    if responses.shape != mask.shape:
        raise ValueError(f"responses {tuple(responses.shape)} and response_mask {tuple(mask.shape)} differ in shape")
    lasts = last_tokens(mask)
    token_lists = [responses[row, : last + 1].tolist() for row, last in enumerate(lasts)]
    texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True)
    columns = {key: batch.non_tensor_batch[key] for key in ROW_KEYS if key in batch.non_tensor_batch}
    return [sample_of({key: values[row] for key, values in columns.items()}, text, tokens, last)
            for row, (text, tokens, last) in enumerate(zip(texts, token_lists, lasts))]


def trajectory_sample(row: Mapping[str, Any], response_ids: Sequence[int], response_mask: Sequence[int],
                      tokenizer: Any) -> ScoringSample:
    """The sample of one finished trajectory, decoded as :func:`decode_samples` decodes its padded row."""
    last = max((position for position, keep in enumerate(response_mask) if keep), default=-1)
    ids = [int(token) for token in response_ids[: last + 1]]
    return sample_of(row, tokenizer.decode(ids, skip_special_tokens=True), ids, last)


def scorer_name(scorer: Any) -> str:
    """``module.function`` for a function, the ``repr`` of anything else (e.g. a CustomScorer)."""
    if inspect.isroutine(scorer):
        return f"{scorer.__module__}.{scorer.__qualname__}"
    return repr(scorer)
