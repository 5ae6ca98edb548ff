"""rlplat-distill's distillation terms (rlplat_distill.losses): the top-k forms against the full
divergences computed from whole distributions, the sampled-token estimators against the exact reverse KL
over many samples, zero loss and zero gradient when the teacher is the student, the policy gradient of the
sampled form, and each term normalised by its own mask's global counts inside the actor loss."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlplat import DataProto
from rlplat.losses import PolicyLossConfig
from rlplat_distill.losses import (
    GATHERED_LOG_PROBS, TEACHER_LOG_PROBS, TEACHER_MASK, TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS, forward_kl_topk_loss,
    jsd_topk_loss, reverse_kl_loss, reverse_kl_topk_loss, sampled_divergence, topk_divergence,
)
from rlplat.losses.functions import ActorLoss

VOCABULARY = 11


def distributions(seed: int, shape=(3, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(*shape, VOCABULARY, generator=generator, dtype=torch.float64).log_softmax(-1)
    teacher = (2 * torch.randn(*shape, VOCABULARY, generator=generator, dtype=torch.float64)).log_softmax(-1)
    return student, teacher


def full_kl(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return (first.exp() * (first - second)).sum(-1)


def test_top_k_over_the_whole_vocabulary_is_the_full_reverse_kl_within_1e_6():
    student, teacher = distributions(0)
    order = teacher.argsort(-1, descending=True)  # the teacher's top-k ids, as a teacher returns them
    got = topk_divergence(student.gather(-1, order).float(), teacher.gather(-1, order).float(), "reverse")
    assert torch.allclose(got.double(), full_kl(student, teacher), atol=1e-6)


def test_forward_kl_and_the_jsd_endpoints_and_midpoint_over_the_whole_vocabulary():
    student, teacher = distributions(1)
    forward = topk_divergence(student, teacher, "forward").double()
    assert torch.allclose(forward, full_kl(teacher, student), atol=1e-6)
    assert torch.allclose(topk_divergence(student, teacher, "jsd", beta=0.0).double(), full_kl(teacher, student), atol=1e-6)
    assert torch.allclose(topk_divergence(student, teacher, "jsd", beta=1.0).double(), full_kl(student, teacher), atol=1e-6)
    mixture = (0.5 * student.exp() + 0.5 * teacher.exp()).log()
    symmetric = 0.5 * full_kl(teacher, mixture) + 0.5 * full_kl(student, mixture)
    assert torch.allclose(topk_divergence(student, teacher, "jsd", beta=0.5).double(), symmetric, atol=1e-6)
    assert float(symmetric.max()) <= math.log(2) + 1e-9  # the JSD's bound


def test_a_top_k_smaller_than_the_vocabulary_compares_the_renormalised_restrictions():
    student, teacher = distributions(2)
    ids = teacher.topk(4, dim=-1).indices
    restricted = lambda values: values.gather(-1, ids) - values.gather(-1, ids).logsumexp(-1, keepdim=True)  # noqa: E731
    expected = full_kl(restricted(student), restricted(teacher))
    assert torch.allclose(topk_divergence(student.gather(-1, ids), teacher.gather(-1, ids), "reverse").double(), expected, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_sampled_estimators_mean_matches_the_full_reverse_kl_within_its_standard_error(estimator):
    student, teacher = distributions(3, shape=(4,))
    samples = 200_000
    generator = torch.Generator().manual_seed(7)
    tokens = torch.multinomial(student.exp(), samples, replacement=True, generator=generator)  # [4, samples]
    estimates = sampled_divergence(student.gather(-1, tokens), teacher.gather(-1, tokens), estimator)
    mean, error = estimates.mean(-1), estimates.std(-1) / math.sqrt(samples)
    exact = full_kl(student, teacher)
    assert ((mean - exact).abs() <= 4 * error).all(), (mean, exact, error)


def term_config(**knobs) -> PolicyLossConfig:
    return PolicyLossConfig(policy_loss=knobs)


def inputs_config(config: PolicyLossConfig, columns: dict, tokens: float, sequences: int) -> PolicyLossConfig:
    return dataclasses.replace(config, inputs=columns, global_counts={TEACHER_MASK: {"tokens": tokens, "sequences": sequences}})


@pytest.mark.parametrize("knobs", [{"estimator": "k3"}, {"estimator": "k1"}, {"estimator": "k3", "use_policy_gradient": False}])
def test_teacher_equal_to_student_gives_an_exactly_zero_sampled_loss_and_gradient(knobs):
    generator = torch.Generator().manual_seed(4)
    log_prob = torch.randn(3, 6, generator=generator).log_softmax(-1).requires_grad_()
    mask = torch.ones(3, 6)
    config = inputs_config(term_config(**knobs), {TEACHER_LOG_PROBS: log_prob.detach().clone(), TEACHER_MASK: mask}, 18, 3)
    loss, _ = reverse_kl_loss(log_prob.detach(), log_prob, None, mask, "token-mean", config)
    loss.backward()
    assert float(loss.detach()) == 0.0 and bool((log_prob.grad == 0).all())


@pytest.mark.parametrize("function", [reverse_kl_topk_loss, forward_kl_topk_loss, jsd_topk_loss])
def test_teacher_equal_to_student_gives_an_exactly_zero_top_k_loss_and_gradient(function):
    student, _ = distributions(5)
    student = student.float().requires_grad_()
    mask = torch.ones(3, 5)
    columns = {GATHERED_LOG_PROBS: student, TEACHER_TOPK_LOG_PROBS: student.detach().clone(), TEACHER_MASK: mask}
    loss, _ = function(None, student[..., 0], None, mask, "token-mean", inputs_config(term_config(), columns, 15, 3))
    loss.backward()
    assert abs(float(loss.detach())) < 1e-7 and float(student.grad.abs().max()) < 1e-7


def test_the_sampled_policy_gradient_is_the_log_ratio_times_the_score():
    generator = torch.Generator().manual_seed(6)
    log_prob = torch.randn(2, 4, generator=generator).requires_grad_()
    teacher = torch.randn(2, 4, generator=generator)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    config = inputs_config(term_config(estimator="k1"), {TEACHER_LOG_PROBS: teacher, TEACHER_MASK: mask}, 5, 2)
    loss, metrics = reverse_kl_loss(log_prob.detach(), log_prob, None, mask, "token-mean", config)
    loss.backward()
    expected = (log_prob.detach() - teacher) * mask / 5  # d/ds of sum(sg(s - t) * ratio) / tokens at ratio 1
    assert torch.allclose(log_prob.grad, expected, atol=1e-6)
    assert math.isclose(float(loss.detach()), float(((log_prob.detach() - teacher) * mask).sum() / 5), rel_tol=1e-6)
    assert math.isclose(metrics["distill/reverse_kl"], float(loss.detach()), rel_tol=1e-6)


def test_k1_differentiated_directly_is_refused():
    mask = torch.ones(1, 2)
    config = inputs_config(term_config(estimator="k1", use_policy_gradient=False),
                           {TEACHER_LOG_PROBS: torch.zeros(1, 2), TEACHER_MASK: mask}, 2, 1)
    with pytest.raises(ValueError, match="does not depend on the teacher"):
        reverse_kl_loss(torch.zeros(1, 2), torch.zeros(1, 2), None, mask, "token-mean", config)


def micro_batch(rows: int, width: int, seed: int, teacher_rows: int) -> tuple[dict, DataProto]:
    generator = torch.Generator().manual_seed(seed)
    log_prob = torch.randn(rows, width, generator=generator) - 2
    response_mask = torch.ones(rows, width)
    teacher_mask = torch.zeros(rows, width)
    teacher_mask[:teacher_rows] = 1
    batch = DataProto.from_dict({
        "response_mask": response_mask, "old_log_probs": log_prob.clone(), "advantages": torch.randn(rows, width, generator=generator),
        TEACHER_LOG_PROBS: torch.randn(rows, width, generator=generator) - 2, TEACHER_MASK: teacher_mask,
    })
    return {"log_probs": log_prob.requires_grad_()}, batch


def test_a_term_is_normalised_by_its_own_masks_global_count_and_does_not_dilute_the_policy_term():
    outputs, batch = micro_batch(rows=4, width=3, seed=8, teacher_rows=1)
    config = {"terms": [{"loss_mode": "reverse_kl", "coef": 2.0, "estimator": "k1"}], "loss_agg_mode": "token-mean"}
    loss_fn = ActorLoss(config)
    assert loss_fn.count_masks == (TEACHER_MASK,) and loss_fn.gather_ids is None
    batch.meta_info.update({"global_token_count": 12, "global_sequence_count": 4,
                            "global_counts": {TEACHER_MASK: {"tokens": 3, "sequences": 1}}})
    loss, metrics = loss_fn(outputs, batch)
    plain, _ = ActorLoss({"loss_agg_mode": "token-mean"})(outputs, batch)
    estimate = (batch.batch["old_log_probs"] - batch.batch[TEACHER_LOG_PROBS])[:1]
    term = float(estimate.sum()) / 3  # the teacher's 3 tokens, not the batch's 12
    assert math.isclose(metrics["distill/reverse_kl"], term, rel_tol=1e-6)
    assert math.isclose(float(loss), float(plain) + 2.0 * term, rel_tol=1e-6)


def test_policy_loss_coef_zero_trains_the_terms_alone():
    outputs, batch = micro_batch(rows=2, width=3, seed=9, teacher_rows=2)
    batch.meta_info["global_counts"] = {TEACHER_MASK: {"tokens": 6, "sequences": 2}}
    loss, metrics = ActorLoss({"policy_loss_coef": 0, "terms": [{"loss_mode": "reverse_kl", "estimator": "k1"}]})(outputs, batch)
    assert "actor/pg_loss" not in metrics
    assert math.isclose(float(loss), metrics["distill/reverse_kl"], rel_tol=1e-6)


def test_the_actor_loss_asks_the_engine_to_gather_at_the_teachers_top_k_ids():
    loss_fn = ActorLoss({"terms": [{"loss_mode": "jsd_topk", "beta": 0.3}]})
    assert loss_fn.gather_ids == TEACHER_TOPK_IDS and loss_fn.count_masks == (TEACHER_MASK,)


@pytest.mark.parametrize("node, message", [
    ({"policy_loss_coef": 0}, "train nothing"),
    ({"terms": [{"coef": 1.0}]}, "loss_mode"),
    ({"terms": [{"loss_mode": "reverse_kl", "coef": "x"}]}, "coef"),
    ({"policy_loss_coef": -1, "terms": [{"loss_mode": "reverse_kl"}]}, "policy_loss_coef"),
])
def test_bad_terms_are_refused_when_the_node_is_read(node, message):
    from rlplat.config_node import ConfigError, read_config_node

    with pytest.raises(ConfigError, match=message):
        read_config_node(node, PolicyLossConfig, "actor.loss")


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_aggregation_mode_of_a_term_splits_exactly_with_its_own_global_counts(mode):
    """Micro-batches normalised by the term mask's global counts sum to the unsplit mini-batch's term, in each
    of verl's modes (rows without a teacher token count in no denominator)."""
    generator = torch.Generator().manual_seed(10)
    log_prob = torch.randn(6, 4, generator=generator) - 1
    teacher = torch.randn(6, 4, generator=generator) - 1
    response_mask = (torch.rand(6, 4, generator=generator) > 0.2).float()
    teacher_mask = response_mask.clone()
    teacher_mask[[1, 4]] = 0  # rows no teacher scored
    counts = {"tokens": float((teacher_mask * response_mask).sum()), "sequences": int(((teacher_mask * response_mask).sum(-1) > 0).sum())}

    def term(rows):
        config = dataclasses.replace(term_config(estimator="k3"), inputs={TEACHER_LOG_PROBS: teacher[rows], TEACHER_MASK: teacher_mask[rows]},
                                     global_counts={TEACHER_MASK: counts})
        return float(reverse_kl_loss(log_prob[rows], log_prob[rows], None, response_mask[rows], mode, config)[0])

    whole = term(list(range(6)))
    assert whole != 0
    assert term([0, 1, 2]) + term([3, 4, 5]) == pytest.approx(whole, rel=1e-6)
