"""The ``math_verify`` scorer: answer extraction and equivalence by the ``math-verify`` library (sympy).

What is compared:

* **The response's last box, else the whole response.** When ``solution_str`` holds a complete
  ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``), its last one is the answer, found as the
  ``math`` scorer finds it: an earlier box or a later remark does not count. (Given the whole response,
  math-verify would join several boxes into one set of answers.) Without a box, math-verify searches
  the whole response and keeps the first answer it can parse, trying in this order: ``final answer is
  ...``, ``answer: ...`` / ``answer ...``, then the rightmost LaTeX span (``$...$``, ``\\(...\\)``,
  ``\\[...\\]``, a bare ``\\frac{a}{b}``) or plain number or expression (``3/4``, ``1,234.5``, ``20%``).
* **The ground truth, as given.** Plain (``3/4``, ``42``, ``x^2+1``), LaTeX (``\\frac{3}{4}``, ``$...$``)
  or boxed (its last box); text without ``$``, ``\\(``, ``\\[`` or a box is read as one LaTeX math
  span. A number is converted with ``str``.
* **Equivalence** is math-verify's ``verify``: numbers within 6 decimal places (``0.5`` = ``1/2``),
  symbolic equality through sympy (``x^2+1`` = ``1+x^2``), sets (unordered: ``1,2`` = ``\\{2,1\\}``),
  intervals, tuples, matrices, equations (``x=3`` = ``3``) and percentages.

Outcomes: ``{"score": 1.0 | 0.0, "acc": bool, "pred": str | None}``, ``pred`` being the extracted answer
as sympy writes it (``3/4``, ``Interval.Lopen(1, 2)``), None when the response holds no parsable
answer (that scores 0). A ground truth math-verify cannot parse raises ``ValueError`` naming it: it
is a data error, and the reward manager counts it in ``reward/errors`` and gives the configured
fallback score rather than silently scoring every response 0. An answer whose exact value is an
integer of more than 2**20 bits (``10^{10^{10}}``, ``(10^7)!``) is never evaluated: such a response
scores 0 and such a ground truth raises ``ValueError`` (sympy would spend minutes and gigabytes inside
one uninterruptible big-integer operation).

Time: each call is bounded by :data:`TIMEOUT_S` (``TimeoutError`` past it, which reward managers
count in ``reward/timeouts``). math-verify's own timeouts use ``SIGALRM``, which works only in the
main thread, while reward managers score in worker threads and executors; they are turned off here
and :func:`run_within` bounds the call instead, from any thread. Like a signal handler, it takes
effect between Python bytecodes: a single long C call (a regular expression, a big-integer power) runs
to its end first, which is why huge integers are refused up front.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import numbers
import re
import threading
from typing import Any, Callable, Mapping, TypeVar

import sympy
from math_verify import parse, verify

from rlplat_rewards.hendrycks_math import last_boxed, unbox

TIMEOUT_S = 5.0
"""Seconds one :func:`score` call may take (ground truth, response and comparison together)."""

MAX_EXACT_BITS = 1 << 20
"""The largest exact integer (in bits) an answer may need; see the module docstring."""

_REINJECT_INTERVAL_S = 1.0
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\[|\\\(")
_Result = TypeVar("_Result")


class _DeadlinePassed(BaseException):
    """Raised inside the timed thread. A BaseException so that the ``except Exception`` blocks of
    math-verify and sympy, which turn errors into "no answer", do not swallow it."""


_set_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


class _Watch:
    """A watchdog thread that raises :class:`_DeadlinePassed` in the watched thread once ``seconds`` have
    passed after :meth:`start`, and again every ``_REINJECT_INTERVAL_S`` while that thread has not stopped
    the watch (in case a bare ``except:`` swallowed it). It injects only while holding ``lock`` and never
    once ``stopped`` is set, so after :meth:`stop` has set it under the lock at most one is pending."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.thread_id = threading.get_ident()
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.watchdog = threading.Thread(target=self._watch, daemon=True, name="rlplat-math-verify-deadline")

    def start(self) -> None:
        """Start the clock. Call it inside the ``try`` whose ``finally`` calls :meth:`stop`: with a short
        deadline on a busy machine the first :class:`_DeadlinePassed` can come before ``start`` returns."""
        self.watchdog.start()

    def _watch(self) -> None:
        wait = self.seconds
        while not self.stopped.wait(wait):
            with self.lock:
                if self.stopped.is_set():
                    return
                _set_async_exc(self.thread_id, _DeadlinePassed)
            wait = _REINJECT_INTERVAL_S

    def stop(self) -> None:
        """Stop watching; afterwards no :class:`_DeadlinePassed` is raised in this thread. Every step is
        repeatable, so one raised while stopping (the deadline passing just now) restarts them."""
        while True:
            try:
                with self.lock:
                    self.stopped.set()
                if self.watchdog.ident is not None:  # started (a watch stopped before its start never is)
                    self.watchdog.join()
                _set_async_exc(self.thread_id, ctypes.py_object())  # NULL: drop one still pending
                return
            except _DeadlinePassed:
                continue


def run_within(function: Callable[[], _Result], seconds: float, what: str = "the call") -> _Result:
    """``function()``, or ``TimeoutError`` once it has run ``seconds``; callable from any thread, no signals.

    The exception is raised inside ``function`` asynchronously (``PyThreadState_SetAsyncExc``), so the
    work really stops, between two bytecodes; see the module docstring for what that cannot interrupt."""
    if not seconds > 0:
        raise ValueError(f"run_within: seconds must be positive, got {seconds!r}")
    watch = _Watch(seconds)
    try:
        try:
            watch.start()
            return function()
        finally:
            watch.stop()
    except _DeadlinePassed:
        raise TimeoutError(f"{what} took longer than {seconds} s") from None


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its (signal) timeouts are off; :func:`run_within` replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _exact_bits(expr: Any) -> int:
    """An estimate of the largest exact integer (in bits) evaluating ``expr`` builds, counting only
    powers and factorials of numbers. Subexpressions are visited innermost first, so an exponent is
    evaluated only once it is known to be small."""
    if isinstance(expr, sympy.MatrixBase):
        return max((_exact_bits(element) for element in expr), default=0)
    if not isinstance(expr, sympy.Basic):
        return 0
    largest = 0
    for node in sympy.postorder_traversal(expr):
        bits = 0
        try:
            if isinstance(node, sympy.Pow) and node.base.is_number and node.exp.is_number:
                base, exponent = node.base.doit(), node.exp.doit()
                if isinstance(base, sympy.Rational) and isinstance(exponent, sympy.Rational) and abs(base) != 1 and base != 0:
                    bits = abs(exponent) * max(abs(base.p).bit_length(), base.q.bit_length())
            elif isinstance(node, sympy.factorial) and node.args[0].is_number:
                argument = node.args[0].doit()
                if isinstance(argument, sympy.Integer) and argument > 2:
                    bits = argument * math.log2(int(argument))
        except Exception:  # an estimate: whatever sympy cannot evaluate here builds no integer either
            continue
        if bits > MAX_EXACT_BITS:
            return int(bits)
        largest = max(largest, int(bits))
    return largest


def _last_box(text: str) -> str | None:
    """The last complete box of ``text`` as ``\\boxed{...}`` (the form math-verify reads), or None."""
    boxed = last_boxed(text)
    content = unbox(boxed) if boxed is not None else None
    return None if content is None else f"\\boxed{{{content}}}"


def _answers(parsed: list[Any]) -> list[Any]:
    """The parsed answers of a ``parse`` result, without its raw-text fallbacks."""
    return [item for item in parsed if not isinstance(item, str)]


@functools.lru_cache(maxsize=4096)
def parse_ground_truth(ground_truth: str) -> list[Any]:
    """math-verify's parse of ``ground_truth`` (see the module docstring for the accepted forms); cached,
    since every response to a prompt shares it. ``ValueError`` when nothing parsable is in it."""
    text = ground_truth.strip()
    source = _last_box(text) or (text if _MATH_DELIMITER.search(text) else f"${text}$")
    parsed = parse(source, parsing_timeout=None) if text else []
    answers = _answers(parsed)
    if not answers:
        raise ValueError(
            f"math_verify: the ground truth {ground_truth!r} holds no answer math-verify can parse "
            f"(it extracted {parsed!r}); correct it in the data's reward_model.ground_truth, or score "
            "this data with the 'math' scorer, which compares normalised strings"
        )
    bits = max(_exact_bits(answer) for answer in answers)
    if bits > MAX_EXACT_BITS:
        raise ValueError(
            f"math_verify: the ground truth {ground_truth!r} is an integer of about {bits} bits, more than "
            f"MAX_EXACT_BITS={MAX_EXACT_BITS}; comparing it would take minutes and gigabytes"
        )
    return parsed


def _ground_truth_text(ground_truth: Any) -> str:
    if isinstance(ground_truth, str):
        return ground_truth
    if isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    raise TypeError(
        f"math_verify: the ground truth must be a string or a number, got {type(ground_truth).__name__} "
        f"{ground_truth!r}"
    )


def _written(parsed: list[Any]) -> str:
    """The first parsed answer as sympy writes it; the extracted text if that fails."""
    try:
        return str(_answers(parsed)[0])
    except ValueError:  # an integer past Python's str() digit limit
        texts = [item for item in parsed if isinstance(item, str)]
        return texts[0] if texts else "<an integer too long to print>"


def judge(solution_str: str, ground_truth: Any) -> dict[str, Any]:
    """The comparison behind :func:`score`, without the time bound."""
    gold = parse_ground_truth(_ground_truth_text(ground_truth))
    parsed = parse(_last_box(solution_str) or solution_str, parsing_timeout=None)
    answers = _answers(parsed)
    if not answers:
        return {"score": 0.0, "acc": False, "pred": None}
    pred = _written(parsed)
    if max(_exact_bits(answer) for answer in answers) > MAX_EXACT_BITS:
        return {"score": 0.0, "acc": False, "pred": pred}
    correct = bool(verify(gold, parsed, timeout_seconds=None))
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": pred}


def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """1.0 when the answer math-verify extracts from ``solution_str`` is equivalent to ``ground_truth``;
    see the module docstring. Within :data:`TIMEOUT_S`, from any thread."""
    return run_within(
        lambda: judge(solution_str, ground_truth),
        TIMEOUT_S,
        what=f"math_verify on ground truth {ground_truth!r} (data_source {data_source!r})",
    )
