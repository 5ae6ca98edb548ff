"""Reward managers (kind ``reward_manager``): decode a batch, score it, write ``token_level_scores``.

Each is built by its registered factory from ``(scorer, tokenizer, config)`` (``config`` the
``reward.config`` node, see :class:`~rlplat_rewards.config.RewardManagerConfig`) and called with a DataProto. It reads
``responses`` and ``response_mask`` [B, R] and the non-tensor ``data_source``, ``reward_model`` (a dict
with ``ground_truth``; a plain ``ground_truth`` column also works) and ``extra_info``; the response is
decoded up to its last valid token with special tokens skipped. It returns a *new* DataProto holding
only what it computed (the caller unions it into the batch):

* ``token_level_scores`` [B, R] float32: the score at the last token where ``response_mask`` is 1, 0
  elsewhere (a row without valid tokens gets no score);
* one non-tensor column per extra field the scorer returned (``acc``, ``pred``, ...; ``None`` on rows
  that did not return it);
* ``meta_info["reward_metrics"]``: ``reward/errors``, ``reward/timeouts``, ``reward/killed`` (scorer
  processes killed at ``timeout_s``) and ``reward/<field>/mean`` of every numeric or boolean extra field;
* ``meta_info["health_events"]``, only when the call killed a scorer process: one
  :class:`~rlplat.contracts.health.HealthEvent` dict (check ``scorer``) naming the rows
  (:func:`~rlplat_rewards.isolation.killed_event`). The manager does not raise for it: the driver's
  sentinel decides.

A scorer that raises (or returns something that is not a score, or overruns ``timeout_s``) on a
sample gives that sample ``fallback_score`` and no extra fields, is counted in ``reward/errors`` (and
``reward/timeouts``), and the first such traceback of the call is logged; with ``raise_on_error`` the
call raises instead, naming the row. Where the scorer runs is ``reward.config.isolation``
(:mod:`rlplat_rewards.isolation`): in scorer processes, a sample over ``timeout_s`` has its process
killed; in this process, a sync scorer that times out keeps running in a daemon thread (Python cannot
stop it, and one stuck in C code holding the GIL stops the whole process) and async scorers are
cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import traceback
from typing import Any, Callable

import numpy as np
import torch

from rlplat.contracts.health import HEALTH_EVENTS
from rlplat.contracts.reward import RewardManager, split_score
from rlplat.config_node import read_config_node
from rlplat_rewards.config import RewardManagerConfig
from rlplat_rewards.isolation import killed_event, scorer_pool
from rlplat_rewards.samples import ScoringSample, decode_samples, scorer_name


logger = logging.getLogger("rlplat_rewards")


def resolve(result: Any) -> Any:
    """Await ``result`` if it is awaitable (in a fresh event loop, on a helper thread if one is running)."""
    if not inspect.isawaitable(result):
        return result

    async def wait():
        return await result

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    return call_with_timeout(lambda: asyncio.run(wait()), None, force_thread=True)


def call_with_timeout(function: Callable[[], Any], timeout: float | None, force_thread: bool = False) -> Any:
    """``resolve(function())``, raising ``TimeoutError`` after ``timeout`` seconds (None: no limit)."""
    if timeout is None and not force_thread:
        return resolve(function())
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = resolve(function())
        except BaseException as error:  # handed to the caller's thread below
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True, name="rlplat-reward-scorer")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the scorer took longer than reward.timeout_s={timeout}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class FailureTracker:
    """Counts failed samples for one call, logs the first traceback, or raises when configured to."""

    def __init__(self, settings: RewardManagerConfig, scorer_name: str):
        self.settings = settings
        self.scorer_name = scorer_name
        self.errors = 0
        self.timeouts = 0
        self.killed = 0
        """Scorer processes killed at ``timeout_s``."""
        self.killed_rows: list[int] = []
        """The rows whose sample was being scored by a killed process (every row, for a batch call)."""

    def failed(self, rows: str, data_source: str, error: Exception, indices: list[int]) -> float:
        """Record a failure on ``rows`` (a description; ``indices`` the rows) and return the fallback score."""
        where = f"reward scorer {self.scorer_name} failed on {rows} (data_source {data_source!r})"
        if self.settings.raise_on_error:
            raise RuntimeError(f"{where}: {type(error).__name__}: {error}") from error
        self.errors += 1
        self.timeouts += isinstance(error, TimeoutError)
        if getattr(error, "killed", False):
            self.killed += 1
            self.killed_rows.extend(indices)
        if self.errors == 1:
            details = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            logger.error(
                "%s; it gets reward.fallback_score=%s and is counted in reward/errors (set "
                "reward.raise_on_error=true to stop instead). First traceback of this batch:\n%s",
                where, self.settings.fallback_score, details,
            )
        return float(self.settings.fallback_score)


def build_output(samples: list[ScoringSample], scores: list[float], extras: list[dict[str, Any]], width: int,
                 tracker: FailureTracker) -> Any:
    """The DataProto the module docstring describes."""
    from rlplat.protocol import DataProto

    token_level_scores = torch.zeros(len(samples), width, dtype=torch.float32)
    for row, (sample, score) in enumerate(zip(samples, scores)):
        if sample.last_token >= 0:
            token_level_scores[row, sample.last_token] = score
    keys = list(dict.fromkeys(key for fields in extras for key in fields))
    columns = {key: [fields.get(key) for fields in extras] for key in keys}
    metrics = {"reward/errors": float(tracker.errors), "reward/timeouts": float(tracker.timeouts),
               "reward/killed": float(tracker.killed)}
    for key, values in columns.items():
        present = [value for value in values if value is not None]
        if present and all(isinstance(value, (bool, int, float, np.number)) for value in present):
            metrics[f"reward/{key}/mean"] = float(np.mean(np.asarray(present, dtype=np.float64)))
    meta_info: dict[str, Any] = {"reward_metrics": metrics}
    if tracker.killed:
        meta_info[HEALTH_EVENTS] = [killed_event(tracker.scorer_name, tracker.settings.timeout_s, tracker.killed_rows,
                                                 tracker.killed)]
    return DataProto.from_dict(tensors={"token_level_scores": token_level_scores}, non_tensors=columns, meta_info=meta_info)


class ScoringRewardManager(RewardManager):
    """What every manager here holds: the scorer, the tokenizer that decodes responses, the manager
    settings (the ``reward.config`` node, :class:`~rlplat_rewards.config.RewardManagerConfig`), and the
    :class:`~rlplat_rewards.isolation.ScorerPool` the scorer runs in (``pool``; None: in this process)."""

    def __init__(self, scorer: Callable[..., Any], tokenizer: Any, config: Any = None):
        if not callable(scorer):
            raise TypeError(
                f"{type(self).__name__} needs a scorer (a callable), got {scorer!r}; the trainer passes the one "
                "reward.scorer or reward.custom_function selects (rlplat.scorers.scorer_for)"
            )
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.settings = read_config_node(config, RewardManagerConfig, "reward.config")
        self.pool = scorer_pool(scorer, self.settings.isolation, self.settings.timeout_s, self.settings.processes,
                                scorer_name(scorer))

    def close(self) -> None:
        """Stop the scorer processes, if any (garbage collection and interpreter exit do it too)."""
        if self.pool is not None:
            self.pool.close()


def scorer_arguments(sample: ScoringSample) -> dict[str, Any]:
    return {"data_source": sample.data_source, "solution_str": sample.solution_str,
            "ground_truth": sample.ground_truth, "extra_info": sample.extra_info}


class NaiveRewardManager(ScoringRewardManager):
    """Scores one sample at a time with ``scorer(data_source, solution_str, ground_truth, extra_info)``,
    each within ``reward.timeout_s``."""

    def __call__(self, batch: Any) -> Any:
        samples = decode_samples(batch, self.tokenizer)
        tracker = FailureTracker(self.settings, scorer_name(self.scorer))
        scores, extras = [], []
        width = batch.batch["responses"].shape[1]
        for row, (sample, outcome) in enumerate(zip(samples, self.outcomes(samples))):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                score, fields = split_score(outcome, where=f"reward scorer {tracker.scorer_name}")
                score, fields = self.shape(sample, score, fields, width)
            except Exception as error:
                score, fields = tracker.failed(f"row {row}", sample.data_source, error, [row]), {}
            scores.append(score)
            extras.append(fields)
        return build_output(samples, scores, extras, width, tracker)

    def outcomes(self, samples: list[ScoringSample]) -> Any:
        """Each sample's raw result or the exception it failed with, in order: from the scorer processes in
        one go, or scored here one by one as they are asked for (``raise_on_error`` stops at the first)."""
        if self.pool is not None:
            yield from self.pool.score_all([scorer_arguments(sample) for sample in samples], self.settings.timeout_s)
            return
        for sample in samples:
            try:
                yield call_with_timeout(functools.partial(self.scorer, **scorer_arguments(sample)), self.settings.timeout_s)
            except Exception as error:
                yield error

    def shape(self, sample: ScoringSample, score: float, fields: dict[str, Any], width: int) -> tuple[float, dict[str, Any]]:
        """Adjust a successfully scored sample (the DAPO manager adds its length penalty here)."""
        return score, fields


class BatchRewardManager(ScoringRewardManager):
    """One vectorised call per batch: ``scorer(data_sources=[...], solution_strs=[...],
    ground_truths=[...], extra_infos=[...])`` returning one score (number or dict) per row, as verl's
    batch manager. If the call itself fails, every row falls back (and counts as an error)."""

    def __call__(self, batch: Any) -> Any:
        samples = decode_samples(batch, self.tokenizer)
        tracker = FailureTracker(self.settings, scorer_name(self.scorer))
        width = batch.batch["responses"].shape[1]
        arguments = {"data_sources": [s.data_source for s in samples], "solution_strs": [s.solution_str for s in samples],
                     "ground_truths": [s.ground_truth for s in samples], "extra_infos": [s.extra_info for s in samples]}
        isolated = self.pool.score_all([arguments], self.settings.timeout_s)[0] if self.pool is not None else None
        try:
            if self.pool is None:
                results = call_with_timeout(functools.partial(self.scorer, **arguments), self.settings.timeout_s)
            elif isinstance(isolated, Exception):
                raise isolated
            else:
                results = isolated
            results = list(results)
            if len(results) != len(samples):
                raise TypeError(f"the batch scorer returned {len(results)} results for {len(samples)} rows")
        except Exception as error:
            fallback = tracker.failed("the whole batch", "several", error, list(range(len(samples))))
            tracker.errors = len(samples)
            tracker.timeouts = len(samples) if isinstance(error, TimeoutError) else 0
            return build_output(samples, [fallback] * len(samples), [{} for _ in samples], width, tracker)
        scores, extras = [], []
        for row, (sample, result) in enumerate(zip(samples, results)):
            try:
                score, fields = split_score(result, where=f"reward scorer {tracker.scorer_name}")
            except TypeError as error:
                score, fields = tracker.failed(f"row {row}", sample.data_source, error, [row]), {}
            scores.append(score)
            extras.append(fields)
        return build_output(samples, scores, extras, width, tracker)


class DAPORewardManager(NaiveRewardManager):
    """The naive manager plus DAPO's overlong shaping (when ``reward.overlong_buffer.enable``):
    ``score += min(-(length - expected_len) / len * penalty_factor, 0)`` with
    ``expected_len = max_resp_len - len`` (``max_resp_len`` defaults to the response width R) and
    ``length`` the response's tokens up to its last valid one. With ``overlong_buffer.log`` the
    columns ``overlong_reward`` and ``overlong`` are added. A failed sample gets the plain fallback."""

    def shape(self, sample: ScoringSample, score: float, fields: dict[str, Any], width: int) -> tuple[float, dict[str, Any]]:
        buffer = self.settings.overlong_buffer
        if not buffer.enable:
            return score, fields
        max_length = self.settings.max_resp_len if self.settings.max_resp_len is not None else width
        expected_length = max_length - buffer.len
        overlong_reward = min(-(sample.length - expected_length) / buffer.len * buffer.penalty_factor, 0)
        if buffer.log:
            fields = {**fields, "overlong_reward": overlong_reward, "overlong": overlong_reward < 0}
        return score + overlong_reward, fields
