"""Scoring in killable processes (``reward.config.isolation``): a scorer stuck in C code holding the GIL costs
its samples, not the run; crashes and exceptions come back as errors; the processes never outlive their
manager; known-safe scorers stay in this process.

The tests whose scorer loops in C run in a fresh interpreter with a time limit (``python_run``), so a
regression fails them instead of hanging the test run; the others make a scorer process overrun its
deadline with ``time.sleep``, which a thread-based fallback would survive too, without killing anything.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlplat.config_node import ConfigError
from rlplat.scorers import CustomScorer, DataSourceScorer, exact_match
from rlplat.testing import reward_batch, word_tokenizer
from rlplat_rewards import gsm8k, hendrycks_math, isolation, math_verify_scorer
from rlplat_rewards.managers import BatchRewardManager, NaiveRewardManager
from rlplat_rewards.reward_loop import AsyncRewardManager, decode_samples
from rlplat.kits.aio import run_async

WORDS = ["4", "5", "backtrack", "sleep", "crash", "raise", "torch"]

SCORER = '''
import asyncio
import os
import re
import sys
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "backtrack":  # 2**40 steps inside one C call that holds the GIL
        re.match(r"(a+)+$", "a" * 40 + "b")
    if solution_str == "sleep":
        time.sleep(3600)
    if solution_str == "crash":
        os._exit(3)
    if solution_str == "raise":
        raise ValueError("bad sample")
    if solution_str == "torch":
        return {"score": 0.5, "torch_imported": "torch" in sys.modules}
    return float(solution_str == ground_truth)


async def compute_score_async(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return {"score": 0.25, "pid": os.getpid()}


def compute_scores(data_sources, solution_strs, ground_truths, extra_infos):
    if "sleep" in solution_strs:
        time.sleep(3600)
    return [float(text == truth) for text, truth in zip(solution_strs, ground_truths)]
'''


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(WORDS)


@pytest.fixture
def scorer_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SCORER)
    return path


def scores_of(output):
    return output.batch["token_level_scores"].sum(-1).tolist()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def no_scorer_process(monkeypatch):
    """Fails a test that starts a scorer process."""
    def refuse(*args, **kwargs):
        raise AssertionError("a scorer process was started")

    monkeypatch.setattr(isolation, "_Worker", refuse)


# -- a scorer stuck in C code ---------------------------------------------------------------------------

STUCK_RUN = """
    import json, os, time
    from rlplat.scorers import CustomScorer
    from rlplat.testing import reward_batch, word_tokenizer
    from rlplat_rewards.managers import NaiveRewardManager
    from rlplat_rewards.reward_loop import AsyncRewardManager

    tokenizer = word_tokenizer({words!r})
    batch = reward_batch(tokenizer, ["4", "backtrack", "5", "4", "backtrack", "4"], ["4"] * 6)
    scorer = CustomScorer({path!r})
    manager = {manager}(scorer, tokenizer, {config!r})
    started = time.perf_counter()
    output = manager(batch)
    seconds = time.perf_counter() - started
    pids = manager.{pool}.pids()
    manager.close()
    print(json.dumps({{"seconds": seconds, "scores": output.batch["token_level_scores"].sum(-1).tolist(),
                      "metrics": output.meta_info["reward_metrics"], "events": output.meta_info.get("health_events"),
                      "pids": pids}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("manager, pool, config", [
    ("NaiveRewardManager", "pool", {"timeout_s": 1, "fallback_score": -1.0}),
    ("AsyncRewardManager", "loop.pool", {"timeout_s": 1, "default_score": -1.0, "max_concurrency": 4}),
], ids=["naive", "async"])
def test_a_scorer_stuck_in_a_regular_expression_costs_its_samples_not_the_run(python_run, scorer_file, manager, pool,
                                                                             config):
    code = STUCK_RUN.format(words=WORDS, path=str(scorer_file), manager=manager, pool=pool, config=config)
    result = python_run(code, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["seconds"] < 60, f"{report['seconds']:.1f} s for 6 samples with timeout_s=1"
    assert report["scores"] == [1.0, -1.0, 0.0, 1.0, -1.0, 1.0]
    metrics = report["metrics"]
    assert (metrics["reward/timeouts"], metrics["reward/killed"], metrics["reward/errors"]) == (2, 2, 2)
    [event] = report["events"]
    assert (event["check"], event["role"]) == ("scorer", "reward")
    assert event["figures"]["killed"] == 2 and event["figures"]["rows"] == [1, 4]
    assert event["figures"]["timeout_s"] == 1 and "my_reward.py" in event["figures"]["scorer"]
    assert not any(alive(pid) for pid in report["pids"])


# -- processes overrunning, dying, raising --------------------------------------------------------------

def test_a_sample_over_its_deadline_has_its_process_killed_and_the_rest_continue_in_a_new_one(tokenizer, scorer_file):
    manager = NaiveRewardManager(CustomScorer(scorer_file), tokenizer, {"timeout_s": 1, "fallback_score": -1.0})
    try:
        output = manager(reward_batch(tokenizer, ["4", "sleep", "4"], ["4"] * 3))
        assert scores_of(output) == [1.0, -1.0, 1.0]
        metrics = output.meta_info["reward_metrics"]
        assert (metrics["reward/timeouts"], metrics["reward/killed"]) == (1, 1)
        assert output.meta_info["health_events"][0]["figures"]["rows"] == [1]
        assert len(manager.pool.pids()) == 1  # the replacement
    finally:
        manager.close()


def test_a_batch_call_over_its_deadline_fails_every_row_with_one_kill(tokenizer, scorer_file, monkeypatch, request):
    # a module-level function goes to the scorer process by its module's name, with this sys.path
    monkeypatch.syspath_prepend(str(scorer_file.parent))
    request.addfinalizer(lambda: sys.modules.pop("my_reward", None))
    compute_scores = importlib.import_module("my_reward").compute_scores
    manager = BatchRewardManager(compute_scores, tokenizer, {"timeout_s": 1, "fallback_score": -1.0})
    try:
        output = manager(reward_batch(tokenizer, ["4", "sleep"], ["4"] * 2))
    finally:
        manager.close()
    assert scores_of(output) == [-1.0, -1.0]
    assert output.meta_info["reward_metrics"]["reward/killed"] == 1
    assert output.meta_info["health_events"][0]["figures"] == {
        "killed": 1, "timeout_s": 1.0, "scorer": "my_reward.compute_scores", "rows": [0, 1]}


def test_a_scorer_process_that_dies_is_an_error_not_a_hang_and_the_pool_recovers(tokenizer, scorer_file):
    manager = NaiveRewardManager(CustomScorer(scorer_file), tokenizer,
                                 {"timeout_s": 30, "isolation": "process", "fallback_score": -1.0})
    try:
        output = manager(reward_batch(tokenizer, ["4", "crash", "4"], ["4"] * 3))
        again = manager(reward_batch(tokenizer, ["4"], ["4"]))
    finally:
        manager.close()
    assert scores_of(output) == [1.0, -1.0, 1.0] and scores_of(again) == [1.0]
    metrics = output.meta_info["reward_metrics"]
    assert (metrics["reward/errors"], metrics["reward/timeouts"], metrics["reward/killed"]) == (1, 0, 0)
    assert "health_events" not in output.meta_info


def test_a_scorer_exception_comes_back_with_its_traceback(tokenizer, scorer_file, caplog):
    manager = NaiveRewardManager(CustomScorer(scorer_file), tokenizer, {"timeout_s": 30, "isolation": "process"})
    try:
        with caplog.at_level(logging.ERROR, logger="rlplat_rewards"):
            output = manager(reward_batch(tokenizer, ["raise", "4"], ["4"] * 2))
        failing = NaiveRewardManager(CustomScorer(scorer_file), tokenizer,
                                     {"timeout_s": 30, "isolation": "process", "raise_on_error": True})
        with pytest.raises(RuntimeError, match="row 0.*ValueError: bad sample"):
            failing(reward_batch(tokenizer, ["raise"], ["4"]))
        failing.close()
    finally:
        manager.close()
    assert scores_of(output) == [0.0, 1.0]
    assert output.meta_info["reward_metrics"]["reward/errors"] == 1
    assert "Traceback in the scorer process" in caplog.text and f'File "{scorer_file}"' in caplog.text


def test_an_async_def_scorer_is_awaited_in_its_scorer_process(tokenizer, scorer_file):
    manager = NaiveRewardManager(CustomScorer(scorer_file, "compute_score_async"), tokenizer,
                                 {"timeout_s": 30, "isolation": "process"})
    try:
        output = manager(reward_batch(tokenizer, ["4", "5"], ["4"] * 2))
        pids = manager.pool.pids()
    finally:
        manager.close()
    assert scores_of(output) == [0.25, 0.25]
    assert set(output.non_tensor_batch["pid"]) == set(pids) and os.getpid() not in pids


def test_a_scorer_process_imports_no_torch_its_scorer_does_not(tokenizer, scorer_file):
    manager = NaiveRewardManager(CustomScorer(scorer_file), tokenizer, {"timeout_s": 30})
    try:
        output = manager(reward_batch(tokenizer, ["torch"], ["4"]))
    finally:
        manager.close()
    assert list(output.non_tensor_batch["torch_imported"]) == [False]


def test_the_async_manager_carries_kills_from_the_rollout_workers_columns(tokenizer, scorer_file):
    manager = AsyncRewardManager(CustomScorer(scorer_file), tokenizer, {"timeout_s": 1, "default_score": -1.0})
    batch = reward_batch(tokenizer, ["4", "sleep", "4"], ["4"] * 3)
    try:
        scoring = run_async(manager.trajectory_scorer().score_all(decode_samples(batch, tokenizer)))
    finally:
        manager.close()
    batch.non_tensor_batch.update(scoring.columns())
    output = manager.scores_from_rollout(batch)
    assert scores_of(output) == [1.0, -1.0, 1.0]
    assert output.meta_info["reward_metrics"]["reward/killed"] == 1
    [event] = output.meta_info["health_events"]
    assert event["figures"] == {"killed": 1, "timeout_s": 1.0, "scorer": manager.loop.name, "rows": [1]}


# -- thread isolation -----------------------------------------------------------------------------------

def test_thread_isolation_keeps_the_timeout_on_a_thread(tokenizer, no_scorer_process):
    release = threading.Event()

    def spins_on_five(data_source, solution_str, ground_truth, extra_info=None):
        while solution_str == "5" and not release.is_set():  # a Python-level loop: it gives the GIL up
            pass
        return 1.0

    manager = NaiveRewardManager(spins_on_five, tokenizer, {"timeout_s": 0.5, "isolation": "thread"})
    try:
        output = manager(reward_batch(tokenizer, ["4", "5", "4"], ["4"] * 3))
    finally:
        release.set()
    assert manager.pool is None
    assert scores_of(output) == [1.0, 0.0, 1.0]
    metrics = output.meta_info["reward_metrics"]
    assert (metrics["reward/timeouts"], metrics["reward/killed"]) == (1, 0)
    assert "health_events" not in output.meta_info


# -- where a scorer runs --------------------------------------------------------------------------------

@pytest.mark.parametrize("scorer", [exact_match, gsm8k.score, gsm8k.score_flexible, hendrycks_math.score],
                         ids=["exact_match", "gsm8k", "gsm8k_flexible", "math"])
def test_known_safe_scorers_stay_in_this_process(tokenizer, no_scorer_process, scorer):
    naive = NaiveRewardManager(scorer, tokenizer, {"timeout_s": 1})
    assert naive.pool is None and AsyncRewardManager(scorer, tokenizer, {"timeout_s": 1}).loop.pool is None
    assert scores_of(naive(reward_batch(tokenizer, ["4"], ["5"]))) == [0.0]


class Routes(DataSourceScorer):
    def __init__(self, claims):
        super().__init__()
        self.routes = claims

    def claims(self):
        return self.routes


def test_the_default_scorer_is_safe_when_every_scorer_it_routes_to_is():
    assert isolation.known_safe(Routes({"openai/gsm8k": "gsm8k", "lighteval/MATH": "math"}))
    assert not isolation.known_safe(Routes({"openai/gsm8k": "gsm8k", "math500": "math_verify"}))


def test_math_verify_is_not_known_safe():
    # its parsers' regular expressions and sympy's big integers run in C, beyond its own watchdog
    assert not isolation.known_safe(math_verify_scorer.score)


def test_a_users_function_gets_a_process_only_with_a_deadline_under_auto(tokenizer, scorer_file):
    scorer = CustomScorer(scorer_file)
    assert isolation.scorer_pool(scorer, "auto", None, 1, "f") is None
    assert isolation.scorer_pool(scorer, "auto", 1.0, 1, "f") is not None
    assert isolation.scorer_pool(scorer, "process", None, 1, "f") is not None
    assert isolation.scorer_pool(scorer, "thread", 1.0, 1, "f") is None


def test_a_closure_stays_on_a_thread_under_auto_and_is_refused_under_process(tokenizer, caplog):
    def closure(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    with caplog.at_level(logging.WARNING, logger="rlplat_rewards.isolation"):
        assert NaiveRewardManager(closure, tokenizer, {"timeout_s": 1}).pool is None
    assert "runs on a thread" in caplog.text
    with pytest.raises(ValueError, match="isolation=process: the scorer .*closure.* cannot be rebuilt"):
        NaiveRewardManager(closure, tokenizer, {"timeout_s": 1, "isolation": "process"})


@pytest.mark.parametrize("manager", [NaiveRewardManager, AsyncRewardManager], ids=["naive", "async"])
@pytest.mark.parametrize("key, value, message", [
    ("isolation", "fork", r"reward.config.isolation: expected auto\|thread\|process, got 'fork'"),
    ("processes", 0, r"reward.config.processes: expected an integer >= 1 \(scorer processes\), got 0"),
])
def test_a_bad_isolation_setting_is_refused_naming_the_key(tokenizer, manager, key, value, message):
    with pytest.raises(ConfigError, match=message):
        manager(exact_match, tokenizer, {key: value})


# -- no orphans -----------------------------------------------------------------------------------------

def test_no_scorer_process_outlives_close_or_garbage_collection(tokenizer, scorer_file):
    closed = NaiveRewardManager(CustomScorer(scorer_file), tokenizer, {"timeout_s": 30, "processes": 2})
    closed(reward_batch(tokenizer, ["4"] * 4, ["4"] * 4))
    collected = AsyncRewardManager(CustomScorer(scorer_file), tokenizer, {"timeout_s": 30})
    collected(reward_batch(tokenizer, ["4"], ["4"]))
    pids, more = closed.pool.pids(), collected.loop.pool.pids()
    assert len(pids) == 2 and len(more) == 1 and all(map(alive, pids + more))
    closed.close()
    del collected
    gc.collect()
    assert not any(map(alive, pids + more))


@pytest.mark.slow
def test_no_scorer_process_outlives_the_interpreter(python_run, scorer_file):
    result = python_run(f"""
        from rlplat.scorers import CustomScorer
        from rlplat.testing import reward_batch, word_tokenizer
        from rlplat_rewards.managers import NaiveRewardManager

        tokenizer = word_tokenizer({WORDS!r})
        manager = NaiveRewardManager(CustomScorer({str(scorer_file)!r}), tokenizer, {{"timeout_s": 30}})
        manager(reward_batch(tokenizer, ["4"], ["4"]))
        print(*manager.pool.pids(), flush=True)
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    pids = [int(pid) for pid in result.stdout.split()]
    assert pids and not any(map(alive, pids))


@pytest.mark.slow
def test_a_scorer_process_dies_with_a_killed_caller(scorer_file, tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from rlplat.scorers import CustomScorer
        from rlplat_rewards.isolation import ScorerDescription, ScorerPool

        pool = ScorerPool(ScorerDescription.of(CustomScorer({str(scorer_file)!r})))
        future = pool.submit({{"data_source": "t", "solution_str": "sleep", "ground_truth": "4"}}, None)
        while not pool.pids():
            pass
        print(*pool.pids(), flush=True)
        future.result()
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    bound = threading.Timer(120, caller.kill)  # a caller that never prints fails the test, not hangs it
    bound.start()
    try:
        pids = [int(pid) for pid in caller.stdout.readline().split()]
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(30)
        bound.cancel()
    deadline = time.monotonic() + 30
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and not any(map(alive, pids))
