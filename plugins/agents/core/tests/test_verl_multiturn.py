"""verl's gsm8k multi-turn-with-tool command line (examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh
with its config gsm8k_multiturn_grpo.yaml) on rlplat: data in verl's schema, verl's tools file naming the
user's own tool class, verl's keys as written; and a tools file no agent loop would read, refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlplat_agents.config import AgentConfig, check_tools_read
from rlplat.config_node import ConfigError, read_config_node

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "verl_gsm8k_multiturn"
SYSTEM = "Call `calc_gsm8k_reward`, then answer `#### <n>`."
QUESTIONS = [("Ann has 3 pens and buys 4. How many pens?", "7"), ("Bo has 9 cups and breaks 2. How many cups?", "7"),
             ("A box holds 6 eggs. How many eggs in 2 boxes?", "12"), ("Cy reads 5 pages a day. Pages in 3 days?", "15"),
             ("Di had 20 cents and spent 8. Cents left?", "12"), ("4 cats each have 4 legs. How many legs?", "16"),
             ("Ed picks 11 apples and eats 3. Apples left?", "8"), ("Fay saves 10 a week. Saved after 5 weeks?", "50")]
"""Short questions: the tiny model's context is 256 tokens, one per character."""


def gsm8k_rows(split: str, agent_name: str | None = "tool_agent") -> list[dict]:
    """Rows in the schema of verl's examples/data_preprocess/gsm8k_tool_agent_loop.py (with ``agent_name``) and
    gsm8k_multiturn_w_tool.py (without)."""
    rows = []
    for index, (question, answer) in enumerate(QUESTIONS):
        row = {"data_source": "openai/gsm8k",
               "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
               "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
               "extra_info": {"split": split, "index": index, "answer": f"#### {answer}", "question": question,
                              "need_tools_kwargs": True,
                              "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}},
                              "interaction_kwargs": {"query": question, "ground_truth": answer}}}
        if agent_name is not None:
            row["agent_name"] = agent_name
        rows.append(row)
    return rows


@pytest.fixture
def verl_files(tmp_path):
    """(train parquet, test parquet, tools file with a lifecycle log, the log)."""
    import yaml

    from rlplat.kits.data import write_parquet

    train = write_parquet(gsm8k_rows("train"), tmp_path / "train.parquet")
    test = write_parquet(gsm8k_rows("test")[:4], tmp_path / "test.parquet")
    tools = yaml.safe_load((FIXTURES / "gsm8k_tool_config.yaml").read_text())
    log = tmp_path / "tool.jsonl"
    tools["tools"][0]["config"]["log_path"] = str(log)
    tools_file = tmp_path / "gsm8k_tool_config.yaml"
    tools_file.write_text(yaml.safe_dump(tools))
    return train, test, tools_file, log


def verl_multiturn_command_line(model: Path, train: Path, test: Path, tools_file: Path, run: Path) -> list[str]:
    """verl's run_qwen2.5-3b_gsm8k_multiturn.sh and the multi_turn keys of its gsm8k_multiturn_grpo.yaml, sized for
    a tiny model on a CPU. Left out: what rlplat refuses with a reason (ref.fsdp_config.param_offload=True
    differing from the actor's, over_sample_rate=0.1, global_profiler.*); sglang is the hf rollout here. Added:
    what a CPU machine needs (trainer.device=cpu, cluster.backend=local), the scorer verl picks by data_source
    (reward.scorer=gsm8k), and the length of the run."""
    return [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=128",
        "data.max_response_length=64", "data.filter_overlong_prompts=True", "data.truncation=error",
        "data.return_raw_chat=True", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
        "actor_rollout_ref.rollout.multi_stage_wake_up=True", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.mode=async",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", 'trainer.logger=["console","file"]',
        "trainer.project_name=multi-turn-grpo-tiny", "trainer.experiment_name=cpu", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=20", "trainer.val_before_train=True",
        f"data.train_files={train}", f"data.val_files={test}",
        "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_file}",
        "actor_rollout_ref.rollout.multi_turn.format=hermes", "trainer.total_epochs=15",
        "trainer.device=cpu", "cluster.backend=local", "reward.scorer=gsm8k",
        "trainer.total_training_steps=2", f"trainer.default_local_dir={run}",
    ]


@pytest.mark.slow
def test_verls_gsm8k_multiturn_command_line_trains_two_steps_through_the_users_verl_tool(cli_run, verl_files, tmp_path):
    from rlplat_demo import tools as tool_demo

    train, test, tools_file, log = verl_files
    run = tmp_path / "run"
    result = cli_run("run", *verl_multiturn_command_line(tool_demo.model_dir(), train, test, tools_file, run),
                     pythonpath=FIXTURES, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for note in ("verl key actor_rollout_ref.rollout.multi_turn.tool_config_path -> agent.tools_config",
                 "verl key actor_rollout_ref.rollout.multi_turn.format -> agent.tool_parser",
                 "verl key actor_rollout_ref.rollout.multi_turn.max_assistant_turns -> agent.loops.tool.max_turns"):
        assert f"rlplat: {note}\n" in result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "agent/turns/mean" in record]
    assert [record["step"] for record in steps] == [1, 2]  # the rows' agent_name tool_agent ran the tool loop
    assert all("agent/tool_reward/mean" in record and "actor/kl_loss" in record for record in steps)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    created = [event for event in events if event["event"] == "create"]
    released = [event for event in events if event["event"] == "release"]
    # every conversation created one instance of the user's tool with its row's ground truth, and released it
    assert len(created) >= 2 * 4 * 2 and sorted(e["instance_id"] for e in created) == sorted(e["instance_id"] for e in released)
    assert {event["ground_truth"] for event in created} <= {answer for _, answer in QUESTIONS}


# -- a tools file no loop reads --------------------------------------------------------------------------------

def run_loops(config, data) -> set[str]:
    """The loops a run uses, as ``rlplat.config.check_agent`` finds them: agent.loop and the data's agent_name values."""
    from rlplat_agents.config import VERL_LOOP_NAMES
    from rlplat_agents.config import data_agent_names

    used = {config.agent.loop} if config.agent.loop else set()
    for key in ("train_files", "val_files"):
        used |= data_agent_names(list(data[key]))
    return {VERL_LOOP_NAMES.get(name, name) for name in used}


def loaded(tmp_path, rows: list[dict], *overrides: str):
    from rlplat.config import load_config
    from rlplat.kits.data import write_parquet
    from rlplat_demo import tools as tool_demo

    train = write_parquet(rows, tmp_path / "train.parquet")
    config = load_config(None, [f"model.path={tool_demo.model_dir()}", f"data.train_files=[{train}]", "cluster.backend=local",
                                f"agent.tools_config={FIXTURES / 'gsm8k_tool_config.yaml'}", *overrides], validate=False)
    return read_config_node(config.agent, AgentConfig, "agent"), run_loops(config, config.data)


def test_a_tools_file_with_no_loop_selected_is_refused_and_the_message_says_how_to_select_one(tmp_path):
    agent, loops = loaded(tmp_path, gsm8k_rows("train", agent_name=None))  # verl's gsm8k_multiturn_w_tool.py rows
    assert loops == set()
    with pytest.raises(ConfigError) as raised:
        check_tools_read(agent, loops)
    message = str(raised.value)
    assert message.startswith(f"agent.tools_config={agent.tools_config} is read by no agent loop: agent.loop is not set")
    assert "set agent.loop=tool (verl: actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent)" in message


def test_a_tools_file_with_only_loops_that_offer_no_tools_is_refused(tmp_path):
    agent, loops = loaded(tmp_path, gsm8k_rows("train", agent_name=None), "agent.loop=single_turn")
    with pytest.raises(ConfigError, match="read by no agent loop of this run: single_turn offers no tools"):
        check_tools_read(agent, loops)


def test_a_tools_file_the_tool_loop_reads_passes(tmp_path):
    check_tools_read(*loaded(tmp_path, gsm8k_rows("train")))  # agent_name tool_agent
    check_tools_read(*loaded(tmp_path, gsm8k_rows("train", agent_name=None), "agent.loop=tool"))
    check_tools_read(AgentConfig(), set())  # no tools file: nothing to read


def test_a_plugin_loop_that_does_not_say_whether_it_offers_tools_is_trusted(register_temporary_plugin):
    from rlplat import hookimpl
    from rlplat.contracts.agent import AgentLoop

    class Browser(AgentLoop):
        async def run(self, row, client, context):
            raise NotImplementedError

    class Plugin:
        @hookimpl
        def register_agent_loops(self, register):
            register("browser", Browser)

    register_temporary_plugin(Plugin(), name="browser-loop")
    check_tools_read(AgentConfig(tools_config="tools.yaml"), {"browser"})
    with pytest.raises(ConfigError, match="env, single_turn offer no tools"):
        check_tools_read(AgentConfig(tools_config="tools.yaml"), {"single_turn", "env"})


def test_verls_command_line_with_rows_naming_no_loop_is_refused_at_load_in_one_line(cli_in_process, verl_files, tmp_path):
    # verl's gsm8k_multiturn_w_tool.py rows carry no agent_name: the tools file would never be offered
    from rlplat.kits.data import write_parquet
    from rlplat_demo import tools as tool_demo

    _, _, tools_file, log = verl_files
    train = write_parquet(gsm8k_rows("train", agent_name=None), tmp_path / "train_no_loop.parquet")
    test = write_parquet(gsm8k_rows("test", agent_name=None)[:4], tmp_path / "test_no_loop.parquet")
    run = tmp_path / "run"
    result = cli_in_process("run", *verl_multiturn_command_line(tool_demo.model_dir(), train, test, tools_file, run))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("rlplat: config error:")]
    assert line.startswith(f"rlplat: config error: agent.tools_config={tools_file} is read by no agent loop")
    assert not run.exists() and not log.exists()
