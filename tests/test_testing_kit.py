"""The conformance suites of rlplat.testing pass a correct implementation and catch broken ones.

Each case writes a plugin author's test module with pytester and runs it in a subprocess (torch
cannot be imported twice in one process, which pytester's in-process runs would do).
"""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

SCORER_SUITE = """
    import pytest
    from rlplat.testing import RewardScorerConformance, ScorerCase

    def good(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth}

    def broken(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info is not None:
            extra_info["seen"] = True
        return "right" if solution_str == ground_truth else "wrong"

    class TestScorer(RewardScorerConformance):
        @pytest.fixture
        def scorer(self):
            return IMPLEMENTATION

        @pytest.fixture
        def scorer_cases(self):
            return [ScorerCase("t", "4", "4", {"id": 1}, 1.0), ScorerCase("t", "5", "4", None, 0.0)]
"""

ESTIMATOR_SUITE = """
    import pytest
    import torch
    from rlplat.testing import AdvantageEstimatorConformance

    def good(token_level_rewards, response_mask, index, values=None, config=None):
        if token_level_rewards.shape != response_mask.shape:
            raise ValueError(f"shape mismatch: {tuple(token_level_rewards.shape)} vs {tuple(response_mask.shape)}")
        scores = token_level_rewards.sum(-1)
        baseline = torch.stack([scores[torch.from_numpy(index == group)].mean() for group in index])
        advantages = (scores - baseline)[:, None] * response_mask
        return advantages, advantages.clone()

    def broken(token_level_rewards, response_mask, index, values=None, config=None):
        scores = token_level_rewards.sum(-1)
        advantages = (scores - scores.mean())[:, None].expand_as(token_level_rewards).clone()
        return advantages, advantages

    class TestEstimator(AdvantageEstimatorConformance):
        @pytest.fixture
        def estimator(self):
            return IMPLEMENTATION

        @pytest.fixture
        def estimator_config(self):
            return None
"""

LOSS_SUITE = """
    import pytest
    import torch
    from rlplat.losses import aggregate_loss
    from rlplat.testing import PolicyLossConformance

    def good(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
        ratio = torch.exp(log_prob - old_log_prob)
        loss = aggregate_loss(-advantages * ratio, response_mask, loss_agg_mode)
        return loss, {"actor/ratio_mean": float(ratio.detach().mean())}

    def broken(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
        ratio = torch.exp(log_prob - old_log_prob)
        return (-advantages * ratio).mean(), {"actor/ratio_mean": ratio.mean()}

    class TestLoss(PolicyLossConformance):
        @pytest.fixture
        def policy_loss(self):
            return IMPLEMENTATION

        @pytest.fixture
        def policy_loss_config(self):
            return {}
"""

ALGORITHM_SUITE = """
    import pytest
    from rlplat import hookimpl
    from rlplat.contracts.algorithm import Algorithm
    from rlplat.testing import AlgorithmConformance

    class Parts:
        @hookimpl
        def register_advantage_estimators(self, register):
            register("kit_estimator", "json:dumps")

        @hookimpl
        def register_policy_losses(self, register):
            register("kit_loss", "json:loads")

    class SumLoss:
        def __init__(self, config):
            self.config = config

        def __call__(self, outputs, micro_batch):
            return outputs["log_probs"].sum(), {}

    def good():
        return Algorithm(name="kit", adv_estimator="kit_estimator", policy_loss="kit_loss", default_config={"gamma": 1.0},
                         actor_loss=SumLoss)

    def broken():
        return Algorithm(name="kit", adv_estimator="kit_estimatr", policy_loss="kit_loss", needs_critic="yes",
                         default_config={"gama": 0.9})

    class TestAlgorithm(AlgorithmConformance):
        @pytest.fixture(autouse=True)
        def parts(self, register_temporary_plugin):
            register_temporary_plugin(Parts(), name="kit-parts")

        @pytest.fixture
        def algorithm(self):
            return IMPLEMENTATION()
"""

COMMAND_SUITE = """
    import pytest
    import typer
    from rlplat.testing import CommandConformance

    good = typer.Typer(help="Things.")

    @good.command()
    def show():
        typer.echo("shown")

    broken = "not a command"

    class TestCommand(CommandConformance):
        @pytest.fixture
        def command(self):
            return IMPLEMENTATION

        @pytest.fixture
        def command_name(self):
            return "things"
"""


def run_suite(pytester, template: str, implementation: str):
    pytester.makepyfile(test_suite=textwrap.dedent(template.replace("IMPLEMENTATION", implementation)))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")


def test_scorer_suite(pytester):
    run_suite(pytester, SCORER_SUITE, "good").assert_outcomes(passed=8, skipped=1)
    broken = run_suite(pytester, SCORER_SUITE, "broken")
    broken.assert_outcomes(passed=1, failed=7, skipped=1)
    broken.stdout.fnmatch_lines(["*test_does_not_modify_its_inputs*", "*test_cases_score_as_expected*"])


def test_estimator_suite(pytester):
    run_suite(pytester, ESTIMATOR_SUITE, "good").assert_outcomes(passed=6)
    broken = run_suite(pytester, ESTIMATOR_SUITE, "broken")
    broken.assert_outcomes(passed=4, failed=2)
    broken.stdout.fnmatch_lines(["*test_is_zero_where_the_response_mask_is_zero*", "*test_mismatched_shapes_raise*"])


def test_policy_loss_suite(pytester):
    run_suite(pytester, LOSS_SUITE, "good").assert_outcomes(passed=13)
    broken = run_suite(pytester, LOSS_SUITE, "broken")
    broken.stdout.fnmatch_lines(["*test_masked_tokens_get_no_gradient*", "*test_unknown_aggregation_mode*"])
    assert broken.ret != 0


def test_algorithm_suite_and_the_temporary_plugin_fixture(pytester):
    run_suite(pytester, ALGORITHM_SUITE, "good").assert_outcomes(passed=8, skipped=1)
    broken = run_suite(pytester, ALGORITHM_SUITE, "broken")
    broken.assert_outcomes(passed=5, failed=3, skipped=1)
    broken.stdout.fnmatch_lines(["*Did you mean 'kit_estimator'*", "*unknown config key 'algorithm.gama'*"])


def test_command_suite(pytester):
    run_suite(pytester, COMMAND_SUITE, "good").assert_outcomes(passed=2)
    run_suite(pytester, COMMAND_SUITE, "broken").assert_outcomes(failed=2)


def test_isolated_registry_starts_empty_and_temporary_plugins_are_removed(isolated_registry, register_temporary_plugin):
    from rlplat import hookimpl, registry

    class Plugin:
        @hookimpl
        def register_reward_scorers(self, register):
            register("kit_temporary_scorer", "json:dumps")

    assert all(isolated_registry.names(kind) == [] for kind in ("engine", "reward_scorer", "algorithm"))
    register_temporary_plugin(Plugin(), name="kit-temporary")
    assert "kit_temporary_scorer" in registry.names("reward_scorer")


PARSER_SUITE = """
    import json, re
    import pytest
    from rlplat.contracts.agent import ParsedTurn, ToolCall, ToolCallParser
    from rlplat.testing import ToolCallParserConformance

    class Good(ToolCallParser):
        CALL = re.compile(r"<<(.*?)>>", re.DOTALL)

        def parse(self, text):
            calls, errors = [], []
            for body in self.CALL.findall(text):
                try:
                    value = json.loads(body)
                    calls.append(ToolCall(value["name"], value.get("arguments", {})))
                except (ValueError, KeyError, TypeError) as error:
                    errors.append(str(error))
            return ParsedTurn(self.CALL.sub("", text).strip(), tuple(calls), tuple(errors))

        def format(self, calls, content=""):
            return content + "".join("<<" + json.dumps({"name": c.name, "arguments": c.arguments}) + ">>" for c in calls)

    class Broken(Good):
        def parse(self, text):
            bodies = self.CALL.findall(text)
            return ParsedTurn("", tuple(ToolCall(json.loads(b)["name"], {}) for b in bodies))

    class TestParser(ToolCallParserConformance):
        @pytest.fixture
        def parser(self):
            return IMPLEMENTATION()
"""

TOOL_SUITE = """
    import pytest
    from rlplat.contracts.agent import Tool, ToolResult
    from rlplat.testing import ToolCase, ToolConformance

    class Good(Tool):
        @classmethod
        def default_schema(cls):
            return {"type": "function", "function": {"name": "upper", "parameters": {"type": "object"}}}

        async def call(self, arguments, state):
            text = arguments.get("text")
            if not isinstance(text, str):
                return ToolResult("error: upper needs 'text'", error=True)
            return ToolResult(text.upper())

    class Broken(Good):
        async def call(self, arguments, state):
            return ToolResult(arguments["text"].upper())

    class TestTool(ToolConformance):
        @pytest.fixture
        def tool(self):
            return IMPLEMENTATION()

        @pytest.fixture
        def tool_cases(self):
            return [ToolCase({"text": "ab"}, "AB"), ToolCase({"text": 3}, "error", error=True)]
"""

ENVIRONMENT_SUITE = """
    import pytest
    from rlplat.contracts.agent import EnvStep, Environment
    from rlplat.testing import EnvironmentCase, EnvironmentConformance

    class Good(Environment):
        async def reset(self, row):
            self.answer = row["answer"]

        async def step(self, response):
            if response.strip() == self.answer:
                return EnvStep(None, reward=1.0, done=True)
            return EnvStep("no", reward=0.0)

    class Broken(Environment):
        async def reset(self, row):
            self.row = row

        async def step(self, response):
            self.row["tries"] = self.row.get("tries", 0) + 1
            return EnvStep("", reward=float(response == self.row["answer"]), done=False)

    class TestEnvironment(EnvironmentConformance):
        @pytest.fixture
        def make_environment(self):
            return IMPLEMENTATION

        @pytest.fixture
        def environment_cases(self):
            return [EnvironmentCase({"answer": "4"}, "4", "5")]
"""

AGENT_LOOP_SUITE = """
    import dataclasses
    import pytest
    from rlplat.agent.chat import ChatRenderer
    from rlplat.contracts.agent import AgentContext, AgentLoop, TrajectoryBuilder
    from rlplat.contracts.rollout import SamplingParams
    from rlplat.testing import AgentLoopConformance, ScriptedClient
    from rlplat.testing.chat_tokenizers import CHATML_TOOLS, chat_tokenizer

    class Good(AgentLoop):
        async def run(self, row, client, context):
            builder = TrajectoryBuilder(context.prompt_ids, context.response_length)
            for turn in range(2):
                if builder.remaining <= 0:
                    break
                output = await client.generate(builder.ids, dataclasses.replace(context.sampling, max_new_tokens=builder.remaining))
                builder.add_model(output)
                if not builder.add_context(context.renderer.delta_ids([{"role": "user", "content": "again"}])):
                    return builder.build(turn + 1, "length")
            return builder.build(2, "stop")

    class Broken(AgentLoop):
        async def run(self, row, client, context):
            builder = TrajectoryBuilder(context.prompt_ids, context.response_length)
            output = await client.generate(builder.ids, dataclasses.replace(context.sampling, max_new_tokens=context.response_length))
            builder.add_model(output)
            text = context.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            builder.response_ids = context.tokenizer.encode(" " + text, add_special_tokens=False)[:context.response_length]
            builder.response_mask = [1] * len(builder.response_ids)
            builder.rollout_log_probs = [-0.25] * len(builder.response_ids)
            return builder.build(1, "stop")

    TOKENIZER = chat_tokenizer(CHATML_TOOLS)
    RENDERER = ChatRenderer(TOKENIZER)

    class TestLoop(AgentLoopConformance):
        @pytest.fixture
        def agent_loop(self):
            return IMPLEMENTATION()

        @pytest.fixture
        def agent_rows(self):
            return [{"raw_prompt": [{"role": "user", "content": "hi"}]}]

        @pytest.fixture
        def agent_context(self):
            prompt = RENDERER.prompt_ids([{"role": "user", "content": "hi"}])
            return AgentContext(TOKENIZER, RENDERER, SamplingParams(), 64, prompt)

        @pytest.fixture
        def make_client(self):
            return lambda: ScriptedClient(TOKENIZER, ["hello there"], TOKENIZER.convert_tokens_to_ids("<|im_end|>"))
"""


def test_tool_call_parser_suite(pytester):
    run_suite(pytester, PARSER_SUITE, "Good").assert_outcomes(passed=16)
    broken = run_suite(pytester, PARSER_SUITE, "Broken")
    broken.stdout.fnmatch_lines(["*test_format_then_parse_gives_the_calls_back*", "*test_text_without_calls_is_content*"])
    assert broken.ret != 0


def test_tool_suite(pytester):
    run_suite(pytester, TOOL_SUITE, "Good").assert_outcomes(passed=6)
    broken = run_suite(pytester, TOOL_SUITE, "Broken")
    broken.stdout.fnmatch_lines(["*test_bad_arguments_are_an_error_result_not_an_exception*"])
    assert broken.ret != 0


def test_environment_suite(pytester):
    run_suite(pytester, ENVIRONMENT_SUITE, "Good").assert_outcomes(passed=4)
    broken = run_suite(pytester, ENVIRONMENT_SUITE, "Broken")
    broken.stdout.fnmatch_lines(["*test_solving_answer_ends_with_more_reward_than_failing*", "*test_does_not_modify_the_row*"])
    assert broken.ret != 0


def test_agent_loop_suite(pytester):
    run_suite(pytester, AGENT_LOOP_SUITE, "Good").assert_outcomes(passed=5)
    broken = run_suite(pytester, AGENT_LOOP_SUITE, "Broken")
    broken.stdout.fnmatch_lines(["*test_trajectories_hold_exactly_the_sampled_tokens*"])
    assert broken.ret != 0


JUDGE_PARSER_SUITE = """
    import re
    import pytest
    from rlplat.contracts.reward import JudgeParser
    from rlplat.testing import JudgeParserCase, JudgeParserConformance

    class Good(JudgeParser):
        def parse(self, text):
            found = re.findall(r"\\d+", text)
            if not found:
                raise ValueError(f"no number in {text!r}")
            score = float(found[-1])
            if not 0 <= score <= 10:
                raise ValueError(f"{score} is outside [0, 10]")
            return score

        def score_range(self):
            return (0.0, 10.0)

    class Broken(Good):
        def parse(self, text):
            return float(re.findall(r"\\d+", text)[-1])

    class TestParser(JudgeParserConformance):
        @pytest.fixture
        def judge_parser(self):
            return IMPLEMENTATION()

        @pytest.fixture
        def judge_parser_cases(self):
            return [JudgeParserCase("Rating: 7", 7.0), JudgeParserCase("I cannot say.", None)]
"""


def test_judge_parser_suite(pytester):
    run_suite(pytester, JUDGE_PARSER_SUITE, "Good").assert_outcomes(passed=26)
    broken = run_suite(pytester, JUDGE_PARSER_SUITE, "Broken")
    broken.stdout.fnmatch_lines(["*test_cases_parse_as_expected*", "*test_scores_fall_in_the_declared_range*"])
    assert broken.ret != 0
