"""`rlplat config explain` / `config show --doc`: every key with its type, default, value, owner and
docstring, the plugin-owned ones from the schema the chosen plugin declares."""

from __future__ import annotations

import dataclasses
from typing import Dict

import pytest

from rlplat import hookimpl
from rlplat.config import load_config
from rlplat.cli.explain import explain, render
from rlplat.contracts.algorithm import Algorithm
from rlplat_demo import overrides as demo_overrides


@pytest.fixture(scope="module")
def keys():
    return {doc.key: doc for doc in explain(load_config(None, demo_overrides(), algo="grpo"))}


def test_every_key_has_a_description(keys):
    assert [key for key, doc in keys.items() if not doc.doc] == []


def test_a_core_key_shows_its_type_default_value_and_owner(keys):
    lr = keys["actor.optim.lr"]
    assert (lr.type, lr.default, lr.value, lr.owner) == ("float", 1e-6, 1.5e-4, "core (rlplat)")
    assert "Peak learning rate" in lr.doc


def test_plugin_keys_come_from_the_chosen_plugins_schemas(keys):
    assert keys["actor.engine_config.dtype"].owner.startswith("engine 'fsdp2' from rlplat-engine-fsdp2")
    assert keys["rollout.config.max_batch_rows"].owner.startswith("rollout 'hf'")
    assert keys["reward.config.overlong_buffer.len"].type == "int"
    assert keys["actor.loss.policy_loss.clip_cov_ratio"].owner.startswith("policy_loss 'vanilla'")
    assert keys["algorithm.kl_ctrl.kl_coef"].owner.startswith("algorithm 'grpo'")
    assert keys["roles.critic.placement"].default == "colocated"


def test_keys_core_fills_in_or_the_engine_sets_per_micro_batch_are_not_offered(keys):
    assert "actor.engine_config.lr" not in keys and "actor.engine_config.model_path" not in keys
    assert "rollout.config.model_path" not in keys
    assert "actor.loss.global_token_count" not in keys


def test_render_selects_a_node_by_its_prefix(keys):
    text = render(list(keys.values()), "actor.optim")
    assert text.startswith("actor.optim.lr  (float; default 1e-06; here 0.00015)  [core (rlplat)]")
    assert "critic.optim" not in text and "actor.ppo_epochs" not in text


def test_choosing_another_policy_loss_drops_the_algorithms_knobs_for_its_own(register_temporary_plugin):
    class Plugin:
        @hookimpl
        def register_algorithms(self, register):
            register("knobbed", lambda: Algorithm(name="knobbed", adv_estimator="grpo", policy_loss="clip_cov",
                                                  default_config={"actor": {"policy_loss": {"clip_cov_ratio": 0.01}}}))

    register_temporary_plugin(Plugin(), name="knobbed-algorithm")
    assert load_config(None, demo_overrides(), algo="knobbed").actor.loss.policy_loss.clip_cov_ratio == 0.01
    chosen = load_config(None, [*demo_overrides(), "actor.loss.policy_loss.loss_mode=vanilla"], algo="knobbed")
    assert dict(chosen.actor.loss.policy_loss) == {"loss_mode": "vanilla"}


def test_config_explain_prints_a_key_and_exits_2_on_an_unknown_one(cli_run):
    result = cli_run("config", "explain", "actor.engine_config.enable_gradient_checkpointing")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("actor.engine_config.enable_gradient_checkpointing  (bool; default False)  [engine 'fsdp2'")
    assert "Recompute each decoder layer" in result.stdout
    wrong = cli_run("config", "explain", "actor.optim.lrr")
    assert wrong.returncode == 2 and "no config key 'actor.optim.lrr'. Did you mean 'actor.optim.lr'?" in wrong.stderr


def test_config_explain_reads_the_preset_demo_names(cli_run):
    result = cli_run("config", "explain", "agent.max_prompt_length", "--demo", "tools")
    assert result.returncode == 0, result.stderr
    assert "the tools preset" in result.stderr
    assert result.stdout.startswith("agent.max_prompt_length  (int or None; default None; here 32)")


def test_config_show_without_a_model_shows_the_demo_config_as_run_uses_it(cli_run):
    result = cli_run("config", "show", "reward.scorer=gsm8k")
    assert result.returncode == 0, result.stderr
    assert "using the built-in demo's settings" in result.stderr
    assert "demo/assets/model" in result.stdout and "scorer: gsm8k" in result.stdout



@dataclasses.dataclass
class NamedEntry:
    path: str = "x"
    """Where it is."""


@dataclasses.dataclass
class NodeOfNamedEntries:
    entries: Dict[str, NamedEntry] = dataclasses.field(default_factory=dict)
    """Named entries."""


def test_a_mapping_of_named_entries_lists_the_entries_keys_under_a_name_placeholder():
    from rlplat.cli.explain import schema_keys

    keys = [(doc.key, doc.doc) for doc in schema_keys(NodeOfNamedEntries, "node.", {}, "test")]
    assert keys == [("node.entries", "Named entries."), ("node.entries.<name>.path", "Where it is.")]
