"""The built-in demo's shipped assets: a tiny model with signal on its task, the task data, the reward."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

import rlplat_demo as demo
from rlplat.data import RLDataset
from rlplat.scorers import exact_match
from rlplat.testing import RewardScorerConformance, ScorerCase
from rlplat.testing.tiny_models import arithmetic_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo.model_dir())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo.model_dir()).eval()


def pairs_of(path):
    return [tuple(map(int, row[0]["content"].rstrip("=").split("+"))) for row in pq.read_table(path)["prompt"].to_pylist()]


def test_assets_total_under_10_mb():
    total = sum(path.stat().st_size for path in demo.assets_dir().rglob("*") if path.is_file())
    assert total < 10_000_000, total


def test_missing_assets_say_how_to_build_them(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "__file__", str(tmp_path / "__init__.py"))
    with pytest.raises(demo.DemoAssetsMissing, match="python -m rlplat_demo.build"):
        demo.model_dir()


def test_the_shipped_model_is_a_small_qwen2_with_a_16_token_vocabulary(model, tokenizer):
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(parameter.numel() for parameter in model.parameters()) < 1_000_000
    assert len(tokenizer) == 16 and model.config.vocab_size == 16


def test_the_tokenizer_prepends_bos_and_round_trips_a_prompt(tokenizer):
    ids = tokenizer("12+34=")["input_ids"]
    assert ids == [1, 5, 6, 14, 7, 8, 15]  # [BOS] then one id per character: digits at 4..13, "+" 14, "=" 15
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34="


def test_the_shipped_tokenizer_encodes_every_prompt_as_the_arithmetic_tokenizer_does(tokenizer):
    # Loaded next to a qwen2 config.json, transformers 5 may rebuild the tokenizer with Qwen2's own
    # pre-tokenizer; the demo's prompts must still get the ids the model was trained on.
    files = [str(demo.train_file()), str(demo.val_file())]
    shipped, built = RLDataset(files, tokenizer), RLDataset(files, arithmetic_tokenizer())
    assert shipped.fingerprint == built.fingerprint


def test_the_splits_load_in_the_data_schema_and_validation_is_held_out(tokenizer):
    train = RLDataset(str(demo.train_file()), tokenizer)
    val = RLDataset(str(demo.val_file()), tokenizer, config_key="data.val_files")
    assert len(val) == 200 and len(train) >= 2048
    row = val[0]
    assert row["data_source"] == "arith"
    a, b = map(int, row["raw_prompt"][0]["content"].rstrip("=").split("+"))
    assert row["reward_model"]["ground_truth"] == str(a + b)
    assert not set(pairs_of(demo.train_file())) & set(pairs_of(demo.val_file()))


def test_the_shipped_model_has_signal_but_has_not_solved_the_task(model, tokenizer):
    import torch

    pairs = pairs_of(demo.val_file())[:50]
    prompts = tokenizer([f"{a}+{b}=" for a, b in pairs], return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model.generate(**prompts, do_sample=False, max_new_tokens=4, eos_token_id=2, pad_token_id=0)
    answers = tokenizer.batch_decode(output[:, prompts["input_ids"].shape[1]:], skip_special_tokens=True)
    accuracy = sum(exact_match("arith", answer, str(a + b))["acc"] for answer, (a, b) in zip(answers, pairs)) / 50
    assert 0.15 <= accuracy <= 0.6, accuracy


def test_exact_match_rewards_only_the_exact_answer():
    assert exact_match("arith", " 46\n", "46") == {"score": 1.0, "acc": True}
    assert exact_match("arith", "47", "46") == {"score": 0.0, "acc": False}
    assert exact_match("arith", "461", "46") == {"score": 0.0, "acc": False}
    assert exact_match("arith", "", "46") == {"score": 0.0, "acc": False}


class TestExactMatchConformance(RewardScorerConformance):
    @pytest.fixture
    def scorer(self):
        return exact_match

    @pytest.fixture
    def scorer_cases(self):
        return [ScorerCase("arith", "46", "46", None, 1.0), ScorerCase("arith", "45", "46", {"split": "val"}, 0.0)]
