"""Rollout correction: weights and masks of the presets on a tensor worked out by hand, the config checked at
load, the diagnostics against their formulas, and runs where the rollout and the trainer agree (correction
changes nothing) or differ by a known amount (the diagnostics move by it)."""

from __future__ import annotations

import math

import pytest
import torch

from rlplat.config import ConfigError, load_config
from rlplat.demo import preset
from rlplat.losses import ActorLoss
from rlplat.losses.rollout_correction import (PRESETS, RolloutCorrectionConfig, importance_weights, offpolicy_metrics,
                                              read_rollout_correction, rejection_mask)
from rlplat.protocol import DataProto
from rlplat.tracking import read_metrics
from rlplat.trainer import Trainer

LN = math.log
#: log pi_old - log pi_rollout; the last token of row 0 and the last two of row 1 are padding
LOG_RATIO = torch.tensor([[LN(2), 0.0, -LN(2), 7.0], [LN(3), LN(1.5), 9.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)


def config(**fields) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(**fields)


def close(actual, expected):
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-7, rtol=0), actual


def test_token_weights_are_truncated_at_the_threshold_and_zero_at_padding():
    weights, metrics = importance_weights(LOG_RATIO, MASK, config(rollout_is="token", rollout_is_threshold=2.0))
    close(weights, [[2.0, 1.0, 0.5, 0.0], [2.0, 1.5, 0.0, 0.0]])  # 3 -> 2 (TIS)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 1 + 0.5 + 3 + 1.5) / 5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # 0.5 is the bound, not below


def test_sequence_weights_use_the_sum_of_the_log_ratios_on_every_token_of_the_row():
    weights, metrics = importance_weights(LOG_RATIO, MASK, config(rollout_is="sequence", rollout_is_threshold=2.0))
    close(weights, [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])  # exp(0) and exp(ln 4.5) -> 2
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(4.5)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(1.0)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)


def test_batch_normalisation_gives_the_truncated_weights_mean_one():
    weights, metrics = importance_weights(LOG_RATIO, MASK, config(rollout_is="token", rollout_is_threshold=2.0,
                                                                  rollout_is_batch_normalize=True))
    close(weights, [[2 / 1.4, 1 / 1.4, 0.5 / 1.4, 0.0], [2 / 1.4, 1.5 / 1.4, 0.0, 0.0]])
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.4)


def test_geometric_k1_rejection_masks_a_whole_sequence_outside_its_bounds():
    mask, metrics = rejection_mask(LOG_RATIO, MASK, config(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_1.5"))
    # row 0: mean(-l) = 0, inside [ln 0.5, ln 1.5]; row 1: -ln(4.5)/2 = -0.752 < ln 0.5 = -0.693
    close(mask, [[1, 1, 1, 0], [0, 0, 0, 0]])
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)


def test_token_k3_rejection_masks_single_tokens_and_options_combine_by_and():
    mask, _ = rejection_mask(LOG_RATIO, MASK, config(rollout_rs="token_k3", rollout_rs_threshold=0.5))
    # k3 = e^l - 1 - l: 0.307, 0, 0.193 | 0.901 (> 0.5), 0.095
    close(mask, [[1, 1, 1, 0], [0, 1, 0, 0]])
    both, _ = rejection_mask(LOG_RATIO, MASK, config(rollout_rs="token_k3,seq_sum_k2", rollout_rs_threshold="0.5,0.3"))
    # seq_sum k2 = sum l^2/2: row 0 0.480 (> 0.3), row 1 0.686 (> 0.3)
    close(both, [[0, 0, 0, 0], [0, 0, 0, 0]])


def test_every_preset_reads_as_verls_fields():
    assert read_rollout_correction({"preset": "decoupled_seq_is_rs"}) == RolloutCorrectionConfig(
        preset="decoupled_seq_is_rs", rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0")
    assert read_rollout_correction({"preset": "bypass_ppo_clip"}).bypass_mode
    assert not read_rollout_correction({"preset": "disabled"}).enabled
    assert read_rollout_correction({"preset": "decoupled_token_is", "rollout_is_threshold": 5.0}).rollout_is_threshold == 5.0
    for name in PRESETS:
        read_rollout_correction({"preset": name})


def test_the_weights_multiply_only_the_policy_loss():
    generator = torch.Generator().manual_seed(0)
    rows, width = 4, 5
    tensors = {"response_mask": torch.ones(rows, width), "old_log_probs": -torch.rand(rows, width, generator=generator),
               "advantages": torch.randn(rows, width, generator=generator)}
    log_probs = tensors["old_log_probs"] + 0.01 * torch.randn(rows, width, generator=generator)
    loss = ActorLoss({"loss_agg_mode": "token-mean"})
    plain, _ = loss({"log_probs": log_probs}, DataProto.from_dict(tensors))
    weighted, _ = loss({"log_probs": log_probs}, DataProto.from_dict({**tensors, "rollout_is_weights": torch.full((rows, width), 3.0)}))
    assert weighted.item() == pytest.approx(3 * plain.item(), rel=1e-6)


def test_diagnostics_follow_their_formulas():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.2, 0.0, 0.0]], dtype=torch.float64)
    train = rollout + LOG_RATIO
    metrics = offpolicy_metrics(train, rollout, MASK)
    valid = LOG_RATIO[MASK.bool()]
    assert metrics["rollout_corr/kl"] == pytest.approx(float(-valid.mean()))
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(float((valid.exp() - valid - 1).mean()))
    assert metrics["rollout_corr/chi2_token"] == pytest.approx(float((valid.exp() ** 2).mean() - 1))
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx(((1.0 ** 2) + 4.5 ** 2) / 2 - 1)
    differences = [float(-(LN(2) - LN(2)) / 3), float(-(LN(3) + LN(1.5)) / 2)]
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(sum(differences) / 2)
    ratios = valid.exp()
    assert metrics["rollout_corr/eff_sample_size"] == pytest.approx(float(1 / ((ratios / ratios.mean()) ** 2).mean()))


@pytest.mark.parametrize("node, message", [
    ("algorithm.rollout_correction.preset=token_is", "unknown rollout correction preset 'token_is'"),
    ("algorithm.rollout_correction.rollout_rs=seq_mean_k9", "unknown option"),
    ("algorithm.rollout_correction.rollout_rs=seq_mean_k3", "rollout_rs needs rollout_rs_threshold"),
    ("algorithm.rollout_correction.rollout_is=tokens", "rollout_is must be token, sequence or null"),
])
def test_a_bad_node_is_refused_at_load(node, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*preset("arith"), node], algo="grpo")


def test_bypass_with_weights_is_refused_at_load():
    with pytest.raises(ConfigError, match="bypass_mode applies no weights"):
        load_config(overrides=[*preset("arith"), "algorithm.rollout_correction.preset=bypass_ppo_clip",
                               "algorithm.rollout_correction.rollout_is=token"], algo="grpo")


def run(tmp_path, name, *extra, steps=20, noise=0.0, monkeypatch=None):
    out = tmp_path / name
    config = load_config(overrides=[*preset("arith"), f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
                                    "trainer.val_before_train=false", "trainer.save_freq=0", f"trainer.output_dir={out}",
                                    "trainer.logger=[jsonl]", *extra], algo="grpo")
    trainer = Trainer(config)
    if noise:
        generate = trainer.generate

        def noisy(prompts, sampling=None):  # the rollout's log-probs, off by a known amount
            batch = generate(prompts, sampling)
            batch.batch["rollout_log_probs"] = batch.batch["rollout_log_probs"] + noise * batch.batch["response_mask"]
            return batch

        trainer.generate = noisy
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return read_metrics(out)


@pytest.mark.slow
def test_with_the_same_fp32_engine_correction_changes_nothing_but_the_diagnostics(tmp_path):
    off = run(tmp_path, "off")
    on = run(tmp_path, "on", "algorithm.rollout_correction.preset=decoupled_token_is")
    assert len(on) == len(off) == 20
    for plain, corrected in zip(off, on):
        assert abs(corrected["rollout_corr/kl"]) <= 1e-6 and corrected["rollout_corr/k3_kl"] <= 1e-6
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean", "response_length/mean"):
            assert corrected[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_noise_in_the_rollout_log_probs_moves_the_diagnostics_as_computed(tmp_path):
    noise = 0.05
    rows = run(tmp_path, "noisy", steps=2, noise=noise)
    for row in rows:
        # l = log pi_train - log pi_rollout = -noise on every valid token (the engines agree to ~1e-7)
        assert row["rollout_corr/kl"] == pytest.approx(noise, abs=1e-5)
        assert row["rollout_corr/k3_kl"] == pytest.approx(math.exp(-noise) + noise - 1, abs=1e-6)
        assert row["rollout_corr/chi2_token"] == pytest.approx(math.exp(-2 * noise) - 1, abs=1e-5)
        assert row["rollout_corr/log_ppl_diff"] == pytest.approx(noise, abs=1e-5)


TOKEN_W = [[2.0, 1.0, 0.5, 0.0], [2.0, 1.5, 0.0, 0.0]]
SEQUENCE_W = [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]
#: seq_sum_k1 in [0.5, 2] and seq_mean_k1 in [0.999, 1.001] keep row 0 (log ratios summing to 0) and drop
#: row 1 (sum ln 4.5); seq_mean_k3 <= 0.01 drops both (means 0.167 and 0.498)
ROW_0_KEPT = [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
NONE_KEPT = [[0.0] * 4, [0.0] * 4]
PRESET_TABLE = {
    "decoupled_token_is": (TOKEN_W, MASK.tolist()),
    "decoupled_seq_is": (SEQUENCE_W, MASK.tolist()),
    "decoupled_seq_is_rs": (ROW_0_KEPT, ROW_0_KEPT),
    "decoupled_geo_rs": (None, ROW_0_KEPT),
    "decoupled_geo_rs_seq_tis": (ROW_0_KEPT, ROW_0_KEPT),
    "decoupled_geo_rs_token_tis": ([[2.0, 1.0, 0.5, 0.0], [0.0] * 4], ROW_0_KEPT),
    "decoupled_k3_rs": (None, NONE_KEPT),
    "decoupled_k3_rs_seq_tis": (NONE_KEPT, NONE_KEPT),
    "decoupled_k3_rs_token_tis": (NONE_KEPT, NONE_KEPT),
    "disabled": (None, MASK.tolist()),
}


@pytest.mark.parametrize("name", sorted(PRESET_TABLE))
def test_each_decoupled_preset_gives_the_weights_and_mask_worked_out_by_hand(name):
    from rlplat.losses.rollout_correction import apply

    batch = DataProto.from_dict({"old_log_probs": LOG_RATIO.clone(), "rollout_log_probs": torch.zeros_like(LOG_RATIO),
                                 "response_mask": MASK.clone()})
    apply(batch, read_rollout_correction({"preset": name}))
    weights, mask = PRESET_TABLE[name]
    close(batch.batch["response_mask"], mask)
    if weights is None:
        assert "rollout_is_weights" not in batch.batch.keys()
    else:
        close(batch.batch["rollout_is_weights"], weights)


def test_the_table_covers_every_preset_but_bypass():
    assert set(PRESET_TABLE) | {"bypass_ppo_clip"} == set(PRESETS)


@pytest.mark.slow
def test_bypass_mode_trains_against_the_rollouts_log_probs_without_a_pass_of_its_own(tmp_path):
    # two mini-batches per step would need old_log_probs from a pass of their own; bypass takes the rollout's
    plain = run(tmp_path, "plain", "actor.ppo_mini_batch_size=16", steps=2)
    bypass = run(tmp_path, "bypass", "actor.ppo_mini_batch_size=16", "algorithm.rollout_correction.preset=bypass_ppo_clip", steps=2)
    assert all("timing_s/old_log_prob" in row for row in plain)
    assert not any("timing_s/old_log_prob" in row for row in bypass)
    for before, after in zip(plain, bypass):  # the fp32 engines agree, so the updates do too
        assert after["actor/pg_loss"] == pytest.approx(before["actor/pg_loss"], rel=1e-3, abs=1e-6)


def test_lengths_and_the_sync_check_read_the_mask_as_sampled_not_as_rejection_left_it():
    from rlplat.trainer import batch_metrics
    from rlplat.workers.actor_rollout_ref import log_prob_mismatch

    sampled = torch.ones(2, 4)
    rollout = torch.zeros(2, 4)
    rollout[1, 2] = -3.0
    batch = DataProto.from_dict({"responses": torch.ones(2, 4, dtype=torch.long), "prompts": torch.ones(2, 2, dtype=torch.long),
                                 "attention_mask": torch.ones(2, 6, dtype=torch.long), "old_log_probs": torch.zeros(2, 4),
                                 "rollout_log_probs": rollout, "response_mask": sampled.clone(),
                                 "token_level_scores": torch.zeros(2, 4), "token_level_rewards": torch.zeros(2, 4)})
    from rlplat.losses.rollout_correction import apply

    apply(batch, read_rollout_correction({"preset": "decoupled_geo_rs"}))
    assert batch.batch["response_mask"][1].sum() == 0  # row 1 rejected
    assert batch_metrics(batch, sampled)["response_length/mean"] == 4.0
    assert log_prob_mismatch(batch, sampled)["rollout/log_prob_diff_max"] == 3.0


def test_filtering_dapo_groups_by_a_rule_column_needs_the_rule_in_training(tmp_path):
    from rlplat.demo import reward_model_dir

    with pytest.raises(ConfigError, match="filter_groups.metric='acc'.*rule_weight=0"):
        load_config(overrides=[*preset("arith"), f"reward.model.path={reward_model_dir()}", "reward.model.rule_weight=0",
                               "algorithm.filter_groups.metric=acc"], algo="dapo")
