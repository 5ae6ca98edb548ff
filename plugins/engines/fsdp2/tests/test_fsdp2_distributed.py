"""The engine inside rlplat workers: two CPU processes under Ray (gloo, FSDP2 shards of 1/2) against one
process in the in-process backend, on the same global batches, float32.

Tolerances are the issue's: 2 ranks vs 1 <= 1e-5 on parameters after a step; micro-batch size or token
budget <= 1e-6 on the gradient; save -> load -> next step exact; ``export_hf`` logits <= 1e-6.
"""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch

from rlplat import DataProto, Dispatch, LocalWorkerGroup, RayWorkerGroup, ResourcePool, Worker, WorkerError, WorkerSpec, register
from rlplat.controller.worker import without_padding_weight
from rlplat.testing.distributed import max_difference
from rlplat.testing.engines import TINY_QWEN2
from rlplat_engine_fsdp2.engine import FSDP2Engine, full_tensor

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

# Ray workers get this module's classes by value, so the tests run from any working directory.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BASE = dict(
    model_config=dict(TINY_QWEN2),
    seed=7,
    lr=1e-3,
    dtype="float32",
    micro_batch_size_per_gpu=2,
)


class PolicyGradientLoss:
    """Token-mean surrogate ``-sum(advantages * log_probs * mask) / global_token_count``."""

    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"]
        return loss, {"test/pg_loss": float(loss.detach())}


class ValueRegressionLoss:
    """Token-mean ``0.5 * (values - returns)^2`` over the response mask."""

    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        error = (outputs["values"] - batch["returns"]) ** 2 * batch["response_mask"]
        return 0.5 * error.sum() / micro_batch.meta_info["global_token_count"], {}


class EngineHost(Worker):
    """Holds named engines built from ``BASE`` with overrides; every method runs on every rank."""

    def __init__(self):
        super().__init__()
        self.engines: dict[str, FSDP2Engine] = {}

    @register(Dispatch.ONE_TO_ALL)
    def build(self, name: str, overrides: dict) -> None:
        engine = FSDP2Engine(BASE, **overrides)
        engine.init_model()
        self.engines[name] = engine

    @register(Dispatch.ONE_TO_ALL)
    def build_seeded_per_rank(self, name: str, overrides: dict) -> None:
        """An engine whose seed differs by rank (random weights that differ, unless the engine makes them agree)."""
        engine = FSDP2Engine(BASE, **{**overrides, "seed": 1000 + self.rank})
        engine.init_model()
        self.engines[name] = engine

    @register(Dispatch.DP_COMPUTE_PROTO)
    def forward(self, name: str, batch: DataProto) -> DataProto:
        return self.engines[name].forward(batch)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def train(self, name: str, batch: DataProto, loss: str = "policy") -> dict:
        loss_fn = ValueRegressionLoss() if loss == "value" else PolicyGradientLoss()
        return self.engines[name].train_batch(without_padding_weight(batch, self.padding_rows), loss_fn)

    @register(Dispatch.ONE_TO_ALL)
    def build_mesh(self, name: str, overrides: dict, model: dict | None = None) -> None:
        """An engine whose data-parallel place (Ulysses groups) the mesh methods dispatch by."""
        engine = FSDP2Engine({**BASE, **({"model_config": model} if model else {})}, **overrides)
        engine.init_model()
        self.engines[name] = engine
        self.set_dispatch_info(*engine.data_parallel_info())

    @register(Dispatch.DP_MESH)
    def forward_mesh(self, name: str, batch: DataProto, calculate_entropy: bool = False) -> DataProto:
        return self.engines[name].forward(batch, calculate_entropy=calculate_entropy)

    @register(Dispatch.DP_MESH)
    def train_mesh(self, name: str, batch: DataProto, loss: str = "policy") -> DataProto:
        loss_fn = ValueRegressionLoss() if loss == "value" else PolicyGradientLoss()
        metrics = self.engines[name].train_batch(without_padding_weight(batch, self.padding_rows), loss_fn)
        return DataProto(meta_info={"metrics": metrics})

    @register(Dispatch.ONE_TO_ALL)
    def parameters(self, name: str) -> dict:
        return {key: tensor.clone() for bucket in self.engines[name].named_weights() for key, tensor in bucket}

    @register(Dispatch.ONE_TO_ALL)
    def gradients(self, name: str) -> dict:
        return {key: full_tensor(parameter.grad) for key, parameter in self.engines[name].module.named_parameters()}

    @register(Dispatch.ONE_TO_ALL)
    def keep_float32_bytes(self, limit: int) -> int:
        """Set the size up to which logits are kept whole (the chunked output layer above it); the old size."""
        from rlplat_engine_fsdp2 import modeling

        old, modeling.KEEP_FLOAT32_BYTES = modeling.KEEP_FLOAT32_BYTES, limit
        return old

    @register(Dispatch.ONE_TO_ALL)
    def save(self, name: str, path: str) -> None:
        self.engines[name].save(path)

    @register(Dispatch.ONE_TO_ALL)
    def load(self, name: str, path: str) -> None:
        self.engines[name].load(path)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, name: str, path: str) -> None:
        self.engines[name].export_hf(path)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def logits(self, name: str, batch: DataProto) -> DataProto:
        module = self.engines[name].module.eval()
        data = batch.batch
        with torch.no_grad():
            logits = module(input_ids=data["input_ids"], attention_mask=data["attention_mask"], position_ids=data["position_ids"]).logits
        return DataProto.from_dict({"logits": logits})


@pytest.fixture(scope="module")
def two_ranks(ray_cluster):
    pool = ResourcePool([2])
    group = RayWorkerGroup(pool, WorkerSpec(EngineHost), role="actor")
    yield group
    group.shutdown()
    pool.release()


@pytest.fixture(scope="module")
def one_rank():
    group = LocalWorkerGroup(WorkerSpec(EngineHost), role="actor")
    yield group
    group.shutdown()


def one_step_batch(batch_of, rows: int = 8) -> DataProto:
    batch = batch_of(rows)
    return batch.with_meta_info({"ppo_mini_batch_size": rows})


def test_a_two_rank_step_equals_a_one_rank_step_on_the_same_global_batch(two_ranks, one_rank, batch_of):
    batch = one_step_batch(batch_of)
    for group in (two_ranks, one_rank):
        group.build("step", {})
    initial = one_rank.parameters("step")[0]
    two_rank_metrics = two_ranks.train("step", batch)
    one_rank_metrics = one_rank.train("step", batch)
    after_two, after_one = two_ranks.parameters("step")[0], one_rank.parameters("step")[0]
    difference = max_difference(after_two, after_one)
    print(f"2 ranks vs 1 rank, max |parameter difference| after one step: {difference:.3g}")
    assert difference <= 1e-5
    assert max_difference(after_one, initial) >= 1e-4  # the step moved the weights far beyond the tolerance
    assert two_rank_metrics[0]["grad_norm"] == pytest.approx(one_rank_metrics[0]["grad_norm"], rel=1e-5)
    assert two_rank_metrics[0]["loss"] == pytest.approx(one_rank_metrics[0]["loss"], rel=1e-5, abs=1e-7)


def test_a_varying_row_count_with_dispatch_padding_steps_exactly_on_its_real_rows(two_ranks, one_rank, batch_of):
    batch = batch_of(7).with_meta_info({"ppo_mini_batch_size": 4})
    for group in (two_ranks, one_rank):
        group.build("varying", {})
    # Dispatch pads 7 rows to 8 (rank 0: rows 0-3, rank 1: rows 4-6 and a copy of row 0 with no weight);
    # each rank takes 2 rows per step: steps on rows {0, 1, 4, 5}, then on the remainder {2, 3, 6}.
    two_ranks.train("varying", batch)
    for rows in ([0, 1, 4, 5], [2, 3, 6]):
        one_rank.train("varying", batch.select_idxs(rows).with_meta_info({"ppo_mini_batch_size": len(rows)}))
    after_two, after_one = two_ranks.parameters("varying")[0], one_rank.parameters("varying")[0]
    difference = max_difference(after_two, after_one)
    print(f"7 rows in mini-batches of 4 on 2 ranks vs the same steps on 1 rank, max |parameter difference|: {difference:.3g}")
    assert difference <= 1e-5


def test_a_mini_batch_size_that_does_not_split_over_the_ranks_names_the_key(two_ranks, batch_of):
    two_ranks.build("odd", {})
    with pytest.raises(WorkerError, match=r"ppo_mini_batch_size=3 rows of the global batch do not split over 2 data-parallel"):
        two_ranks.train("odd", batch_of(8).with_meta_info({"ppo_mini_batch_size": 3}))


def test_forward_on_two_ranks_equals_one_rank_row_for_row(two_ranks, one_rank, batch_of):
    batch = batch_of(6)
    for group in (two_ranks, one_rank):
        group.build("forward", {})
    torch.testing.assert_close(two_ranks.forward("forward", batch).batch["log_probs"], one_rank.forward("forward", batch).batch["log_probs"], atol=1e-5, rtol=0)


def gradient_after_one_step(group, name: str, overrides: dict, batch: DataProto) -> dict:
    group.build(name, {"grad_clip": None, **overrides})
    group.train(name, batch)
    return group.gradients(name)[0]


def test_the_micro_batch_size_does_not_change_the_gradient(two_ranks, batch_of):
    batch = one_step_batch(batch_of)
    whole = gradient_after_one_step(two_ranks, "micro4", {"micro_batch_size_per_gpu": 4}, batch)
    single_rows = gradient_after_one_step(two_ranks, "micro1", {"micro_batch_size_per_gpu": 1}, batch)
    difference = max_difference(single_rows, whole)
    print(f"micro-batches of 1 vs 4 rows per rank, max |gradient difference|: {difference:.3g}")
    assert difference <= 1e-6
    assert max(float(gradient.abs().max()) for gradient in whole.values()) > 1e-2


def test_a_token_budget_does_not_change_the_gradient(two_ranks, batch_of):
    batch = one_step_batch(batch_of)
    whole = gradient_after_one_step(two_ranks, "micro4", {"micro_batch_size_per_gpu": 4}, batch)
    # Each rank holds 4 rows of 6 to 11 tokens (35 or 36 in all): a budget of 24 needs 2 or more micro-batches.
    budget = gradient_after_one_step(two_ranks, "budget", {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24}, batch)
    difference = max_difference(budget, whole)
    print(f"token budget 24 vs micro-batches of 4 rows, max |gradient difference|: {difference:.3g}")
    assert difference <= 1e-6


def test_reducing_gradients_once_per_mini_batch_does_not_change_the_gradient(two_ranks, batch_of):
    batch = one_step_batch(batch_of)
    every = gradient_after_one_step(two_ranks, "micro1", {"micro_batch_size_per_gpu": 1}, batch)
    once = gradient_after_one_step(two_ranks, "sync_once", {"micro_batch_size_per_gpu": 1, "gradient_sync_every_micro_batch": False}, batch)
    assert max_difference(once, every) <= 1e-6


def test_token_budget_forward_returns_rows_in_their_original_order(two_ranks, batch_of):
    batch = batch_of(8, seed=3)
    two_ranks.build("fixed", {"micro_batch_size_per_gpu": 1})
    two_ranks.build("budget", {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16})
    torch.testing.assert_close(two_ranks.forward("budget", batch).batch["log_probs"], two_ranks.forward("fixed", batch).batch["log_probs"], atol=1e-6, rtol=0)


def test_save_load_then_the_next_step_equals_not_stopping(two_ranks, batch_of, tmp_path):
    batch = one_step_batch(batch_of)
    two_ranks.build("uninterrupted", {"lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "total_training_steps": 6})
    two_ranks.build("resumed", {"lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "total_training_steps": 6, "seed": 99})
    for _ in range(2):
        two_ranks.train("uninterrupted", batch)
    two_ranks.save("uninterrupted", str(tmp_path / "checkpoint"))
    expected = two_ranks.train("uninterrupted", batch)[0]
    two_ranks.load("resumed", str(tmp_path / "checkpoint"))
    resumed = two_ranks.train("resumed", batch)[0]
    after_expected, after_resumed = two_ranks.parameters("uninterrupted")[0], two_ranks.parameters("resumed")[0]
    print(f"save -> load -> step vs not stopping, max |parameter difference|: {max_difference(after_resumed, after_expected)}")
    assert all(torch.equal(after_resumed[key], after_expected[key]) for key in after_expected)
    assert resumed["lr"] == expected["lr"] > 0
    assert resumed["loss"] == expected["loss"]


@pytest.mark.parametrize("shard_one_rank", [False, True], ids=["plain module", "fully_shard"])
def test_a_checkpoint_resumes_at_the_other_world_size(two_ranks, one_rank, batch_of, tmp_path, shard_one_rank):
    # Two ranks save FSDP2 shards, one rank loads them (and the other way round); the next step on the
    # same global batch matches one that never stopped, within the tolerance of two ranks against one.
    batch = one_step_batch(batch_of)
    one_rank_options = {"lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "total_training_steps": 6, "shard_one_rank": shard_one_rank}
    for writer, reader in ((two_ranks, one_rank), (one_rank, two_ranks)):
        writer.build("writer", {**one_rank_options, "seed": 3})
        reader.build("reader", {**one_rank_options, "seed": 99})
        writer.train("writer", batch)
        writer.save("writer", str(tmp_path / "checkpoint"))
        expected = writer.train("writer", batch)[0]
        reader.load("reader", str(tmp_path / "checkpoint"))
        resumed = reader.train("reader", batch)[0]
        difference = max_difference(reader.parameters("reader")[0], writer.parameters("writer")[0])
        print(f"{writer.world_size} rank(s) save, {reader.world_size} load, next step: max |parameter difference| {difference:.3g}")
        assert difference <= 1e-5
        assert resumed["lr"] == expected["lr"] > 0
        assert resumed["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)


def test_export_hf_then_from_pretrained_gives_the_same_logits(two_ranks, batch_of, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = one_step_batch(batch_of)
    two_ranks.build("exported", {})
    two_ranks.train("exported", batch)
    two_ranks.export_hf("exported", str(tmp_path / "hf"))
    expected = two_ranks.logits("exported", batch).batch["logits"]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    data = batch.batch
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], position_ids=data["position_ids"]).logits
    difference = float((logits - expected).abs().max())
    print(f"export_hf -> from_pretrained, max |logit difference|: {difference:.3g}")
    assert difference <= 1e-6


def test_the_value_model_loss_goes_down_on_a_fixed_batch(two_ranks, batch_of):
    batch = one_step_batch(batch_of)
    two_ranks.build("critic", {"value_model": True, "lr": 1e-4})
    losses = [two_ranks.train("critic", batch, loss="value")[0]["loss"] for _ in range(6)]
    print(f"value loss over 6 steps on one batch: {[round(loss, 4) for loss in losses]}")
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    assert losses[-1] < losses[0] / 2
    values = two_ranks.forward("critic", batch).batch
    assert set(values.keys()) == {"values"} and values["values"].shape == (8, 5)


# -- data_parallel: replicate ------------------------------------------------------------------------

REPLICATE = {"data_parallel": "replicate"}


def test_replicated_two_ranks_step_as_sharded_two_ranks_and_one_rank(two_ranks, one_rank, batch_of):
    batch = batch_of(7).with_meta_info({"ppo_mini_batch_size": 4})  # dispatch padding and two optimizer steps
    two_ranks.build("replicated", {**REPLICATE, "micro_batch_size_per_gpu": 1})
    two_ranks.build("sharded", {"micro_batch_size_per_gpu": 1})
    replicated, sharded = two_ranks.train("replicated", batch)[0], two_ranks.train("sharded", batch)[0]
    after_replicated, after_sharded = two_ranks.parameters("replicated"), two_ranks.parameters("sharded")[0]
    difference = max_difference(after_replicated[0], after_sharded)
    print(f"replicate vs shard on 2 ranks, 2 steps, max |parameter difference|: {difference:.3g}")
    assert difference <= 1e-5
    assert max_difference(after_replicated[0], after_replicated[1]) == 0  # the ranks hold the same weights
    assert replicated["grad_norm"] == pytest.approx(sharded["grad_norm"], rel=1e-5)
    one_rank.build("replicated", REPLICATE)  # one rank: replicate is the plain module, as shard is
    for rows in ([0, 1, 4, 5], [2, 3, 6]):
        one_rank.train("replicated", batch.select_idxs(rows).with_meta_info({"ppo_mini_batch_size": len(rows)}))
    assert max_difference(one_rank.parameters("replicated")[0], after_replicated[0]) <= 1e-5


def test_replicated_ranks_start_from_rank_zeros_weights(two_ranks):
    # Different seeds per rank build different random models; the start-up broadcast makes both rank 0's.
    two_ranks.build_seeded_per_rank("per_rank", REPLICATE)
    two_ranks.build("rank0_seed", {**REPLICATE, "seed": 1000})
    first, second = two_ranks.parameters("per_rank")
    assert max_difference(first, second) == 0
    assert max_difference(first, two_ranks.parameters("rank0_seed")[0]) == 0


def test_replicated_checkpoints_resume_exactly_and_load_sharded(two_ranks, one_rank, batch_of, tmp_path):
    batch = one_step_batch(batch_of)
    schedule = {"lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "total_training_steps": 6}
    two_ranks.build("writer", {**REPLICATE, **schedule, "seed": 3})
    two_ranks.build("reader", {**REPLICATE, **schedule, "seed": 99})
    two_ranks.build("sharded_reader", {**schedule, "seed": 98})
    two_ranks.train("writer", batch)
    two_ranks.save("writer", str(tmp_path / "checkpoint"))
    expected = two_ranks.train("writer", batch)[0]
    after_writer = two_ranks.parameters("writer")[0]
    for reader in ("reader", "sharded_reader"):
        two_ranks.load(reader, str(tmp_path / "checkpoint"))
        resumed = two_ranks.train(reader, batch)[0]
        difference = max_difference(two_ranks.parameters(reader)[0], after_writer)
        print(f"replicate saves, {reader} loads, next step: max |parameter difference| {difference:.3g}")
        assert difference == 0 if reader == "reader" else difference <= 1e-5
        assert resumed["lr"] == expected["lr"] > 0
    one_rank.build("reader", {**schedule, "seed": 97})
    one_rank.load("reader", str(tmp_path / "checkpoint"))
    one_rank.train("reader", batch)
    assert max_difference(one_rank.parameters("reader")[0], after_writer) <= 1e-5


def test_replicate_refuses_mixed_precision():
    from rlplat_engine_fsdp2.config import read_engine_config

    with pytest.raises(ValueError, match="data_parallel 'replicate' computes and reduces in float32"):
        read_engine_config({**BASE, **REPLICATE, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="data_parallel must be one of"):
        read_engine_config({**BASE, "data_parallel": "ddp"})


def test_a_moe_model_steps_on_two_sharded_ranks_as_on_one_with_replayed_routes_and_router_losses(two_ranks, one_rank, batch_of):
    """FSDP2 shards the experts with their layers; the update replays the old forward's routes (r2) on each
    rank's rows, adds the router losses weighted by each rank's share of the tokens, and reports the load
    over both ranks' tokens: one step equals the one-rank step."""
    from rlplat.kits.moe import ROUTES
    from rlplat.testing.tiny_models import tiny_moe_config

    overrides = {"model_config": tiny_moe_config("qwen3_moe"), "moe": {"router_replay": "r2", "aux_loss_coef": 0.1, "z_loss_coef": 0.01}}
    batch = one_step_batch(batch_of)
    for group in (two_ranks, one_rank):
        group.build("moe", overrides)
    found = one_rank.forward("moe", batch)
    routes = (found[0] if isinstance(found, list) else found).batch[ROUTES]
    batch = batch.union(DataProto.from_dict({ROUTES: routes}))
    two_metrics, one_metrics = two_ranks.train("moe", batch)[0], one_rank.train("moe", batch)[0]
    # the gradients (AdamW's first step turns a rounding difference in a near-zero element into up to lr)
    two_gradients, one_gradients = two_ranks.gradients("moe")[0], one_rank.gradients("moe")[0]
    difference = max_difference(two_gradients, one_gradients)
    print(f"MoE, 2 sharded ranks vs 1: max |gradient difference| {difference:.3g}, "
          f"largest gradient {max(float(g.abs().max()) for g in one_gradients.values()):.3g}")
    assert difference <= 1e-6
    for key in ("loss", "grad_norm", "actor/moe/aux_loss", "actor/moe/z_loss", "actor/moe/load_imbalance",
                "actor/moe/load_imbalance/layer_1", "actor/moe/replayed_fraction", "actor/moe/replay_agreement"):
        assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
    assert one_metrics["actor/moe/replayed_fraction"] == 1.0 and one_metrics["actor/moe/replay_agreement"] == 1.0


def test_the_chunked_output_layer_steps_on_two_sharded_ranks_as_on_one_and_as_the_whole_logits(two_ranks, one_rank, batch_of):
    """The output layer a chunk at a time (4 tokens x 8 vocabulary entries, its own backward) inside FSDP2's
    forward, where the layer's weight is the gathered one and its gradient is reduce-scattered: the gradients
    of 2 sharded ranks equal 1 rank's, and 1 rank's equal the whole-logits path's."""
    batch = one_step_batch(batch_of)
    one_rank.build("whole", {})
    one_rank.train("whole", batch)
    whole = one_rank.gradients("whole")[0]
    previous = [group.keep_float32_bytes(0)[0] for group in (two_ranks, one_rank)]
    try:
        for group in (two_ranks, one_rank):
            group.build("chunked", {"logprob_chunk_size": 4, "logprob_vocab_chunk_size": 8})
        two_metrics, one_metrics = two_ranks.train("chunked", batch)[0], one_rank.train("chunked", batch)[0]
        two_gradients, one_gradients = two_ranks.gradients("chunked")[0], one_rank.gradients("chunked")[0]
    finally:
        for group, limit in zip((two_ranks, one_rank), previous):
            group.keep_float32_bytes(limit)
    largest = max(float(gradient.abs().max()) for gradient in whole.values())
    assert max_difference(two_gradients, one_gradients) <= 1e-6 * max(1.0, largest)
    assert max_difference(one_gradients, whole) <= 1e-6 * max(1.0, largest)
    assert two_metrics["loss"] == pytest.approx(one_metrics["loss"], rel=1e-5, abs=1e-7)


# -- Ulysses sequence parallelism ------------------------------------------------------------------------

def long_batch(rows: int = 6, seed: int = 3) -> DataProto:
    """Rows of 7 to 27 valid tokens (prompts of 4 to 12 left-padded to 12, responses of 3 to 15 right-padded to
    15): the packs have odd lengths, so the two ranks' slices need padding, and response tokens fall in both."""
    generator = torch.Generator().manual_seed(seed)
    prompt, response = 12, 15
    input_ids = torch.randint(1, 16, (rows, prompt + response), generator=generator)
    attention_mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    for row in range(rows):
        prompt_tokens, response_tokens = 4 + (3 * row) % 9, 3 + (5 * row) % 13
        attention_mask[row, prompt - prompt_tokens : prompt + response_tokens] = 1
    input_ids = input_ids * attention_mask
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, prompt:],
        "response_mask": attention_mask[:, prompt:].float(),
        "advantages": torch.randn(rows, response, generator=generator), "returns": torch.randn(rows, response, generator=generator),
    }, meta_info={"ppo_mini_batch_size": rows})


GQA_ONE_KV_HEAD = dict(BASE["model_config"], num_key_value_heads=1)


@pytest.mark.parametrize("model, overrides, budget, empty", [
    (None, {}, None, False),
    (GQA_ONE_KV_HEAD, {"micro_batch_size_per_gpu": 4}, None, False),  # one key/value head, repeated over the 2 ranks
    (None, {"use_dynamic_bsz": True}, 16, False),  # 16 tokens a process: packs of up to 32 tokens on SP=2, as on 1 rank
    (None, {"enable_gradient_checkpointing": True}, None, False),  # backward recomputes each layer: its all-to-alls again
    (None, {}, None, True),  # rows 0 and 1 without a response token: a micro-batch with no position to score
], ids=["mha", "gqa-1-kv-head", "token-budget", "recompute", "no-response-micro-batch"])
def test_ulysses_sp2_equals_one_rank_log_probs_entropy_and_one_step_parameters(two_ranks, one_rank, model, overrides, budget, empty):
    """SP=2 on 2 gloo processes (one data-parallel group: both ranks get every row, rank 0 answers) against the
    packed engine on one rank: log-probs and entropy within 1e-5, the step's gradients within 1e-6 of their
    largest entry, and the parameters after the step within 1e-5. lr 1e-4: AdamW's first step moves every
    weight by about lr whatever its gradient, so a gradient entry near 0 (where float32 summation order alone
    flips its sign) moves by up to 2 lr either way; at 1e-4 that stays a tenth of the tolerance while every
    weight still moves 10x beyond it."""
    batch = long_batch()
    if empty:
        batch.batch["attention_mask"][:2, 12:] = 0
        batch.batch["response_mask"][:2] = 0
    overrides = {"lr": 1e-4, "grad_clip": None, **overrides}
    two_ranks.build_mesh("sp", {"ulysses_sequence_parallel_size": 2, **overrides, **({"max_token_len_per_gpu": budget} if budget else {})}, model)
    one_rank.build_mesh("sp", {**overrides, **({"max_token_len_per_gpu": 2 * budget} if budget else {})}, model)
    initial = one_rank.parameters("sp")[0]
    sp_out, one_out = two_ranks.forward_mesh("sp", batch, True), one_rank.forward_mesh("sp", batch, True)
    difference = max(float((sp_out.batch[key] - one_out.batch[key]).abs().max()) for key in ("log_probs", "entropy"))
    sp_metrics = two_ranks.train_mesh("sp", batch).meta_info["metrics"]
    one_metrics = one_rank.train_mesh("sp", batch).meta_info["metrics"]
    one_gradients = one_rank.gradients("sp")[0]
    gradients = max_difference(two_ranks.gradients("sp")[0], one_gradients)
    largest = max(float(gradient.abs().max()) for gradient in one_gradients.values())
    after = one_rank.parameters("sp")[0]
    step = max_difference(two_ranks.parameters("sp")[0], after)
    print(f"Ulysses SP=2 vs 1 rank: log-probs/entropy {difference:.3g}, gradients {gradients:.3g} (largest {largest:.3g}), "
          f"parameters after a step {step:.3g}")
    assert difference <= 1e-5 and step <= 1e-5 and gradients <= 1e-6 * max(1.0, largest)
    assert max_difference(after, initial) >= 5e-5  # the step moved the weights far beyond the tolerance
    assert sp_metrics["loss"] == pytest.approx(one_metrics["loss"], rel=1e-5, abs=1e-7)
    assert sp_metrics["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-5)
    assert sp_metrics["test/pg_loss"] == pytest.approx(one_metrics["test/pg_loss"], rel=1e-5, abs=1e-7)


def test_ulysses_chunked_output_layer_value_and_reward_models_equal_one_rank(two_ranks, one_rank):
    """With the output layer run a chunk at a time (forced) on each rank's slice, and for a value model, SP=2's
    step equals one rank's (lr 1e-4: see the test above); a reward model's scores (each sequence's last token,
    on whichever rank holds it) equal one rank's."""
    batch = long_batch(seed=5)
    previous = [group.keep_float32_bytes(0)[0] for group in (two_ranks, one_rank)]
    try:
        for group, sp in ((two_ranks, 2), (one_rank, 1)):
            group.build_mesh("sp-chunked", {"ulysses_sequence_parallel_size": sp, "logprob_chunk_size": 4, "logprob_vocab_chunk_size": 8,
                                            "lr": 1e-4})
            group.build_mesh("sp-value", {"ulysses_sequence_parallel_size": sp, "value_model": True, "lr": 1e-4})
        log_probs = [group.forward_mesh("sp-chunked", batch, True).batch for group in (two_ranks, one_rank)]
        losses = [group.train_mesh("sp-chunked", batch).meta_info["metrics"]["loss"] for group in (two_ranks, one_rank)]
        chunked = max_difference(two_ranks.parameters("sp-chunked")[0], one_rank.parameters("sp-chunked")[0])
    finally:
        for group, limit in zip((two_ranks, one_rank), previous):
            group.keep_float32_bytes(limit)
    for group, sp in ((two_ranks, 2), (one_rank, 1)):
        group.build_mesh("sp-reward", {"ulysses_sequence_parallel_size": sp, "reward_model": True})
    scores = [group.forward_mesh("sp-reward", batch).batch["rm_scores"] for group in (two_ranks, one_rank)]
    assert float((scores[0] - scores[1]).abs().max()) <= 1e-5 and float(scores[1].abs().min()) > 0
    values = [group.forward_mesh("sp-value", batch).batch["values"] for group in (two_ranks, one_rank)]
    for group in (two_ranks, one_rank):
        group.train_mesh("sp-value", batch, "value")
    value_step = max_difference(two_ranks.parameters("sp-value")[0], one_rank.parameters("sp-value")[0])
    for key in ("log_probs", "entropy"):
        assert float((log_probs[0][key] - log_probs[1][key]).abs().max()) <= 1e-5
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)
    assert chunked <= 1e-5 and value_step <= 1e-5
    assert float((values[0] - values[1]).abs().max()) <= 1e-5


def test_ulysses_sp2_with_a_moe_model_records_replays_and_balances_as_one_rank(two_ranks, one_rank):
    """A Qwen3-MoE policy at SP=2: each rank's routers see its slice of the pack. The forward's recorded routes
    (r2), gathered from both slices, equal one rank's; the update replays them, and its router losses (the
    load-balancing loss and the z-loss of the whole pack, summed over the group) and load metrics equal one
    rank's, as do the gradients and the parameters after the step."""
    from rlplat.kits.moe import ROUTES
    from rlplat.testing.tiny_models import tiny_moe_config

    overrides = {"lr": 1e-4, "grad_clip": None, "micro_batch_size_per_gpu": 3,
                 "moe": {"router_replay": "r2", "aux_loss_coef": 0.1, "z_loss_coef": 0.01}}
    model = tiny_moe_config("qwen3_moe")
    two_ranks.build_mesh("sp-moe", {"ulysses_sequence_parallel_size": 2, **overrides}, model)
    one_rank.build_mesh("sp-moe", overrides, model)
    batch = long_batch()
    sp_out, one_out = two_ranks.forward_mesh("sp-moe", batch, True), one_rank.forward_mesh("sp-moe", batch, True)
    assert float((sp_out.batch["log_probs"] - one_out.batch["log_probs"]).abs().max()) <= 1e-5
    assert torch.equal(sp_out.batch[ROUTES], one_out.batch[ROUTES])
    batch = batch.union(DataProto.from_dict({ROUTES: one_out.batch[ROUTES]}))
    sp_metrics = two_ranks.train_mesh("sp-moe", batch).meta_info["metrics"]
    one_metrics = one_rank.train_mesh("sp-moe", batch).meta_info["metrics"]
    one_gradients = one_rank.gradients("sp-moe")[0]
    gradients = max_difference(two_ranks.gradients("sp-moe")[0], one_gradients)
    step = max_difference(two_ranks.parameters("sp-moe")[0], one_rank.parameters("sp-moe")[0])
    print(f"Ulysses SP=2 MoE vs 1 rank: gradients {gradients:.3g}, parameters after a step {step:.3g}")
    assert gradients <= 1e-6 * max(1.0, max(float(g.abs().max()) for g in one_gradients.values())) and step <= 1e-5
    for key in ("loss", "grad_norm", "actor/moe/aux_loss", "actor/moe/z_loss", "actor/moe/load_imbalance",
                "actor/moe/load_imbalance/layer_1", "actor/moe/replayed_fraction", "actor/moe/replay_agreement"):
        assert sp_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
    # metrics come back as a list, one entry per data-parallel group
    assert sp_metrics["actor/moe/replayed_fraction"] == [1.0] and sp_metrics["actor/moe/replay_agreement"] == [1.0]


def test_ulysses_refuses_a_size_that_does_not_divide_the_heads_or_the_ranks(two_ranks):
    with pytest.raises(WorkerError, match=r"ulysses_sequence_parallel_size=2 does not divide the model's 3 attention heads"):
        two_ranks.build_mesh("sp-bad", {"ulysses_sequence_parallel_size": 2},
                             dict(BASE["model_config"], num_attention_heads=3, num_key_value_heads=3, hidden_size=96))
    with pytest.raises(WorkerError, match=r"ulysses_sequence_parallel_size=4 does not divide the 2 ranks"):
        two_ranks.build_mesh("sp-bad", {"ulysses_sequence_parallel_size": 4})
    with pytest.raises(WorkerError, match=r"ulysses_sequence_parallel_size=2 splits packed micro-batches: it needs use_remove_padding"):
        two_ranks.build_mesh("sp-bad", {"ulysses_sequence_parallel_size": 2, "use_remove_padding": False})
