"""The verifiers adapter without a training run: the demo environment's rubric on known answers, the row
mapped to a verifiers rollout input, and ``rlplat_verifiers.agent.run`` driving verifiers' own rollout and
scoring against a scripted policy endpoint."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from rlplat_verifiers import agent, arithmetic

ROW = {"raw_prompt": [{"role": "user", "content": "49+12="}], "data_source": "arith_chat",
       "reward_model": {"ground_truth": "61"}, "extra_info": {"split": "train", "index": 7}, "uid": "u-7"}


def run_with(policy_class, replies, task=ROW, **agent_kwargs):
    """``agent.run(task, ...)`` against a policy answering ``replies``: (its result, the requests it got)."""

    async def main():
        async with policy_class(replies) as policy:
            result = await agent.run(task, policy.base_url, "key", **agent_kwargs)
        return result, policy.requests

    return asyncio.run(main())


@pytest.mark.parametrize("reply, reward, integer", [("61", 1.0, 1.0), (" 61\n", 1.0, 1.0), ("62", 0.0, 1.0),
                                                     ("sixty-one", 0.0, 0.0)])
def test_the_rubric_rewards_exactly_the_right_answer(scripted_policy, reply, reward, integer):
    result, _ = run_with(scripted_policy, [reply])
    assert result["reward"] == reward
    assert result["metrics"]["verifiers/correct_answer"] == reward
    assert result["metrics"]["verifiers/integer_answer"] == integer
    assert result["metrics"]["verifiers/truncated"] == 0.0 and result["metrics"]["verifiers/invalid_response"] == 0.0


def test_an_empty_reply_is_a_wrong_answer_not_a_failed_row(scripted_policy):
    """verifiers ends the rollout with EmptyModelResponseError; the policy sampled it, so it trains as 0."""
    result, _ = run_with(scripted_policy, [""])
    assert result["reward"] == 0.0
    assert result["metrics"]["verifiers/invalid_response"] == 1.0


def test_the_environment_asks_once_with_the_row_prompt_and_the_model_name(scripted_policy):
    _, requests = run_with(scripted_policy, ["61"], model="policy-under-training")
    assert len(requests) == 1
    assert requests[0]["messages"] == [{"role": "user", "content": "49+12="}]
    assert requests[0]["model"] == "policy-under-training"


def test_the_environment_system_prompt_goes_first_as_verifiers_formats_its_datasets(scripted_policy):
    kwargs = {"system_prompt": "Answer with the number only."}
    _, requests = run_with(scripted_policy, ["61"], environment_kwargs=kwargs)
    assert requests[0]["messages"] == [{"role": "system", "content": "Answer with the number only."},
                                       {"role": "user", "content": "49+12="}]


def test_the_rollout_input_of_a_row():
    environment = agent.load_environment(agent.DEFAULT_ENVIRONMENT)
    assert agent.rollout_input(ROW, environment) == {
        "prompt": [{"role": "user", "content": "49+12="}], "example_id": 7, "answer": "61",
        "info": {"split": "train", "index": 7}}
    numeric = {**ROW, "reward_model": {"ground_truth": 61}, "extra_info": {}}
    assert agent.rollout_input(numeric, environment)["answer"] == "61"
    assert agent.rollout_input(numeric, environment)["example_id"] == 0


def test_a_row_without_a_chat_prompt_is_refused():
    environment = agent.load_environment(agent.DEFAULT_ENVIRONMENT)
    with pytest.raises(ValueError, match="raw_prompt"):
        agent.rollout_input({**ROW, "raw_prompt": None}, environment)


def test_a_refused_request_fails_the_row_instead_of_scoring_it(scripted_policy):
    refusal = {"status": 400, "message": "the trajectory's response budget is spent", "code": "invalid_request"}
    with pytest.raises(RuntimeError, match="ended in error"):
        run_with(scripted_policy, [refusal])


def test_the_environment_is_built_once_per_process_and_arguments():
    first = agent.load_environment(agent.DEFAULT_ENVIRONMENT, {"count": 5})
    assert agent.load_environment(agent.DEFAULT_ENVIRONMENT, {"count": 5}) is first
    assert agent.load_environment(agent.DEFAULT_ENVIRONMENT, {"count": 6}) is not first
    assert len(first.get_dataset()) == 5


def test_a_path_to_something_else_than_an_environment_is_refused():
    with pytest.raises(TypeError, match="not a verifiers Environment"):
        agent.load_environment("rlplat_verifiers.arithmetic:questions", {"count": 1, "seed": 0})
    with pytest.raises(ValueError, match="cannot import"):
        agent.load_environment("no_such_module:load_environment")
    with pytest.raises(ValueError, match="has no"):
        agent.load_environment("rlplat_verifiers.arithmetic:no_such_function")


def test_the_demo_questions_are_the_demo_task():
    rows = arithmetic.questions(50, seed=1)
    for row in rows:
        a, b = map(int, row["question"].removesuffix("=").split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a + b)
    assert arithmetic.questions(50, seed=1) == rows


def keep_handler(signum, frame):
    """A worker's own handler, which building an environment must leave in place."""


def test_building_an_environment_leaves_the_worker_signal_handlers(monkeypatch):
    previous = {signum: signal.signal(signum, keep_handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        agent.load_environment(agent.DEFAULT_ENVIRONMENT, {"count": 3, "seed": 11})  # verifiers installs its own
        assert signal.getsignal(signal.SIGTERM) is keep_handler and signal.getsignal(signal.SIGINT) is keep_handler
        errors = []

        def build_off_the_main_thread():
            try:
                agent.load_environment(agent.DEFAULT_ENVIRONMENT, {"count": 3, "seed": 12})
            except Exception as error:  # collected for the assertion below
                errors.append(error)

        thread = threading.Thread(target=build_off_the_main_thread)
        thread.start()
        thread.join()
        assert errors == []
        assert signal.getsignal(signal.SIGTERM) is keep_handler and signal.getsignal(signal.SIGINT) is keep_handler
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
