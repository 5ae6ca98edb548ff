"""Conformance suite for training engines (kind ``engine``, contract :class:`rlplat.TrainingEngine`).

A plugin subclasses :class:`TrainingEngineConformance` and provides two fixtures::

    class TestMyEngine(TrainingEngineConformance):
        @pytest.fixture
        def engine_factory(self):
            return lambda: MyEngine(tiny_config)  # a new, un-initialised engine; same config, same seed

        @pytest.fixture
        def engine_batch(self):
            return my_small_batch()  # input_ids, attention_mask, position_ids, responses, response_mask

The suite runs in the test process (one data-parallel rank); the engine sets up its own process group
if none exists. It calls every contract method with a loss of its own, the token-mean negative
log-likelihood of the responses normalised by ``global_token_count``, and checks what the contract
promises: shapes, dtypes and keys of ``forward``, determinism under the seed, metrics of
``train_batch``, bucket bounds and coverage of ``named_weights``, an exact save/load round trip, an
``export_hf`` directory that ``transformers`` loads and that predicts what the engine predicts, errors
that name what is wrong, and the optional features an engine lists (``split_step``, ``trainable_state``). Policy engines only: a value model's ``forward`` has no log-probs.

:data:`TINY_QWEN2` (an engine's ``model_config``) and :func:`tiny_engine_batch` are the model and batches the
built-in engines' tests share, so two engines' numbers can be compared on the same inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pytest
import torch

from rlplat.protocol import DataProto

LOG_PROB_TOLERANCE = 1e-5

#: The tiny model of DEMO_NOTES.md as an engine's ``model_config``: vocab 16, hidden 128, intermediate 512,
#: 2 layers, 4 heads, tied embeddings.
TINY_QWEN2 = dict(
    model_type="qwen2",
    vocab_size=16,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)

PROMPT_LENGTH, RESPONSE_LENGTH = 6, 5


def tiny_engine_batch(rows: int = 8, seed: int = 0) -> DataProto:
    """``rows`` sequences of 6 prompt + 5 response tokens over :data:`TINY_QWEN2`'s vocabulary: row ``r`` has
    ``r % 3`` left-padding tokens in its prompt and ends ``r % 4`` tokens early (right padding), so rows hold 6
    to 11 tokens. Carries ``advantages`` and ``returns`` (standard normal) and a ``values`` column of zeros for
    the losses; the same under the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    length = PROMPT_LENGTH + RESPONSE_LENGTH
    input_ids = torch.randint(4, 16, (rows, length), generator=generator)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):
        attention_mask[row, : row % 3] = 0
        attention_mask[row, length - row % 4 :] = 0
    input_ids = input_ids * attention_mask  # padding id 0
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, PROMPT_LENGTH:],
            "response_mask": attention_mask[:, PROMPT_LENGTH:].float(),
            "advantages": torch.randn(rows, RESPONSE_LENGTH, generator=generator),
            "returns": torch.randn(rows, RESPONSE_LENGTH, generator=generator),
            "values": torch.zeros(rows, RESPONSE_LENGTH),
        }
    )


class TokenMeanNLL:
    """``-sum(log_probs * response_mask) / global_token_count``; records each micro-batch's meta_info."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, outputs: Mapping[str, torch.Tensor], micro_batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        self.seen.append(dict(micro_batch.meta_info))
        mask = micro_batch.batch["response_mask"].to(outputs["log_probs"].device, outputs["log_probs"].dtype)
        loss = -(outputs["log_probs"] * mask).sum() / micro_batch.meta_info["global_token_count"]
        return loss, {"kit/nll": float(loss.detach())}


def response_mask(batch: DataProto) -> torch.Tensor:
    if "response_mask" in batch.batch.keys():
        return batch.batch["response_mask"]
    return batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1]:]


def exported_log_probs(directory: str, batch: DataProto, temperature: float) -> torch.Tensor:
    """Log-probs of the responses under the model ``from_pretrained`` loads from ``directory``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    data = batch.batch
    response_length = data["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], position_ids=data["position_ids"]).logits
    scaled = logits[:, -response_length - 1 : -1].float() / temperature
    return scaled.log_softmax(-1).gather(-1, data["responses"].unsqueeze(-1)).squeeze(-1)


class TrainingEngineConformance:
    """Fixtures to provide: ``engine_factory`` (no arguments -> a new engine before ``init_model``,
    configured identically each time) and ``engine_batch`` (a small DataProto with ``input_ids``,
    ``attention_mask``, ``position_ids``, ``responses`` and ``response_mask``)."""

    @pytest.fixture
    def engine(self, engine_factory: Callable[[], Any]) -> Any:
        engine = engine_factory()
        engine.init_model()
        return engine

    @staticmethod
    def fresh(engine_factory: Callable[[], Any]) -> Any:
        engine = engine_factory()
        engine.init_model()
        return engine

    def test_forward_returns_float32_log_probs_per_response_token(self, engine, engine_batch):
        output = engine.forward(engine_batch)
        rows, response_length = engine_batch.batch["responses"].shape
        assert isinstance(output, DataProto)
        assert "log_probs" in output.batch.keys()
        log_probs = output.batch["log_probs"]
        assert log_probs.shape == (rows, response_length)
        assert log_probs.dtype == torch.float32
        assert torch.isfinite(log_probs).all() and (log_probs <= 0).all()

    def test_entropy_is_returned_only_when_asked(self, engine, engine_batch):
        assert "entropy" not in engine.forward(engine_batch).batch.keys()
        entropy = engine.forward(engine_batch, calculate_entropy=True).batch["entropy"]
        assert entropy.shape == engine_batch.batch["responses"].shape and entropy.dtype == torch.float32
        assert torch.isfinite(entropy).all() and (entropy >= -1e-6).all()

    def test_forward_keeps_row_order(self, engine, engine_batch):
        permutation = torch.randperm(len(engine_batch), generator=torch.Generator().manual_seed(0))
        shuffled = engine.forward(engine_batch.select_idxs(permutation)).batch["log_probs"]
        in_order = engine.forward(engine_batch).batch["log_probs"]
        torch.testing.assert_close(shuffled, in_order[permutation], atol=LOG_PROB_TOLERANCE, rtol=0)

    def test_init_is_deterministic_under_the_seed(self, engine_factory, engine_batch):
        first = self.fresh(engine_factory).forward(engine_batch).batch["log_probs"]
        second = self.fresh(engine_factory).forward(engine_batch).batch["log_probs"]
        assert torch.equal(first, second)

    def test_train_batch_reports_grad_norm_lr_and_the_loss_metrics_and_moves_the_model(self, engine, engine_batch):
        before = engine.forward(engine_batch).batch["log_probs"]
        metrics = engine.train_batch(engine_batch, TokenMeanNLL())
        for key in ("grad_norm", "lr", "kit/nll"):
            assert key in metrics, f"train_batch metrics lack {key!r}: {sorted(metrics)}"
            assert isinstance(metrics[key], float), f"metric {key!r} is {type(metrics[key]).__name__}, not float"
        assert metrics["grad_norm"] > 0 and metrics["lr"] >= 0
        assert not torch.equal(engine.forward(engine_batch).batch["log_probs"], before)

    def test_the_loss_function_sees_the_mini_batch_token_and_sequence_counts(self, engine, engine_batch):
        mask = engine_batch.batch["response_mask"].clone()
        mask[0] = 0  # a row without a valid response token is not a sequence the loss averages over
        columns = {key: engine_batch.batch[key] for key in engine_batch.tensor_keys() if key != "response_mask"}
        batch = DataProto.from_dict({**columns, "response_mask": mask}, meta_info={**engine_batch.meta_info, "ppo_mini_batch_size": len(engine_batch)})
        loss = TokenMeanNLL()
        engine.train_batch(batch, loss)
        assert loss.seen, "train_batch never called the loss function"
        tokens, rows_with_tokens = float(mask.sum()), len(engine_batch) - 1
        for meta_info in loss.seen:
            assert meta_info["global_token_count"] == pytest.approx(tokens)
            assert meta_info["global_sequence_count"] == rows_with_tokens

    def test_named_weights_respect_the_bucket_bound(self, engine):
        sizes = [tensor.numel() * tensor.element_size() for bucket in engine.named_weights() for _, tensor in bucket]
        bound = max(sizes)
        buckets = list(engine.named_weights(bucket_bytes=bound))
        assert len(buckets) > 1
        for bucket in buckets:
            total = sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            assert total <= bound or len(bucket) == 1, f"a bucket of {total} bytes exceeds bucket_bytes={bound}"
        names = [name for bucket in buckets for name, _ in bucket]
        assert len(names) == len(set(names)), "named_weights yields a name twice"

    def test_named_weights_cover_every_parameter_in_hugging_face_naming(self, engine, tmp_path):
        from transformers import AutoModelForCausalLM

        engine.export_hf(str(tmp_path / "hf"))
        reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        weights = {name: tensor for bucket in engine.named_weights() for name, tensor in bucket}
        for name, parameter in reference.named_parameters():
            assert name in weights, f"named_weights has no {name!r} (it has {sorted(weights)[:5]}...)"
            assert weights[name].shape == parameter.shape, name
            torch.testing.assert_close(weights[name].float().cpu(), parameter.detach(), atol=0, rtol=0)

    def test_export_hf_loads_and_predicts_what_the_engine_predicts(self, engine, engine_batch, tmp_path):
        engine.train_batch(engine_batch, TokenMeanNLL())
        engine.export_hf(str(tmp_path / "hf"))
        temperature = 0.7
        expected = engine.forward(engine_batch, temperature=temperature).batch["log_probs"]
        valid = response_mask(engine_batch).bool()  # outside the mask an engine may return anything (0 when packed)
        exported = exported_log_probs(str(tmp_path / "hf"), engine_batch, temperature)
        torch.testing.assert_close(exported[valid], expected[valid], atol=LOG_PROB_TOLERANCE, rtol=0)

    def test_save_then_load_continues_exactly_as_not_stopping(self, engine_factory, engine_batch, tmp_path):
        uninterrupted = self.fresh(engine_factory)
        uninterrupted.train_batch(engine_batch, TokenMeanNLL())
        uninterrupted.save(str(tmp_path / "checkpoint"))
        uninterrupted.train_batch(engine_batch, TokenMeanNLL())
        resumed = self.fresh(engine_factory)
        resumed.load(str(tmp_path / "checkpoint"))
        resumed.train_batch(engine_batch, TokenMeanNLL())
        assert torch.equal(resumed.forward(engine_batch).batch["log_probs"], uninterrupted.forward(engine_batch).batch["log_probs"])

    def test_loading_a_missing_checkpoint_raises_naming_the_path(self, engine, tmp_path):
        missing = tmp_path / "no-such-checkpoint"
        with pytest.raises((FileNotFoundError, ValueError)) as raised:
            engine.load(str(missing))
        assert "no-such-checkpoint" in str(raised.value)

    def test_a_batch_without_responses_is_refused_naming_the_key(self, engine, engine_batch):
        without = engine_batch.select(batch_keys=[k for k in engine_batch.tensor_keys() if k != "responses"])
        with pytest.raises((KeyError, ValueError), match="responses"):
            engine.forward(without)
        with pytest.raises((KeyError, ValueError), match="responses"):
            engine.train_batch(without, TokenMeanNLL())

    def test_offload_then_onload_changes_nothing(self, engine, engine_batch):
        before = engine.forward(engine_batch).batch["log_probs"]
        engine.offload()
        engine.onload()
        assert torch.equal(engine.forward(engine_batch).batch["log_probs"], before)

    def test_shared_weights_if_offered_are_views_of_what_training_updates(self, engine, engine_batch):
        shared = engine.shared_weights()
        if shared is None:
            pytest.skip("this engine offers no shared weights here (sharded or offloaded)")
        names = {name for bucket in engine.named_weights() for name, _ in bucket}
        assert {name for name, _ in shared} <= names, "shared_weights names a weight named_weights does not"
        addresses = {name: tensor.data_ptr() for name, tensor in shared}
        before = {name: tensor.clone() for name, tensor in shared}
        engine.train_batch(engine_batch, TokenMeanNLL())
        current = {name: tensor for bucket in engine.named_weights() for name, tensor in bucket}
        assert any(not torch.equal(tensor, before[name]) for name, tensor in shared), "training changed no shared tensor"
        for name, tensor in shared:  # the same storage, holding the updated weights
            assert tensor.data_ptr() == addresses[name]
            torch.testing.assert_close(tensor.float().cpu(), current[name].float().cpu(), atol=0, rtol=0)

    def test_the_split_step_if_offered_is_train_batch_in_two_calls(self, engine_factory, engine_batch):
        """``split_step`` in ``features``: ``forward_backward`` then ``optimizer_step`` moves the model as one
        ``train_batch`` step on the same rows; a step with ``lr`` 0 moves nothing; a bad setting is refused."""
        split = self.fresh(engine_factory)
        if "split_step" not in getattr(split, "features", ()):
            pytest.skip("the engine does not split its step (no 'split_step' in TrainingEngine.features)")
        whole = engine_batch.with_meta_info({**engine_batch.meta_info, "ppo_mini_batch_size": None})
        native = self.fresh(engine_factory)
        native.train_batch(whole, TokenMeanNLL())
        output = split.forward_backward(whole, TokenMeanNLL())
        valid = response_mask(engine_batch).bool()
        assert output.batch["log_probs"].shape == engine_batch.batch["responses"].shape
        assert "kit/nll" in output.meta_info["metrics"], f"forward_backward metrics: {sorted(output.meta_info['metrics'])}"
        metrics = split.optimizer_step()
        assert {"grad_norm", "lr"} <= set(metrics), f"optimizer_step metrics: {sorted(metrics)}"
        stepped = split.forward(engine_batch).batch["log_probs"]
        torch.testing.assert_close(stepped[valid], native.forward(engine_batch).batch["log_probs"][valid], atol=1e-6, rtol=0)
        split.forward_backward(whole, TokenMeanNLL())
        split.optimizer_step({"lr": 0.0})
        assert torch.equal(split.forward(engine_batch).batch["log_probs"][valid], stepped[valid]), "a step with lr 0 moved the model"
        split.forward_backward(whole, TokenMeanNLL())
        with pytest.raises(ValueError, match="unknown setting"):
            split.optimizer_step({"no_such_setting": 1.0})

    def test_the_trainable_state_if_offered_puts_back_what_training_changed(self, engine_factory, engine_batch):
        """``trainable_state`` in ``features``: after a step, loading the state taken before it gives the
        predictions from before, and the same step again lands where the first did (optimizer state included)."""
        engine = self.fresh(engine_factory)
        if "trainable_state" not in getattr(engine, "features", ()):
            pytest.skip("the engine cannot hand out its trainable state (no 'trainable_state' in TrainingEngine.features)")
        state = engine.trainable_state()
        before = engine.forward(engine_batch).batch["log_probs"]
        engine.train_batch(engine_batch, TokenMeanNLL())
        after = engine.forward(engine_batch).batch["log_probs"]
        engine.load_trainable_state(state)
        assert torch.equal(engine.forward(engine_batch).batch["log_probs"], before)
        engine.train_batch(engine_batch, TokenMeanNLL())
        assert torch.equal(engine.forward(engine_batch).batch["log_probs"], after)

    def test_state_is_a_mapping(self, engine):
        assert isinstance(engine.state(), Mapping)

    def test_reports_its_data_parallel_place_within_its_group(self, engine):
        dp_rank, dp_size, collect = engine.data_parallel_info()
        assert isinstance(dp_size, int) and dp_size >= 1
        assert isinstance(dp_rank, int) and 0 <= dp_rank < dp_size
        assert isinstance(collect, bool)
