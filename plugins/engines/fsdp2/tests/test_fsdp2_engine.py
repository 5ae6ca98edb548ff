"""The engine's parts and single-rank behaviour: micro-batch plans, the LR schedule, chunked log-probs,
config errors, registration, checkpoint details, loading from a local Hugging Face directory."""

from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from rlplat.controller.worker import without_padding_weight
from rlplat.losses import aggregate_loss
from rlplat_engine_fsdp2.config import FSDP2EngineConfig, read_engine_config
from rlplat_engine_fsdp2 import modeling
from rlplat_engine_fsdp2.engine import FSDP2Engine, full_tensor
from rlplat.kits.engine import WarmupSchedule, balanced_partition, fixed_size_partition, token_budget_partition
from rlplat.testing.distributed import max_difference
from rlplat_engine_fsdp2.modeling import response_entropy, response_log_probs


class SumOfLogProbs:
    """``-sum(advantages * log_probs * mask) / global_token_count``."""

    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"]
        return loss, {}


def built(config: dict, **overrides) -> FSDP2Engine:
    engine = FSDP2Engine(config, **overrides)
    engine.init_model()
    return engine


def full_gradients(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {name: full_tensor(parameter.grad) for name, parameter in engine.module.named_parameters()}


# -- micro-batch plans --------------------------------------------------------------------------------


def test_fixed_size_micro_batches_are_consecutive_rows():
    assert fixed_size_partition(5, 2) == [[0, 1], [2, 3], [4]]


def test_balanced_partition_puts_each_row_heaviest_first_on_the_lightest_group():
    # 5->A, 4->B, 3->B (7), 3->A (8), 2->B (9), 1->A (9): both groups weigh 9.
    assert balanced_partition([5, 4, 3, 3, 2, 1], 2) == [[0, 3, 5], [1, 2, 4]]


def test_a_token_budget_takes_the_fewest_groups_that_fit():
    assert token_budget_partition([5, 4, 3, 3, 2, 1], budget=9) == [[0, 3, 5], [1, 2, 4]]
    # ceil(18 / 8) = 3 groups of 6 tokens each.
    assert token_budget_partition([5, 4, 3, 3, 2, 1], budget=8) == [[0, 5], [1, 4], [2, 3]]
    assert token_budget_partition([5, 4], budget=9, min_parts=3) == [[0], [1], []]


def test_a_row_longer_than_the_token_budget_is_an_error_naming_it():
    with pytest.raises(ValueError, match="row 2 has 12 tokens, more than max_token_len_per_gpu=10"):
        token_budget_partition([3, 4, 12], budget=10)


# -- LR schedule --------------------------------------------------------------------------------------


def test_warmup_is_linear_from_zero_then_constant():
    schedule = WarmupSchedule("constant", warmup_steps=4)
    assert [schedule(step) for step in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_decays_from_the_end_of_warmup_to_the_floor():
    schedule = WarmupSchedule("cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # progress 0, 1/2 and 1 of the 4 decay steps: 1, 0.1 + 0.9 * 0.5, 0.1; held at 0.1 afterwards.
    assert [schedule(step) for step in (1, 2, 4, 6, 9)] == pytest.approx([0.5, 1.0, 0.55, 0.1, 0.1])


def test_train_batch_reports_the_lr_each_step_used(tiny_config, batch_of):
    engine = built(tiny_config, lr_warmup_steps=2)
    batch = batch_of(8).with_meta_info({"ppo_mini_batch_size": 4})
    metrics = engine.train_batch(batch, SumOfLogProbs())  # two steps: lr 0, then lr 1e-3 / 2
    assert metrics["lr"] == pytest.approx((0.0 + 5e-4) / 2)
    assert engine.state()["step"] == 2 and engine.state()["lr"] == pytest.approx(1e-3)


# -- log-probs and entropy -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [1, 6, 1000])
@pytest.mark.parametrize("keep_bytes", [0, modeling.KEEP_FLOAT32_BYTES], ids=["chunked", "kept"])
def test_chunked_log_probs_and_entropy_equal_the_whole_log_softmax(chunk_tokens, keep_bytes, monkeypatch):
    monkeypatch.setattr(modeling, "KEEP_FLOAT32_BYTES", keep_bytes)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator, dtype=torch.float64).float().requires_grad_(True)
    tokens = torch.randint(0, 11, (3, 5), generator=generator)
    temperature = 0.7
    log_softmax = (logits / temperature).log_softmax(-1)
    expected = log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    chunked = response_log_probs(logits, tokens, temperature, chunk_tokens)
    torch.testing.assert_close(chunked, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(response_entropy(logits, temperature, chunk_tokens), expected_entropy, atol=1e-6, rtol=0)
    (expected_gradient,) = torch.autograd.grad(expected.sum(), logits)
    (chunked_gradient,) = torch.autograd.grad(chunked.sum(), logits)
    torch.testing.assert_close(chunked_gradient, expected_gradient, atol=1e-6, rtol=0)


def test_a_small_float32_tensor_is_kept_for_backward_and_a_large_one_recomputed_by_windows(monkeypatch):
    calls = []

    def log_probs(chunk, tokens):
        calls.append(chunk.shape[1])
        return chunk.float().gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    logits = torch.randn(2, 4, 3, requires_grad=True)  # 96 float32 bytes
    tokens = torch.zeros(2, 4, dtype=torch.long)
    for keep_bytes, expected_calls in ((96, [4]), (95, [2, 2, 2, 2])):  # forward windows of 2 positions, then again in backward
        monkeypatch.setattr(modeling, "KEEP_FLOAT32_BYTES", keep_bytes)
        calls.clear()
        modeling.over_chunks(log_probs, logits, tokens, chunk_tokens=4).sum().backward()
        assert calls == expected_calls


def test_entropy_is_computed_for_the_loss_function_only_when_it_reads_it(tiny_config, batch_of):
    seen = {}

    def loss_fn(outputs, micro_batch):
        seen["keys"] = sorted(outputs)
        seen["entropy"] = outputs["entropy"]
        return -outputs["entropy"].sum() / micro_batch.meta_info["global_token_count"], {}

    built(tiny_config).train_batch(batch_of(4), loss_fn)
    assert seen["keys"] == ["entropy", "log_probs"] and seen["entropy"].requires_grad


# -- config -------------------------------------------------------------------------------------------


def test_an_unknown_config_key_names_the_closest_field():
    with pytest.raises(ValueError, match="fsdp2 engine config: unknown key 'micro_batch_size'. Did you mean 'micro_batch_size_per_gpu'\\?"):
        read_engine_config({"model_path": "/models/x", "micro_batch_size": 4})


def test_the_model_source_must_be_exactly_one_of_path_and_config():
    with pytest.raises(ValueError, match="exactly one of model_path"):
        FSDP2EngineConfig()
    with pytest.raises(ValueError, match="exactly one of model_path"):
        FSDP2EngineConfig(model_path="/models/x", model_config={"model_type": "qwen2"})


def test_an_omegaconf_node_and_keyword_overrides_are_accepted(tiny_config):
    from omegaconf import OmegaConf

    engine = FSDP2Engine(OmegaConf.create(tiny_config), lr=5e-5, betas=(0.8, 0.9))
    assert engine.config.lr == 5e-5 and engine.config.betas == [0.8, 0.9]
    assert engine.config.model_config["vocab_size"] == 16


def test_the_engine_is_registered_as_fsdp2_with_its_config_schema(tiny_config):
    from rlplat import EngineRegistry, registry

    entry = registry.entry("engine", "fsdp2")
    assert entry.config_schema == "rlplat_engine_fsdp2.config:FSDP2EngineConfig"
    assert isinstance(EngineRegistry().build("fsdp2", tiny_config), FSDP2Engine)


def test_a_model_path_that_is_not_a_model_directory_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local Hugging Face model directory"):
        built({"model_path": str(tmp_path / "missing")})


# -- training details ---------------------------------------------------------------------------------


class MeanNegativeLogLikelihood:
    """``aggregate_loss(-log_probs)`` in ``mode``, normalised by the engine's global counts."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, outputs, micro_batch):
        meta = micro_batch.meta_info
        loss = aggregate_loss(-outputs["log_probs"], micro_batch.batch["response_mask"], self.mode,
                              global_token_count=meta["global_token_count"], global_sequence_count=meta["global_sequence_count"])
        return loss, {}


def parameters_of(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in engine.named_weights() for name, tensor in bucket}


def test_a_remainder_of_rows_is_a_last_smaller_mini_batch_with_its_exact_gradient(tiny_config, batch_of):
    batch = batch_of(5)
    split = built(tiny_config, grad_clip=None)
    split.train_batch(batch.with_meta_info({"ppo_mini_batch_size": 2}), SumOfLogProbs())  # rows [0, 1], [2, 3], [4]
    reference = built(tiny_config, grad_clip=None)
    for rows in ([0, 1], [2, 3], [4]):
        reference.train_batch(batch.select_idxs(rows), SumOfLogProbs())  # each mini-batch alone, unsplit
    assert split.state()["step"] == reference.state()["step"] == 3
    expected, actual = full_gradients(reference), full_gradients(split)  # the gradient of the last step, row 4 alone
    assert max(float((expected[name] - actual[name]).abs().max()) for name in expected) <= 1e-6
    after_split, after_reference = parameters_of(split), parameters_of(reference)
    assert max(float((after_split[name] - after_reference[name]).abs().max()) for name in after_split) <= 1e-6


def test_a_mini_batch_larger_than_the_batch_is_one_step_on_the_whole_batch(tiny_config, batch_of):
    batch = batch_of(5)
    larger, whole = built(tiny_config, grad_clip=None), built(tiny_config, grad_clip=None)
    larger.train_batch(batch.with_meta_info({"ppo_mini_batch_size": 64}), SumOfLogProbs())
    whole.train_batch(batch, SumOfLogProbs())
    assert larger.state()["step"] == whole.state()["step"] == 1
    # Exact: both engines draw the same weights under the seed into fresh (64-byte aligned) allocations and
    # run the same micro-batches of 2 rows through the same kernels at this process's thread count, so the
    # sums are blocked alike; another split of the rows would differ in the last bits.
    expected, actual = full_gradients(whole), full_gradients(larger)
    assert max(float((expected[name] - actual[name]).abs().max()) for name in expected) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_padding_rows_without_response_weight_leave_the_gradient_of_the_real_rows(tiny_config, batch_of, mode):
    batch = batch_of(5)
    padded, pad_size = batch.pad_to_divisor(4)  # 3 copies of rows 0-2, as dispatch pads for 4 ranks
    padded = without_padding_weight(padded, pad_size)
    real, with_padding = built(tiny_config, grad_clip=None), built(tiny_config, grad_clip=None)
    real.train_batch(batch, MeanNegativeLogLikelihood(mode))
    with_padding.train_batch(padded, MeanNegativeLogLikelihood(mode))
    expected, actual = full_gradients(real), full_gradients(with_padding)
    assert max(float((expected[name] - actual[name]).abs().max()) for name in expected) <= 1e-6
    assert max(float(gradient.abs().max()) for gradient in expected.values()) > 1e-3


def test_activation_checkpointing_does_not_change_the_gradient(tiny_config, batch_of):
    batch = batch_of(4)
    plain, checkpointed = built(tiny_config, grad_clip=None), built(tiny_config, grad_clip=None, enable_gradient_checkpointing=True)
    plain.train_batch(batch, SumOfLogProbs())
    checkpointed.train_batch(batch, SumOfLogProbs())
    expected, actual = full_gradients(plain), full_gradients(checkpointed)
    assert max(float((expected[name] - actual[name]).abs().max()) for name in expected) <= 1e-6


def test_a_non_finite_gradient_skips_the_step(tiny_config, batch_of):
    engine = built(tiny_config)
    before = {name: tensor.clone() for bucket in engine.named_weights() for name, tensor in bucket}
    metrics = engine.train_batch(batch_of(4), lambda outputs, micro_batch: (outputs["log_probs"].sum() * float("nan"), {}))
    assert metrics["skipped_step"] == 1.0 and math.isnan(metrics["grad_norm"])
    assert engine.state()["step"] == 0
    assert all(torch.equal(tensor, before[name]) for bucket in engine.named_weights() for name, tensor in bucket)


# -- optimizer and sharding ---------------------------------------------------------------------------


def stepped(config: dict, batch_of, steps: int, **overrides) -> dict[str, torch.Tensor]:
    engine = built(config, **overrides)
    for seed in range(steps):
        engine.train_batch(batch_of(4, seed=seed), SumOfLogProbs())
    return parameters_of(engine)


def test_foreach_adamw_updates_bit_for_bit_as_the_for_loop(tiny_config, batch_of):
    for_loop = stepped(tiny_config, batch_of, 3, optimizer_implementation="for-loop")
    foreach = stepped(tiny_config, batch_of, 3, optimizer_implementation="foreach")
    # Bit for bit is what config.py promises. It holds at any thread count: the forwards and backwards are
    # those of the previous test (same weights, same shapes), and on CPU a foreach op runs the for-loop's
    # elementwise kernel on each tensor, every element rounded on its own (no sum whose order could change).
    assert all(torch.equal(foreach[name], for_loop[name]) for name in for_loop)
    assert max_difference(for_loop, parameters_of(built(tiny_config))) >= 1e-3


def test_fused_adamw_differs_from_the_for_loop_by_float32_rounding(tiny_config, batch_of):
    # One step: the same formula rounded differently, a few ulps of a weight (one ulp is 6e-8 near 1)
    # while the step moves weights by lr = 1e-3. Later steps see gradients of weights that differ by
    # that much, and AdamW's m / sqrt(v) amplifies it where a gradient is near 0, as a different
    # reduction order does (the tolerance of two ranks against one, 1e-5).
    for_loop, fused = (stepped(tiny_config, batch_of, 1, optimizer_implementation=kind) for kind in ("for-loop", "fused"))
    assert 0 < max_difference(fused, for_loop) <= 1e-7
    for_loop, fused = (stepped(tiny_config, batch_of, 3, optimizer_implementation=kind) for kind in ("for-loop", "fused"))
    assert max_difference(fused, for_loop) <= 1e-5


def test_one_float32_rank_trains_the_plain_module_as_fully_shard_would(tiny_config, batch_of):
    plain, sharded = built(tiny_config), built(tiny_config, shard_one_rank=True)
    assert (plain.state()["sharded"], sharded.state()["sharded"]) == (False, True)
    assert not any(isinstance(parameter, DTensor) for parameter in plain.module.parameters())
    plain_metrics = [plain.train_batch(batch_of(4, seed=seed), SumOfLogProbs()) for seed in range(3)]
    sharded_metrics = [sharded.train_batch(batch_of(4, seed=seed), SumOfLogProbs()) for seed in range(3)]
    # Bit for bit is what config.py promises for shard_one_rank. Over one rank FSDP2's all-gather and
    # reduce-scatter copy; the gathered parameters are 64-byte aligned as the plain module's are (the tiny
    # model's tensors are all multiples of 16 floats), so every matmul and reduction sees the same shapes
    # and alignment at this process's thread count.
    after_plain, after_sharded = parameters_of(plain), parameters_of(sharded)
    assert all(torch.equal(after_plain[name], after_sharded[name]) for name in after_plain)
    assert plain_metrics == sharded_metrics


@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_one_bfloat16_rank_trains_the_plain_module_as_fully_shard_would(tiny_config, batch_of, remove_padding):
    # One rank in bfloat16: cast copies of the weights per call, float32 gradients accumulated per micro-batch
    # (ComputeCopies), what FSDP2's MixedPrecisionPolicy computes over one rank: the same steps bit for bit.
    options = dict(dtype="bfloat16", use_remove_padding=remove_padding, micro_batch_size_per_gpu=2)
    plain, sharded = built(tiny_config, **options), built(tiny_config, shard_one_rank=True, **options)
    assert (plain.state()["sharded"], sharded.state()["sharded"]) == (False, True)
    assert not any(isinstance(parameter, DTensor) for parameter in plain.module.parameters())
    assert all(parameter.dtype == torch.float32 for parameter in plain.module.parameters())
    plain_metrics = [plain.train_batch(batch_of(4, seed=seed), SumOfLogProbs()) for seed in range(3)]
    sharded_metrics = [sharded.train_batch(batch_of(4, seed=seed), SumOfLogProbs()) for seed in range(3)]
    after_plain, after_sharded = parameters_of(plain), parameters_of(sharded)
    assert all(torch.equal(after_plain[name], after_sharded[name]) for name in after_plain)
    assert plain_metrics == sharded_metrics
    forward = [engine.forward(batch_of(4, seed=9)).batch["log_probs"] for engine in (plain, sharded)]
    assert forward[0].dtype == torch.float32 and torch.equal(forward[0], forward[1])
    # between calls the engine holds its float32 weights alone: the copies live inside a call
    assert all(parameter.dtype == torch.float32 for parameter in plain.module.parameters())


@pytest.mark.slow  # compiling takes ~15 s on CPU
def test_compiled_layers_train_as_eager_ones(tiny_config, batch_of):
    # torch.compile on the decoder layers: fused kernels round float32 differently (a few ulps of values of order
    # 1-10), so losses, log-probs and gradients agree within 1e-5. Weights are not compared after AdamW steps:
    # Adam divides each gradient by its own magnitude, so a rounding difference in a near-zero gradient moves that
    # weight by up to the learning rate.
    from rlplat_engine_fsdp2 import modeling

    if modeling.compile_problem("cpu") is not None:
        pytest.skip(modeling.compile_problem("cpu"))  # the refusal itself: test_compile_where_it_cannot_build_is_refused
    eager, compiled = built(tiny_config), built(tiny_config, compile=True)
    for seed in range(3):
        batch = batch_of(4, seed=seed)
        losses = [engine.forward_backward(batch, SumOfLogProbs()).meta_info["metrics"]["loss"] for engine in (eager, compiled)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-5)
        gradients = [{name: parameter.grad for name, parameter in engine.module.named_parameters()} for engine in (eager, compiled)]
        assert max_difference(*gradients) <= 1e-5
        for engine in (eager, compiled):
            engine.optimizer_step()
    log_probs = [engine.forward(batch_of(4, seed=9)).batch["log_probs"] for engine in (eager, compiled)]
    assert torch.allclose(log_probs[0], log_probs[1], atol=1e-5, rtol=0)


# -- checkpoints --------------------------------------------------------------------------------------


def test_load_restores_the_random_number_generators(tiny_config, tmp_path):
    engine = built(tiny_config)
    engine.save(str(tmp_path / "checkpoint"))
    drawn = (torch.rand(3), random.random(), np.random.rand())
    engine.load(str(tmp_path / "checkpoint"))
    assert torch.equal(torch.rand(3), drawn[0]) and random.random() == drawn[1] and np.random.rand() == drawn[2]


@pytest.mark.parametrize("shard_one_rank", [False, True], ids=["plain module", "fully_shard"])
@pytest.mark.parametrize("implementation", ["fused", "for-loop"])
def test_save_load_then_the_next_steps_equal_not_stopping(tiny_config, batch_of, tmp_path, shard_one_rank, implementation):
    options = dict(shard_one_rank=shard_one_rank, optimizer_implementation=implementation, lr_warmup_steps=2,
                   lr_scheduler_type="cosine", total_training_steps=6)
    uninterrupted, resumed = built(tiny_config, **options), built({**tiny_config, "seed": 99}, **options)
    for seed in range(2):
        uninterrupted.train_batch(batch_of(4, seed=seed), SumOfLogProbs())
    uninterrupted.save(str(tmp_path / "checkpoint"))
    resumed.load(str(tmp_path / "checkpoint"))
    # Exact resume is the project's promise: the checkpoint restores weights, optimizer state, schedule and
    # RNG into the resumed engine's own allocations, and both engines run the same micro-batches through
    # the same kernels in this process, so every sum is blocked alike at any thread count.
    for seed in range(2, 4):
        expected = uninterrupted.train_batch(batch_of(4, seed=seed), SumOfLogProbs())
        assert resumed.train_batch(batch_of(4, seed=seed), SumOfLogProbs()) == expected
    after_uninterrupted, after_resumed = parameters_of(uninterrupted), parameters_of(resumed)
    assert all(torch.equal(after_resumed[name], after_uninterrupted[name]) for name in after_uninterrupted)
    assert resumed.state() == uninterrupted.state()


def test_a_checkpoint_resumes_with_another_optimizer_implementation(tiny_config, batch_of, tmp_path):
    # The optimizer state is the same tensors whichever kernel wrote it; the next step differs from not
    # stopping only by the kernels' float32 rounding.
    writer, reader = built(tiny_config, optimizer_implementation="for-loop"), built(tiny_config, optimizer_implementation="fused")
    writer.train_batch(batch_of(4), SumOfLogProbs())
    writer.save(str(tmp_path / "checkpoint"))
    reader.load(str(tmp_path / "checkpoint"))
    writer.train_batch(batch_of(4, seed=1), SumOfLogProbs())
    reader.train_batch(batch_of(4, seed=1), SumOfLogProbs())
    assert max_difference(parameters_of(writer), parameters_of(reader)) <= 1e-7


def test_a_checkpoint_whose_save_did_not_finish_is_refused(tiny_config, tmp_path):
    engine = built(tiny_config)
    engine.save(str(tmp_path / "checkpoint"))
    (tmp_path / "checkpoint" / "checkpoint.json").unlink()
    with pytest.raises(FileNotFoundError, match="save did not finish"):
        engine.load(str(tmp_path / "checkpoint"))


def test_saving_again_replaces_the_checkpoint_and_leaves_no_partial_directory(tiny_config, batch_of, tmp_path):
    engine = built(tiny_config)
    engine.save(str(tmp_path / "checkpoint"))
    engine.train_batch(batch_of(4), SumOfLogProbs())
    engine.save(str(tmp_path / "checkpoint"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint"]
    assert '"global_step": 1' in (tmp_path / "checkpoint" / "checkpoint.json").read_text()


# -- a local Hugging Face directory -------------------------------------------------------------------


def character_tokenizer(directory):
    """DEMO_NOTES' character-level tokenizer: 16 ids, ``[PAD] [BOS] [EOS] [UNK] 0-9 + =``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, **{str(digit): 4 + digit for digit in range(10)}, "+": 14, "=": 15}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]")
    tokenizer.save_pretrained(str(directory))


def test_an_engine_built_from_a_local_directory_exports_model_and_tokenizer(tiny_config, batch_of, tmp_path):
    from transformers import AutoTokenizer

    source = built(tiny_config)
    source.export_hf(str(tmp_path / "model"))
    character_tokenizer(tmp_path / "model")
    loaded = built({"model_path": str(tmp_path / "model"), "dtype": "float32"})
    batch = batch_of(4)
    exported = {name: tensor for bucket in source.named_weights() for name, tensor in bucket}
    assert all(torch.equal(tensor, exported[name]) for bucket in loaded.named_weights() for name, tensor in bucket)
    # The weights are bit-identical; the two forwards are not guaranteed to be. The loaded engine runs the 4
    # rows as one micro-batch (its default micro_batch_size_per_gpu) where the source runs two of 2, and with
    # 2 threads the CPU matmuls split float32 sums differently for a pack of 35 tokens than for packs of 20
    # and 15 (2.4e-7 apart on the log-probs here). Its weights also sit where safetensors put them (8-byte
    # aligned, not 64), which changes the summation order of single-row products. A few float32 ulps per
    # sum through 2 layers stay far below 1e-5; a weight matrix left out (zeroed) moves these log-probs by
    # 4e-3 or more.
    torch.testing.assert_close(loaded.forward(batch).batch["log_probs"], source.forward(batch).batch["log_probs"],
                               rtol=1e-5, atol=1e-5)
    loaded.export_hf(str(tmp_path / "exported"))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "exported"))("12+3=")["input_ids"] == [5, 6, 14, 7, 15]


#: Where the micro-batch loop may read tensor values on the host: the host copy of a micro-batch, before it moves
#: (selecting its rows, planning its pack).
HOST_SIDE = {("engine.py", "micro_batch"), ("packing.py", "pack"), ("packing.py", "plan_attention_groups")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nothing_in_the_micro_batch_loop_waits_for_the_device(tiny_config, batch_of, dtype, monkeypatch):
    # A read of a tensor's value on the host (.item(), float(), int(), bool(), .tolist()) stalls a GPU's host until
    # the device catches up. Inside an update's micro-batch loop (packed, the default) only the host copy of each
    # micro-batch may be read: the GRPO actor loss (its metrics deferred), old log-probs taken from the update's
    # forwards, entropy, two micro-batches. (Padded micro-batches still meet Hugging Face's own mask check.)
    import traceback

    from rlplat.losses import ActorLoss
    from rlplat.workers.actor_rollout_ref import ROW_INDEX, OldLogProbsFromForward

    engine = built(tiny_config, dtype=dtype)
    batch = batch_of(4, seed=1)
    batch.batch["advantages"] = torch.randn(batch.batch["responses"].shape)
    batch.batch[ROW_INDEX] = torch.arange(len(batch))
    loss = OldLogProbsFromForward(ActorLoss({"entropy_coeff": 0.01, "use_kl_loss": False}), len(batch))
    inside, reads = [False], []

    def watched(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if inside[0]:
                frames = {(frame.filename.rsplit("/", 1)[-1], frame.name) for frame in traceback.extract_stack()}
                if not frames & HOST_SIDE:
                    reads.append(f"{name}: " + " <- ".join(f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
                                                           for frame in traceback.extract_stack()[-4:-1]))
            return original(self, *args, **kwargs)
        return read

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, watched(name))
    computing = engine.computing

    @contextlib.contextmanager
    def flagged():
        with computing():
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    monkeypatch.setattr(engine, "computing", flagged)
    metrics = engine.train_batch(batch, loss)
    assert not reads, reads
    assert math.isfinite(metrics["actor/pg_loss"]) and loss.entropy() is not None and loss.result().device.type == "cpu"

    # the check itself: a loss that reads a metric on the host inside the loop is caught
    class Reading:
        def __call__(self, outputs, micro_batch):
            return outputs["log_probs"].sum() * 0.0, {"value": float(outputs["log_probs"].sum())}

    engine.train_batch(batch, Reading())
    assert reads and reads[0].startswith("__float__")


def test_compile_where_it_cannot_build_is_refused(tiny_config, monkeypatch):
    from rlplat_engine_fsdp2 import modeling

    monkeypatch.setattr(torch, "__file__", "/opt/a venv/lib/python3.11/site-packages/torch/__init__.py")
    assert "does not quote a path with a space" in modeling.compile_problem("cpu")
    assert modeling.compile_problem("cuda") is None
    with pytest.raises(ValueError, match="compile=true on CPU: .*'/opt/a venv/lib/python3.11/site-packages/torch'"):
        built(tiny_config, compile=True)
