"""Sequence packing (``use_remove_padding``): the packed forward and update equal the padded ones.

A tiny Qwen2 with grouped-query attention (4 heads, 2 key-value heads), float32, on batches of
sequences whose lengths spread from 2 to 300 tokens in verl's layout (left-padded prompt, right-padded
response). Tolerances: 1e-5 on per-token outputs (packed vs padded); 1e-6 relative on loss and
gradient norm across micro-batch partitions with packing on.
"""

from __future__ import annotations

import pytest
import torch

from rlplat import DataProto
from rlplat.losses import aggregate_loss
from rlplat_engine_fsdp2.engine import FSDP2Engine
from rlplat_engine_fsdp2.packing import attention_implementation, pack, plan_attention_groups

TINY_GQA_QWEN2 = dict(
    model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512,
)
MAX_PROMPT, MAX_RESPONSE = 150, 150


def spread_batch(rows: int = 32, seed: int = 0) -> DataProto:
    """``rows`` sequences of random prompt (1-150) and response (1-150) lengths, so 2 to 300 tokens.
    Rows 0-3 have a 1-token prompt (a response token predicted from a sequence's very first token);
    row 5 has a 1-token response; row 6 an empty one (its response is all padding)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, MAX_PROMPT + 1, (rows,), generator=generator)
    response_lengths = torch.randint(1, MAX_RESPONSE + 1, (rows,), generator=generator)
    prompt_lengths[:4] = 1
    response_lengths[5], response_lengths[6] = 1, 0
    columns = torch.arange(MAX_PROMPT + MAX_RESPONSE)
    prompt_valid = columns[None, :MAX_PROMPT] >= MAX_PROMPT - prompt_lengths[:, None]
    response_valid = columns[None, :MAX_RESPONSE] < response_lengths[:, None]
    attention_mask = torch.cat([prompt_valid, response_valid], dim=1).long()
    input_ids = torch.randint(1, 64, attention_mask.shape, generator=generator) * attention_mask
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, MAX_PROMPT:],
            "response_mask": response_valid.float(),
            "advantages": torch.randn(rows, MAX_RESPONSE, generator=generator),
        },
        meta_info={"ppo_mini_batch_size": rows},
    )


def built(*, packed: bool, **overrides) -> FSDP2Engine:
    config = dict(model_config=dict(TINY_GQA_QWEN2), seed=3, lr=1e-3, dtype="float32", micro_batch_size_per_gpu=32)
    engine = FSDP2Engine(config, use_remove_padding=packed, **overrides)
    engine.init_model()
    return engine


@pytest.fixture(scope="module")
def batch() -> DataProto:
    return spread_batch()


# -- the pack ------------------------------------------------------------------------------------------


def test_attention_groups_gather_similar_lengths_longest_first():
    # 100 and 60 (>= half of 100); 40 and 20 (>= half of 40); 3 (< half of 40, and 40 is not short).
    groups = plan_attention_groups([3, 40, 100, 60, 20], torch.device("cpu"))
    assert [(group.rows, group.length) for group in groups.groups] == [(2, 100), (2, 40), (1, 3)]
    # All sequences of up to 32 tokens share a group whatever their spread.
    assert [(group.rows, group.length) for group in plan_attention_groups([1, 32, 7], torch.device("cpu")).groups] == [(3, 32)]


def test_a_pack_holds_the_valid_tokens_with_their_own_positions_and_the_response_predictors():
    # Row 0: prompt [5 6], response [7 pad]; row 1: prompt [pad 8], response [9 4].
    input_ids = torch.tensor([[5, 6, 7, 0], [0, 8, 9, 4]])
    attention_mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 2], [0, 0, 1, 2]])
    packed = pack(input_ids, attention_mask, position_ids, input_ids[:, 2:], grouped_attention=False)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert packed.cu_seq_lens.tolist() == [0, 3, 6]
    # Response tokens 7 (after 6 at pack position 1), 9 (after 8 at 3) and 4 (after 9 at 4).
    assert packed.predictors.tolist() == [1, 3, 4] and packed.targets.tolist() == [7, 9, 4]
    assert packed.unpack(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 0.0], [2.0, 3.0]]


def test_packed_attention_refuses_terms_it_does_not_compute():
    from transformers import AttentionInterface

    function = AttentionInterface._global_mapping[attention_implementation("sdpa")]
    states = torch.randn(1, 2, 4, 8)
    packed = dict(cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32), max_length_q=4)
    with pytest.raises(NotImplementedError, match="Module attends with softcap, which packed sdpa attention does not implement"):
        function(torch.nn.Module(), states, states, states, None, softcap=30.0, **packed)
    with pytest.raises(NotImplementedError, match="a sliding window of 2 tokens, shorter than a sequence \\(4\\)"):
        function(torch.nn.Module(), states, states, states, None, sliding_window=2, **packed)


# -- packed forward == padded forward ------------------------------------------------------------------


def assert_equal_where_valid(packed: torch.Tensor, padded: torch.Tensor, mask: torch.Tensor) -> None:
    valid = mask.bool()
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=0)
    # The first response token of every row (row 0 opens the pack; every other row follows another sequence).
    first = valid[:, 0]
    torch.testing.assert_close(packed[first, 0], padded[first, 0], atol=1e-5, rtol=0)
    assert torch.count_nonzero(packed[~valid]) == 0


def test_packed_log_probs_and_entropy_equal_padded(batch):
    padded, packed = built(packed=False), built(packed=True)
    expected = padded.forward(batch, calculate_entropy=True).batch
    actual = packed.forward(batch, calculate_entropy=True).batch
    mask = batch.batch["response_mask"]
    assert int(mask.sum()) > 1000
    assert_equal_where_valid(actual["log_probs"], expected["log_probs"], mask)
    assert_equal_where_valid(actual["entropy"], expected["entropy"], mask)


def test_packed_log_probs_equal_padded_in_micro_batches_and_token_budgets(batch):
    padded = built(packed=False, micro_batch_size_per_gpu=32).forward(batch).batch["log_probs"]
    mask = batch.batch["response_mask"]
    for overrides in ({"forward_micro_batch_size_per_gpu": 5}, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 700}):
        packed = built(packed=True, **overrides).forward(batch).batch["log_probs"]
        assert_equal_where_valid(packed, padded, mask)


def test_packed_values_equal_padded(batch):
    padded, packed = built(packed=False, value_model=True), built(packed=True, value_model=True)
    mask = batch.batch["response_mask"]
    assert_equal_where_valid(packed.forward(batch).batch["values"], padded.forward(batch).batch["values"], mask)


def test_eager_attention_packs_too(batch):
    rows = batch.select_idxs(list(range(8)))
    padded = built(packed=False, attn_implementation="eager").forward(rows).batch["log_probs"]
    packed = built(packed=True, attn_implementation="eager").forward(rows).batch["log_probs"]
    assert_equal_where_valid(packed, padded, rows.batch["response_mask"])


def test_an_unpacked_call_on_a_packing_model_keeps_the_configured_attention(batch):
    rows = batch.select_idxs(list(range(4))).batch
    arguments = dict(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], position_ids=rows["position_ids"])
    with torch.no_grad():
        expected = built(packed=False).module(**arguments).logits
        actual = built(packed=True).module(**arguments).logits
    # Exact on purpose: the two models draw the same weights under the seed into fresh allocations and take
    # the same inputs, so the same attention kernel gives the same bits at any thread count; another kernel
    # (eager instead of sdpa) would differ in the last bits.
    assert torch.equal(actual, expected)


def test_a_model_whose_attention_cannot_be_packed_runs_padded_with_a_warning(batch, monkeypatch):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2PreTrainedModel

    rows = batch.select_idxs(list(range(4)))
    expected = built(packed=False).forward(rows).batch["log_probs"]
    monkeypatch.setattr(Qwen2PreTrainedModel, "_supports_attention_backend", False)
    with pytest.warns(UserWarning, match="Qwen2ForCausalLM does not route attention through Hugging Face's attention interface"):
        engine = built(packed=True)
    assert engine.state()["remove_padding"] is False
    # Exact: the same weights and the same padded micro-batch through the same kernels; packed rows would
    # differ in the last bits (and be 0 at padding).
    assert torch.equal(engine.forward(rows).batch["log_probs"], expected)


# -- the update ----------------------------------------------------------------------------------------


class TokenMean:
    """``token-mean`` (rlplat.losses) of ``-advantages * log_probs``, or of ``-log_probs`` with
    ``advantages=False`` (a loss without cancellation between tokens, for relative comparisons)."""

    def __init__(self, advantages: bool = True):
        self.advantages = advantages

    def __call__(self, outputs, micro_batch):
        batch, meta = micro_batch.batch, micro_batch.meta_info
        weight = batch["advantages"] if self.advantages else 1.0
        loss = aggregate_loss(-weight * outputs["log_probs"], batch["response_mask"], "token-mean",
                              global_token_count=meta["global_token_count"], global_sequence_count=meta["global_sequence_count"])
        return loss, {}


def test_loss_and_gradient_norm_do_not_depend_on_the_packed_partition(batch):
    rows = batch.select_idxs(list(range(16))).with_meta_info({"ppo_mini_batch_size": 16})
    partitions = [
        {"micro_batch_size_per_gpu": 16},
        {"micro_batch_size_per_gpu": 5},
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 700},
    ]
    metrics = [built(packed=True, grad_clip=None, **partition).train_batch(rows, TokenMean(advantages=False))
               for partition in partitions]
    padded = built(packed=False, grad_clip=None, micro_batch_size_per_gpu=8).train_batch(rows, TokenMean(advantages=False))
    for result in metrics[1:]:
        assert result["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-6)
        assert result["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-6)
    assert metrics[0]["loss"] == pytest.approx(padded["loss"], rel=1e-5)
    assert metrics[0]["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
    assert metrics[0]["grad_norm"] > 1e-2


def test_packed_and_padded_updates_give_the_same_weights(batch):
    rows = batch.select_idxs(list(range(12))).with_meta_info({"ppo_mini_batch_size": 12})
    # eps 1e-6: AdamW's first step, lr * g / (|g| + eps), would turn rounding on gradients of about eps into
    # differences of a sizeable part of lr (see test_packing_distributed).
    padded = built(packed=False, grad_clip=None, eps=1e-6)
    packed = built(packed=True, grad_clip=None, eps=1e-6, micro_batch_size_per_gpu=7)
    for engine in (padded, packed):
        engine.train_batch(rows, TokenMean())
    expected = {name: tensor for bucket in padded.named_weights() for name, tensor in bucket}
    actual = {name: tensor for bucket in packed.named_weights() for name, tensor in bucket}
    assert max(float((actual[name] - expected[name]).abs().max()) for name in expected) <= 1e-6


def test_activation_checkpointing_recomputes_packed_attention(batch):
    rows = batch.select_idxs(list(range(8))).with_meta_info({"ppo_mini_batch_size": 8})
    plain = built(packed=True, grad_clip=None)
    checkpointed = built(packed=True, grad_clip=None, enable_gradient_checkpointing=True)
    expected, actual = (engine.train_batch(rows, TokenMean(advantages=False)) for engine in (plain, checkpointed))
    assert actual["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)


def test_a_packed_micro_batch_without_response_tokens_steps_with_a_zero_share(batch):
    rows = batch.select_idxs([6, 2]).with_meta_info({"ppo_mini_batch_size": 2})  # row 6's response is all padding
    assert rows.batch["response_mask"][0].sum() == 0
    split = built(packed=True, grad_clip=None, micro_batch_size_per_gpu=1).train_batch(rows, TokenMean())
    whole = built(packed=True, grad_clip=None, micro_batch_size_per_gpu=2).train_batch(rows, TokenMean())
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-6) and whole["grad_norm"] > 1e-2


# -- packed attention kernels ---------------------------------------------------------------------------


def test_flex_document_attention_equals_grouped_attention():
    from rlplat_engine_fsdp2.packing import DocumentMask, flex_causal_attention, grouped_causal_attention

    lengths = [1, 7, 33, 120, 64, 2, 90]
    generator = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    query = torch.randn(1, 4, tokens, 8, generator=generator)
    key, value = (torch.randn(1, 2, tokens, 8, generator=generator) for _ in range(2))
    documents = DocumentMask(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    grouped = grouped_causal_attention(torch.nn.Module(), query, key, value, plan_attention_groups(lengths, query.device), 0.3, 0.0)
    flex = flex_causal_attention(query, key, value, documents, 0.3)
    assert flex.shape == grouped.shape == (1, tokens, 4, 8)
    torch.testing.assert_close(flex, grouped, atol=1e-5, rtol=0)


def test_a_model_on_flex_attention_gives_the_grouped_log_probs(batch):
    # flex attention has no backward on CPU, so the engine refuses it there for training; the forward of the same
    # model through either kernel, on the whole spread batch (2-300 tokens a sequence), agrees to float rounding
    from rlplat_engine_fsdp2 import packing

    engine = built(packed=True)
    assert packing.packed_kernel(engine.module) == "grouped"  # auto on CPU
    expected = engine.forward(batch, calculate_entropy=True).batch
    packing.set_kernel(engine.module, "flex")
    actual = engine.forward(batch, calculate_entropy=True).batch
    mask = batch.batch["response_mask"]
    assert_equal_where_valid(actual["log_probs"], expected["log_probs"], mask)
    assert_equal_where_valid(actual["entropy"], expected["entropy"], mask)


@pytest.mark.parametrize("kernel, reason", [
    ("varlen", "needs torch >= 2.10, a CUDA device and bfloat16 or float16 compute; this process has torch"),
    ("flex", "flex attention has no backward on cpu"),
])
def test_packed_kernels_that_cannot_run_here_are_refused_with_the_reason(kernel, reason):
    with pytest.raises(ValueError, match=reason):
        built(packed=True, packed_attention=kernel)


def test_an_unknown_packed_kernel_is_a_config_error():
    from rlplat.config_node import ConfigError

    with pytest.raises((ValueError, ConfigError), match="packed_attention 'xformers' is not one of"):
        built(packed=True, packed_attention="xformers")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_cuda_packed_kernels_train_as_grouped_attention(batch, kernel):
    # bf16 on CUDA: the kernels sum in different orders, so the log-probs agree to bf16 rounding (mean difference
    # well under 0.01 nats) and the gradients point the same way (cosine > 0.999)
    from rlplat_engine_fsdp2 import packing

    if kernel == "varlen" and not packing.varlen_available():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    options = dict(dtype="bfloat16", micro_batch_size_per_gpu=16)
    engines = {name: built(packed=True, packed_attention=name, **options) for name in ("grouped", kernel)}
    assert packing.packed_kernel(engines[kernel].module) == kernel
    mask = batch.batch["response_mask"].bool()
    log_probs = {name: engine.forward(batch).batch["log_probs"][mask] for name, engine in engines.items()}
    assert (log_probs[kernel] - log_probs["grouped"]).abs().mean() < 1e-2
    gradients = {}
    for name, engine in engines.items():
        engine.forward_backward(batch, TokenMean(advantages=False))
        gradients[name] = torch.cat([parameter.grad.flatten().float() for parameter in engine.module.parameters()])
    assert torch.nn.functional.cosine_similarity(gradients[kernel], gradients["grouped"], dim=0) > 0.999
