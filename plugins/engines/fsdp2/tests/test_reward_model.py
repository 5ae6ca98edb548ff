"""The engine as a reward model: ``rm_scores`` read at each row's last attended token, equal to a direct
Hugging Face ``AutoModelForSequenceClassification`` forward of each sequence alone."""

from __future__ import annotations

import pytest
import torch

from rlplat import DataProto
from rlplat.testing.engines import TINY_QWEN2
from rlplat_engine_fsdp2.engine import FSDP2Engine


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A sequence classifier with one label whose pad id (2) is also a token inside the sequences: Hugging
    Face's own pooling (the last token that is not the pad id) would read the wrong position."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    settings = dict(TINY_QWEN2)
    config = AutoConfig.for_model(settings.pop("model_type"), num_labels=1, pad_token_id=2, **settings)
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.1)
    directory = tmp_path_factory.mktemp("reward_model")
    model.save_pretrained(directory)
    return str(directory)


def direct_scores(path: str, batch: DataProto) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for row in range(len(batch)):
            mask = batch.batch["attention_mask"][row].bool()
            ids = batch.batch["input_ids"][row][mask].unsqueeze(0)
            hidden = model.model(input_ids=ids).last_hidden_state
            scores.append(model.score(hidden[0, -1]).squeeze())
    return torch.stack(scores)


def scoring_batch(rows: int) -> DataProto:
    """Rows of 3 to 11 tokens, left and right padded (pad id 0), every fourth position token 2 (the pad id
    of the model above)."""
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, 16, (rows, 11), generator=generator)
    input_ids[:, 3::4] = 2
    attention_mask = torch.ones_like(input_ids)
    for row in range(rows):
        attention_mask[row, : row % 3] = 0
        attention_mask[row, 11 - row % 7:] = 0
    return DataProto.from_dict({"input_ids": input_ids * attention_mask, "attention_mask": attention_mask,
                                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)})


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_rm_scores_equal_a_direct_forward_of_each_sequence(reward_model_dir, packed):
    batch = scoring_batch(64)
    engine = FSDP2Engine(dict(model_path=reward_model_dir, reward_model=True, dtype="float32", micro_batch_size_per_gpu=16,
                              use_remove_padding=packed))
    engine.init_model()
    scores = engine.forward(batch).batch["rm_scores"]
    assert scores.shape == (64,) and scores.dtype == torch.float32
    expected = direct_scores(reward_model_dir, batch)
    # float32: padded and packed rows round a few ulps differently from a row alone (measured max 1.0e-6 at |score| 1.8)
    assert torch.allclose(scores, expected, atol=1e-6, rtol=1e-6), (scores - expected).abs().max()
    assert scores.std() > 0.01  # the rows differ, so a wrong position would show


def test_a_causal_lm_checkpoint_gets_a_one_label_head(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(TINY_QWEN2)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings))
    model.save_pretrained(tmp_path)
    engine = FSDP2Engine(dict(model_path=str(tmp_path), reward_model=True, dtype="float32"))
    engine.init_model()
    assert type(engine.module).__name__ == "Qwen2ForSequenceClassification"
    assert engine.module.score.weight.shape == (1, TINY_QWEN2["hidden_size"])
    assert engine.forward(scoring_batch(4)).batch["rm_scores"].shape == (4,)


def test_a_classifier_with_two_labels_is_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    settings = dict(TINY_QWEN2)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(settings.pop("model_type"), num_labels=2, pad_token_id=0, **settings))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="2 labels"):
        FSDP2Engine(dict(model_path=str(tmp_path), reward_model=True)).init_model()


def test_value_and_reward_model_are_exclusive():
    with pytest.raises(ValueError, match="exclusive"):
        FSDP2Engine(dict(model_config=dict(TINY_QWEN2), reward_model=True, value_model=True))


def test_a_reward_model_batch_without_an_attention_mask_is_named():
    engine = FSDP2Engine(dict(model_config=dict(TINY_QWEN2), reward_model=True, dtype="float32"))
    engine.init_model()
    with pytest.raises(KeyError, match="attention_mask"):
        engine.forward(DataProto.from_dict({"input_ids": torch.ones(2, 3, dtype=torch.long)}))
