"""The generative judge: its parsers (kind ``judge_parser``), its config node checked at load, the
``judge`` role, and the ``judge`` reward manager asking a real tiny judge model served by the hf rollout.

Two judges are built locally on the arithmetic tokenizer (digits, ``+``, ``=``): a random one, whose answers
(digit strings) never hold a ``<score>`` tag, so every row takes the parse-failure path; and one whose output
layer is zero except for the rows of ``7`` and ``3`` (one vector and its negative), so every greedy token
it writes is a digit and each answer reads as a number.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlplat import registry
from rlplat.config import ConfigError, load_config
from rlplat.contracts.role import RunContext
from rlplat.controller.host import WorkerSpec
from rlplat.controller.local_backend import LocalWorkerGroup
from rlplat.kits.data import write_parquet
from rlplat_judge.manager import JudgeConfig, JudgeRewardManager, build_parser, render
from rlplat.protocol import DataProto
from rlplat.testing import JudgeParserCase, JudgeParserConformance, RewardManagerConformance, RoleConformance
from rlplat.testing.chat_tokenizers import CHATML_TOOLS, save_chat_tokenizer
from rlplat.testing.tiny_models import arithmetic_tokenizer, save_tiny_model, tiny_causal_lm
from rlplat.trainer.tracking import read_metrics
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

TEMPLATE = "{question}{response}="
QUESTIONS = ["12+34=", "5+6=", "40+2=", "7+7="]
RESPONSES = ["46", "11", "9", "14"]


def save_digit_judge(directory) -> str:
    """A judge whose greedy tokens are always ``7`` or ``3``: untied output layer, zero but for those rows."""
    tokenizer = arithmetic_tokenizer()
    model = tiny_causal_lm(seed=1, tie_word_embeddings=False)
    with torch.no_grad():
        head = model.lm_head.weight
        direction = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
        head.zero_()
        head[tokenizer.convert_tokens_to_ids("7")] = direction
        head[tokenizer.convert_tokens_to_ids("3")] = -direction
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": question}], "reward_model": {"ground_truth": str(eval(question[:-1]))}}
            for question in QUESTIONS]
    template = root / "judge_prompt.txt"
    template.write_text(TEMPLATE)
    chat_judge = root / "chat_judge"
    save_chat_tokenizer(chat_judge, CHATML_TOOLS)
    return {"policy": save_tiny_model(root / "policy", seed=0), "random_judge": save_tiny_model(root / "random_judge", seed=3),
            "digit_judge": save_digit_judge(root / "digit_judge"), "chat_judge": str(chat_judge),
            "train": write_parquet(rows, root / "train.parquet"), "template": str(template)}


def policy_batch(questions=QUESTIONS, responses=RESPONSES) -> DataProto:
    """Rows as the reward step sees them: responses right padded (EOS included), raw chat prompts."""
    tokenizer = arithmetic_tokenizer()
    encoded = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text in responses]
    width = max(map(len, encoded)) + 1
    tokens = torch.zeros(len(encoded), width, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for row, ids in enumerate(encoded):
        tokens[row, : len(ids)], mask[row, : len(ids)] = torch.tensor(ids), 1
    raw_prompts = np.empty(len(questions), dtype=object)
    raw_prompts[:] = [[{"role": "system", "content": "add"}, {"role": "user", "content": question}] for question in questions]
    return DataProto.from_dict({"responses": tokens, "response_mask": mask}, non_tensors={
        "raw_prompt": raw_prompts, "data_source": ["arith"] * len(questions),
        "reward_model": [{"ground_truth": str(eval(question[:-1]))} for question in questions]})


def judge_node(model_path, **settings):
    return {"model_path": model_path, "prompt_template": TEMPLATE, "apply_chat_template": False, **settings}


def judge_group(node) -> LocalWorkerGroup:
    group = LocalWorkerGroup(WorkerSpec(ActorRolloutRefWorker, JudgeConfig(**node).worker_config()), role="judge", init_distributed=False)
    group.init_model()
    return group


@pytest.fixture(scope="module")
def digit_node(assets):
    return judge_node(assets["digit_judge"], parser="number", parser_config={"min_score": 0, "max_score": 99},
                      normalize=True, max_new_tokens=2)


@pytest.fixture(scope="module")
def digit_group(digit_node):
    group = judge_group(digit_node)
    yield group
    group.shutdown()


def bound_manager(node, group) -> JudgeRewardManager:
    manager = JudgeRewardManager(None, arithmetic_tokenizer(), node)
    manager.bind_workers({"actor": None, "judge": group})
    return manager


# -- parsers ----------------------------------------------------------------------------------------------

PARSER_CASES = {
    "number": ({"min_score": 0, "max_score": 10}, [JudgeParserCase("I would rate it 7.", 7.0), JudgeParserCase("Scores 2, then 8.5", 8.5),
                                                     JudgeParserCase("x=-3 and 5-3", 3.0), JudgeParserCase("no digits here", None),
                                                     JudgeParserCase("it is 11", None), JudgeParserCase("-1", None)]),
    "tagged": ({"min_score": 1, "max_score": 5}, [JudgeParserCase("<score>4</score>", 4.0), JudgeParserCase("<score>1</score> no, <score> 2.5 </score>", 2.5),
                                                   JudgeParserCase("4 out of 5", None), JudgeParserCase("<score>9</score>", None),
                                                   JudgeParserCase("<score>four</score>", None)]),
    "yes_no": ({}, [JudgeParserCase("Yes.", 1.0), JudgeParserCase("no, because yes is wrong", 0.0), JudgeParserCase("YES", 1.0),
                    JudgeParserCase("nothing yesterday", None), JudgeParserCase("", None)]),
}


class TestBuiltInParsers(JudgeParserConformance):
    @pytest.fixture(params=sorted(PARSER_CASES))
    def name(self, request):
        return request.param

    @pytest.fixture
    def judge_parser(self, name):
        return registry.get("judge_parser", name)(PARSER_CASES[name][0])

    @pytest.fixture
    def judge_parser_cases(self, name):
        return PARSER_CASES[name][1]


def test_parsers_read_the_configured_position_pattern_and_words():
    assert build_parser("number", {"position": "first"}).parse("7 then 3") == 7.0
    assert build_parser("tagged", {"position": "first"}).parse("<score>1</score><score>2</score>") == 1.0
    assert build_parser("tagged", {"pattern": r"Rating: \[\[(\d+)\]\]"}).parse("Rating: [[6]]") == 6.0
    yes_no = build_parser("yes_no", {"yes": ["correct"], "no": ["incorrect", "wrong"], "position": "last"})
    assert yes_no.parse("Correct at first sight, but wrong.") == 0.0
    assert yes_no.score_range() == (0.0, 1.0)
    assert build_parser("number", {}).score_range() is None


@pytest.mark.parametrize("name, config, message", [
    ("tagged", {"pattern": r"<score>\d+</score>"}, "must have exactly one group"),
    ("tagged", {"pattern": "(unclosed"}, "not a valid regular expression"),
    ("number", {"min_score": 5, "max_score": 5}, "must be below max_score"),
    ("yes_no", {"yes": ["ok"], "no": ["OK"]}, r"\['ok'\] are both yes and no words"),
    ("number", {"position": "middle"}, "expected one of 'last', 'first'"),
])
def test_a_bad_parser_config_is_an_error_naming_the_key(name, config, message):
    with pytest.raises(ValueError, match=message):
        build_parser(name, config)


# -- the config node, checked at load ----------------------------------------------------------------------

def run_overrides(assets, output_dir, *extra):
    return [
        f"model.path={assets['policy']}", f"data.train_files=[{assets['train']}]", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=3", "actor.micro_batch_size_per_gpu=4",
        "cluster.backend=local", f"trainer.output_dir={output_dir}", "trainer.logger=[jsonl]", "trainer.total_training_steps=2",
        "reward.manager=judge", f"reward.config.prompt_template_path={assets['template']}", "reward.config.apply_chat_template=false",
        *extra,
    ]


@pytest.mark.parametrize("extra, message", [
    ([], r"reward.config: model_path is not set: give the judge model's local Hugging Face directory"),
    (["reward.config.model_path={policy}", "reward.config.parser=numbr"],
     r"unknown judge parser 'numbr'; the judge parsers are number, tagged, yes_no. Did you mean 'number'\?"),
    (["reward.config.model_path={policy}", "reward.config.parser=number", "reward.config.parser_config.max_scor=3"],
     r"unknown config key 'reward.config.parser_config.max_scor'. Did you mean 'reward.config.parser_config.max_score'"),
    (["reward.config.model_path={policy}", "reward.config.parser=number", "reward.config.normalize=true"],
     "normalize=true needs a score range"),
    (["reward.config.model_path={policy}", "reward.config.rollout_config.model_path=/elsewhere"],
     "rollout_config.model_path is set from reward.config.model_path"),
    (["reward.config.model_path={policy}", "reward.config.rollout_config.dtpe=float32"],
     r"unknown config key 'reward.config.rollout_config.dtpe'. Did you mean 'reward.config.rollout_config.dtype'"),
    (["reward.config.model_path={policy}", "reward.config.rollout=vlm"], r"reward.config: rollout: unknown rollout 'vlm'; available: hf, sglang, vllm. Did you mean 'vllm'\?"),
    (["reward.config.model_path={policy}", "reward.config.prompt_template=Judge"], "both set"),
    (["reward.config.model_path={policy}", "reward.config.max_new_tokens=0"], "max_new_tokens must be >= 1"),
    (["reward.config.model_path={policy}", "reward.config.truncation=right"], r"reward.config.truncation: expected one of"),
    (["reward.config.model_path={policy}", "roles.judge.placement=separate"], "roles.judge.placement=separate needs cluster.backend=ray"),
])
def test_a_bad_judge_node_fails_at_load(assets, tmp_path, extra, message):
    extra = [item.format(policy=assets["policy"]) for item in extra]
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=run_overrides(assets, tmp_path, *extra))


def test_a_template_without_the_response_is_refused(assets, tmp_path):
    template = tmp_path / "bad.txt"
    template.write_text("{question} is hard")
    with pytest.raises(ValueError, match=r"has no \{response\} placeholder"):
        JudgeConfig(model_path=assets["policy"], prompt_template_path=str(template))


# -- the role --------------------------------------------------------------------------------------------

@pytest.fixture
def judge_run(assets, tmp_path):
    config = load_config(overrides=run_overrides(assets, tmp_path, f"reward.config.model_path={assets['random_judge']}"))
    return RunContext(config, registry.get("algorithm", "grpo")(), total_steps=2)


class TestJudgeRole(RoleConformance):
    @pytest.fixture
    def role(self):
        return registry.get("role", "judge")()

    @pytest.fixture
    def run_context(self, judge_run):
        return judge_run


def test_the_judge_role_serves_the_judge_model_from_a_rollout_only_worker(assets, judge_run):
    role = registry.get("role", "judge")()
    assert role.enabled(judge_run) and role.default_placement == "colocated" and role.movable
    spec = role.worker(judge_run)
    assert spec.cls is ActorRolloutRefWorker
    config = spec.args[0]
    assert config["roles"] == ["rollout"] and config["rollout"] == "hf"
    assert config["rollout_config"] == {"model_path": assets["random_judge"], "load_weights": True}
    assert config["sampling"] == {"n": 1, "greedy": True, "temperature": 1.0, "max_new_tokens": 64}


def test_the_judge_role_is_off_without_the_judge_manager(assets, tmp_path):
    config = load_config(overrides=[item for item in run_overrides(assets, tmp_path) if not item.startswith("reward.")])
    assert not registry.get("role", "judge")().enabled(RunContext(config, registry.get("algorithm", "grpo")(), 1))


# -- the manager -----------------------------------------------------------------------------------------

def test_scoring_before_bind_workers_or_without_a_judge_group_is_an_error(assets):
    manager = JudgeRewardManager(None, arithmetic_tokenizer(), judge_node(assets["random_judge"]))
    with pytest.raises(RuntimeError, match=r"no judge worker group: call bind_workers\(groups\)"):
        manager(policy_batch())
    with pytest.raises(RuntimeError, match=r"scores through the 'judge' worker group, which this run did not build \(groups: actor\)"):
        manager.bind_workers({"actor": None})


def test_a_judge_tokenizer_without_a_chat_template_needs_apply_chat_template_false(assets):
    with pytest.raises(ValueError, match="has no chat template: set reward.config.apply_chat_template=false"):
        JudgeRewardManager(None, arithmetic_tokenizer(), judge_node(assets["random_judge"], apply_chat_template=True))


def test_the_judge_prompt_is_the_rendered_template_in_the_judge_chat_template(assets):
    from transformers import AutoTokenizer

    manager = JudgeRewardManager(None, arithmetic_tokenizer(), {"model_path": assets["chat_judge"], "prompt_template": "Q: {question} A: {response} T: {ground_truth}"})
    prompts, truncated = manager.judge_prompts(policy_batch())
    chat = AutoTokenizer.from_pretrained(assets["chat_judge"])
    expected = chat.apply_chat_template([{"role": "user", "content": "Q: 5+6= A: 11 T: 11"}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert prompts[1] == list(expected) and truncated == 0


def test_a_placeholder_inside_a_response_is_not_expanded():
    assert render("{response} / {question}", {"response": "{question}", "question": "q"}) == "{question} / q"


@pytest.mark.parametrize("policy, expected", [("left", "2+34=46="), ("middle", "[BOS]12+=46=")])
def test_a_long_judge_prompt_loses_its_start_or_its_middle(assets, policy, expected):
    manager = JudgeRewardManager(None, arithmetic_tokenizer(), judge_node(assets["random_judge"], max_prompt_length=8, truncation=policy))
    prompts, truncated = manager.judge_prompts(policy_batch())
    assert arithmetic_tokenizer().decode(prompts[0]) == expected  # full: [BOS]12+34=46=, 10 tokens
    assert truncated == 1  # the other rows fit


def test_truncation_error_names_the_row(assets):
    manager = JudgeRewardManager(None, arithmetic_tokenizer(), judge_node(assets["random_judge"], max_prompt_length=8, truncation="error"))
    with pytest.raises(ValueError, match="row 0: the judge prompt has 10 tokens, over reward.config.max_prompt_length=8"):
        manager.judge_prompts(policy_batch())


def test_unreadable_judge_answers_get_the_default_score_and_are_counted(assets):
    node = judge_node(assets["random_judge"], default_score=-0.5, max_new_tokens=6)  # tagged parser: needs <score>..</score>
    group = judge_group(node)
    try:
        batch = policy_batch()
        output = bound_manager(node, group)(batch)
    finally:
        group.shutdown()
    scores = output.batch["token_level_scores"]
    assert scores[:, [2, 2, 1, 2]].diagonal().tolist() == [-0.5] * 4  # at each row's EOS, the last valid token
    assert int((scores != 0).sum()) == 4
    texts = list(output.non_tensor_batch["judge_text"])
    assert len(texts) == 4 and all(isinstance(text, str) and "<score>" not in text for text in texts)
    assert any(texts), "the random judge wrote nothing at all: the path under test was not exercised"
    metrics = output.meta_info["reward_metrics"]
    assert metrics["reward/judge/parse_failures"] == 4 and metrics["reward/errors"] == 4
    assert metrics["reward/judge/score/mean"] == metrics["reward/judge/score/min"] == metrics["reward/judge/score/max"] == -0.5
    assert metrics["timing_s/reward_judge"] > 0


def direct_answers(model_path, texts, max_new_tokens) -> list[str]:
    """The judge model's greedy answers through transformers alone, one unpadded prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_path), AutoModelForCausalLM.from_pretrained(model_path).eval()
    answers = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


@pytest.fixture(scope="module")
def digit_answers(assets):
    return direct_answers(assets["digit_judge"], [q + r + "=" for q, r in zip(QUESTIONS, RESPONSES)], max_new_tokens=2)


def test_readable_answers_are_parsed_and_normalised(digit_node, digit_group, digit_answers):
    output = bound_manager(digit_node, digit_group)(policy_batch())
    answers = digit_answers
    assert all(len(answer) == 2 and set(answer) <= {"3", "7"} for answer in answers), answers
    assert list(output.non_tensor_batch["judge_text"]) == answers
    expected = [int(answer) / 99 for answer in answers]  # number parser in [0, 99], normalised
    assert output.batch["token_level_scores"].sum(-1).tolist() == pytest.approx(expected)
    metrics = output.meta_info["reward_metrics"]
    assert metrics["reward/judge/parse_failures"] == 0
    assert metrics["reward/judge/score/max"] == pytest.approx(max(expected))
    assert metrics["reward/judge/score/min"] == pytest.approx(min(expected))


class TestJudgeManagerConformance(RewardManagerConformance):
    @pytest.fixture
    def reward_manager(self, digit_node, digit_group):
        return bound_manager(digit_node, digit_group)

    @pytest.fixture
    def reward_batch(self):
        return policy_batch()

    @pytest.fixture
    def expected_scores(self, digit_answers):
        return [int(answer) / 99 for answer in digit_answers]


# -- a training run ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_trains_two_steps_rewarded_by_the_colocated_judge_which_keeps_its_weights(assets, tmp_path):
    from safetensors.torch import load_file

    from rlplat.trainer import Trainer

    run = tmp_path / "run"
    config = load_config(overrides=run_overrides(assets, run, f"reward.config.model_path={assets['digit_judge']}",
                                                 "reward.config.parser=number", "reward.config.parser_config.min_score=0",
                                                 "reward.config.parser_config.max_score=99", "reward.config.normalize=true",
                                                 "reward.config.max_new_tokens=2", "actor.optim.lr=1e-2"))
    trainer = Trainer(config)
    try:
        trainer.fit()
        groups = trainer.placement.groups
        assert set(groups) == {"actor", "judge"} and groups["judge"].backend is groups["actor"].backend  # one process
        judge = groups["judge"].backend.host.workers["judge"].rollout.model.state_dict()
    finally:
        trainer.shutdown()
    saved = load_file(f"{assets['digit_judge']}/model.safetensors")
    assert all(torch.equal(judge[name], tensor) for name, tensor in saved.items())  # the policy's updates never reached it
    metrics = [row for row in read_metrics(run) if "reward/judge/parse_failures" in row]
    assert [row["step"] for row in metrics] == [1, 2]
    for row in metrics:
        assert row["reward/judge/parse_failures"] == 0 and 0 < row["reward/judge/score/mean"] < 1
        assert row["timing_s/reward_judge"] > 0


@pytest.mark.slow
def test_the_judge_in_a_pool_of_its_own_scores_a_ray_run(assets, tmp_path, local_ray):
    from rlplat.trainer import Trainer

    run = tmp_path / "run"
    config = load_config(overrides=run_overrides(assets, run, f"reward.config.model_path={assets['digit_judge']}",
                                                 "reward.config.parser=number", "reward.config.max_new_tokens=2",
                                                 "cluster.backend=ray", "roles.judge.placement=separate"))
    trainer = Trainer(config)
    try:
        trainer.fit()
        groups = trainer.placement.groups
        assert {name: group.world_size for name, group in groups.items()} == {"actor": 1, "judge": 1}
        assert not set(groups["actor"].pids()) & set(groups["judge"].pids()) and len(trainer.placement.pools) == 2
    finally:
        trainer.shutdown()
    metrics = [row for row in read_metrics(run) if "reward/judge/parse_failures" in row]
    assert [row["step"] for row in metrics] == [1, 2]
    assert all(row["reward/judge/parse_failures"] == 0 and 33 <= row["reward/judge/score/mean"] <= 77 for row in metrics)


def test_relative_paths_become_absolute_for_workers_elsewhere(assets, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(assets["digit_judge"]).parent)
    settings = JudgeConfig(model_path="digit_judge", prompt_template_path="judge_prompt.txt")
    assert settings.worker_config()["rollout_config"]["model_path"] == assets["digit_judge"]
    assert settings.prompt_template_path == assets["template"] and settings.template_text() == TEMPLATE
