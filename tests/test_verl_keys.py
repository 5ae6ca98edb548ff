"""verl's dotted keys on rlplat's command line: every target exists, each kind of translation and refusal,
hydra's prefixes, the nested (YAML) path, the documented table, and ``rlplat config show`` on a real verl
GRPO command line, and ``rlplat run`` training the demo from that command line."""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlplat import verl_keys
from rlplat.config import ConfigError, RLConfig, load_config
from rlplat.verl_keys import RULES, Target, format_value, parse_value, translate_command_line, translate_mapping, translate_overrides

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
    parts = target.key.split(".")
    if parts[1:2] == ["engine_config"]:
        return declares(schema_of("engine", "fsdp2"), parts[2:])
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
    return declares(RLConfig, parts)


TARGETS = sorted({target for rule in RULES for target in rule.targets}, key=str)


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_every_target_of_the_table_is_a_key_rlplat_or_a_built_in_plugin_declares(target):
    assert resolves(target), f"{target} (a target of rlplat.verl_keys.RULES) is not in rlplat's config schema"


def test_no_target_is_a_key_the_config_loader_fills_itself():
    from rlplat.contracts import engine, rollout

    # what core hands every engine and rollout; setting one of these in the node is a config error
    for node, contract, name in (("engine_config", engine, "EngineBuildConfig"), ("config", rollout, "RolloutBuildConfig")):
        reserved = {field.name for field in dataclasses.fields(getattr(contract, name))} if hasattr(contract, name) else set()
        keys = {target.key.split(".")[2] for target in TARGETS if target.key.split(".")[1] == node and target.key[0] in "acr"
                and not target.key.startswith("reward.")}
        assert not reserved & keys, node


def test_rlplat_keys_among_the_rules_keep_their_meaning_and_the_defaults_the_module_reads_are_rlplats():
    base = OmegaConf.structured(RLConfig)
    for rule in RULES:
        key = rule.key.removesuffix(".*")
        if OmegaConf.select(base, key, default="absent") != "absent":
            assert not rule.verl_only, f"{rule.key} is rlplat's key too: its rule must leave rlplat's values unchanged"
    for key, value in verl_keys.RLPLAT_DEFAULTS.items():
        assert OmegaConf.select(base, key) == value, key


def test_the_algorithms_the_module_selects_are_registered_and_only_ppo_has_a_critic():
    from rlplat import registry

    assert set(verl_keys.ESTIMATOR_ALGORITHMS.values()) | {"dapo"} <= set(registry.names("algorithm"))
    assert set(verl_keys.ESTIMATOR_ALGORITHMS) <= set(registry.names("advantage_estimator"))
    with_critic = {name for name in registry.names("algorithm") if registry.get("algorithm", name)().needs_critic}
    assert with_critic == set(verl_keys.CRITIC_ALGORITHMS)


def test_the_doc_holds_the_table_of_the_module_word_for_word():
    text = DOC.read_text()
    table = text.split(verl_keys.TABLE_START, 1)[1].split(verl_keys.TABLE_END, 1)[0].strip("\n") + "\n"
    assert table == verl_keys.markdown_table(), (
        "docs/coming-from-verl.md is out of date: replace its table with `python -m rlplat.verl_keys`")
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
])
def test_values_that_differ_in_convention_are_converted_and_the_note_says_why(verl, rlplat, why):
    translated, notes = translate_overrides([verl])
    assert translated == [rlplat]
    assert notes[0].startswith(f"verl key {verl} -> {rlplat} (") and why in notes[0]


def test_gpus_per_node_sets_the_worker_processes_and_asks_for_gpus_unless_the_command_line_says_otherwise():
    translated, notes = translate_overrides(["trainer.n_gpus_per_node=8"])
    assert translated == ["cluster.devices_per_node=8", "cluster.use_gpu=true"]
    assert "add cluster.use_gpu=false to run these workers as CPU processes" in notes[0]
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
    ("actor_rollout_ref.model.lora_rank=0", "full fine-tuning"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature=0", "validates greedily"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]", "always hold the model"),
])
def test_keys_that_change_nothing_here_are_accepted_and_ignored_with_the_reason(verl, why):
    translated, notes = translate_overrides([verl])
    assert translated == []
    assert notes[0].startswith(f"verl key {verl} accepted and ignored: ") and why in notes[0]


def test_every_key_without_an_equivalent_is_refused_by_name_in_one_error():
    arguments = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.model.lora_rank=64",
                 "trainer.critic_warmup=5", "actor_rollout_ref.actor.no_such_key=1", "trainer.logger=[console,mlflow]",
                 "actor_rollout_ref.actor.optim.lr=1e-6"]
    with pytest.raises(ConfigError) as raised:
        translate_overrides(arguments)
    message = str(raised.value)
    assert message.startswith("5 verl key(s) with no rlplat equivalent")
    for argument in arguments[:4]:
        assert f"\n  {argument}: " in message
    assert "without tensor parallelism" in message and "no LoRA adapters" in message and "not to mlflow" in message
    assert "actor.optim.lr" not in message


def test_the_reference_model_takes_the_actors_engine_settings_so_a_different_one_is_refused():
    same = translate_overrides(["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                                "actor_rollout_ref.ref.fsdp_config.param_offload=True"])[0]
    assert same == ["actor.engine_config.param_offload=True"]
    with pytest.raises(ConfigError, match=r"ref\.fsdp_config\.param_offload=True: rlplat's reference model runs with "
                                          r"the actor's engine settings \(actor_rollout_ref\.actor\.fsdp_config\.param_offload=false\)"):
        translate_overrides(["actor_rollout_ref.ref.fsdp_config.param_offload=True"])


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
    with pytest.raises(ConfigError, match=r"1 verl key\(s\).*\n  actor_rollout_ref.model.lora_rank=8: "):
        translate_mapping({"actor_rollout_ref": {"model": {"lora_rank": 8}}})


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
    from rlplat import demo

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
    from rlplat import demo

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
    result = cli_run("run", "actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert result.returncode == 2
    assert result.stderr.startswith("rlplat: config error: 2 verl key(s) with no rlplat equivalent")
    assert "Traceback" not in result.stderr


def test_verls_rollout_correction_keys_are_rlplats_and_a_key_rlplat_lacks_is_refused():
    arguments = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
                 "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce"]
    assert translate_overrides(arguments) == (arguments, [])
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.rollout_token_veto_threshold=1e-4: rlplat's"):
        translate_overrides(["algorithm.rollout_correction.rollout_token_veto_threshold=1e-4"])
