"""verl's dotted keys on rlplat's command line: every target exists, each kind of translation and refusal,
hydra's prefixes, the nested (YAML) path, the documented table, and ``rlplat config show`` on a real verl
GRPO command line, and ``rlplat run`` training the demo from that command line."""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlplat.config import ConfigError, RLConfig, load_config
from rlplat_verl import rules, table
from rlplat_verl.rules import Target, format_value, parse_value
from rlplat_verl.table import RULES
from rlplat_verl.translate import translate_command_line, translate_mapping, translate_overrides

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "coming-from-verl.md"


# -- the table cannot drift -------------------------------------------------------------------------------


def schema_of(kind: str, name: str) -> type:
    from rlplat import registry
    from rlplat.registry import resolve_dotted_path

    schema = registry.entry(kind, name).config_schema
    return resolve_dotted_path(schema) if isinstance(schema, str) else schema


def loss_schema(role: str) -> type:
    from rlplat import registry

    spec = registry.get("algorithm", "ppo")()
    schema = spec.loss_schema(role) if hasattr(spec, "loss_schema") else None
    if schema is None:
        from rlplat_algorithms import config

        schema = config.PolicyLossConfig if role == "actor" else config.ValueLossConfig
    return schema


def declares(schema: type, path: list[str]) -> bool:
    """``path`` names a field of the dataclass ``schema`` (nested dataclasses followed; below a mapping
    field any key is allowed)."""
    fields = {field.name for field in dataclasses.fields(schema)}
    if path[0] not in fields:
        return False
    if len(path) == 1:
        return True
    hint = typing.get_type_hints(schema)[path[0]]
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return declares(candidate, path[1:])
        origin = typing.get_origin(candidate) or candidate
        if isinstance(origin, type) and issubclass(origin, collections.abc.Mapping):
            return True
    return False


def resolves(target: Target) -> bool:
    """Where the config loader looks ``target`` up: a plugin's schema for the nodes plugins own, else core's."""
    from rlplat.contracts.role import RoleConfig

    parts = target.key.split(".")
    if parts[1:2] == ["engine_config"]:
        return declares(schema_of("engine", "fsdp2"), parts[2:])
    if parts[:3] == ["reward", "model", "engine_config"]:
        return declares(schema_of("engine", "fsdp2"), parts[3:])
    if parts[:2] == ["agent", "loops"]:
        return declares(schema_of("agent_loop", parts[2]), parts[3:])
    if parts[0] == "roles":
        return declares(schema_of("role", parts[1]) or RoleConfig, parts[2:])
    if parts[:2] == ["rollout", "config"]:
        return declares(schema_of("rollout", target.rollout), parts[2:])
    if parts[:2] == ["reward", "config"]:
        return declares(schema_of("reward_manager", "naive"), parts[2:])
    if parts[:3] == ["actor", "loss", "policy_loss"]:
        return declares(schema_of("policy_loss", "vanilla"), parts[3:])
    if parts[1:2] == ["loss"]:
        return declares(loss_schema(parts[0]), parts[2:])
    if parts[0] == "algorithm":
        return parts == ["algorithm", "name"] or declares(schema_of("algorithm", "dapo"), parts[1:])
    for node in plugin_nodes():  # a node a plugin owns (agent, reward.model): its schema
        if parts[:len(node.split("."))] == node.split("."):
            return declares(schema_of("config_node", node), parts[len(node.split(".")):])
    return declares(RLConfig, parts)


def plugin_nodes() -> list[str]:
    from rlplat import registry

    return registry.names("config_node")


TARGETS = sorted({target for rule in RULES for target in rule.targets}, key=str)


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_every_target_of_the_table_is_a_key_rlplat_or_a_built_in_plugin_declares(target):
    assert resolves(target), f"{target} (a target of rlplat_verl.table.RULES) is not in rlplat's config schema"


def test_no_target_is_a_key_the_config_loader_fills_itself():
    from rlplat.contracts import engine, rollout

    # what core hands every engine and rollout; setting one of these in the node is a config error
    for node, contract, name in (("engine_config", engine, "EngineBuildConfig"), ("config", rollout, "RolloutBuildConfig")):
        reserved = {field.name for field in dataclasses.fields(getattr(contract, name))} if hasattr(contract, name) else set()
        keys = {target.key.split(".")[2] for target in TARGETS if target.key.split(".")[1] == node and target.key[0] in "acr"
                and not target.key.startswith("reward.")}
        assert not reserved & keys, node


def test_rlplat_keys_among_the_rules_keep_their_meaning_and_the_defaults_the_module_reads_are_rlplats():
    from rlplat.config import base_config

    base = base_config()  # core's nodes and the plugins' (agent, reward.model)
    for rule in RULES:
        key = rule.key.removesuffix(".*")
        if OmegaConf.select(base, key, default="absent") != "absent":
            assert not rule.verl_only, f"{rule.key} is rlplat's key too: its rule must leave rlplat's values unchanged"
    for key, value in rules.RLPLAT_DEFAULTS.items():
        assert OmegaConf.select(base, key) == value, key


def test_the_algorithms_the_module_selects_are_registered_and_only_ppo_has_a_critic():
    from rlplat import registry

    assert set(rules.ESTIMATOR_ALGORITHMS.values()) | {"dapo"} <= set(registry.names("algorithm"))
    assert set(rules.ESTIMATOR_ALGORITHMS) <= set(registry.names("advantage_estimator"))
    with_critic = {name for name in registry.names("algorithm") if registry.get("algorithm", name)().needs_critic}
    assert with_critic == set(rules.CRITIC_ALGORITHMS)


def test_the_doc_holds_the_table_of_the_module_word_for_word():
    text = DOC.read_text()
    written = text.split(table.TABLE_START, 1)[1].split(table.TABLE_END, 1)[0].strip("\n") + "\n"
    assert written == table.markdown_table(), (
        "docs/coming-from-verl.md is out of date: replace its table with `python -m rlplat_verl.table`")
    assert "verl-dataproto.md" in text
    for rule in RULES:
        assert f"`{rule.key}`" in text


# -- one kind of translation per test ---------------------------------------------------------------------


def test_a_verl_key_becomes_rlplats_with_the_value_as_written_and_a_note():
    assert translate_overrides(["actor_rollout_ref.actor.optim.lr=1e-6"]) == (
        ["actor.optim.lr=1e-6"], ["verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr"])


@pytest.mark.parametrize("verl, rlplat", [
    ("actor_rollout_ref.actor.use_kl_loss=True", "actor.loss.use_kl_loss=True"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload=True", "actor.engine_config.param_offload=True"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor.engine_config.enable_gradient_checkpointing=True"),
    ("actor_rollout_ref.rollout.name=vllm", "rollout.name=vllm"),
    ("actor_rollout_ref.rollout.n=5", "rollout.n=5"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor.ppo_mini_batch_size=256"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40", "actor.micro_batch_size_per_gpu=40"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor.loss.policy_loss.loss_mode=gspo"),
    ("data.max_response_length=1024", "rollout.response_length=1024"),
    ("trainer.default_local_dir=/ckpt/run", "trainer.output_dir=/ckpt/run"),
    ("trainer.nnodes=2", "cluster.nnodes=2"),
    ("custom_reward_function.path=my_reward.py", "reward.custom_function.path=my_reward.py"),
    ("reward_model.reward_manager=dapo", "reward.manager=dapo"),
    ("reward_model.reward_kwargs.overlong_buffer_cfg.len=512", "reward.config.overlong_buffer.len=512"),
    ("critic.ppo_micro_batch_size_per_gpu=4", "critic.micro_batch_size_per_gpu=4"),
    ("critic.cliprange_value=0.2", "critic.loss.cliprange_value=0.2"),
    ("actor_rollout_ref.model.lora_rank=32", "actor.lora.rank=32"),
    ("actor_rollout_ref.model.lora_alpha=64", "actor.lora.alpha=64"),
    ("actor_rollout_ref.model.lora_adapter_path=/adapters/a", "actor.lora.adapter_path=/adapters/a"),
    ("actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "actor.lora.target_modules=[q_proj,v_proj]"),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml", "agent.tools_config=tools.yaml"),
    ("actor_rollout_ref.rollout.multi_turn.format=hermes", "agent.tool_parser=hermes"),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5", "agent.loops.tool.max_turns=5"),
    ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1", "agent.loops.tool.max_parallel_calls=1"),
    ("actor_rollout_ref.rollout.multi_turn.max_tool_response_length=256", "agent.loops.tool.max_tool_response_length=256"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=my_loop", "agent.loop=my_loop"),
    ("trainer.v1.trainer_mode=colocate_async", "trainer.mode=colocate_async"),
])
def test_verl_keys_map_to_rlplats(verl, rlplat):
    assert translate_overrides([verl])[0] == [rlplat]


def test_rlplat_keys_pass_unchanged_and_without_a_note():
    arguments = ["data.train_batch_size=1024", "algorithm.adv_estimator=grpo", "trainer.total_epochs=15",
                 "trainer.val_before_train=false", "trainer.save_freq=20", "trainer.logger=[console,wandb]",
                 "data.train_files=[a.parquet]", "actor.optim.lr=1e-6", "data.no_such_key=1"]
    assert translate_overrides(arguments) == (arguments, [])


@pytest.mark.parametrize("verl, rlplat, why", [
    ("actor_rollout_ref.rollout.top_k=-1", "rollout.top_k=0", "both turn the top-k filter off"),
    ("data.train_files=/data/train.parquet", "data.train_files=[/data/train.parquet]", "takes a list of files"),
    ("trainer.save_freq=-1", "trainer.save_freq=0", "saves only at the end"),
    ("trainer.test_freq=-1", "trainer.test_freq=0", "never validates during training"),
    ("trainer.logger=[console,file]", "trainer.logger=[console,jsonl]", "metrics.jsonl"),
    ("trainer.logger=console", "trainer.logger=[console]", "takes a list"),
    ("trainer.device=cpu", "cluster.use_gpu=false", "GPUs or CPUs"),
    ("data.filter_overlong_prompts=True", "data.truncation=filter", "drops overlong prompts at load"),
    ("actor_rollout_ref.actor.strategy=fsdp", "actor.engine=fsdp2", "shards as verl's FSDP does"),
    ("actor_rollout_ref.actor.fsdp_config.dtype=bf16", "actor.engine_config.dtype=bfloat16", "spells the dtype out"),
    ("actor_rollout_ref.rollout.val_kwargs.do_sample=True", "rollout.val_greedy=false", "says greedy"),
    ("actor_rollout_ref.actor.router_replay.mode=R3", "actor.moe.router_replay=r3", "R3 the rollout's"),
    ("actor_rollout_ref.actor.router_replay.mode=R2", "actor.moe.router_replay=r2", "R2 the old-log-prob forward's"),
])
def test_values_that_differ_in_convention_are_converted_and_the_note_says_why(verl, rlplat, why):
    translated, notes = translate_overrides([verl])
    assert translated == [rlplat]
    assert notes[0].startswith(f"verl key {verl} -> {rlplat} (") and why in notes[0]


def test_gpus_per_node_sets_the_worker_processes_and_the_note_says_what_a_cpu_machine_does_with_them():
    translated, notes = translate_overrides(["trainer.n_gpus_per_node=8"])
    assert translated == ["cluster.devices_per_node=8"]  # cluster.use_gpu=auto decides GPUs or CPU processes
    assert "as CPU processes on Ray otherwise (cluster.backend=ray, the default)" in notes[0]
    assert "cluster.backend=local runs one process: give trainer.n_gpus_per_node=1 with it" in notes[0]
    assert translate_overrides(["trainer.n_gpus_per_node=2", "cluster.use_gpu=false"])[0] == [
        "cluster.devices_per_node=2", "cluster.use_gpu=false"]
    assert translate_overrides(["trainer.n_gpus_per_node=2", "trainer.device=cpu"])[0] == [
        "cluster.devices_per_node=2", "cluster.use_gpu=false"]


def test_a_micro_batch_counted_over_all_gpus_is_divided_by_the_worker_processes():
    translated, notes = translate_overrides(["actor_rollout_ref.actor.ppo_micro_batch_size=64", "trainer.n_gpus_per_node=4",
                                             "trainer.nnodes=2", "cluster.use_gpu=false"])
    assert translated[0] == "actor.micro_batch_size_per_gpu=8"  # 64 rows / (2 nodes x 4 processes)
    assert "divided by 8 worker processes" in notes[0]


def test_warm_up_counts_training_steps_in_verl_and_optimizer_steps_in_rlplat():
    # 64 prompts / 16 per mini-batch x 2 epochs = 8 optimizer steps per training step
    batch = ["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_epochs=2"]
    translated, notes = translate_overrides(batch + ["actor_rollout_ref.actor.optim.lr_warmup_steps=5"])
    assert translated[-1] == "actor.optim.warmup_steps=40" and "8 per training step" in notes[-1]
    translated, _ = translate_overrides(batch + ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                                                 "trainer.total_training_steps=50"])
    assert "actor.optim.warmup_steps=40" in translated  # 0.1 x 50 training steps x 8
    assert translate_overrides(["actor_rollout_ref.actor.optim.lr_warmup_steps=5"])[0] == ["actor.optim.warmup_steps=640"]


def test_the_sglang_and_hf_rollouts_get_their_own_keys_for_the_rollout_engine_settings():
    key = "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"
    assert translate_overrides(["actor_rollout_ref.rollout.name=vllm", key])[0][1] == "rollout.config.gpu_memory_utilization=0.6"
    assert translate_overrides([key], rollout="sglang")[0] == ["rollout.config.mem_fraction_static=0.6"]
    translated, notes = translate_overrides([key])  # no rollout named: rlplat's default, hf
    assert translated == [] and "accepted and ignored: rollout hf" in notes[0]
    assert translate_overrides(["actor_rollout_ref.rollout.max_num_seqs=64"])[0] == ["rollout.config.max_batch_rows=64"]


def test_the_actor_and_reference_log_prob_micro_batches_share_one_key_and_the_smaller_wins():
    translated, notes = translate_overrides(["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
                                             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20"])
    assert translated == ["actor.engine_config.forward_micro_batch_size_per_gpu=20"]
    assert "(the smaller)" in notes[0]


def test_a_keys_meaning_can_depend_on_another_key_of_the_command_line():
    filtered = translate_overrides(["data.filter_overlong_prompts=True", "data.truncation=error"])[0]
    assert filtered == ["data.truncation=filter"]
    both = ["data.max_response_length=1024", "actor_rollout_ref.rollout.response_length=512"]
    assert translate_overrides(both)[0] == ["rollout.response_length=512"]  # verl's rollout reads its own key
    assert translate_overrides(["trainer.resume_mode=resume_path", "trainer.resume_from_path=/run/checkpoints/global_step_20"])[0] == [
        "trainer.resume=/run/checkpoints/global_step_20"]


def test_a_verl_command_line_selects_the_algorithm_its_estimator_implies_with_the_critics_batch_settings():
    translated, notes = translate_overrides(["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_mini_batch_size=64"])
    assert translated == ["algorithm.adv_estimator=gae", "algorithm.name=ppo", "actor.ppo_mini_batch_size=64",
                          "critic.ppo_mini_batch_size=64"]
    assert "also sets algorithm.name=ppo" in notes[0]
    assert "verl's critic takes the actor's ppo_mini_batch_size" in notes[1]
    assert translate_overrides(["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_epochs=2"], algo="ppo")[0] == [
        "algorithm.adv_estimator=gae", "actor.ppo_epochs=2", "critic.ppo_epochs=2"]  # --algo already chose it
    assert translate_overrides(["algorithm.adv_estimator=gae"]) == (["algorithm.adv_estimator=gae"], [])  # not verl-style
    dapo = translate_overrides(["algorithm.filter_groups.enable=True", "actor_rollout_ref.rollout.n=16"])[0]
    assert dapo[:2] == ["algorithm.filter_groups.enable=True", "algorithm.name=dapo"]


@pytest.mark.parametrize("verl, why", [
    ("trainer.critic_warmup=0", "rlplat updates the actor from the first step, as 0 asks"),
    ("actor_rollout_ref.rollout.enforce_eager=True", "no memory pool, scheduler or CUDA graphs"),
    ("actor_rollout_ref.actor.use_remove_padding=True", "sets rlplat's packing"),
    ("actor_rollout_ref.rollout.load_format=safetensors", "receives the actor's weights before its first generation"),
    ("actor_rollout_ref.rollout.multi_turn.enable=True", "by its agent_name column"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent", "batched generate"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature=0", "validates greedily"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]", "always hold the model"),
])
def test_keys_that_change_nothing_here_are_accepted_and_ignored_with_the_reason(verl, why):
    translated, notes = translate_overrides([verl])
    assert translated == []
    assert notes[0].startswith(f"verl key {verl} accepted and ignored: ") and why in notes[0]


def test_every_key_without_an_equivalent_is_refused_by_name_in_one_error():
    arguments = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.model.tiled_mlp.enabled=True",
                 "trainer.critic_warmup=5", "actor_rollout_ref.actor.no_such_key=1", "trainer.logger=[console,mlflow]",
                 "actor_rollout_ref.actor.optim.lr=1e-6"]
    with pytest.raises(ConfigError) as raised:
        translate_overrides(arguments)
    message = str(raised.value)
    assert message.startswith("5 verl key(s) with no rlplat equivalent")
    for argument in arguments[:4]:
        assert f"\n  {argument}: " in message
    assert "without tensor parallelism" in message and "no tiled MLP" in message and "not to mlflow" in message
    assert "actor.optim.lr" not in message


def test_the_reference_model_takes_the_actors_engine_settings_so_a_different_one_is_refused():
    same = translate_overrides(["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                                "actor_rollout_ref.ref.fsdp_config.param_offload=True"])[0]
    assert same == ["actor.engine_config.param_offload=True"]
    with pytest.raises(ConfigError, match=r"ref\.fsdp_config\.param_offload=True: rlplat's reference model runs with "
                                          r"the actor's engine settings \(actor_rollout_ref\.actor\.fsdp_config\.param_offload=false\)"):
        translate_overrides(["actor_rollout_ref.ref.fsdp_config.param_offload=True"])


def test_ulysses_sizes_map_to_the_fsdp2_engines_key_and_the_reference_follows_the_actor():
    assert translate_overrides(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"])[0] == [
        "actor.engine_config.ulysses_sequence_parallel_size=2"]
    assert translate_overrides(["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
                                "critic.ulysses_sequence_parallel_size=2"])[0] == [
        "actor.engine_config.ulysses_sequence_parallel_size=4", "critic.engine_config.ulysses_sequence_parallel_size=2"]
    assert translate_overrides(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"])[0] == []
    with pytest.raises(ConfigError, match=r"ref\.ulysses_sequence_parallel_size=2: rlplat's reference model runs with the "
                                          r"actor's engine settings \(its Ulysses size is 1\)"):
        translate_overrides(["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"])


def test_a_value_of_the_wrong_kind_is_refused_not_raised():
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=two: not a value this key takes"):
        translate_overrides(["actor_rollout_ref.rollout.tensor_model_parallel_size=two"])


# -- hydra's prefixes ---------------------------------------------------------------------------------------


def test_hydra_plus_prefixes_are_dropped_with_a_note_and_the_key_is_translated():
    translated, notes = translate_overrides(["+actor_rollout_ref.actor.optim.lr=1e-6", "++trainer.nnodes=2", "+data.seed=3"])
    assert translated == ["actor.optim.lr=1e-6", "cluster.nnodes=2", "data.seed=3"]
    assert notes[0] == ("hydra prefix '+' dropped from +actor_rollout_ref.actor.optim.lr: every rlplat key exists, "
                        "so nothing is added")
    assert notes[2].startswith("hydra prefix '++' dropped from ++trainer.nnodes")


def test_hydra_deletion_is_refused_with_the_other_refusals():
    with pytest.raises(ConfigError) as raised:
        translate_overrides(["~trainer.logger", "trainer.critic_warmup=5"])
    assert str(raised.value).startswith("2 verl key(s)") and "~trainer.logger: hydra's ~ deletes a key" in str(raised.value)


# -- the nested path: a YAML file in verl's layout ------------------------------------------------------------

VERL_LAYOUT = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 64, "max_response_length": 256, "filter_overlong_prompts": True, "truncation": "error"},
    "actor_rollout_ref": {
        "model": {"path": "/models/policy", "use_remove_padding": True, "_target_": "verl.workers.config.HFModelConfig"},
        "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 16, "use_kl_loss": True, "fsdp_config": {"param_offload": False}},
        "rollout": {"name": "???", "n": 5, "top_k": -1, "engine_kwargs": {"vllm": {}, "sglang": {}}},
    },
    "trainer": {"n_gpus_per_node": 2, "device": "cpu", "logger": ["console"], "save_freq": -1},
}


def test_a_nested_config_in_verls_layout_becomes_rlplats_by_the_same_rules():
    translated, notes = translate_mapping(VERL_LAYOUT)
    assert translated == {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_batch_size": 64, "truncation": "filter"},
        "rollout": {"response_length": 256, "n": 5, "top_k": 0},
        "model": {"path": "/models/policy"},
        "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 16, "loss": {"use_kl_loss": True},
                  "engine_config": {"use_remove_padding": True, "param_offload": False}},
        "cluster": {"devices_per_node": 2, "use_gpu": False},
        "trainer": {"logger": ["console"], "save_freq": 0},
    }
    assert notes[0] == "dropped 1 _target_ key(s): verl's class paths mean nothing to rlplat"
    assert "verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in notes


def test_a_nested_config_refuses_like_the_command_line():
    with pytest.raises(ConfigError, match=r"1 verl key\(s\).*\n  actor_rollout_ref.model.lora.rank=8: verl's model.lora node is"):
        translate_mapping({"actor_rollout_ref": {"model": {"lora": {"rank": 8}}}})


def test_a_verl_layout_config_file_is_translated_to_a_file_load_config_reads(tmp_path):
    file = tmp_path / "verl.yaml"
    file.write_text(OmegaConf.to_yaml(OmegaConf.create(VERL_LAYOUT)))
    # the file's trainer.n_gpus_per_node=2 divides the command line's micro-batch over all GPUs
    config_file, overrides, notes = translate_command_line(file, ["actor_rollout_ref.actor.ppo_micro_batch_size=8", "rollout.n=4"])
    assert config_file != str(file) and notes[-1] == f"--config {file} has verl keys: its rlplat translation is {config_file}"
    assert overrides == ["actor.micro_batch_size_per_gpu=4", "rollout.n=4"]
    config = load_config(config_file, overrides, validate=False)
    assert (config.actor.optim.lr, config.rollout.n, config.rollout.top_k, config.cluster.devices_per_node) == (1e-6, 4, 0, 2)


def test_an_rlplat_config_file_is_left_as_it_is(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("actor:\n  optim:\n    lr: 3.0e-4\n")
    assert translate_command_line(file, ["rollout.n=8"]) == (str(file), ["rollout.n=8"], [])


@pytest.mark.parametrize("value", ["a b", "x,y", "[a]", "null", "1e-6", "'q'", "", "C:/path:1", 3, 1e-06, True, None,
                                   ["console", "a,b"], {"k": "v w"}])
def test_converted_values_read_back_as_the_same_value(value):
    assert parse_value(format_value(value)) == value


# -- the command line ---------------------------------------------------------------------------------------

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(solution_str.strip() == ground_truth)\n"


def verl_grpo_command_line(reward) -> list[str]:
    """examples/grpo_trainer/run_qwen2-7b.sh of verl, on the demo's model and data, the hf rollout and 2 CPU
    processes: 40 keys."""
    import rlplat_demo as demo

    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={demo.train_file()}", f"data.val_files={demo.val_file()}",
        "data.train_batch_size=32", "data.max_prompt_length=16", "data.max_response_length=4",
        "data.filter_overlong_prompts=True", "data.truncation=error", f"actor_rollout_ref.model.path={demo.model_dir()}",
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64", "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", 'trainer.logger=["console","jsonl"]',
        "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=demo", "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1", "trainer.device=cpu", "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15",
        f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score",
    ]


@pytest.mark.slow
def test_config_show_takes_a_verl_grpo_command_line_on_the_demo(cli_in_process, tmp_path):
    import rlplat_demo as demo

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    result = cli_in_process("config", "show", *verl_grpo_command_line(reward))
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stderr.splitlines() if line.startswith("rlplat: verl key ")]
    assert "rlplat: verl key actor_rollout_ref.actor.optim.lr -> actor.optim.lr" in notes
    assert "rlplat: verl key trainer.critic_warmup=0 accepted and ignored: rlplat updates the actor from the first step, as 0 asks" in notes
    assert "rlplat: verl key trainer.device=cpu -> cluster.use_gpu=false (rlplat places workers on GPUs or CPUs)" in notes
    assert len(notes) == 30  # 40 keys, of which 10 are rlplat's own (data.train_batch_size, trainer.total_epochs, ...)
    config = OmegaConf.create(result.stdout)
    assert config.model.path == str(demo.model_dir()) and list(config.data.train_files) == [str(demo.train_file())]
    assert (config.actor.optim.lr, config.actor.ppo_mini_batch_size, config.actor.micro_batch_size_per_gpu) == (1e-4, 16, 64)
    assert config.actor.loss.use_kl_loss is True and config.actor.engine_config.forward_micro_batch_size_per_gpu == 64
    assert (config.rollout.name, config.rollout.n, config.rollout.response_length) == ("hf", 8, 4)
    assert config.data.truncation == "filter" and config.rollout.config == {}
    assert (config.cluster.devices_per_node, config.cluster.nnodes, config.cluster.use_gpu) == (2, 1, False)
    assert config.reward.custom_function.path == str(reward) and config.trainer.total_epochs == 15


@pytest.mark.slow
def test_rlplat_run_trains_the_demo_from_a_verl_grpo_command_line(cli_run, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    result = cli_run("run", *verl_grpo_command_line(reward), "trainer.total_training_steps=2",
                     f"trainer.default_local_dir={run}", "trainer.val_before_train=False", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rlplat: verl key trainer.default_local_dir -> trainer.output_dir" in result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "actor/kl_loss" in record]
    assert [record["step"] for record in steps] == [1, 2]  # the KL loss of use_kl_loss=True is in effect
    assert (run / "checkpoints" / "global_step_2" / "COMPLETE").exists()


@pytest.mark.slow
def test_run_refuses_verl_keys_without_an_equivalent_before_anything_starts(cli_run):
    result = cli_run("run", "actor_rollout_ref.model.lora.rank=64", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert result.returncode == 2
    assert result.stderr.startswith("rlplat: config error: 2 verl key(s) with no rlplat equivalent")
    assert "Traceback" not in result.stderr


def test_verls_rollout_correction_keys_are_rlplats_and_a_key_rlplat_lacks_is_refused():
    arguments = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
                 "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce"]
    assert translate_overrides(arguments) == (arguments, [])
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.rollout_token_veto_threshold=1e-4: rlplat's"):
        translate_overrides(["algorithm.rollout_correction.rollout_token_veto_threshold=1e-4"])


# -- what rlplat has now: LoRA, multi-turn tools, reward models, separate rollouts, asynchronous modes ----------


def test_lora_module_names_become_lists_and_the_megatron_lora_node_is_refused_naming_the_fsdp2_keys():
    translated, notes = translate_overrides(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=all-linear",
                                             "actor_rollout_ref.model.exclude_modules=null"])
    assert translated == ["actor.lora.rank=8", "actor.lora.target_modules=[all-linear]"]
    assert "no module is left out" in notes[-1]
    with pytest.raises(ConfigError, match="give actor_rollout_ref.model.lora_rank, lora_alpha and target_modules"):
        translate_overrides(["actor_rollout_ref.model.lora.rank=16"])


def test_verls_lora_merge_switch_is_rlplats_sync_mode_when_lora_is_on():
    merge = "actor_rollout_ref.model.lora.merge"
    assert translate_overrides(["actor_rollout_ref.model.lora_rank=8", f"{merge}=False"])[0][1] == "actor.lora.sync=adapter"
    assert translate_overrides(["actor_rollout_ref.model.lora_rank=8", f"{merge}=True"])[0][1] == "actor.lora.sync=merged"
    assert translate_overrides([f"{merge}=False"])[0] == []  # no LoRA: verl does not read it


def test_verl_keeps_the_side_it_names_and_rlplat_cuts_it_so_truncation_sides_swap():
    key = "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side"
    assert [translate_overrides([f"{key}={side}"])[0] for side in ("left", "right", "middle")] == [
        ["agent.loops.tool.truncate_side=right"], ["agent.loops.tool.truncate_side=left"], ["agent.loops.tool.truncate_side=middle"]]


@pytest.mark.parametrize("assistant, user, max_turns", [(5, None, 5), (None, 2, 3), (5, 2, 3), (2, 4, 2), (3, 2, 3)])
def test_the_tighter_of_verls_two_turn_limits_becomes_the_tool_loops_max_turns(assistant, user, max_turns):
    keys = [f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={assistant}",
            f"actor_rollout_ref.rollout.multi_turn.max_user_turns={user}"]
    given = [key for key, value in zip(keys, (assistant, user)) if value is not None]
    assert translate_overrides(given)[0] == [f"agent.loops.tool.max_turns={max_turns}"]


def test_verls_tool_agent_is_the_tool_loop_and_the_data_loaders_copy_of_the_tools_file_is_accepted():
    assert translate_overrides(["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"])[0] == ["agent.loop=tool"]
    same = ["actor_rollout_ref.rollout.multi_turn.tool_config_path=t.yaml", "data.tool_config_path=t.yaml"]
    assert translate_overrides(same)[0] == ["agent.tools_config=t.yaml"]
    with pytest.raises(ConfigError, match="data.tool_config_path=other.yaml: rlplat offers the tools of"):
        translate_overrides([same[0], "data.tool_config_path=other.yaml"])


def test_a_reward_model_is_on_with_its_path_and_its_settings_are_read_only_then():
    legacy = ["reward_model.enable=True", "reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=4",
              "reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=4096",
              "reward_model.model.fsdp_config.param_offload=True", "reward_model.strategy=fsdp2"]
    assert translate_overrides(legacy)[0] == [
        "reward.model.path=/rm", "reward.model.micro_batch_size_per_gpu=4", "reward.model.use_dynamic_bsz=True",
        "reward.model.max_token_len_per_gpu=4096", "reward.model.engine_config.param_offload=True", "reward.model.engine=fsdp2"]
    current = ["reward.reward_model.enable=True", "reward.reward_model.model_path=/rm", "reward.reward_model.rollout.name=vllm",
               "reward.reward_model.enable_resource_pool=True", "reward.reward_model.nnodes=1", "reward.reward_model.n_gpus_per_node=2"]
    translated, notes = translate_overrides(current)
    assert translated == ["reward.model.path=/rm", "reward.model.placement=separate", "reward.model.nnodes=1",
                          "reward.model.devices_per_node=2"]
    assert "rlplat with a training engine's forward pass" in notes[2]
    off = translate_overrides(["reward_model.enable=False", "reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=4"])
    assert off[0] == []  # verl reads none of them with the reward model off


@pytest.mark.parametrize("arguments, why", [
    (["reward_model.enable=True"], "rlplat's reward model is on when reward.model.path is set: give reward_model.model.path"),
    (["reward.reward_model.enable=True", "reward.reward_model.model_path=/judge", "reward.custom_reward_function.path=f.py"],
     "rlplat's is reward.manager=judge"),
    (["reward_model.enable=True", "reward_model.model.path=/rm", "reward_model.max_length=512", "reward_model.truncation=right"],
     "give reward_model.truncation=left"),
    (["reward_model.enable=True", "reward_model.model.path=/rm", "reward_model.no_such_key=1"], "rlplat config explain reward.model"),
])
def test_reward_model_settings_rlplat_cannot_honour_are_refused_saying_what_it_offers(arguments, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        translate_overrides(arguments)


def test_a_rollout_on_machines_of_its_own_is_rlplats_separate_rollout_role():
    translated, notes = translate_overrides(["actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=4"])
    assert translated == ["roles.rollout.placement=separate", "roles.rollout.nnodes=2", "roles.rollout.devices_per_node=4"]
    assert translate_overrides(["actor_rollout_ref.rollout.nnodes=0", "actor_rollout_ref.rollout.n_gpus_per_node=8"])[0] == []


def test_verls_asynchronous_trainer_modes_and_their_staleness_bound_are_rlplats():
    separate = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.num_warmup_batches=2",
                "trainer.v1.sampler.max_off_policy_threshold=4", "trainer.v1.sampler.max_off_policy_strategy=wait",
                "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                "trainer.v1.separate_async.parameter_sync_step=4", "trainer.v1.colocate_async.num_warmup_batches=5"]
    translated, notes = translate_overrides(separate)
    # 2 batches beyond the trained one -> 3 in flight; a trajectory spanning 4 versions lags 3 updates
    assert translated == ["trainer.mode=separate_async", "trainer.rollout_ahead=3", "trainer.max_staleness=3",
                          "trainer.staleness_policy=wait", "data.train_batch_size=64", "actor.ppo_mini_batch_size=16"]
    assert "= 64 / 16 = 4 optimizer steps" in notes[-2] and "trainer_mode=colocate_async" in notes[-1]
    with pytest.raises(ConfigError, match="parameter_sync_step=2: verl requires data.train_batch_size = parameter_sync_step"):
        translate_overrides(separate[:-2] + ["trainer.v1.separate_async.parameter_sync_step=2"])
    sync = translate_overrides(["trainer.v1.trainer_mode=sync", "trainer.v1.sampler.max_off_policy_threshold=8"])
    assert sync[0] == ["trainer.mode=sync"] and "sync trains on-policy" in sync[1][1]


@pytest.mark.parametrize("argument, offers", [
    ("actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml", "configured under agent.loops.<name>"),
    ("actor_rollout_ref.rollout.multi_turn.function_tool_path=tools.py", "list each tool in the tools file"),
    ("actor_rollout_ref.rollout.multi_turn.interaction_config_path=i.yaml", "agent.loop=env with agent.environment"),
    ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=True", "appends the model's sampled tokens verbatim"),
    ("actor_rollout_ref.hybrid_engine=False", "roles.rollout.placement=separate"),
    ("trainer.v1.trainer_mode=fully_async", "rlplat's trainer modes are sync, colocate_async, separate_async"),
    ("trainer.v1.sampler.max_off_policy_threshold=null", "give a number of versions (-> trainer.max_staleness)"),
    ("critic.model.lora_rank=8", "rlplat's LoRA adapters are the actor's (actor.lora)"),
    ("sandbox_fusion.url=http://sandbox", "its python tool (agent.tools_config, name: python)"),
    ("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "the distribution sampled from (processed_logprobs)"),
])
def test_what_rlplat_still_refuses_here_names_what_it_offers_instead(argument, offers):
    arguments = [argument] + (["trainer.v1.trainer_mode=colocate_async"] if "sampler" in argument else [])
    with pytest.raises(ConfigError, match=re.escape(offers)):
        translate_overrides(arguments)


# -- on-policy distillation: verl 0.9's distillation node -> distillation.teachers, roles.teacher, actor.loss.terms -----

TEACHER = "distillation.teacher_models.teacher_model.model_path=/teacher"
LOSS = "distillation.distillation_loss"
VERL_DISTILLATION_LOSS = {  # verl 0.9's distillation.yaml (its dataclass defaults differ; the YAML's apply)
    "_target_": "verl.workers.config.DistillationLossConfig", "loss_mode": "k3", "topk": 32, "use_task_rewards": True,
    "distillation_loss_coef": 1.0, "loss_max_clamp": None, "log_prob_min_clamp": None, "use_policy_gradient": False,
    "policy_loss_mode": "vanilla", "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
}


def distil(*arguments: str, algo: str | None = None) -> tuple[list[str], list[str]]:
    """``arguments`` after verl's switch and one teacher; ``distillation_loss.`` keys may be given without it."""
    keys = [argument if argument.lstrip("+").startswith(("distillation.", "actor")) else f"{LOSS}.{argument}"
            for argument in arguments]
    return translate_overrides(["distillation.enabled=true", TEACHER, *keys], algo=algo)


def test_verls_default_distillation_loss_is_one_reverse_kl_term_beside_the_policy_loss():
    from rlplat_verl import distillation_keys

    assert distillation_keys.VERL_LOSS == {key: value for key, value in VERL_DISTILLATION_LOSS.items() if key != "_target_"}
    translated, notes = distil()
    # distillation.yaml: loss_mode k3, use_policy_gradient false, use_task_rewards true, distillation_loss_coef 1.0
    assert translated == ["actor.loss.terms=[{loss_mode: reverse_kl, coef: 1.0, estimator: k3, use_policy_gradient: false}]",
                          "actor.loss.policy_loss_coef=1.0", "distillation.teachers.teacher_model.model_path=/teacher"]
    assert "verl's defaults for the keys not given" in notes[0]
    assert notes[1] == ("verl key distillation.teacher_models.teacher_model.model_path -> "
                        "distillation.teachers.teacher_model.model_path")


@pytest.mark.parametrize("loss, written", [
    (["loss_mode=k1", "use_policy_gradient=true", "distillation_loss_coef=0.5", "loss_max_clamp=10.0"],
     ["actor.loss.terms=[{loss_mode: reverse_kl, coef: 0.5, estimator: k1, use_policy_gradient: true, loss_max_clamp: 10.0}]",
      "actor.loss.policy_loss_coef=1.0"]),
    (["loss_mode=k2", "use_task_rewards=false", "distillation_loss_coef=0.5", "topk=64", "log_prob_min_clamp=-10.0"],
     ["actor.loss.terms=[{loss_mode: reverse_kl, coef: 1.0, estimator: k2, use_policy_gradient: false}]",
      "actor.loss.policy_loss_coef=0.0"]),  # without task rewards verl ignores the coef; topk and the log-prob clamp: top-k only
    (["loss_mode=forward_kl_topk", "topk=64", "distillation_loss_coef=0.25"],
     ["actor.loss.terms=[{loss_mode: forward_kl_topk, coef: 0.25, renormalize: false}]", "actor.loss.policy_loss_coef=1.0",
      "distillation.top_k=64"]),
])
def test_each_key_of_verls_loss_lands_in_the_term_and_its_note_says_where(loss, written):
    translated, notes = distil(*loss, algo="dr_grpo")  # dr_grpo: no KL loss by default
    assert translated == written + ["distillation.teachers.teacher_model.model_path=/teacher"]
    assert len(notes) == 2 + len(loss)  # one note per key
    for setting, note in zip(loss, notes[2:]):
        assert note.startswith(f"verl key {LOSS}.{setting} ")
        assert note.endswith("distillation.enabled writes it)") or "accepted and ignored: verl reads it only with" in note


def test_pure_distillation_also_drops_the_kl_loss_and_entropy_bonus_as_verl_does():
    translated, notes = distil("use_task_rewards=false", "actor_rollout_ref.actor.use_kl_loss=True",
                               "actor_rollout_ref.actor.entropy_coeff=0.01")
    # grpo's default use_kl_loss=true is written off; the entropy bonus is already 0 in rlplat's grpo
    assert translated[1:3] == ["actor.loss.policy_loss_coef=0.0", "actor.loss.use_kl_loss=false"]
    assert not any(argument.startswith("actor.loss.entropy_coeff") for argument in translated)
    assert "verl multiplies its whole PPO loss, this included, by 0" in notes[-1]
    assert not any("use_kl_loss" in argument for argument in distil("use_task_rewards=false", algo="dr_grpo")[0])
    kept = distil("use_task_rewards=false", "actor.loss.use_kl_loss=true")[0]  # rlplat's own key decides
    assert "actor.loss.use_kl_loss=true" in kept and "actor.loss.use_kl_loss=false" not in kept


def test_several_teachers_are_routed_by_their_key_and_a_lone_teacher_scores_every_row():
    teachers = ["+distillation.teacher_models.gsm8k.key=openai/gsm8k", "+distillation.teacher_models.gsm8k.model_path=/a",
                "+distillation.teacher_models.gsm8k.num_replicas=1", "+distillation.teacher_models.gsm8k.inference.dtype=bf16",
                "+distillation.teacher_models.gsm8k.inference.tensor_model_parallel_size=2",
                "+distillation.teacher_models.geo.key=geo", "+distillation.teacher_models.geo.model_path=/b"]
    translated, notes = distil(*teachers)
    assert translated[2:] == [  # the default entry teacher_model is dropped beside named ones, as verl drops it
        "distillation.teachers.gsm8k.data_sources=[openai/gsm8k]", "distillation.teachers.gsm8k.model_path=/a",
        "distillation.teachers.gsm8k.engine_config.dtype=bfloat16", "distillation.teachers.geo.data_sources=[geo]",
        "distillation.teachers.geo.model_path=/b"]
    assert "verl drops its default entry teacher_model when other teachers are named" in notes[1]
    assert any("tensor_model_parallel_size=2 accepted and ignored: verl serves each teacher with a rollout server" in note
               for note in notes)
    lone, notes = distil("distillation.teacher_models.teacher_model.key=openai/gsm8k")
    assert lone[2:] == ["distillation.teachers.teacher_model.model_path=/teacher"]  # data_sources null: every row
    assert "verl sends every row to a lone teacher whatever its key" in notes[-1]


def test_a_teacher_pool_of_its_own_is_rlplats_separate_teacher_role():
    translated, _ = distil("distillation.nnodes=2", "distillation.n_gpus_per_node=4")
    assert translated[3:] == ["roles.teacher.nnodes=2", "roles.teacher.placement=separate", "roles.teacher.devices_per_node=4"]
    translated, notes = distil("distillation.nnodes=0", "distillation.n_gpus_per_node=8")
    assert translated[2:] == ["distillation.teachers.teacher_model.model_path=/teacher"]
    assert "rlplat's teachers run in the actor's processes (roles.teacher.placement=colocated" in notes[2]
    assert "verl reads it only for a teacher pool of its own" in notes[3]


def test_the_policy_gradient_form_is_accepted_when_verls_distillation_clip_ratios_are_the_actors():
    same = ["loss_mode=k1", "use_policy_gradient=true", "clip_ratio_high=0.28"]
    translated, notes = distil(*same, algo="dapo")  # dapo's actor clips at 0.2 / 0.28
    assert translated[0].startswith("actor.loss.terms=[{loss_mode: reverse_kl, coef: 1.0, estimator: k1, use_policy_gradient: true")
    assert "clip_ratio_high=0.28 accepted and ignored: rlplat's reverse_kl clips with actor.loss's clip ratios" in notes[-1]
    with pytest.raises(ConfigError, match=re.escape("use_policy_gradient=true: rlplat's reverse_kl clips its policy gradient "
                                                    "with the actor's clip ratios (actor.loss.clip_ratio_low/high), and verl's "
                                                    "differ: clip_ratio_high 0.2 for the distillation loss, 0.28 for the actor's")):
        distil("loss_mode=k1", "use_policy_gradient=true", algo="dapo")  # verl's distillation default is 0.2
    with pytest.raises(ConfigError, match=r"clip_ratio_low=0.1: .*clip_ratio_low 0.1 for the distillation loss, 0.2 for"):
        distil("loss_mode=k1", "use_policy_gradient=true", "clip_ratio_low=0.1")


@pytest.mark.parametrize("arguments, why", [
    (["loss_mode=forward_kl_topk", "log_prob_min_clamp=-10.0"], "forward_kl_topk compares the teacher's and the student's "
                                                                "log-probs as they are, without a lower clamp"),
    (["loss_mode=forward_kl_topk", "use_policy_gradient=true"], "verl's policy-gradient form (the divergence as the sampled "
                                                                "token's advantage) has no rlplat loss"),
    (["loss_mode=k1"], "k1 differentiated directly (use_policy_gradient=false, verl's default)"),
    (["loss_mode=jsd"], "rlplat's distillation losses take verl's k1, kl, k2, mse, k3, low_var_kl, abs, forward_kl_topk"),
    (["use_policy_gradient=true", "policy_loss_mode=gspo"], "the vanilla clipped surrogate only"),
    (["no_such_key=1"], "rlplat knows no such key of verl's distillation_loss"),
    (["distillation.teacher_models.teacher_model.inference_dtype=bf16"], "verl's teacher entries have key, model_path"),
    (["+distillation.teacher_models.a.model_path=/a", "+distillation.teacher_models.b.key=b",
      "+distillation.teacher_models.b.model_path=/b"], "give distillation.teacher_models.a.key (the data_source of the rows"),
    (["actor_rollout_ref.rollout.temperature=0.7"], "verl scores the teacher at temperature 1 and the student at the "
                                                    "rollout's (0.7)"),
    (["actor.loss.terms=[{loss_mode: reverse_kl}]"], "and actor.loss.terms is given too: write the loss one way"),
])
def test_distillation_settings_rlplat_cannot_honour_are_refused_saying_why(arguments, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        distil(*arguments)


def test_verls_switch_on_without_a_teacher_model_is_refused_and_rlplats_teachers_count():
    with pytest.raises(ConfigError, match=re.escape("distillation.enabled=true: no teacher: give "
                                                    "distillation.teacher_models.teacher_model.model_path")):
        translate_overrides(["distillation.enabled=true"])
    own = ["distillation.enabled=true", "distillation.teachers.math.model_path=/m"]
    assert translate_overrides(own)[0][2:] == ["distillation.teachers.math.model_path=/m"]


def test_with_verls_switch_off_its_distillation_keys_are_ignored_and_rlplats_pass_as_they_are():
    verl = ["distillation.enabled=false", TEACHER, f"{LOSS}.loss_mode=jsd", "distillation.nnodes=2"]
    translated, notes = translate_overrides(verl)
    assert translated == []
    assert notes[0].endswith("accepted and ignored: off: no teachers, as in rlplat without distillation.teachers")
    assert all(note.endswith("verl reads it only with distillation.enabled=true") for note in notes[1:])
    rlplat = ["distillation.teachers.math.model_path=/m", "distillation.teachers.math.data_sources=[math]",
              "distillation.teacher_key=task", "distillation.top_k=16", "distillation.unrouted=skip", "distillation.sleep=false",
              "actor.loss.terms=[{loss_mode: jsd_topk, coef: 1.0}]", "roles.teacher.placement=colocated"]
    assert translate_overrides(rlplat) == (rlplat, [])


def test_a_verl_config_file_with_distillation_on_translates_by_the_same_rules():
    node = {"enabled": True, "nnodes": 0, "n_gpus_per_node": 8, "teacher_key": "data_source",
            "teacher_models": {"teacher_model": {"_target_": "verl.workers.config.DistillationTeacherModelConfig",
                                                 "key": None, "model_path": "/teacher", "num_replicas": 0,
                                                 "inference": {"name": "vllm", "dtype": "bfloat16"}}},
            "distillation_loss": {**VERL_DISTILLATION_LOSS, "loss_mode": "forward_kl_topk", "use_task_rewards": False}}
    translated, _ = translate_mapping({"distillation": node})
    assert translated == {
        "actor": {"loss": {"terms": [{"loss_mode": "forward_kl_topk", "coef": 1.0, "renormalize": False}],
                           "policy_loss_coef": 0.0, "use_kl_loss": False}},
        "distillation": {"top_k": 32, "teacher_key": "data_source",
                         "teachers": {"teacher_model": {"model_path": "/teacher", "engine_config": {"dtype": "bfloat16"}}}},
    }


FORMERLY_REFUSED = {
    "lora": ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
             "actor_rollout_ref.model.target_modules=all-linear"],
    "reward model": ["reward_model.enable=True", "reward_model.model.path={model}", "reward_model.micro_batch_size_per_gpu=4"],
    "multi-turn tools": ["actor_rollout_ref.rollout.multi_turn.enable=True",
                         "actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                         "actor_rollout_ref.rollout.multi_turn.format=hermes",
                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                         "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                         "actor_rollout_ref.rollout.agent.num_workers=8"],
    "separate rollout": ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                         "trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=2",
                         "algorithm.rollout_correction.rollout_is=token",  # stale samples need a correction
                         "cluster.backend=ray"],
    "distillation": ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path={model}",
                     "distillation.distillation_loss.loss_mode=k3", "distillation.distillation_loss.use_task_rewards=false"],
}
SHOWN = {
    "lora": {"actor.lora.rank": 8, "actor.lora.alpha": 16.0, "actor.lora.target_modules": ["all-linear"]},
    "reward model": {"reward.model.path": "{model}", "reward.model.micro_batch_size_per_gpu": 4},
    "multi-turn tools": {"agent.tools_config": "{tools}", "agent.tool_parser": "hermes", "agent.loops.tool.max_turns": 3,
                         "agent.loop": "tool"},
    "separate rollout": {"roles.rollout.placement": "separate", "roles.rollout.nnodes": 1, "roles.rollout.devices_per_node": 1,
                         "trainer.mode": "separate_async", "trainer.max_staleness": 1},
    "distillation": {"distillation.teachers.teacher_model.model_path": "{model}", "distillation.teachers.teacher_model.data_sources": None,
                     "actor.loss.terms": [{"loss_mode": "reverse_kl", "coef": 1.0, "estimator": "k3", "use_policy_gradient": False}],
                     "actor.loss.policy_loss_coef": 0.0, "actor.loss.use_kl_loss": False},
}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(FORMERLY_REFUSED))
def test_config_show_prints_the_translation_of_keys_it_once_refused(cli_in_process, group):
    import rlplat_demo as demo
    from rlplat_demo import tools as tool_demo

    values = {"model": str(demo.model_dir()), "tools": str(tool_demo.tools_config_file())}
    arguments = [argument.format(**values) for argument in FORMERLY_REFUSED[group]]
    if group == "multi-turn tools":
        arguments += [f"model.path={tool_demo.model_dir()}", f"data.train_files=[{tool_demo.data_file('train')}]"]
    result = cli_in_process("config", "show", *arguments)
    assert result.returncode == 0, result.stderr[-2000:]
    notes = [line for line in result.stderr.splitlines() if line.startswith("rlplat: verl key ")]
    verl = [argument.partition("=")[0] for argument in arguments
            if not argument.startswith(("cluster.", "model.", "data.", "algorithm.rollout_correction."))]  # rlplat keys: no note
    assert [note.split()[3].partition("=")[0] for note in notes] == verl  # one note per verl key, in order
    config = OmegaConf.create(result.stdout)
    for key, value in SHOWN[group].items():
        expected = value.format(**values) if isinstance(value, str) else value
        assert OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(config, key)}))["v"] == expected, key


VERL_091_DEFAULTS = {  # the nodes of verl 0.9.1's _generated_ppo_trainer.yaml that this table learnt, at their defaults
    "actor_rollout_ref": {
        "model": {"lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None,
                  "lora_adapter_path": None,
                  "lora": {"type": "lora", "merge": False, "rank": 0, "alpha": 32, "dropout": 0.0,
                           "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "exclude_modules": [],
                           "adapter_path": None, "freeze_vision_model": True}},
        "rollout": {
            "nnodes": 0, "n_gpus_per_node": 8,
            "multi_turn": {"_target_": "verl.workers.config.MultiTurnConfig", "enable": False, "max_assistant_turns": None,
                           "tool_config_path": None, "function_tool_path": None, "max_user_turns": None,
                           "max_parallel_calls": 1, "max_tool_response_length": 256, "tool_response_truncate_side": "middle",
                           "use_inference_chat_template": False, "tokenization_sanity_check_mode": "strict",
                           "format": "hermes", "num_repeat_rollouts": None},
            "agent": {"num_workers": 8, "default_agent_loop": "single_turn_agent", "agent_loop_config_path": None,
                      "custom_async_server": {"path": None, "name": None}},
        },
    },
    "data": {"tool_config_path": None, "function_tool_path": None, "return_raw_input_ids": False},
    "reward_model": {"enable": None, "enable_resource_pool": None, "n_gpus_per_node": None, "nnodes": None,
                     "model": {"path": None, "external_lib": None, "trust_remote_code": None},
                     "rollout": {"name": None, "dtype": None, "tensor_model_parallel_size": None}},
    "reward": {"reward_model": {"enable": False, "enable_resource_pool": False, "n_gpus_per_node": 8, "nnodes": 0,
                                "model_path": None, "rollout": {"name": "???", "dtype": "bfloat16",
                                                                "tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.5}}},
    "distillation": {"_target_": "verl.workers.config.DistillationConfig", "enabled": False,
                     "distillation_loss": VERL_DISTILLATION_LOSS, "n_gpus_per_node": 8, "nnodes": 0,
                     "teacher_models": {"teacher_model": {
                         "_target_": "verl.workers.config.DistillationTeacherModelConfig", "key": None, "model_path": None,
                         "num_replicas": 0, "inference": {"_target_": "verl.workers.config.RolloutConfig", "name": "???",
                                                          "dtype": "bfloat16", "gpu_memory_utilization": 0.5,
                                                          "tensor_model_parallel_size": 2, "max_model_len": None,
                                                          "engine_kwargs": {}, "temperature": 1.0}}},
                     "teacher_key": "data_source"},
    "trainer": {"use_v1": True, "v1": {
        "trainer_mode": "sync", "sync": {}, "colocate_async": {"num_warmup_batches": 1},
        "separate_async": {"num_warmup_batches": 1, "parameter_sync_step": 4,
                           "hybrid_rollout": {"enable_switch": False, "switch_threshold_ratio": 0.4}},
        "sampler": {"max_off_policy_threshold": 8, "max_off_policy_strategy": "drop", "sync_refill_failed_groups": False,
                    "custom_sampler": {"path": None, "name": None}, "sampler_kwargs": {}}}},
}


def test_a_verl_config_file_with_these_nodes_at_verls_defaults_translates_without_a_refusal():
    translated, _ = translate_mapping(VERL_091_DEFAULTS)
    assert translated == {
        "actor": {"lora": {"rank": 0, "alpha": 16, "target_modules": ["all-linear"]}},
        "agent": {"tool_parser": "hermes",
                  "loops": {"tool": {"max_parallel_calls": 1, "max_tool_response_length": 256, "truncate_side": "middle"}}},
        "trainer": {"mode": "sync"},
        "distillation": {"teacher_key": "data_source"},  # rlplat's key too, same meaning
    }
