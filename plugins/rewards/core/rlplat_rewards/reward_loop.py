"""The asynchronous reward loop: per-sample scoring with a concurrency bound, a timeout, retries and a
default score; the ``async`` reward manager built on it; and the scores of trajectories scored while
the others still generated.

:class:`RewardLoop` scores :class:`ScoringSample` objects in an asyncio event loop, at most
``max_concurrency`` at once. Where an attempt runs is ``isolation`` (:mod:`rlplat_rewards.isolation`): in a
scorer process, which is killed (and replaced) when the attempt overruns ``timeout_s``; or in this
process, where a synchronous scorer runs each attempt on a daemon thread of its own, so the event loop
stays free and a scorer that never returns blocks neither the run nor the interpreter's exit (at its
timeout it is abandoned, still holding its thread: Python cannot stop a thread, and one stuck in C code
holding the GIL stops the whole process), and an ``async def`` scorer is awaited in the loop and
cancelled at its timeout. An attempt fails when the
scorer raises, returns something that is not a score (:func:`~rlplat.contracts.reward.split_score`) or
overruns ``timeout_s``. A failed attempt is retried up to ``retries`` times, ``retry_backoff_s`` later
(doubled for each further retry; the sample gives up its slot while it waits); a sample whose every
attempt failed gets ``default_score`` and no extra fields, or, with ``raise_on_error``, stops the call
with an error naming its row. The first failure of a batch is logged with its traceback.

It is used two ways:

* :class:`AsyncRewardManager` (``reward.manager=async``) scores a batch in the driver, like the other
  reward managers;
* with agent loops and ``reward.config.overlap`` (the default), each rollout worker scores every
  trajectory as soon as it finishes, while the others still generate
  (:class:`~rlplat.agent.manager.AgentLoopManager` with a ``reward_loop``). The worker's batch then
  carries each row's outcome in the columns of :data:`LOOP_COLUMNS`, and :func:`precomputed_scores`
  turns them, in the driver, into exactly what the manager returns for that batch.

What both return (the :class:`~rlplat.contracts.reward.RewardManager` contract): ``token_level_scores``
[B, R] float32 with the score at the last token where ``response_mask`` is 1 (a row without one gets no
score); one non-tensor column per extra field the scorer returned (None on rows that did not return
it); and ``meta_info["reward_metrics"]``:

* ``reward/errors``: failed attempts; ``reward/timeouts``: the failed attempts that overran ``timeout_s``;
  ``reward/killed``: the scorer processes killed for overrunning it;
* ``reward/retries``: attempts after a sample's first; ``reward/defaults``: samples given ``default_score``;
* ``reward/max_in_flight``: the most samples being scored at once (in one process);
* ``reward/<field>/mean`` of every numeric or boolean extra field;
* ``timing_s/reward_scoring``: wall-clock seconds from the first sample's scoring start to the last
  one's end (the longest of the workers' when scoring overlapped generation);
* ``timing_s/reward_after_generation``: the part of it after generation had finished, the scoring the
  step waits for (in the driver: all of it);
* ``reward/overlap_fraction``: the share of the samples' scoring time (summed over samples) spent while
  their worker was still generating (0 in the driver).

and, only when a scorer process was killed, ``meta_info["health_events"]``: one
:class:`~rlplat.contracts.health.HealthEvent` dict (check ``scorer``) naming the rows
(:func:`~rlplat_rewards.isolation.killed_event`; rows scored in the rollout workers carry their kills in
the ``reward_killed`` column). Neither raises: the driver's sentinel decides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import random
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from rlplat.config_node import read_config_node
from rlplat.contracts.health import HEALTH_EVENTS
from rlplat.contracts.reward import RewardManager, split_score
from rlplat.kits.reward import last_tokens
from rlplat_rewards.config import check_isolation
from rlplat_rewards.isolation import ScorerStartError, killed_event, scorer_pool
from rlplat_rewards.samples import ScoringSample, decode_samples, scorer_name, trajectory_sample

if TYPE_CHECKING:
    import numpy as np

    from rlplat.protocol import DataProto

logger = logging.getLogger("rlplat_rewards.reward_loop")


@dataclasses.dataclass
class RewardLoopConfig:
    """The ``reward.config`` node of the ``async`` reward manager."""

    max_concurrency: int = 8
    """Samples scored at once, in the driver or in each rollout worker (``overlap``)."""
    timeout_s: Optional[float] = None
    """Time limit of one attempt at scoring a sample, in seconds (None: no limit). With ``isolation`` at
    ``process`` the scorer process of an attempt that overruns it is killed (``reward/killed``, a health
    event); on a thread, a sync scorer that overruns it is abandoned on its daemon thread (Python cannot
    stop it); an async one is cancelled."""
    retries: int = 0
    """Attempts after the first when an attempt raised, returned something that is not a score, or
    overran ``timeout_s`` (each counted in ``reward/retries``)."""
    retry_backoff_s: float = 0.0
    """Seconds to wait before the first retry, doubled before each further one."""
    default_score: float = 0.0
    """Score of a sample whose every attempt failed (counted in ``reward/defaults``)."""
    raise_on_error: bool = False
    """Stop with an error naming the row when every attempt at a sample failed, instead of giving it
    ``default_score``."""
    overlap: bool = True
    """When generation goes through agent loops, score each trajectory in the rollout worker as soon as
    it finishes, while the others still generate (the driver then only reads the scores). False: the
    driver scores the whole batch once generation is over."""
    isolation: str = "auto"
    """Where the scorer runs: ``auto``, ``thread`` or ``process``. ``process``: in scorer processes of
    their own (``processes``, in the driver or in each rollout worker), one killed and replaced when an
    attempt overruns ``timeout_s``, so a scorer stuck in C code holding the GIL (a regular expression
    backtracking catastrophically) costs that attempt, not the run. ``thread``: in this process, a sync
    scorer on a daemon thread per attempt, which cannot stop a scorer looping in C. ``auto``: ``process``
    when ``timeout_s`` is set and the scorer is not known safe (a registered scorer whose registration
    says ``safe``: ``exact_match``, ``gsm8k``, ``gsm8k_flexible``, ``math``), else ``thread``; without
    ``timeout_s`` there is no deadline to kill at. A scorer that cannot be rebuilt in another process (a
    lambda, a closure) stays on a thread under ``auto``, with a warning, and is an error under
    ``process``."""
    processes: int = 1
    """Scorer processes when ``isolation`` gives them; at most this many attempts run at once, whatever
    ``max_concurrency``. One matches a thread-based loop on Python-level scorers, which the GIL keeps to
    one core."""

    def __post_init__(self) -> None:
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an integer >= 1, got {self.max_concurrency!r}")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a number of seconds > 0 or null (no limit), got {self.timeout_s!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {self.retries!r}")
        if not (isinstance(self.retry_backoff_s, (int, float)) and 0 <= self.retry_backoff_s < math.inf):
            raise ValueError(f"retry_backoff_s must be a number of seconds >= 0, got {self.retry_backoff_s!r}")
        if not (isinstance(self.default_score, (int, float)) and math.isfinite(self.default_score)):
            raise ValueError(f"default_score must be a finite number, got {self.default_score!r}")
        check_isolation(self.isolation, self.processes)


# -- scoring ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SampleOutcome:
    """How scoring one sample went. Times are ``time.perf_counter`` readings."""

    score: float
    fields: dict[str, Any]
    """The scorer's extra fields (empty when every attempt failed)."""
    status: str
    """``ok``, or how the last attempt failed: ``error`` or ``timeout``."""
    attempts: int
    errors: int
    """Failed attempts (timeouts included)."""
    timeouts: int
    killed: int
    """Attempts whose scorer process was killed at ``timeout_s``."""
    started: float
    """When the first attempt started."""
    finished: float
    in_flight: int
    """The most samples being scored at once, this one included, when one of its attempts started."""

    @property
    def seconds(self) -> float:
        return self.finished - self.started


def is_async_scorer(scorer: Any) -> bool:
    """Whether calling ``scorer`` only creates a coroutine (an ``async def`` function or ``__call__``, or
    a :class:`~rlplat.scorers.CustomScorer` around one): then it runs in the event loop, not on a thread."""
    return any(inspect.iscoroutinefunction(candidate)
               for candidate in (scorer, getattr(scorer, "__call__", None), getattr(scorer, "function", None)))


def on_daemon_thread(function: Callable[[], Any]) -> "asyncio.Future[Any]":
    """``function()`` on a new daemon thread, as a future of the running event loop. Unlike an executor's
    threads, which the interpreter joins at exit, a thread that never returns is left behind."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(succeeded: bool, value: Any) -> None:
        if future.done():  # cancelled: the caller timed out and no longer waits
            if inspect.iscoroutine(value):
                value.close()
            return
        if succeeded:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            outcome = (True, function())
        except BaseException as error:  # handed to the event loop's side
            outcome = (False, error)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the event loop has closed: nobody waits for this result
            if inspect.iscoroutine(outcome[1]):
                outcome[1].close()

    threading.Thread(target=target, daemon=True, name="rlplat-reward-scorer").start()
    return future


class RewardLoop:
    """Scores samples with ``scorer`` under the ``reward.config`` node's settings (:class:`RewardLoopConfig`);
    see the module docstring. ``tokenizer`` decodes trajectories (:meth:`sample`). Holds no event-loop
    state: each batch gets a :class:`ScoringRound` of its own."""

    def __init__(self, scorer: Callable[..., Any], tokenizer: Any, config: Any = None):
        if not callable(scorer):
            raise TypeError(
                f"the reward loop needs a scorer (a callable), got {scorer!r}; the trainer passes the one "
                "reward.scorer or reward.custom_function selects (rlplat.scorers.scorer_for)"
            )
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.settings = read_config_node(config, RewardLoopConfig, "reward.config")
        self.name = scorer_name(scorer)
        self.in_loop = is_async_scorer(scorer)
        self.pool = scorer_pool(scorer, self.settings.isolation, self.settings.timeout_s, self.settings.processes,
                                self.name)

    def sample(self, row: Mapping[str, Any], response_ids: Sequence[int], response_mask: Sequence[int]) -> ScoringSample:
        """The sample of a finished trajectory of ``row`` (:func:`trajectory_sample` with this loop's tokenizer)."""
        return trajectory_sample(row, response_ids, response_mask, self.tokenizer)

    def round(self) -> "ScoringRound":
        """A new round of scoring; its clock starts now. Call it inside the event loop that will run it."""
        return ScoringRound(self)

    async def score_all(self, samples: Sequence[ScoringSample]) -> "ScoringRound":
        """Score every sample (row order); the finished round holds the outcomes."""
        scoring = self.round()
        for row, sample in enumerate(samples):
            scoring.submit(row, sample)
        scoring.generation_finished(scoring.origin)
        await scoring.wait()
        return scoring

    async def attempt(self, sample: ScoringSample) -> Any:
        """One call of the scorer, within ``timeout_s``; its raw result."""
        arguments = {"data_source": sample.data_source, "solution_str": sample.solution_str,
                     "ground_truth": sample.ground_truth, "extra_info": sample.extra_info}
        if self.pool is not None:  # the pool keeps the deadline, from when a process takes the attempt
            return await asyncio.wrap_future(self.pool.submit(arguments, self.settings.timeout_s))
        call = functools.partial(self.scorer, **arguments)

        async def run() -> Any:
            result = call() if self.in_loop else await on_daemon_thread(call)
            if inspect.isawaitable(result):  # a sync wrapper around an async scorer
                result = await result
            return result

        return await asyncio.wait_for(run(), self.settings.timeout_s)


class ScoringRound:
    """The scoring of one batch: samples submitted by row (from the event loop that runs the round),
    their outcomes, the round's concurrency bound and counts."""

    def __init__(self, loop: RewardLoop):
        self.loop = loop
        self.slots = asyncio.Semaphore(loop.settings.max_concurrency)
        self.in_flight = 0
        self.origin = time.perf_counter()
        self.generated: Optional[float] = None
        self.samples: dict[int, ScoringSample] = {}
        self.tasks: dict[int, asyncio.Future] = {}
        self.outcomes: dict[int, SampleOutcome] = {}
        self.failures_logged = 0
        self.identifier = random.getrandbits(62)

    def submit(self, row: int, sample: ScoringSample) -> None:
        """Start scoring ``sample`` as row ``row`` (each row once)."""
        if row in self.tasks:
            raise ValueError(f"reward loop: row {row} was submitted twice in one round")
        self.samples[row] = sample
        self.tasks[row] = asyncio.ensure_future(self.score(row, sample))

    def generation_finished(self, when: Optional[float] = None) -> None:
        """Record the end of generation (now by default): the time scoring overlaps runs up to it."""
        self.generated = time.perf_counter() if when is None else when

    def cancel(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    async def wait(self) -> list[SampleOutcome]:
        """Every submitted sample's outcome, in row order, once all are done."""
        rows = sorted(self.tasks)
        if rows != list(range(len(rows))):
            raise ValueError(f"reward loop: rows {rows[:8]}... were submitted; expected 0..{len(rows) - 1}")
        try:
            outcomes = await asyncio.gather(*(self.tasks[row] for row in rows))
        except BaseException:
            self.cancel()
            raise
        self.outcomes = dict(zip(rows, outcomes))
        return list(outcomes)

    async def score(self, row: int, sample: ScoringSample) -> SampleOutcome:
        settings = self.loop.settings
        attempts = 1 + settings.retries
        started: Optional[float] = None
        errors = timeouts = killed = peak = 0
        error: BaseException | None = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(settings.retry_backoff_s * 2 ** (attempt - 1))
            async with self.slots:
                self.in_flight += 1
                peak = max(peak, self.in_flight)
                started = time.perf_counter() if started is None else started
                try:
                    score, fields = split_score(await self.loop.attempt(sample), where=f"reward scorer {self.loop.name}")
                except (asyncio.TimeoutError, TimeoutError) as failure:
                    error, errors, timeouts = failure, errors + 1, timeouts + 1
                    killed += bool(getattr(failure, "killed", False))
                except ScorerStartError:
                    raise
                except Exception as failure:
                    error, errors = failure, errors + 1
                else:
                    return SampleOutcome(score, fields, "ok", attempt + 1, errors, timeouts, killed, started,
                                         time.perf_counter(), peak)
                finally:
                    self.in_flight -= 1
        status = "timeout" if isinstance(error, (asyncio.TimeoutError, TimeoutError)) else "error"
        self.failed(row, sample, error, attempts, status)
        return SampleOutcome(float(settings.default_score), {}, status, attempts, errors, timeouts, killed, started,
                             time.perf_counter(), peak)

    def failed(self, row: int, sample: ScoringSample, error: BaseException, attempts: int, status: str) -> None:
        """Raise (``raise_on_error``) or log the round's first failed sample."""
        settings = self.loop.settings
        what = (f"timed out (reward.config.timeout_s={settings.timeout_s})" if status == "timeout"
                else f"{type(error).__name__}: {error}")
        where = (f"reward scorer {self.loop.name} failed on row {row} (data_source {sample.data_source!r}) "
                 f"in {attempts} attempt(s); last: {what}")
        if settings.raise_on_error:
            raise RuntimeError(where) from error
        self.failures_logged += 1
        if self.failures_logged == 1:
            details = ("" if status == "timeout" else "First traceback of this batch:\n"
                       + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
            logger.error(
                "%s; it gets reward.config.default_score=%s and is counted in reward/defaults (raise "
                "reward.config.retries or timeout_s, or set reward.config.raise_on_error=true to stop "
                "instead); later failures of this batch are only counted. %s", where, settings.default_score, details,
            )

    def columns(self) -> dict[str, "np.ndarray"]:
        """The outcomes as the non-tensor columns of :data:`LOOP_COLUMNS`, one entry per row; times in
        seconds since the round began (the start of generation)."""
        import numpy as np

        rows = sorted(self.outcomes)
        outcomes = [self.outcomes[row] for row in rows]
        generated = (self.generated if self.generated is not None else self.origin) - self.origin
        fields = np.empty(len(outcomes), dtype=object)
        fields[:] = [dict(outcome.fields) for outcome in outcomes]
        floats = {
            SCORE_COLUMN: [outcome.score for outcome in outcomes],
            "reward_started_s": [outcome.started - self.origin for outcome in outcomes],
            "reward_finished_s": [outcome.finished - self.origin for outcome in outcomes],
            "reward_generated_s": [generated] * len(outcomes),
        }
        integers = {
            "reward_errors": [outcome.errors for outcome in outcomes],
            "reward_timeouts": [outcome.timeouts for outcome in outcomes],
            "reward_killed": [outcome.killed for outcome in outcomes],
            "reward_retries": [outcome.attempts - 1 for outcome in outcomes],
            "reward_defaults": [outcome.status != "ok" for outcome in outcomes],
            "reward_in_flight": [outcome.in_flight for outcome in outcomes],
            "reward_round": [self.identifier] * len(outcomes),
            "reward_tokens_hash": [self.samples[row].tokens_hash for row in rows],
        }
        return {FIELDS_COLUMN: fields,
                **{key: np.asarray(values, dtype=np.float64) for key, values in floats.items()},
                **{key: np.asarray(values, dtype=np.int64) for key, values in integers.items()}}


SCORE_COLUMN = "reward_score"
"""Non-tensor column of a row's score (float) when it was scored in the rollout worker."""
FIELDS_COLUMN = "reward_fields"
"""Non-tensor column of the scorer's extra fields of a row (a dict; empty when scoring failed). One
column of dicts, not one per field: workers whose rows returned different fields still concatenate."""
LOOP_COLUMNS = (SCORE_COLUMN, FIELDS_COLUMN, "reward_errors", "reward_timeouts", "reward_killed", "reward_retries",
                "reward_defaults", "reward_in_flight", "reward_started_s", "reward_finished_s", "reward_generated_s",
                "reward_round", "reward_tokens_hash")
"""What a batch scored in the rollout workers carries per row: the score and extra fields; failed
attempts, timeouts, scorer processes killed, retries, whether the default score was given; the most samples in flight at one of
its attempts; when its scoring started and finished and when its worker's generation finished (seconds
since that worker's generation began); the round (one per worker and batch); the hash of the scored
tokens."""


# -- output -------------------------------------------------------------------------------------------

def reward_output(columns: Mapping[str, "np.ndarray"], lasts: Sequence[int], width: int, *, scorer: str = "",
                  timeout_s: Optional[float] = None) -> "DataProto":
    """The managers' output (see the module docstring) from the :data:`LOOP_COLUMNS` of a batch; ``scorer``
    and ``timeout_s`` are what a health event of killed scorer processes names."""
    import numpy as np
    import torch

    from rlplat.protocol import DataProto

    scores = np.asarray(columns[SCORE_COLUMN], dtype=np.float64)
    token_level_scores = torch.zeros(len(lasts), width, dtype=torch.float32)
    for row, last in enumerate(lasts):
        if last >= 0:
            token_level_scores[row, last] = float(scores[row])
    fields = list(columns[FIELDS_COLUMN])
    keys = list(dict.fromkeys(key for row_fields in fields for key in row_fields))
    extra = {key: [row_fields.get(key) for row_fields in fields] for key in keys}
    metrics = {f"reward/{name}": float(np.sum(columns[f"reward_{name}"]))
               for name in ("errors", "timeouts", "killed", "retries", "defaults")}
    metrics["reward/max_in_flight"] = float(np.max(columns["reward_in_flight"], initial=0))
    for key, values in extra.items():
        present = [value for value in values if value is not None]
        if present and all(isinstance(value, (bool, int, float, np.number)) for value in present):
            metrics[f"reward/{key}/mean"] = float(np.mean(np.asarray(present, dtype=np.float64)))
    metrics.update(scoring_times(columns))
    meta_info: dict[str, Any] = {"reward_metrics": metrics}
    killed = np.asarray(columns["reward_killed"], dtype=np.int64)
    if killed.any():
        meta_info[HEALTH_EVENTS] = [killed_event(scorer, timeout_s, np.flatnonzero(killed).tolist(), int(killed.sum()))]
    return DataProto.from_dict(tensors={"token_level_scores": token_level_scores}, non_tensors=extra,
                               meta_info=meta_info)


def scoring_times(columns: Mapping[str, "np.ndarray"]) -> dict[str, float]:
    """``timing_s/reward_scoring``, ``timing_s/reward_after_generation`` (each the longest over the
    rounds, i.e. the workers, that scored the batch) and ``reward/overlap_fraction``."""
    import numpy as np

    started, finished = (np.asarray(columns[key], dtype=np.float64) for key in ("reward_started_s", "reward_finished_s"))
    generated, rounds = np.asarray(columns["reward_generated_s"], dtype=np.float64), np.asarray(columns["reward_round"])
    span = after = 0.0
    for identifier in np.unique(rounds):
        rows = rounds == identifier
        span = max(span, float(finished[rows].max() - started[rows].min()))
        after = max(after, float(max(finished[rows].max() - max(generated[rows][0], started[rows].min()), 0.0)))
    busy = float(np.sum(finished - started))
    overlapped = float(np.sum(np.clip(np.minimum(finished, generated) - started, 0.0, None)))
    return {"timing_s/reward_scoring": span, "timing_s/reward_after_generation": after,
            "reward/overlap_fraction": overlapped / busy if busy > 0 else 0.0}


_stale_warned = False


def precomputed_scores(batch: "DataProto", *, scorer: str = "", timeout_s: Optional[float] = None) -> Optional["DataProto"]:
    """The reward managers' output for ``batch`` from the scores its rollout workers computed while
    generating (the :data:`LOOP_COLUMNS`), or None when the batch has none: then a reward manager must
    score it. Also None (with a warning, once per process) when a row's scored tokens are not the
    response it holds now, e.g. rows whose responses an algorithm replaced after generation. ``scorer`` and
    ``timeout_s`` go to :func:`reward_output`."""
    global _stale_warned

    columns = batch.non_tensor_batch
    if SCORE_COLUMN not in columns:
        return None
    missing = [key for key in LOOP_COLUMNS if key not in columns]
    if missing:
        raise ValueError(f"the batch has a {SCORE_COLUMN!r} column but not {missing}: the reward loop writes all of "
                         f"{list(LOOP_COLUMNS)}; a column named {SCORE_COLUMN!r} from elsewhere collides with them")
    lasts = last_tokens(batch.batch["response_mask"])
    responses = batch.batch["responses"]
    hashes = [hash(tuple(responses[row, : last + 1].tolist())) for row, last in enumerate(lasts)]
    import numpy as np

    stale = np.flatnonzero(np.asarray(hashes, dtype=np.int64) != np.asarray(columns["reward_tokens_hash"], dtype=np.int64))
    if len(stale):
        if not _stale_warned:
            _stale_warned = True
            logger.warning("rows %s hold responses other than the ones their rollout worker scored; the reward "
                           "manager scores this batch again (reported once)", stale[:8].tolist())
        return None
    return reward_output({key: columns[key] for key in LOOP_COLUMNS}, lasts, responses.shape[1], scorer=scorer,
                         timeout_s=timeout_s)


class AsyncRewardManager(RewardManager):
    """The ``async`` reward manager: a batch's samples scored by a :class:`RewardLoop`, concurrently
    within ``reward.config.max_concurrency``, each with a timeout, retries and a default score; see the
    module docstring. Callable with or without an event loop running in the calling thread."""

    def __init__(self, scorer: Callable[..., Any], tokenizer: Any, config: Any = None):
        self.loop = RewardLoop(scorer, tokenizer, config)
        self.scorer, self.tokenizer, self.settings = scorer, tokenizer, self.loop.settings

    def __call__(self, batch: "DataProto") -> "DataProto":
        from rlplat.kits.aio import run_async

        samples = decode_samples(batch, self.tokenizer)
        scoring = run_async(self.loop.score_all(samples))
        return reward_output(scoring.columns(), [sample.last_token for sample in samples],
                             batch.batch["responses"].shape[1], scorer=self.loop.name, timeout_s=self.settings.timeout_s)

    def trajectory_scorer(self) -> Optional[RewardLoop]:
        """This manager's reward loop when ``reward.config.overlap`` is on: agent loops in the rollout
        workers then score each trajectory as it finishes. Not for a subclass that scores differently (one
        overriding ``__call__`` without overriding this): its scores could differ from the loop's."""
        if not self.settings.overlap or type(self).__call__ is not AsyncRewardManager.__call__:
            return None
        return self.loop

    def scores_from_rollout(self, batch: "DataProto") -> Optional["DataProto"]:
        """The scores the rollout workers' reward loop wrote into ``batch`` (:func:`precomputed_scores`)."""
        return precomputed_scores(batch, scorer=self.loop.name, timeout_s=self.settings.timeout_s)

    def close(self) -> None:
        """Stop the reward loop's scorer processes, if any (garbage collection and interpreter exit do it
        too). The loop :meth:`trajectory_scorer` hands out is this one: its scorer processes stop too."""
        if self.loop.pool is not None:
            self.loop.pool.close()
