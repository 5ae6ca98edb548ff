"""Numerics of the megatron engine on CPU (gloo), from the same Hugging Face weights: log-probs of TP=2,
PP=2 and TP=1 agree within 1e-5 and agree with the fsdp2 engine within 1e-5; one training step's
parameters agree within 1e-6 across TP=1 (two data-parallel ranks, each half the rows), TP=2 and PP=2;
the distributed optimizer with full recompute and PP=2 with selective recompute and token-budget micro-batches take the same step; the
HF export of a TP=2 model reproduces the checkpoint exactly; save -> load -> step repeats the
uninterrupted step exactly (PP=2 and CP=2, distributed checkpoint); context parallelism (CP=2, also with full recompute, the
distributed optimizer, the chunked output layer and a token budget only CP fits) gives TP=1's log-probs and step; TP=2 x PP=2,
PP=2 x VPP=2 (interleaved schedule, also on a single row: fewer micro-batches than stages), TP=2 x CP=2 and CP=2 x PP=2 on
4 processes. Each launch runs
every layout in the same processes (imports cost ~8 s a launch); the two-process one is shared with the memory
test (the ``two_process_results`` fixture)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rlplat.testing.engines import tiny_engine_batch  # noqa: E402
from two_process_launch import launch, write_numerics_checkpoint  # noqa: E402

LOG_PROB_TOLERANCE = 1e-5
PARAMETER_TOLERANCE = 1e-6


def assert_log_probs_close(actual, expected, what):
    valid = tiny_engine_batch(8, seed=3).batch["response_mask"].bool()
    difference = float((actual - expected)[valid].abs().max())
    assert difference <= LOG_PROB_TOLERANCE, f"{what}: log-probs differ by {difference:.3g}"
    return difference


def assert_weights_close(actual, expected, what):
    assert sorted(actual) == sorted(expected), f"{what}: weight names differ"
    difference = max(float((actual[name] - expected[name]).abs().max()) for name in expected)
    assert difference <= PARAMETER_TOLERANCE, f"{what}: parameters after one step differ by {difference:.3g}"
    return difference


@pytest.mark.slow
def test_tp2_pp2_cp2_and_tp1_agree_with_each_other_and_with_fsdp2_and_export_and_resume_exactly(two_process_results):
    results = two_process_results  # the layouts of two_process_launch.NUMERICS_LAYOUTS, then fsdp2
    # Layouts: two data-parallel ranks at TP=1; one replica over both ranks at TP=2 (TP rank 0 collects)
    # and at PP=2 (the last stage collects).
    assert results["tp1/info"] == [(0, 2, True), (1, 2, True)]
    assert results["tp2/info"] == [(0, 1, True), (0, 1, False)]
    assert results["pp2/info"] == [(0, 1, False), (0, 1, True)]
    reference = results["tp1/log_probs"]
    assert_log_probs_close(results["tp2/log_probs"], reference, "TP=2 vs TP=1")
    assert_log_probs_close(results["pp2/log_probs"], reference, "PP=2 vs TP=1")
    assert_log_probs_close(reference, results["fsdp2/log_probs"], "megatron TP=1 vs fsdp2")
    assert_log_probs_close(results["tp2/log_probs"], results["fsdp2/log_probs"], "megatron TP=2 vs fsdp2")
    assert_log_probs_close(results["tp2/entropy"], results["tp1/entropy"], "entropy TP=2 vs TP=1")
    assert_weights_close(results["tp2/weights"], results["tp1/weights"], "TP=2 vs TP=1")
    assert_weights_close(results["pp2/weights"], results["tp1/weights"], "PP=2 vs TP=1")
    assert_weights_close(results["dp2-distributed-recompute/weights"], results["tp1/weights"], "distributed optimizer + full recompute vs TP=1")
    assert_log_probs_close(results["pp2-selective-budget/log_probs"], reference, "PP=2 token budget vs TP=1")
    assert_weights_close(results["pp2-selective-budget/weights"], results["tp1/weights"], "PP=2 selective recompute, token budget vs TP=1")
    for name in ("tp1", "tp2", "pp2"):
        assert results[f"{name}/largest_multi_tensor_bucket"] <= 64 << 10
    assert results["tp1/metrics"]["test/pg_loss"] == pytest.approx(results["tp2/metrics"]["test/pg_loss"], abs=1e-6)
    # the distillation features over vocabulary-parallel logits: top-k and log-probs at given ids
    valid = tiny_engine_batch(8, seed=3).batch["response_mask"].bool()
    for name in ("tp1", "tp2", "pp2"):
        values, ids = results[f"{name}/top_k"]
        assert float((values - results["fsdp2/top_k"][0])[valid].abs().max()) <= 1e-5, name
        assert torch.equal(ids[valid], results["fsdp2/top_k"][1][valid]), name
        assert results[f"{name}/metrics"]["test/gathered"] == pytest.approx(results["tp1/metrics"]["test/gathered"], abs=1e-5), name
    assert results["tp2/export_names_equal"] and results["tp2/export_max_diff"] == 0.0
    assert float(results["pp2/resume_max_diff"]) == 0.0
    # the chunked output layer (6 tokens at a time, recomputed in backward) gives TP=2's numbers
    assert_log_probs_close(results["tp2-chunked/log_probs"], results["tp2/log_probs"], "TP=2 chunked vs whole")
    assert_log_probs_close(results["tp2-chunked/entropy"], results["tp2/entropy"], "entropy TP=2 chunked vs whole")
    assert_weights_close(results["tp2-chunked/weights"], results["tp2/weights"], "TP=2 chunked vs whole, after a step")
    values, ids = results["tp2-chunked/top_k"]
    assert float((values - results["tp2/top_k"][0])[valid].abs().max()) <= 1e-6 and torch.equal(ids[valid], results["tp2/top_k"][1][valid])
    assert results["tp2-chunked/metrics"]["test/gathered"] == pytest.approx(results["tp2/metrics"]["test/gathered"], abs=1e-6)
    assert results["tp2-chunked/metrics"]["grad_norm"] == pytest.approx(results["tp2/metrics"]["grad_norm"], rel=1e-5)
    # context parallelism (CP=2: one replica over both ranks, CP rank 0 collects) gives TP=1's numbers
    for name in ("cp2", "cp2-full-budget-chunked"):
        assert results[f"{name}/info"] == [(0, 1, True), (0, 1, False)], name
        assert_log_probs_close(results[f"{name}/log_probs"], reference, f"{name} vs TP=1")
        assert_log_probs_close(results[f"{name}/entropy"], results["tp1/entropy"], f"entropy {name} vs TP=1")
        assert_weights_close(results[f"{name}/weights"], results["tp1/weights"], f"{name} vs TP=1")
        values, ids = results[f"{name}/top_k"]
        assert float((values - results["tp1/top_k"][0])[valid].abs().max()) <= 1e-5 and torch.equal(ids[valid], results["tp1/top_k"][1][valid])
        assert results[f"{name}/metrics"]["test/gathered"] == pytest.approx(results["tp1/metrics"]["test/gathered"], abs=1e-5), name
        assert results[f"{name}/metrics"]["grad_norm"] == pytest.approx(results["tp1/metrics"]["grad_norm"], rel=1e-5), name
    assert float(results["cp2/resume_max_diff"]) == 0.0


@pytest.mark.slow
def test_tp2_by_pp2_an_interleaved_pipeline_tp2_by_cp2_and_cp2_by_pp2_on_four_processes_agree_with_tp1(tmp_path):
    model = write_numerics_checkpoint(tmp_path / "hf", num_key_value_heads=2, tie_word_embeddings=False, num_hidden_layers=4)
    results = launch(4, {"model": model, "layouts": [
        {"name": "tp1"},
        {"name": "tp2pp2", "tp": 2, "pp": 2, "extra": {"use_distributed_optimizer": True}},
        {"name": "pp2vpp2", "pp": 2, "extra": {"virtual_pipeline_parallel_size": 2}, "single_row": True},
        {"name": "tp2cp2", "tp": 2, "cp": 2},
        {"name": "cp2pp2", "cp": 2, "pp": 2},
    ]}, tmp_path)
    assert [info for info in results["tp2pp2/info"] if info[2]] == [(0, 1, True)]
    assert [info for info in results["pp2vpp2/info"] if info[2]] == [(0, 2, True), (1, 2, True)]
    assert_log_probs_close(results["tp2pp2/log_probs"], results["tp1/log_probs"], "TP=2 x PP=2 vs TP=1")
    assert_weights_close(results["tp2pp2/weights"], results["tp1/weights"], "TP=2 x PP=2 vs TP=1")
    assert_log_probs_close(results["pp2vpp2/log_probs"], results["tp1/log_probs"], "PP=2 x VPP=2 vs TP=1")
    assert_weights_close(results["pp2vpp2/weights"], results["tp1/weights"], "PP=2 x VPP=2 vs TP=1")
    for name in ("tp2cp2", "cp2pp2"):
        assert [info for info in results[f"{name}/info"] if info[2]] == [(0, 1, True)], name
        assert_log_probs_close(results[f"{name}/log_probs"], results["tp1/log_probs"], f"{name} vs TP=1")
        assert_weights_close(results[f"{name}/weights"], results["tp1/weights"], f"{name} vs TP=1")
    valid = tiny_engine_batch(8, seed=3).batch["response_mask"][0].bool()
    assert float((results["pp2vpp2/single_row"][0] - results["tp1/log_probs"][0])[valid].abs().max()) <= LOG_PROB_TOLERANCE
