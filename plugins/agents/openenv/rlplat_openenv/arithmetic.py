"""rlplat's demo task as an OpenEnv environment: ``a+b=`` with up to ``max_attempts`` answers.

The OpenEnv layout of an environment in one module: the action and observation models, a rubric, the
``Environment`` (``reset`` / ``step`` / ``state``) and ``app``, the server ``create_app`` builds (what an
OpenEnv environment's ``server/app.py`` holds; ``uvicorn rlplat_openenv.arithmetic:app`` serves it, and
:func:`rlplat_openenv.agent.run` serves it on 127.0.0.1 by itself).

* ``reset(question=..., answer=...)`` poses any question; else ``reset(task=row)`` the row's (its last
  prompt message, ``reward_model.ground_truth`` the answer); else ``reset(seed=s)`` draws one (two operands
  in 10..99, the demo's range). ``max_attempts`` overrides the environment's limit for the episode.
* ``step(ArithmeticAction(answer=text))`` judges the answer with the environment's rubric,
  :class:`ExactAnswer` (1.0 when the stripped text is the answer, else 0.0; rlplat's ``exact_match``); the
  observation's ``reward`` is the rubric's score. A right answer ends the episode; a wrong one gets
  ``feedback`` ("wrong, try again", the words the demo model was warm-started on) until ``max_attempts``
  answers were given.
"""

from __future__ import annotations

import random
import uuid
from typing import Any, Mapping, Optional

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric
from pydantic import Field

FEEDBACK = "wrong, try again"
MAX_SESSIONS = 512
"""Concurrent sessions the server admits (each conversation of a step holds one)."""


class ArithmeticAction(Action):
    """One answer of the model."""

    answer: str = Field(description="The model's reply, as text")


class ArithmeticObservation(Observation):
    """What the model is shown: the question at reset, the feedback after a wrong answer."""

    question: str = Field(default="", description="The question of the episode")
    feedback: str = Field(default="", description="The next user message: the feedback on a wrong answer, empty when done")
    attempts: int = Field(default=0, description="Answers given so far")
    correct: bool = Field(default=False, description="Whether the last answer was right")


class ArithmeticState(State):
    """The episode: its question, answer, attempts and their limit."""

    question: str = ""
    answer: str = ""
    attempts: int = 0
    max_attempts: int = 1


class ExactAnswer(Rubric):
    """1.0 when the action's answer, stripped, is :attr:`expected`, else 0.0."""

    def __init__(self) -> None:
        super().__init__()
        self.expected: Optional[str] = None

    def forward(self, action: ArithmeticAction, observation: ArithmeticObservation) -> float:
        if self.expected is None:
            raise RuntimeError("ExactAnswer has no expected answer: reset the environment first")
        return 1.0 if action.answer.strip() == self.expected else 0.0

    def reset(self) -> None:
        self.expected = None


def question_of(task: Mapping[str, Any]) -> tuple[str, str]:
    """(question, answer) of an rlplat row: its last prompt message and ``reward_model.ground_truth``."""
    prompt = task.get("raw_prompt") or task.get("prompt")
    ground_truth = (task.get("reward_model") or {}).get("ground_truth")
    if not isinstance(prompt, list) or not prompt or ground_truth is None:
        raise ValueError(f"task {task.get('uid')!r} needs raw_prompt (chat messages) and reward_model.ground_truth")
    return str(prompt[-1]["content"]), str(ground_truth).strip()


class ArithmeticEnvironment(Environment[ArithmeticAction, ArithmeticObservation, ArithmeticState]):
    """See the module docstring. One instance per session; the server builds it with no arguments."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_attempts: int = 3, feedback: str = FEEDBACK):
        super().__init__(rubric=ExactAnswer())
        self.default_max_attempts, self.feedback = max_attempts, feedback
        self._state = ArithmeticState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, task: Optional[Mapping[str, Any]] = None,
              question: Optional[str] = None, answer: Optional[str] = None, max_attempts: Optional[int] = None,
              **kwargs: Any) -> ArithmeticObservation:
        if question is not None and answer is not None:
            pass
        elif task is not None:
            question, answer = question_of(task)
        else:
            generator = random.Random(seed)
            a, b = generator.randint(10, 99), generator.randint(10, 99)
            question, answer = f"{a}+{b}=", str(a + b)
        limit = self.default_max_attempts if max_attempts is None else int(max_attempts)
        if limit < 1:
            raise ValueError(f"max_attempts must be >= 1, got {limit}")
        self.rubric.reset()
        self.rubric.expected = str(answer).strip()
        self._state = ArithmeticState(episode_id=episode_id or str(uuid.uuid4()), question=question,
                                      answer=str(answer).strip(), max_attempts=limit)
        return ArithmeticObservation(question=question, feedback=question)

    def step(self, action: ArithmeticAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ArithmeticObservation:
        state = self._state
        if not state.question:
            raise RuntimeError("step before reset: reset the environment with a task first")
        state.attempts += 1
        state.step_count += 1
        observation = ArithmeticObservation(question=state.question, attempts=state.attempts)
        observation.reward = self._apply_rubric(action, observation)
        observation.correct = observation.reward > 0
        observation.done = observation.correct or state.attempts >= state.max_attempts
        observation.feedback = "" if observation.done else self.feedback
        return observation

    @property
    def state(self) -> ArithmeticState:
        return self._state


app = create_app(ArithmeticEnvironment, ArithmeticAction, ArithmeticObservation, env_name="rlplat_arithmetic",
                 max_concurrent_envs=MAX_SESSIONS)
