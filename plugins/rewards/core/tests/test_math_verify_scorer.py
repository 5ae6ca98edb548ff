"""The math_verify scorer: conformance, equivalence through math-verify, errors, the time bound from
any thread, registration, and the cases where it and the ``math`` scorer disagree."""

import asyncio
import concurrent.futures
import functools
import json
import threading
import time

import pytest

from rlplat import registry
from rlplat.testing import RewardScorerConformance, ScorerCase
from rlplat_rewards import hendrycks_math, math_verify_scorer
from rlplat_rewards.managers import call_with_timeout
from rlplat_rewards.math_verify_scorer import run_within, score


def spin(seconds: float) -> None:
    """Busy Python work for ``seconds`` (what a slow sympy call looks like to the deadline)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class TestMathVerify(RewardScorerConformance):
    @pytest.fixture
    def scorer(self):
        return score

    @pytest.fixture
    def registered_name(self):
        return "math_verify"

    @pytest.fixture
    def scorer_cases(self):
        return [
            ScorerCase("lighteval/MATH", "so the answer is $\\boxed{\\frac12}$.", "0.5", None, 1.0),
            ScorerCase("lighteval/MATH", "first \\boxed{3}, no: \\boxed{4}", "4", {"index": 7}, 1.0),
            ScorerCase("lighteval/MATH", "\\boxed{5}", "4", None, 0.0),
            ScorerCase("lighteval/MATH", "I cannot tell.", "4", None, 0.0),
        ]


# (ground truth, response, expected score): math-verify's equivalence, as documented in the module
EQUIVALENCE_CASES = [
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("0.5", "\\boxed{1/2}", 1.0),
    ("1/2", "$\\boxed{\\dfrac{1}{2}}$", 1.0),
    ("\\boxed{\\frac{3}{4}}", "\\boxed{0.75}", 1.0),  # a boxed ground truth
    ("42", "The answer is $42$.", 1.0),  # no box: the answer in LaTeX
    ("3/4", "So she eats 3/4 of the cake.", 1.0),  # no box, no LaTeX: the last plain expression
    ("x^2+1", "\\boxed{1 + x^2}", 1.0),
    ("(1, 2]", "\\boxed{(1,2]}", 1.0),  # intervals
    ("(1, 2]", "\\boxed{[1,2]}", 0.0),
    ("(-\\infty, 0) \\cup (1, \\infty)", "\\boxed{(1,\\infty)\\cup(-\\infty,0)}", 1.0),
    ("\\{1, 2, 3\\}", "\\boxed{\\{3, 2, 1\\}}", 1.0),  # sets are unordered
    ("\\{1, 2, 3\\}", "\\boxed{\\{1, 2\\}}", 0.0),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),
    ("12,000", "\\boxed{12000}", 1.0),
    ("3", "\\boxed{4}", 0.0),
    ("x^2+1", "\\boxed{x^2-1}", 0.0),
    ("\\frac{1}{3}", "\\boxed{0.33}", 0.0),  # 6 decimal places must agree
]


@pytest.mark.parametrize(("ground_truth", "response", "expected"), EQUIVALENCE_CASES)
def test_equivalence(ground_truth, response, expected):
    assert score("math", response, ground_truth)["score"] == expected


def test_a_response_with_boxes_is_judged_on_its_last_box():
    assert score("math", "\\boxed{3}, or rather \\boxed{4}, since 4 > 3", "4") == {"score": 1.0, "acc": True, "pred": "4"}
    assert score("math", "\\boxed{5}. The final answer is 7", "5")["score"] == 1.0
    assert score("math", "\\fbox{7}", "7")["score"] == 1.0
    assert score("math", "so $\\boxed 7$", "7")["score"] == 1.0


def test_several_boxes_are_not_read_as_a_set_of_answers():
    # math-verify given the whole response would read these two boxes as the set {1, 2}
    assert score("math", "\\boxed{1} and \\boxed{2}", "1, 2")["score"] == 0.0
    assert score("math", "\\boxed{1, 2}", "1, 2")["score"] == 1.0


def test_pred_is_the_extracted_answer_as_sympy_writes_it():
    assert score("math", "$\\boxed{\\frac{6}{8}}$", "3/4")["pred"] == "3/4"
    assert score("math", "\\boxed{(1, 2]}", "(1,2]")["pred"] == "Interval.Lopen(1, 2)"


@pytest.mark.parametrize("response", ["", "I do not know.", "$\\frac{$", "\\boxed{}"])
def test_a_response_without_a_parsable_answer_scores_zero_with_no_pred(response):
    assert score("math", response, "4") == {"score": 0.0, "acc": False, "pred": None}


def test_a_numeric_ground_truth_is_read_as_its_text():
    assert score("math", "\\boxed{42}", 42)["score"] == 1.0
    assert score("math", "\\boxed{\\frac{5}{2}}", 2.5)["score"] == 1.0


@pytest.mark.parametrize("ground_truth", ["", "   ", "\\frac{"])
def test_an_unparsable_ground_truth_is_an_error_naming_it(ground_truth):
    with pytest.raises(ValueError, match=f"the ground truth {ground_truth!r}".replace("\\", "\\\\")):
        score("math", "\\boxed{1}", ground_truth)


@pytest.mark.parametrize("ground_truth", [None, ["1", "2"], True])
def test_a_ground_truth_that_is_not_text_or_a_number_is_a_type_error(ground_truth):
    with pytest.raises(TypeError, match="must be a string or a number"):
        score("math", "\\boxed{1}", ground_truth)


@pytest.mark.parametrize("response", ["$\\boxed{10^{10^{10}}}$", "10^10^10", "$\\boxed{(10^{7})!}$"])
def test_a_response_too_large_to_evaluate_scores_zero_at_once(response):
    # evaluated, 10^(10^10) is one big-integer power of 4 GB that no time bound can interrupt
    started = time.perf_counter()
    assert score("math", response, "5")["score"] == 0.0
    assert time.perf_counter() - started < 10.0  # refused before evaluation: unguarded, this runs for minutes


def test_a_ground_truth_too_large_to_evaluate_is_an_error():
    with pytest.raises(ValueError, match="MAX_EXACT_BITS"):
        score("math", "\\boxed{5}", "2^{2^{30}}")


def test_a_large_answer_within_the_limit_is_compared():
    assert score("math", "\\boxed{2^{1000}}", str(2**1000))["score"] == 1.0


def test_run_within_stops_python_work_in_the_main_thread():
    assert threading.current_thread() is threading.main_thread()
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match="the spin took longer than 0.2 s"):
        run_within(lambda: spin(30), 0.2, what="the spin")
    assert time.perf_counter() - started < 10.0  # stopped: the spin alone lasts 30 s


def test_run_within_stops_python_work_in_a_worker_thread():
    outcome = {}

    def work():
        started = time.perf_counter()
        try:
            run_within(lambda: spin(30), 0.2)
        except TimeoutError as error:
            outcome["error"] = error
        outcome["seconds"] = time.perf_counter() - started

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert isinstance(outcome["error"], TimeoutError)
    assert outcome["seconds"] < 10.0  # stopped: the spin alone lasts 30 s


def test_run_within_returns_the_result_and_leaves_no_thread_behind():
    before = threading.active_count()
    assert run_within(lambda: 6 * 7, 5.0) == 42
    assert threading.active_count() == before


def test_run_within_passes_on_the_function_s_own_error():
    with pytest.raises(ZeroDivisionError):
        run_within(lambda: 1 / 0, 5.0)


def test_no_timeout_escapes_calls_that_end_at_their_deadline():
    # work as long as the bound: the deadline passes during the call, while stopping, or just after
    for _ in range(60):
        try:
            run_within(lambda: spin(0.005), 0.005)
        except TimeoutError:
            pass
    spin(0.05)  # a timeout still pending in this thread would be raised here


def test_a_deadline_that_passes_while_the_watch_starts_is_a_timeout_and_leaves_no_watchdog():
    # A microsecond bound passes while the watchdog thread is starting, as a few milliseconds do on a busy
    # machine: each call ends in a result or a TimeoutError, and no watchdog outlives its call (one that did
    # raised its deadline into whatever this thread ran next, once a second; 8 of 2000 calls did so here).
    for _ in range(2000):
        try:
            run_within(lambda: None, 1e-6)
        except TimeoutError:
            pass
    spin(0.05)  # a timeout still pending in this thread would be raised here
    assert [thread for thread in threading.enumerate() if thread.name == "rlplat-math-verify-deadline"] == []


def test_a_slow_comparison_is_stopped_at_the_bound(monkeypatch):
    # expanding two 300th powers takes sympy about a second (0.4 s to 2.6 s measured here)
    monkeypatch.setattr(math_verify_scorer, "TIMEOUT_S", 0.05)
    with pytest.raises(TimeoutError, match="math_verify on ground truth"):
        score("math", "$\\boxed{(1+x)^{300}-(x+3)^{300}}$", "(x+1)^{300}-(x+2)^{300}")
    monkeypatch.setattr(math_verify_scorer, "TIMEOUT_S", 5.0)
    assert score("math", "\\boxed{2}", "2")["score"] == 1.0


def test_scores_in_a_worker_thread_as_the_naive_manager_calls_it():
    result = call_with_timeout(lambda: score("math", "\\boxed{\\frac{1}{2}}", "0.5"), 30.0)
    assert result == {"score": 1.0, "acc": True, "pred": "1/2"}


def test_concurrent_threads_score_as_one_thread_does():
    cases = EQUIVALENCE_CASES * 2
    serial = [score("math", response, truth) for truth, response, _ in cases]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(lambda case: score("math", case[1], case[0]), cases))
    assert parallel == serial


def test_scores_in_an_event_loop_s_executor():
    async def score_all():
        loop = asyncio.get_running_loop()
        calls = [loop.run_in_executor(None, functools.partial(score, "math", response, truth)) for truth, response, _ in EQUIVALENCE_CASES]
        return await asyncio.gather(*calls)

    results = asyncio.run(score_all())
    assert [result["score"] for result in results] == [expected for _, _, expected in EQUIVALENCE_CASES]


# (ground truth, response, math's score, math_verify's score): the README's "which math scorer"
DISAGREEMENTS = [
    ("\\frac{1}{2}", "The answer is $0.5$.", 0.0, 1.0),  # math needs a box
    ("\\frac{3}{4}", "\\boxed{0.75}", 0.0, 1.0),  # fraction vs decimal
    ("x^2+1", "\\boxed{1+x^2}", 0.0, 1.0),  # symbolic equality
    ("\\{1,2,3\\}", "\\boxed{\\{3,2,1\\}}", 0.0, 1.0),  # sets
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 0.0, 1.0),
    ("1000", "\\boxed{1,000}", 0.0, 1.0),  # thousands separator
    ("3", "\\boxed{3.0}", 0.0, 1.0),
    ("\\frac{5}{2}", "\\boxed{2\\frac{1}{2}}", 0.0, 1.0),  # a mixed number
    ("x \\in [2,5)", "\\boxed{[2,5)}", 0.0, 1.0),
    ("\\text{(B)}", "\\boxed{B}", 0.0, 1.0),
    ("8.4\\%", "\\boxed{8.4}", 1.0, 0.0),  # math drops the percent sign; math-verify reads 8.4% as 0.084
]


@pytest.mark.parametrize(("ground_truth", "response", "math_score", "math_verify_score"), DISAGREEMENTS)
def test_where_math_and_math_verify_disagree(ground_truth, response, math_score, math_verify_score):
    assert hendrycks_math.score("math", response, ground_truth)["score"] == math_score
    assert score("math", response, ground_truth)["score"] == math_verify_score


def test_is_registered_and_claims_no_data_source():
    entry = registry.entry("reward_scorer", "math_verify")
    assert entry.plugin == "rewards"
    assert "math-verify" in entry.description
    assert entry.metadata["data_sources"] == []


def test_rlplat_plugins_list_shows_it(capsys):
    from rlplat.cli.main import main

    try:
        main(["plugins", "list", "--json"])
    except SystemExit as exit:
        assert not exit.code, exit.code
    plugins = {plugin["plugin"]: plugin for plugin in json.loads(capsys.readouterr().out)}
    entries = {(entry["kind"], entry["name"]): entry["status"] for entry in plugins["rewards"]["entries"]}
    assert entries[("reward_scorer", "math_verify")] == "ok"
