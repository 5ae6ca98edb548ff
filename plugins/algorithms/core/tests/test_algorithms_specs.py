"""Algorithm specs: what each declares, the ReMax and DAPO loop hooks, and registry errors."""

import dataclasses

import numpy as np
import pytest
import torch

from rlplat import hookimpl, registry
from rlplat.contracts.rollout import SamplingParams
from rlplat.protocol import DataProto
from rlplat.registry import DuplicateEntryError, UnknownEntryError
from rlplat_algorithms.dapo import GroupAccumulator
from rlplat_algorithms.plugin import ALGORITHMS
from rlplat_algorithms.remax import BASELINE_FLAG

# name -> (estimator, policy loss, needs_critic, reads the reference with its default config)
DECLARED = {
    "ppo": ("gae", "vanilla", True, False),
    "grpo": ("grpo", "vanilla", False, True),
    "dr_grpo": ("dr_grpo", "vanilla", False, False),
    "rloo": ("rloo", "vanilla", False, True),
    "reinforce_pp": ("reinforce_plus_plus", "vanilla", False, True),
    "remax": ("remax", "vanilla", False, True),
    "dapo": ("grpo", "vanilla", False, False),
    "gspo": ("grpo", "gspo", False, False),
}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_each_spec_states_estimator_loss_critic_and_reference(name):
    spec = registry.get("algorithm", name)()
    nodes = spec.default_nodes()
    uses_reference = spec.uses_reference(nodes["actor"]["loss"], nodes["algorithm"])
    assert (spec.adv_estimator, spec.policy_loss, spec.needs_critic, uses_reference) == DECLARED[name]
    assert spec.needs_reference is False  # the config decides: a KL term that reads the reference
    entry = registry.entry("algorithm", name)
    assert (entry.metadata["needs_critic"], entry.metadata["needs_reference"]) == DECLARED[name][2:]
    assert set(DECLARED) == set(ALGORITHMS)


def test_dapo_defaults_are_clip_higher_token_mean_and_overlong_shaping():
    config = registry.get("algorithm", "dapo")().default_config
    assert (config["actor"]["clip_ratio_low"], config["actor"]["clip_ratio_high"]) == (0.2, 0.28)
    assert config["actor"]["loss_agg_mode"] == "token-mean"
    assert config["filter_groups"]["enable"] and config["filter_groups"]["max_num_gen_batches"] > 0
    assert config["reward"]["manager"] == "dapo" and config["reward"]["overlong_buffer"]["enable"]


def scored_batch(uids, scores, acc=None):
    scores = torch.tensor(scores)
    token_level_scores = torch.zeros(len(uids), 3)
    token_level_scores[:, -1] = scores
    non_tensors = {"uid": list(uids)}
    if acc is not None:
        non_tensors["acc"] = list(acc)
    return DataProto.from_dict(
        tensors={"token_level_scores": token_level_scores, "row": torch.arange(len(uids))}, non_tensors=non_tensors
    )


def test_dapo_drops_groups_whose_scores_are_all_equal_and_keeps_groups_of_one():
    # group a [1, 1] is uninformative, b [1, 0] is kept, c has one response and is kept (verl)
    dapo = registry.get("algorithm", "dapo")()
    batch = scored_batch(["a", "a", "b", "b", "c"], [1.0, 1.0, 1.0, 0.0, 0.5])
    kept = dapo.filter_batch(batch)
    assert kept.batch["row"].tolist() == [2, 3, 4]
    assert len(batch) == 5  # the input is untouched


def test_dapo_can_filter_on_a_non_tensor_metric():
    # scores differ within both groups, but acc only within b
    dapo = registry.get("algorithm", "dapo")()
    spec = dataclasses.replace(dapo, default_config={**dapo.default_config, "filter_groups": {"metric": "acc"}})
    batch = scored_batch(["a", "a", "b", "b"], [0.9, 0.8, 1.0, 0.0], acc=[True, True, True, False])
    assert spec.filter_batch(batch).batch["row"].tolist() == [2, 3]


def test_dapo_names_an_unknown_metric():
    dapo = registry.get("algorithm", "dapo")()
    spec = dataclasses.replace(dapo, default_config={"filter_groups": {"metric": "accuracy"}})
    with pytest.raises(KeyError, match="accuracy"):
        spec.filter_batch(scored_batch(["a"], [1.0]))


def test_dynamic_sampling_accumulates_rounds_until_the_batch_is_full_then_trims():
    accumulator = registry.get("algorithm", "dapo")().make_accumulator(train_batch_size=2)
    assert accumulator.add(scored_batch(["a", "a"], [1.0, 0.0])) is None  # 1 of 2 groups
    full = accumulator.add(scored_batch(["b", "b", "c", "c"], [1.0, 0.0, 0.0, 1.0]))
    assert list(full.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]  # trimmed to exactly 2 groups


def test_dynamic_sampling_fails_clearly_past_its_bound():
    accumulator = GroupAccumulator(wanted_groups=3, max_num_gen_batches=2)
    accumulator.add(scored_batch(["a", "a"], [1.0, 0.0]))
    with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
        accumulator.add(scored_batch(["b", "b"], [1.0, 0.0]))  # 2 rounds, 2 of 3 groups


def generated_batch():
    """Two prompts (uids p, q), two samples each; prompt width 2, response width 2."""
    prompts = torch.tensor([[5, 6], [5, 6], [7, 8], [7, 8]])
    responses = torch.tensor([[11, 12], [13, 14], [15, 16], [17, 18]])
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.ones(4, 4, dtype=torch.long),
            "position_ids": torch.arange(4).repeat(4, 1),
            "response_mask": torch.ones(4, 2),
        },
        non_tensors={"uid": ["p", "p", "q", "q"]},
    )


def fake_greedy_generate(calls):
    def generate(prompts, sampling):
        calls.append((prompts, sampling))
        responses = torch.full((len(prompts), 2), 99)
        return DataProto.from_dict(
            tensors={
                "prompts": prompts.batch["input_ids"],
                "responses": responses,
                "input_ids": torch.cat([prompts.batch["input_ids"], responses], dim=1),
                "attention_mask": torch.ones(len(prompts), 4, dtype=torch.long),
                "position_ids": torch.arange(4).repeat(len(prompts), 1),
                "response_mask": torch.ones(len(prompts), 2),
            },
            non_tensors=prompts.non_tensor_batch,
        )

    return generate


def test_remax_generates_one_greedy_response_per_prompt_and_flags_it():
    calls = []
    spec = registry.get("algorithm", "remax")()
    extended = spec.after_generate(generated_batch(), fake_greedy_generate(calls), SamplingParams(n=2, temperature=0.7))
    (prompts, sampling), = calls
    assert sampling.greedy and sampling.n == 1
    assert prompts.batch["input_ids"].tolist() == [[5, 6], [7, 8]]
    assert list(extended.non_tensor_batch[BASELINE_FLAG]) == [False, False, False, False, True, True]
    assert extended.batch["responses"][4:].tolist() == [[99, 99], [99, 99]]
    assert list(extended.non_tensor_batch["uid"][4:]) == ["p", "q"]


def test_remax_turns_the_greedy_scores_into_reward_baselines_and_drops_those_rows():
    spec = registry.get("algorithm", "remax")()
    extended = spec.after_generate(generated_batch(), fake_greedy_generate([]), SamplingParams(n=2))
    scores = torch.zeros(6, 2)
    scores[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.25, 0.75])  # greedy p scored 0.25, greedy q 0.75
    filtered = spec.filter_batch(extended.union(DataProto.from_dict(tensors={"token_level_scores": scores})))
    assert len(filtered) == 4 and BASELINE_FLAG not in filtered.non_tensor_batch
    assert filtered.batch["reward_baselines"].tolist() == [0.25, 0.25, 0.75, 0.75]


def test_unknown_names_list_what_is_available_and_the_closest():
    with pytest.raises(UnknownEntryError, match="Did you mean 'grpo'"):
        registry.get("advantage_estimator", "grop")
    with pytest.raises(UnknownEntryError, match="vanilla"):
        registry.get("policy_loss", "vanila")


def test_a_second_plugin_registering_the_same_name_is_reported_with_both_distributions(register_temporary_plugin):
    class Clash:
        @hookimpl
        def register_advantage_estimators(self, register):
            register("grpo", "json:dumps")

    register_temporary_plugin(Clash(), name="clash", distribution="rlplat-clash")
    with pytest.raises(DuplicateEntryError, match="rlplat-algorithms.*rlplat-clash"):
        registry.get("advantage_estimator", "grpo")
