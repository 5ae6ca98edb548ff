"""Rewards: a scorer judges one response; a reward manager turns a batch into token-level scores; a
judge parser reads the score a judge model wrote (kind ``judge_parser``, used by the ``judge`` manager)."""

from __future__ import annotations

import abc
import numbers
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Union

if TYPE_CHECKING:
    from rlplat.protocol import DataProto

ScoreResult = Union[float, int, bool, Mapping[str, Any]]


class RewardScorer(Protocol):
    """``score(data_source, solution_str, ground_truth, extra_info) -> float | dict``.

    ``solution_str`` is the decoded response (special tokens removed); ``ground_truth`` comes from the
    row's ``reward_model["ground_truth"]``; ``extra_info`` is the row's ``extra_info`` dict or None and
    must not be modified. Returns a number, or a dict with a numeric ``"score"`` plus any extra fields
    (``acc``, ``pred``, ...) that the reward manager carries into metrics. Deterministic; may be
    ``async def``. Must be importable by reference (it is sent to reward workers).
    """

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> ScoreResult: ...


class RewardManager(abc.ABC):
    """Scores a batch. Built by the registry factory from ``(scorer, tokenizer, config)``.

    Reads ``responses`` and ``response_mask`` [B, R] and the non-tensor ``data_source``,
    ``reward_model`` (a dict with ``ground_truth``) and ``extra_info``. Returns a new DataProto with
    ``token_level_scores`` [B, R] float32: the score at the last valid response token, 0 elsewhere;
    each extra field a scorer returned as a non-tensor column of the same name; and
    ``meta_info["reward_metrics"]`` (floats such as ``reward/errors``).
    """

    @abc.abstractmethod
    def __call__(self, batch: "DataProto") -> "DataProto":
        """Score every row of ``batch``; see the class docstring for the keys."""

    def bind_workers(self, groups: Mapping[str, Any]) -> None:
        """Called once by the trainer after the run's worker groups are built, with the groups by role name
        (``actor``, ``judge``, a plugin's role, ...). A manager that scores through a worker group (the
        ``judge`` manager asks the ``judge`` role's rollout) keeps it here; the default needs none."""

    def trajectory_scorer(self) -> Any:
        """What scores each trajectory as soon as it finishes, while the others still generate: asked in the
        rollout workers by a rollout driver that runs trajectories one by one (agent loops), which writes
        the outcomes into the batch it returns; :meth:`scores_from_rollout` reads them back in the driver.
        Its interface is the manager's and its driver's business (``rlplat_rewards``'s ``async`` manager
        returns its reward loop). None, the default: the trainer scores the whole batch by calling the
        manager."""
        return None

    def scores_from_rollout(self, batch: "DataProto") -> "DataProto | None":
        """This manager's output for ``batch`` from the scores its :meth:`trajectory_scorer` computed in the
        rollout workers, or None when the batch carries none (or they are stale): then the trainer calls
        the manager. The default: None."""
        return None


class JudgeParser(abc.ABC):
    """Reads the score a judge model wrote in its answer (kind ``judge_parser``).

    Built by the registered factory from its config node (``reward.config.parser_config``, read with
    the entry's ``config_schema``; a mapping or None when the entry declares none).
    """

    def __init__(self, config: Any = None):
        self.config = config

    @abc.abstractmethod
    def parse(self, text: str) -> float:
        """The score written in ``text`` (the judge's answer, decoded with special tokens removed), a
        finite float. Raises ``ValueError`` saying why when no score can be read (no number, a score out
        of the configured range, ...): the ``judge`` manager then gives the row
        ``reward.config.default_score`` and counts it in ``reward/judge/parse_failures``. Deterministic;
        raises nothing else on any text a model may write."""

    def score_range(self) -> tuple[float, float] | None:
        """``(lowest, highest)`` score :meth:`parse` can return, when it is bounded (a configured range,
        yes/no scores); None when it is not. ``reward.config.normalize`` maps this range onto [0, 1]."""
        return None


def split_score(result: ScoreResult, *, where: str = "scorer") -> tuple[float, dict[str, Any]]:
    """Normalise a scorer's return value to ``(score, extra_fields)``.

    Accepts a number (bools count as 0/1) or a mapping with a numeric ``"score"``; anything else raises
    a ``TypeError`` that names ``where`` (e.g. ``"reward scorer 'gsm8k'"``) and what came back.
    """
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"{where} returned a dict without a 'score' key (keys: {sorted(result)})")
        extras = {key: value for key, value in result.items() if key != "score"}
        score, _ = split_score(result["score"], where=where)
        return score, extras
    if isinstance(result, numbers.Real):  # bool, int, float and numpy's scalars
        value = float(result)
        if value != value:
            raise TypeError(f"{where} returned NaN")
        return value, {}
    raise TypeError(f"{where} must return a number or a dict with a numeric 'score', got {type(result).__name__}: {result!r:.80}")
