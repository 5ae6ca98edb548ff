"""Rollout correction: weights and masks of the presets on a tensor worked out by hand, the config checked at
load, the diagnostics against their formulas, and runs where the rollout and the trainer agree (correction
changes nothing) or differ by a known amount (the diagnostics move by it)."""

from __future__ import annotations

import math

import pytest
import torch

from rlplat.config import ConfigError, load_config
from rlplat_demo import preset
from rlplat.losses import ActorLoss
from rlplat.losses.rollout_correction import (PRESETS, RolloutCorrectionConfig, importance_weights, offpolicy_metrics,
                                              read_rollout_correction, rejection_mask)
from rlplat.protocol import DataProto
from rlplat.trainer.tracking import read_metrics
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


def test_the_tables_cover_every_preset():
    assert set(PRESET_TABLE) | set(BYPASS_TABLE) == set(PRESETS)
    assert not set(PRESET_TABLE) & set(BYPASS_TABLE)


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
    from rlplat.losses.rollout_correction import log_prob_mismatch

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
    from rlplat_demo import reward_model_dir

    with pytest.raises(ConfigError, match="filter_groups.metric='acc'.*rule_weight=0"):
        load_config(overrides=[*preset("arith"), f"reward.model.path={reward_model_dir()}", "reward.model.rule_weight=0",
                               "algorithm.filter_groups.metric=acc"], algo="dapo")


# -- bypass mode: the actor loss corrects each micro-batch ------------------------------------------------------------

#: the update's log-probs; the rollout's are CURRENT - LOG_RATIO, so log pi_theta - log pi_rollout is LOG_RATIO on the
#: valid tokens (padding: 7 and 9, which would weigh e^7 and e^9 if they leaked in)
CURRENT = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -4.0, -5.0]], dtype=torch.float64)
ROLLOUT = CURRENT - LOG_RATIO
#: GRPO-like: one advantage per row (padding's is never read)
ADVANTAGES = torch.tensor([[1.0] * 4, [-2.0] * 4], dtype=torch.float64)
TOKENS = 5  # valid tokens: the token-mean normaliser, rejected ones included (the engine counts the sampled mask)
# ppo_clip (vanilla, clip 0.2, dual clip 3.5) on ratios e^l: row 0 (A = 1) max(-r, -clip(r)) = -1.2, -1, -0.5;
# row 1 (A = -2) 2r = 6, 3 (above 2 * 1.2, under the dual bound 2 * 3.5)
PPO_ROW_0, PPO_ROW_1 = -1.2 - 1.0 - 0.5, 6.0 + 3.0
# reinforce -A * w * log_prob: row 0 with w = 1 gives -(-1 - 2 - 0.5) = 3.5
PG_ROW_0 = 3.5
#: name -> (weights, policy mask, loss, d loss / d log_prob)
BYPASS_TABLE = {
    "bypass_ppo_clip": (None, MASK.tolist(), (PPO_ROW_0 + PPO_ROW_1) / TOKENS,
                        # clipped tokens have no gradient; unclipped: -A * r / 5
                        [[0.0, -0.2, -0.1, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    "bypass_ppo_clip_geo_rs": (None, ROW_0_KEPT, PPO_ROW_0 / TOKENS, [[0.0, -0.2, -0.1, 0.0], [0.0] * 4]),
    "bypass_ppo_clip_k3_rs": (None, NONE_KEPT, 0.0, NONE_KEPT),
    # sequence weights 1 and min(4.5, 2); row 1: -(-2) * 2 * (-1.5 - 0.2) = -6.8; gradient -A * w / 5
    "bypass_pg_is": (SEQUENCE_W, MASK.tolist(), (PG_ROW_0 - 6.8) / TOKENS, [[-0.2, -0.2, -0.2, 0.0], [0.8, 0.8, 0.0, 0.0]]),
    "bypass_pg_geo_rs": (None, ROW_0_KEPT, PG_ROW_0 / TOKENS, [[-0.2, -0.2, -0.2, 0.0], [0.0] * 4]),
    "bypass_pg_geo_rs_seq_tis": (ROW_0_KEPT, ROW_0_KEPT, PG_ROW_0 / TOKENS, [[-0.2, -0.2, -0.2, 0.0], [0.0] * 4]),
    # token weights 2, 1, 0.5: -(2 * -1 + 1 * -2 + 0.5 * -0.5) = 4.25
    "bypass_pg_geo_rs_token_tis": ([[2.0, 1.0, 0.5, 0.0], [0.0] * 4], ROW_0_KEPT, 4.25 / TOKENS,
                                   [[-0.4, -0.2, -0.1, 0.0], [0.0] * 4]),
}
# bypass_ppo_clip's row 1: 2r is unclipped (6 and 3 > 2.4), so its gradient is -A * r / 5 = 2 * 3 / 5 and 2 * 1.5 / 5
BYPASS_TABLE["bypass_ppo_clip"][3][1][:2] = [1.2, 0.6]


LOSS_NODE = {"loss_agg_mode": "token-mean", "clip_ratio_c": 3.5}


def bypass_loss(name: str, **fields):
    return ActorLoss({**LOSS_NODE, "rollout_correction": {"preset": name, **fields}})


def bypass_batch(rows=slice(None)) -> DataProto:
    return DataProto.from_dict({"response_mask": MASK[rows], "old_log_probs": ROLLOUT[rows], "rollout_log_probs": ROLLOUT[rows],
                                "advantages": ADVANTAGES[rows]},
                               meta_info={"global_token_count": TOKENS, "global_sequence_count": 2})


@pytest.mark.parametrize("name", sorted(BYPASS_TABLE))
def test_each_bypass_preset_weights_and_rejects_against_the_current_policy_as_worked_out_by_hand(name):
    from rlplat.losses.rollout_correction import bypass_correction

    weights, mask, _, _ = BYPASS_TABLE[name]
    got_weights, got_mask, _ = bypass_correction(CURRENT, ROLLOUT, MASK, read_rollout_correction({"preset": name}))
    close(got_mask, mask)
    if weights is None:
        assert got_weights is None
    else:
        close(got_weights, weights)  # 0 at padding, and at rejected tokens


@pytest.mark.parametrize("name", sorted(BYPASS_TABLE))
def test_each_bypass_preset_gives_the_loss_and_gradient_worked_out_by_hand(name):
    _, _, loss_value, gradient = BYPASS_TABLE[name]
    log_probs = CURRENT.clone().requires_grad_(True)
    loss, _ = bypass_loss(name)({"log_probs": log_probs}, bypass_batch())
    loss.backward()
    assert loss.item() == pytest.approx(loss_value, abs=1e-7)
    close(log_probs.grad, gradient)  # 0 at padding


def test_the_policy_gradient_loss_is_minus_advantage_times_detached_weight_times_log_prob():
    # bypass_pg_is with a threshold that truncates nothing: w = e^0 = 1 (row 0) and e^(ln 4.5) = 4.5 (row 1);
    # d/d log_prob [-A * w * log_prob / 5] = -A * w / 5, with no term from w (detached), though w depends on log_prob
    log_probs = CURRENT.clone().requires_grad_(True)
    loss, _ = bypass_loss("bypass_pg_is", rollout_is_threshold=10.0)({"log_probs": log_probs}, bypass_batch())
    loss.backward()
    assert loss.item() == pytest.approx((3.5 + 2 * 4.5 * (-1.5 - 0.2)) / 5, abs=1e-7)
    close(log_probs.grad, [[-0.2, -0.2, -0.2, 0.0], [1.8, 1.8, 0.0, 0.0]])


def test_the_policy_gradient_loss_replaces_the_configured_policy_loss():
    config = {"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "gspo"},
              "rollout_correction": {"preset": "bypass_pg_geo_rs"}}
    loss, metrics = ActorLoss(config)({"log_probs": CURRENT}, bypass_batch())
    assert loss.item() == pytest.approx(PG_ROW_0 / TOKENS, abs=1e-7)
    assert "actor/pg_clipfrac" not in metrics


def test_bypass_ppo_clip_trains_as_before_with_diagnostics_added():
    batch = bypass_batch()
    plain_loss, plain_metrics = ActorLoss(LOSS_NODE)({"log_probs": CURRENT}, batch)
    loss, metrics = bypass_loss("bypass_ppo_clip")({"log_probs": CURRENT}, batch)
    assert loss.item() == plain_loss.item()
    assert {key: value for key, value in metrics.items() if not key.startswith("rollout_corr/")} == plain_metrics
    assert metrics["rollout_corr/kl"] == pytest.approx(-LN(4.5) / TOKENS, abs=1e-7)  # mean of -l on the valid tokens


def test_bypass_metrics_are_those_of_the_micro_batch_before_rejection():
    _, metrics = bypass_loss("bypass_pg_geo_rs_token_tis")({"log_probs": CURRENT}, bypass_batch())
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5, abs=1e-7)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2, abs=1e-7)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0, abs=1e-7)  # before truncation, padding left out
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 1 + 0.5 + 3 + 1.5) / 5, abs=1e-7)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(float((LOG_RATIO.exp() - LOG_RATIO - 1)[MASK.bool()].mean()), abs=1e-7)
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx((0.0 - (LN(3) + LN(1.5)) / 2) / 2, abs=1e-7)


@pytest.mark.parametrize("name", ["bypass_pg_geo_rs_token_tis", "bypass_pg_is", "bypass_ppo_clip_geo_rs"])
def test_bypass_micro_batches_add_up_to_the_unsplit_batch(name):
    loss_fn = bypass_loss(name)
    whole_grad = CURRENT.clone().requires_grad_(True)
    whole, whole_metrics = loss_fn({"log_probs": whole_grad}, bypass_batch())
    whole.backward()
    parts_grad = CURRENT.clone().requires_grad_(True)
    total, summed = 0.0, {}
    for row in (0, 1):
        loss, metrics = loss_fn({"log_probs": parts_grad[row:row + 1]}, bypass_batch(slice(row, row + 1)))
        loss.backward()
        total += loss.item()
        for key, value in metrics.items():
            summed[key] = summed.get(key, 0.0) + value
    assert total == pytest.approx(whole.item(), abs=1e-7)
    close(parts_grad.grad, whole_grad.grad.tolist())
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff", "rollout_corr/chi2_seq",
                "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction"):
        if key in whole_metrics:
            assert summed[key] == pytest.approx(whole_metrics[key], abs=1e-7), key


def test_a_bypass_micro_batch_without_the_rollouts_log_probs_is_refused():
    batch = DataProto.from_dict({"response_mask": MASK, "old_log_probs": ROLLOUT, "advantages": ADVANTAGES})
    with pytest.raises(ValueError, match="no rollout_log_probs"):
        bypass_loss("bypass_pg_is")({"log_probs": CURRENT}, batch)


def test_the_actor_loss_takes_a_bypass_node_only():
    with pytest.raises(ConfigError, match="bypass mode only"):
        ActorLoss({"rollout_correction": {"preset": "decoupled_token_is"}})


def test_the_actor_loss_node_carries_the_correction_in_bypass_mode_only():
    from rlplat.losses.rollout_correction import actor_loss_node

    node = {"loss_agg_mode": "token-mean"}
    bypass = {"preset": "bypass_pg_geo_rs", "rollout_rs_threshold": "0.9_1.1"}
    assert actor_loss_node(node, bypass) == {**node, "rollout_correction": bypass}
    assert actor_loss_node(node, {"preset": "decoupled_seq_is"}) == node
    assert actor_loss_node(node, None) == node


@pytest.mark.parametrize("fields, message", [
    ({"loss_type": "reinforce"}, "loss_type=reinforce is the loss of bypass mode"),
    ({"bypass_mode": True, "loss_type": "pg"}, "loss_type must be one of ppo_clip, reinforce, got 'pg'"),
    ({"bypass_mode": True, "rollout_is": "token"}, "bypass_mode applies no weights with loss_type=ppo_clip"),
])
def test_a_bad_bypass_node_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrectionConfig(**fields)


def test_bypass_takes_rejection_with_either_loss_and_weights_with_the_policy_gradient():
    assert RolloutCorrectionConfig(bypass_mode=True, rollout_rs="token_k3", rollout_rs_threshold=0.1).enabled
    assert RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token").enabled
    assert read_rollout_correction({"preset": "bypass_pg_is", "rollout_is": "token"}).rollout_is == "token"


def test_a_bypass_preset_loads_and_a_decoupled_reinforce_is_refused_at_load():
    with pytest.raises(ConfigError, match="loss_type=reinforce is the loss of bypass mode"):
        load_config(overrides=[*preset("arith"), "algorithm.rollout_correction.preset=decoupled_seq_is",
                               "algorithm.rollout_correction.loss_type=reinforce"], algo="grpo")


def test_a_bypass_actor_loss_ships_by_value():
    import pickle

    loss_fn = bypass_loss("bypass_pg_geo_rs_seq_tis")
    shipped = pickle.loads(pickle.dumps(loss_fn))
    assert shipped({"log_probs": CURRENT}, bypass_batch())[0].item() == loss_fn({"log_probs": CURRENT}, bypass_batch())[0].item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bypass_pg_geo_rs_token_tis", "bypass_ppo_clip_k3_rs"])
def test_a_bypass_variant_trains_with_its_correction_inside_the_loss(tmp_path, name):
    rows = run(tmp_path, name, "actor.ppo_mini_batch_size=16", f"algorithm.rollout_correction.preset={name}", steps=2)
    for row in rows:
        assert "timing_s/old_log_prob" not in row
        assert math.isfinite(row["actor/pg_loss"])
        assert "rollout_corr/rollout_rs_masked_fraction" in row and "rollout_corr/kl" in row


def test_the_correction_inside_the_actor_loss_is_set_by_the_run_not_the_user():
    with pytest.raises(ConfigError, match="set by rlplat"):
        load_config(overrides=[*preset("arith"), "actor.loss.rollout_correction.bypass_mode=true"], algo="grpo")


def test_bypass_rejection_needs_no_old_log_prob_pass():
    from rlplat import registry
    from rlplat.config import old_log_prob_pass_reasons

    config = load_config(overrides=[*preset("arith"), "algorithm.rollout_correction.preset=bypass_pg_geo_rs"], algo="grpo")
    assert old_log_prob_pass_reasons(config, registry.get("algorithm", "grpo")()) == []


def staleness_batch(**extra) -> DataProto:
    """Two rows sampled by versions 2..4 (partial rollouts), the last token of row 1 padding; version 4 trained."""
    return DataProto.from_dict(tensors={"policy_version": torch.tensor([[2, 3, 4, 4], [3, 3, 4, 4]]),
                                        "response_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), **extra})


def test_staleness_decay_weights_each_token_by_the_version_that_sampled_it():
    from rlplat.losses.rollout_correction import apply

    batch = staleness_batch()
    metrics = apply(batch, config(staleness_decay=0.5), trained_version=4)
    close(batch.batch["rollout_is_weights"], [[0.25, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 0.0]])
    assert metrics["rollout_corr/token_staleness_mean"] == pytest.approx((2 + 1 + 1 + 1) / 7)
    assert metrics["rollout_corr/staleness_weight_mean"] == pytest.approx((0.25 + 0.5 + 1 + 1 + 0.5 + 0.5 + 1) / 7)
    # on top of token importance weights: the product
    batch = staleness_batch(old_log_probs=LOG_RATIO.float(), rollout_log_probs=torch.zeros(2, 4))
    apply(batch, config(rollout_is="token", staleness_decay=0.5), trained_version=4)
    close(batch.batch["rollout_is_weights"], [[2.0 * 0.25, 1.0 * 0.5, 0.5, 2.0], [2.0 * 0.5, 1.5 * 0.5, 2.0, 0.0]])


@pytest.mark.parametrize("fields, message", [
    ({"staleness_decay": 0.0}, r"staleness_decay must be in \(0, 1\]"),
    ({"staleness_decay": 1.5}, r"staleness_decay must be in \(0, 1\]"),
    ({"staleness_decay": 0.9, "bypass_mode": True}, "staleness_decay weights the loss in decoupled mode"),
])
def test_a_bad_staleness_decay_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        config(**fields)


def test_staleness_decay_alone_corrects_an_asynchronous_run_without_an_old_log_prob_pass():
    from rlplat.config import old_log_prob_pass_reasons
    from rlplat.losses.rollout_correction import apply

    run = load_config(overrides=[*preset("arith"), "trainer.mode=colocate_async", "trainer.max_staleness=1",
                                 "algorithm.rollout_correction.staleness_decay=0.8"], algo="grpo")
    assert not any("rollout_correction" in reason for reason in old_log_prob_pass_reasons(run, None))
    apply(staleness_batch(), config(staleness_decay=0.8), trained_version=4)  # no log-probs needed
    with pytest.raises(RuntimeError, match="needs each token's policy_version"):
        apply(DataProto.from_dict(tensors={"response_mask": torch.ones(1, 2)}), config(staleness_decay=0.8), trained_version=1)
