"""The OpenEnv adapter without a training run: the demo environment and its rubric, the environment served
on 127.0.0.1 and stepped through OpenEnv's own client, and ``rlplat_openenv.agent.run`` playing episodes
against a scripted policy endpoint."""

from __future__ import annotations

import asyncio

import pytest

from rlplat_openenv import agent, server
from rlplat_openenv.arithmetic import FEEDBACK, ArithmeticAction, ArithmeticEnvironment

ROW = {"raw_prompt": [{"role": "user", "content": "49+12="}], "data_source": "arith_chat",
       "reward_model": {"ground_truth": "61"}, "extra_info": {"split": "train", "index": 7}, "uid": "u-7"}


def play(policy_class, replies, task=ROW, **agent_kwargs):
    """``agent.run(task, ...)`` against a policy answering ``replies``: (its result, the requests it got)."""

    async def main():
        async with policy_class(replies) as policy:
            result = await agent.run(task, policy.base_url, "key", **agent_kwargs)
        return result, policy.requests

    return asyncio.run(main())


# -- the environment itself ---------------------------------------------------------------------------------


def test_a_right_answer_scores_1_and_ends_the_episode():
    environment = ArithmeticEnvironment()
    observation = environment.reset(task=ROW)
    assert observation.question == "49+12=" and not observation.done
    observation = environment.step(ArithmeticAction(answer=" 61 "))
    assert (observation.reward, observation.done, observation.correct, observation.feedback) == (1.0, True, True, "")
    assert environment.rubric.last_score == 1.0


def test_a_wrong_answer_scores_0_and_gets_feedback_until_the_attempts_are_spent():
    environment = ArithmeticEnvironment(max_attempts=2)
    environment.reset(task=ROW)
    first = environment.step(ArithmeticAction(answer="60"))
    assert (first.reward, first.done, first.feedback, first.attempts) == (0.0, False, FEEDBACK, 1)
    second = environment.step(ArithmeticAction(answer="62"))
    assert (second.reward, second.done, second.feedback, second.attempts) == (0.0, True, "", 2)
    assert environment.state.step_count == 2


def test_reset_poses_a_given_question_or_draws_one_from_the_seed():
    environment = ArithmeticEnvironment()
    assert environment.reset(question="2+2=", answer="4", max_attempts=1).question == "2+2="
    assert environment.state.max_attempts == 1
    drawn = environment.reset(seed=5).question
    assert drawn == ArithmeticEnvironment().reset(seed=5).question
    a, b = map(int, drawn.removesuffix("=").split("+"))
    assert 10 <= a <= 99 and 10 <= b <= 99 and environment.state.answer == str(a + b)


def test_stepping_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="reset"):
        ArithmeticEnvironment().step(ArithmeticAction(answer="1"))


# -- served on 127.0.0.1, stepped with OpenEnv's client -----------------------------------------------------


def test_the_app_is_served_once_per_process_on_loopback():
    url = server.serve(agent.DEFAULT_APP)
    assert url.startswith("http://127.0.0.1:") and server.serve(agent.DEFAULT_APP) == url


def test_sessions_of_the_served_environment_are_independent():
    from openenv.core.generic_client import GenericEnvClient

    url = server.serve(agent.DEFAULT_APP)
    other = {**ROW, "raw_prompt": [{"role": "user", "content": "10+15="}], "reward_model": {"ground_truth": "25"}}

    async def main():
        async with GenericEnvClient(base_url=url) as first, GenericEnvClient(base_url=url) as second:
            await first.reset(task=ROW)
            await second.reset(task=other)
            return await first.step({"answer": "25"}), await second.step({"answer": "25"})

    first, second = asyncio.run(main())
    assert (first.reward, first.done, first.observation["feedback"]) == (0.0, False, FEEDBACK)
    assert (second.reward, second.done) == (1.0, True)


def test_an_app_path_that_names_nothing_is_refused():
    with pytest.raises(ValueError, match="cannot import"):
        server.serve("no_such_module:app")
    with pytest.raises(ValueError, match="has no"):
        server.serve("rlplat_openenv.arithmetic:no_such_app")


# -- the agent function -------------------------------------------------------------------------------------


def test_the_episode_reward_is_the_environment_reward_after_feedback(scripted_policy):
    result, requests = play(scripted_policy, ["60", "61"])
    assert result == {"reward": 1.0, "metrics": {"openenv/steps": 2.0, "openenv/done": 1.0, "openenv/truncated": 0.0}}
    assert requests[0]["messages"] == [{"role": "user", "content": "49+12="}]
    assert requests[1]["messages"] == [{"role": "user", "content": "49+12="}, {"role": "assistant", "content": "60"},
                                       {"role": "user", "content": FEEDBACK}]


def test_three_wrong_answers_end_the_episode_with_reward_0(scripted_policy):
    result, requests = play(scripted_policy, ["1", "2", "3"])
    assert result["reward"] == 0.0 and result["metrics"]["openenv/steps"] == 3.0 and result["metrics"]["openenv/done"] == 1.0
    assert len(requests) == 3


def test_reset_kwargs_reach_the_environment(scripted_policy):
    result, requests = play(scripted_policy, ["1"], reset_kwargs={"max_attempts": 1})
    assert result["metrics"] == {"openenv/steps": 1.0, "openenv/done": 1.0, "openenv/truncated": 0.0}


def test_max_turns_stops_an_episode_the_environment_has_not_ended(scripted_policy):
    result, requests = play(scripted_policy, ["1", "2"], max_turns=2)
    assert result["metrics"] == {"openenv/steps": 2.0, "openenv/done": 0.0, "openenv/truncated": 0.0}
    assert len(requests[1]["messages"]) == 3  # no feedback turn is added after the last answer


def test_a_spent_token_budget_ends_the_episode_where_it_stands(scripted_policy):
    spent = {"status": 400, "message": "the trajectory's response budget of 40 tokens is spent", "code": "context_length_exceeded"}
    result, _ = play(scripted_policy, ["60", spent])
    assert result == {"reward": 0.0, "metrics": {"openenv/steps": 1.0, "openenv/done": 0.0, "openenv/truncated": 1.0}}


def test_any_other_refusal_fails_the_row(scripted_policy):
    import openai

    refusal = {"status": 400, "message": "malformed", "code": "invalid_request"}
    with pytest.raises(openai.BadRequestError):
        play(scripted_policy, [refusal])


def test_prompt_field_takes_the_first_turn_from_the_reset_observation(scripted_policy):
    task = {"uid": "u-8", "reward_model": {"ground_truth": "4"}}
    result, requests = play(scripted_policy, ["4"], task=task, prompt_field="question",
                            reset_kwargs={"question": "2+2=", "answer": "4"})
    assert requests[0]["messages"] == [{"role": "user", "content": "2+2="}]
    assert result["reward"] == 1.0


def test_a_missing_observation_field_is_named(scripted_policy):
    with pytest.raises(ValueError, match="no field 'hint'"):
        play(scripted_policy, ["60"], message_field="hint")
