"""The conformance suites of rlplat.testing pass a correct implementation and catch broken ones.

Each suite is written as a plugin author's test module, once with a correct implementation and once with
a broken one; all of them run in one pytest subprocess (torch cannot be imported twice in one process,
which pytester's in-process runs would do), and each case checks its two modules' outcomes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`


@dataclass
class ModuleRun:
    """One suite module's outcomes in the shared run: counts by outcome, and its report as pytest prints
    it: each failing test's id and details, then the short summary (``FAILED id - message``)."""

    counts: dict[str, int] = field(default_factory=lambda: {"passed": 0, "failed": 0, "skipped": 0, "errors": 0})
    details: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return self.details + self.summary

    @property
    def ret(self) -> int:
        return 1 if self.counts["failed"] or self.counts["errors"] else 0

    def assert_outcomes(self, passed: int = 0, failed: int = 0, skipped: int = 0, errors: int = 0) -> None:
        assert self.counts == {"passed": passed, "failed": failed, "skipped": skipped, "errors": errors}, "\n".join(self.lines)

    def fnmatch_lines(self, patterns: list[str]) -> None:
        pytest.LineMatcher(self.lines).fnmatch_lines(patterns)


SUITES = {}  # module name -> (template, implementation, declared plugin API); filled below, next to each suite
TODAY = ">=1.1,<2"  # the plugin API range of an implementation written for the current API


def suite_run(template: str, implementation: str, plugin_api: str | None = TODAY) -> str:
    """A suite module: ``IMPLEMENTATION`` in ``template`` becomes ``implementation`` and ``PLUGIN_API`` the
    range the test class declares (None: it declares none, which is API 1.0)."""
    name = f"test_suite_{len(SUITES)}"
    SUITES[name] = (template, implementation, plugin_api)
    return name


SCORER_SUITE = """
    import pytest
    from rlplat.testing import RewardScorerConformance, ScorerCase

    def good(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth}

    def broken(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info is not None:
            extra_info["seen"] = True
        return "right" if solution_str == ground_truth else "wrong"

    class Forgetful:
        # scores by an answer key that a pickled copy loses: picklable (API 1.0 asked no more), but a reward
        # worker's copy would score otherwise (API 1.1 asks that it does not)

        def __init__(self, answers=("4",)):
            self.answers = answers

        def __reduce__(self):
            return Forgetful, ((),)

        def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str.strip() in self.answers)

    class TestScorer(RewardScorerConformance):
        @pytest.fixture
        def scorer(self):
            return IMPLEMENTATION

        @pytest.fixture
        def scorer_cases(self):
            return [ScorerCase("t", "4", "4", {"id": 1}, 1.0), ScorerCase("t", "5", "4", None, 0.0)]

        @pytest.fixture
        def plugin_api(self):
            return PLUGIN_API
"""
SCORER_SUITE_GOOD = suite_run(SCORER_SUITE, "good")
SCORER_SUITE_BROKEN = suite_run(SCORER_SUITE, "broken")
SCORER_SUITE_FORGETFUL_API_1_0 = suite_run(SCORER_SUITE, "Forgetful()", None)
SCORER_SUITE_FORGETFUL_API_1_1 = suite_run(SCORER_SUITE, "Forgetful()")

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
ESTIMATOR_SUITE_GOOD = suite_run(ESTIMATOR_SUITE, "good")
ESTIMATOR_SUITE_BROKEN = suite_run(ESTIMATOR_SUITE, "broken")

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

    def four_modes(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
        # written for API 1.0: aggregates its four modes itself (no token-sum)
        per_token = -advantages * torch.exp(log_prob - old_log_prob) * response_mask
        if loss_agg_mode == "token-mean":
            return per_token.sum() / response_mask.sum(), {}
        if loss_agg_mode == "seq-mean-token-sum":
            return per_token.sum(-1).mean(), {}
        if loss_agg_mode == "seq-mean-token-mean":
            return (per_token.sum(-1) / response_mask.sum(-1)).mean(), {}
        if loss_agg_mode == "seq-mean-token-sum-norm":
            return per_token.sum(-1).mean() / per_token.shape[-1], {}
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")

    class TestLoss(PolicyLossConformance):
        @pytest.fixture
        def policy_loss(self):
            return IMPLEMENTATION

        @pytest.fixture
        def policy_loss_config(self):
            return {}

        @pytest.fixture
        def plugin_api(self):
            return PLUGIN_API
"""
LOSS_SUITE_GOOD = suite_run(LOSS_SUITE, "good")
LOSS_SUITE_BROKEN = suite_run(LOSS_SUITE, "broken")
LOSS_SUITE_FOUR_MODES_API_1_0 = suite_run(LOSS_SUITE, "four_modes", None)
LOSS_SUITE_FOUR_MODES_API_1_1 = suite_run(LOSS_SUITE, "four_modes")

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

    def without_critic_loss():
        # as API 1.0 asked of an algorithm without a critic: no critic loss
        return Algorithm(name="kit", adv_estimator="kit_estimator", policy_loss="kit_loss", actor_loss=SumLoss,
                         critic_loss=None)

    class TestAlgorithm(AlgorithmConformance):
        @pytest.fixture(autouse=True)
        def parts(self, register_temporary_plugin):
            register_temporary_plugin(Parts(), name="kit-parts")

        @pytest.fixture
        def algorithm(self):
            return IMPLEMENTATION()

        @pytest.fixture
        def plugin_api(self):
            return PLUGIN_API
"""
ALGORITHM_SUITE_GOOD = suite_run(ALGORITHM_SUITE, "good")
ALGORITHM_SUITE_BROKEN = suite_run(ALGORITHM_SUITE, "broken")
ALGORITHM_SUITE_NO_CRITIC_LOSS_API_1_0 = suite_run(ALGORITHM_SUITE, "without_critic_loss", None)
ALGORITHM_SUITE_NO_CRITIC_LOSS_API_1_1 = suite_run(ALGORITHM_SUITE, "without_critic_loss")

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
COMMAND_SUITE_GOOD = suite_run(COMMAND_SUITE, "good")
COMMAND_SUITE_BROKEN = suite_run(COMMAND_SUITE, "broken")


OBSERVER_SUITE = """
    import pytest
    from rlplat.contracts.observer import StepObserver
    from rlplat.testing import StepObserverConformance

    class Counting(StepObserver):
        # counts the stages it saw and reports how many rows a step trained
        def start(self, run):
            self.seen = []

        def on_stage(self, name, batch, metrics):
            self.seen.append(name)
            if name == "trained":
                metrics["observed/rows"] = float(len(batch))

    class Meddling(Counting):
        # changes what it watches, reports a word and fails a failed run again
        def on_stage(self, name, batch, metrics):
            if name == "prepared":
                batch.batch["advantages"] = batch.batch["advantages"] * 2
            if name == "trained":
                metrics["observed/verdict"] = "fine"

        def finish(self, state, error=None):
            if error is not None:
                raise RuntimeError("finish") from error

    class TestObserver(StepObserverConformance):
        @pytest.fixture
        def observer_factory(self):
            return lambda run: IMPLEMENTATION()
"""
OBSERVER_SUITE_GOOD = suite_run(OBSERVER_SUITE, "Counting")
OBSERVER_SUITE_BROKEN = suite_run(OBSERVER_SUITE, "Meddling")


@pytest.fixture(scope="module")
def suite_runs(tmp_path_factory) -> dict[str, ModuleRun]:
    """Every suite module written to one directory and run by one pytest subprocess; the outcomes per module."""
    directory = tmp_path_factory.mktemp("suites")
    (directory / "pytest.ini").write_text("[pytest]\n")
    for name, (template, implementation, plugin_api) in SUITES.items():
        source = template.replace("IMPLEMENTATION", implementation).replace("PLUGIN_API", repr(plugin_api))
        (directory / f"{name}.py").write_text(textwrap.dedent(source))
    report = directory / "report.xml"
    environment = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}
    finished = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}",
                               f"--basetemp={directory / 'tmp'}", str(directory)],
                              cwd=directory, capture_output=True, text=True, env=environment, timeout=600)
    assert report.exists(), finished.stdout[-3000:] + finished.stderr[-3000:]
    runs = {name: ModuleRun() for name in SUITES}
    for case in ElementTree.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")[0]
        run = runs[module]
        node = f"{case.get('classname')}::{case.get('name')}"
        problems = [child for child in case if child.tag in ("failure", "error")]
        if any(child.tag == "error" for child in problems):
            run.counts["errors"] += 1
        elif problems:
            run.counts["failed"] += 1
        elif any(child.tag == "skipped" for child in case):
            run.counts["skipped"] += 1
        else:
            run.counts["passed"] += 1
        for problem in problems:
            run.details.append(f"_____ {node} _____")
            run.details.extend((problem.text or "").splitlines())
            run.summary.append(f"{'ERROR' if problem.tag == 'error' else 'FAILED'} {node} - {problem.get('message', '')}")
    return runs


def test_scorer_suite(suite_runs):
    suite_runs[SCORER_SUITE_GOOD].assert_outcomes(passed=9, skipped=1)
    broken = suite_runs[SCORER_SUITE_BROKEN]
    broken.assert_outcomes(passed=2, failed=7, skipped=1)
    broken.fnmatch_lines(["*test_does_not_modify_its_inputs*", "*test_cases_score_as_expected*"])


def test_the_scorer_suite_asks_an_api_1_0_scorer_only_to_pickle_and_an_api_1_1_one_to_score_alike_pickled(suite_runs):
    suite_runs[SCORER_SUITE_FORGETFUL_API_1_0].assert_outcomes(passed=8, skipped=2)
    later = suite_runs[SCORER_SUITE_FORGETFUL_API_1_1]
    later.assert_outcomes(passed=8, failed=1, skipped=1)
    later.fnmatch_lines(["FAILED *test_a_pickled_copy_scores_as_the_original*"])


def test_estimator_suite(suite_runs):
    suite_runs[ESTIMATOR_SUITE_GOOD].assert_outcomes(passed=6)
    broken = suite_runs[ESTIMATOR_SUITE_BROKEN]
    broken.assert_outcomes(passed=4, failed=2)
    broken.fnmatch_lines(["*test_is_zero_where_the_response_mask_is_zero*", "*test_mismatched_shapes_raise*"])


def test_the_policy_loss_suite_asks_an_api_1_0_loss_four_modes_and_an_api_1_1_one_token_sum_too(suite_runs):
    suite_runs[LOSS_SUITE_FOUR_MODES_API_1_0].assert_outcomes(passed=12, skipped=3)  # token-sum twice, registered_name
    later = suite_runs[LOSS_SUITE_FOUR_MODES_API_1_1]
    later.assert_outcomes(passed=12, failed=2, skipped=1)
    later.fnmatch_lines(["FAILED *test_returns_a_finite_scalar*token-sum*unknown loss_agg_mode 'token-sum'*",
                         "FAILED *test_masked_tokens_get_no_gradient*token-sum*"])


def test_policy_loss_suite(suite_runs):
    suite_runs[LOSS_SUITE_GOOD].assert_outcomes(passed=14, skipped=1)
    broken = suite_runs[LOSS_SUITE_BROKEN]
    broken.fnmatch_lines(["*test_masked_tokens_get_no_gradient*", "*test_unknown_aggregation_mode*"])
    assert broken.ret != 0


def test_algorithm_suite_and_the_temporary_plugin_fixture(suite_runs):
    suite_runs[ALGORITHM_SUITE_GOOD].assert_outcomes(passed=8, skipped=1)
    broken = suite_runs[ALGORITHM_SUITE_BROKEN]
    broken.assert_outcomes(passed=5, failed=3, skipped=1)
    broken.fnmatch_lines(["*Did you mean 'kit_estimator'*", "*unknown config key 'algorithm.gama'*"])


def test_the_algorithm_suite_asks_a_critic_loss_of_every_algorithm_from_api_1_1_only(suite_runs):
    suite_runs[ALGORITHM_SUITE_NO_CRITIC_LOSS_API_1_0].assert_outcomes(passed=7, skipped=2)
    later = suite_runs[ALGORITHM_SUITE_NO_CRITIC_LOSS_API_1_1]
    later.assert_outcomes(passed=7, failed=1, skipped=1)
    later.fnmatch_lines(["FAILED *test_builds_its_critic_loss_from_its_default_critic_config*defines no critic_loss*"])


def test_step_observer_suite(suite_runs):
    suite_runs[OBSERVER_SUITE_GOOD].assert_outcomes(passed=4)
    broken = suite_runs[OBSERVER_SUITE_BROKEN]
    broken.assert_outcomes(passed=1, failed=3)
    broken.fnmatch_lines(["*prepared: tensor column 'advantages' changed*", "*observed/verdict*", "*RuntimeError*finish*"])


def test_command_suite(suite_runs):
    suite_runs[COMMAND_SUITE_GOOD].assert_outcomes(passed=2)
    suite_runs[COMMAND_SUITE_BROKEN].assert_outcomes(failed=2)


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
PARSER_SUITE_GOOD = suite_run(PARSER_SUITE, "Good")
PARSER_SUITE_BROKEN = suite_run(PARSER_SUITE, "Broken")

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
TOOL_SUITE_GOOD = suite_run(TOOL_SUITE, "Good")
TOOL_SUITE_BROKEN = suite_run(TOOL_SUITE, "Broken")

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
ENVIRONMENT_SUITE_GOOD = suite_run(ENVIRONMENT_SUITE, "Good")
ENVIRONMENT_SUITE_BROKEN = suite_run(ENVIRONMENT_SUITE, "Broken")

AGENT_LOOP_SUITE = """
    import dataclasses
    import pytest
    from rlplat_agents.chat import ChatRenderer
    from rlplat.contracts.agent import AgentContext, AgentLoop
    from rlplat.kits.agent import TrajectoryBuilder
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
AGENT_LOOP_SUITE_GOOD = suite_run(AGENT_LOOP_SUITE, "Good")
AGENT_LOOP_SUITE_BROKEN = suite_run(AGENT_LOOP_SUITE, "Broken")


def test_tool_call_parser_suite(suite_runs):
    suite_runs[PARSER_SUITE_GOOD].assert_outcomes(passed=16)
    broken = suite_runs[PARSER_SUITE_BROKEN]
    broken.fnmatch_lines(["*test_format_then_parse_gives_the_calls_back*", "*test_text_without_calls_is_content*"])
    assert broken.ret != 0


def test_tool_suite(suite_runs):
    suite_runs[TOOL_SUITE_GOOD].assert_outcomes(passed=6)
    broken = suite_runs[TOOL_SUITE_BROKEN]
    broken.fnmatch_lines(["*test_bad_arguments_are_an_error_result_not_an_exception*"])
    assert broken.ret != 0


def test_environment_suite(suite_runs):
    suite_runs[ENVIRONMENT_SUITE_GOOD].assert_outcomes(passed=4)
    broken = suite_runs[ENVIRONMENT_SUITE_BROKEN]
    broken.fnmatch_lines(["*test_solving_answer_ends_with_more_reward_than_failing*", "*test_does_not_modify_the_row*"])
    assert broken.ret != 0


def test_agent_loop_suite(suite_runs):
    suite_runs[AGENT_LOOP_SUITE_GOOD].assert_outcomes(passed=5)
    broken = suite_runs[AGENT_LOOP_SUITE_BROKEN]
    broken.fnmatch_lines(["*test_trajectories_hold_exactly_the_sampled_tokens*"])
    assert broken.ret != 0


ROLLOUT_SUITE = """
    import dataclasses
    import pytest
    from rlplat.testing import RolloutEngineConformance, TinyModelRolloutFixtures
    from rlplat.testing.tiny_models import save_tiny_model
    from rlplat_rollout_hf.rollout import HFRollout

    class Unseeded(HFRollout):
        # samples from its own generator whatever the seed, and says so
        honours_seeds = False

        def generate(self, prompts, sampling):
            return super().generate(prompts, dataclasses.replace(sampling, seed=None))

        async def generate_tokens(self, prompt_ids, sampling):
            return await super().generate_tokens(prompt_ids, dataclasses.replace(sampling, seed=None))

    class ClaimsSeeds(Unseeded):
        honours_seeds = True

    class Stuck(Unseeded):
        # says it does not honour seeds, and samples greedily whatever it is asked
        def generate(self, prompts, sampling):
            return super().generate(prompts, dataclasses.replace(sampling, greedy=True))

    @pytest.fixture(scope="module")
    def built(tmp_path_factory):
        return IMPLEMENTATION({"model_path": save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)})

    class TestRollout(TinyModelRolloutFixtures, RolloutEngineConformance):
        @pytest.fixture
        def rollout(self, built):
            return built

        @pytest.fixture
        def plugin_api(self):
            return PLUGIN_API
"""
ROLLOUT_SUITE_UNSEEDED = suite_run(ROLLOUT_SUITE, "Unseeded")
ROLLOUT_SUITE_CLAIMS_SEEDS = suite_run(ROLLOUT_SUITE, "ClaimsSeeds")
ROLLOUT_SUITE_STUCK = suite_run(ROLLOUT_SUITE, "Stuck")


def test_the_rollout_suite_holds_a_rollout_without_seeds_to_greedy_repeats_and_sampling_that_varies(suite_runs):
    """A rollout that cannot honour seeds passes when it says so (``honours_seeds = False``), fails the seed test
    when it claims it can, and fails when it never samples (greedy whatever it is asked)."""
    suite_runs[ROLLOUT_SUITE_UNSEEDED].assert_outcomes(passed=20)
    claims = suite_runs[ROLLOUT_SUITE_CLAIMS_SEEDS]
    claims.fnmatch_lines(["*test_the_same_seed_gives_the_same_samples_and_another_seed_others*"])
    assert claims.ret != 0
    stuck = suite_runs[ROLLOUT_SUITE_STUCK]
    stuck.fnmatch_lines(["*two sampled calls drew the same tokens*"])
    assert stuck.ret != 0


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
JUDGE_PARSER_SUITE_GOOD = suite_run(JUDGE_PARSER_SUITE, "Good")
JUDGE_PARSER_SUITE_BROKEN = suite_run(JUDGE_PARSER_SUITE, "Broken")


def test_judge_parser_suite(suite_runs):
    suite_runs[JUDGE_PARSER_SUITE_GOOD].assert_outcomes(passed=26)
    broken = suite_runs[JUDGE_PARSER_SUITE_BROKEN]
    broken.fnmatch_lines(["*test_cases_parse_as_expected*", "*test_scores_fall_in_the_declared_range*"])
    assert broken.ret != 0
