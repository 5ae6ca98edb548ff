"""rlplat's demo task as a verifiers environment: ``a+b=`` questions answered in one chat turn.

A ``vf.SingleTurnEnv`` over an in-memory dataset of the demo's questions (two operands in 10..99, the
``arith_chat`` prompts of rlplat-demo), scored by a ``vf.Rubric`` of one reward function and one metric:

* ``correct_answer`` (weight 1): 1.0 when the parsed answer (``vf.Parser``: the last assistant message,
  stripped) is the ground truth, else 0.0; the same rule as rlplat's ``exact_match``;
* ``integer_answer`` (weight 0, a metric): 1.0 when the answer is an integer at all.

Trained through :func:`rlplat_verifiers.agent.run` (its default environment); the rows come from the run's
data, so the dataset here only satisfies verifiers (an environment needs one) and serves
``vf-eval``-style use of the environment on its own.
"""

from __future__ import annotations

import random
from typing import Any


def correct_answer(parser: Any, completion: Any, answer: str) -> float:
    """1.0 when the completion's answer is ``answer`` (both stripped), else 0.0."""
    parsed = parser.parse_answer(completion)
    return 1.0 if parsed is not None and parsed.strip() == str(answer).strip() else 0.0


def integer_answer(parser: Any, completion: Any) -> float:
    """1.0 when the completion's answer is an integer (digits, an optional sign), else 0.0."""
    parsed = (parser.parse_answer(completion) or "").strip()
    return 1.0 if parsed.lstrip("-").isdigit() else 0.0


def questions(count: int, seed: int) -> list[dict]:
    """``count`` questions ``{"question": "a+b=", "answer": "a+b's value"}`` with a, b in 10..99."""
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = generator.randint(10, 99), generator.randint(10, 99)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def load_environment(count: int = 200, seed: int = 0, system_prompt: str | None = None) -> Any:
    """The environment: ``count`` questions (seeded by ``seed``) as its dataset, no system prompt unless
    one is given (the demo model was warm-started on bare ``a+b=`` user turns)."""
    import verifiers as vf
    from datasets import Dataset

    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[correct_answer], weights=[1.0], parser=parser)
    rubric.add_metric(integer_answer)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(questions(count, seed)), system_prompt=system_prompt,
                            parser=parser, rubric=rubric)
