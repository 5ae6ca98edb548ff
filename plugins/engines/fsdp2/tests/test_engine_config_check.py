"""The checks of the keys every engine config shares (``rlplat.kits.engine.engine_config_problems``), which the
fsdp2 engine's config runs before its own: each problem named by its key, all of them in one error."""

from __future__ import annotations

import dataclasses

import pytest

from rlplat.contracts.engine import EngineBuildConfig
from rlplat.kits.engine import engine_config_problems
from rlplat_engine_fsdp2.config import FSDP2EngineConfig

TINY = {"model_type": "qwen2", "vocab_size": 16}


@dataclasses.dataclass
class SharedKeys(EngineBuildConfig):
    """An engine config with nothing of its own but the keys the shared check reads besides the build keys."""

    model_config: dict | None = None
    dtype: str = "auto"
    logprob_chunk_size: int = 4096
    forward_micro_batch_size_per_gpu: int | None = None


def test_a_valid_config_has_no_problems():
    assert engine_config_problems(SharedKeys(model_config=TINY), ("auto", "float32")) == []


def test_each_shared_key_is_named_with_its_value():
    config = SharedKeys(model_path="/models/x", model_config={"vocab_size": 16}, dtype="int8", lr_scheduler_type="linear",
                        betas=[0.9], ppo_epochs=0, ppo_mini_batch_size=0, grad_clip=0.0)
    assert engine_config_problems(config, ("auto", "float32")) == [
        "give exactly one of model_path (a local Hugging Face directory) and model_config (a config dict)",
        "model_config needs a 'model_type' key (e.g. 'qwen2')",
        "dtype 'int8' is not one of ['auto', 'float32']",
        "lr_scheduler_type 'linear' is not one of ['constant', 'cosine']",
        "betas needs two values, got [0.9]",
        "ppo_epochs must be >= 1, got 0",
        "ppo_mini_batch_size must be >= 1 or None, got 0",
        "grad_clip must be positive or None, got 0.0",
    ]


def test_a_cosine_schedule_needs_steps_after_the_warm_up():
    config = SharedKeys(model_config=TINY, lr_scheduler_type="cosine", lr_warmup_steps=10, total_training_steps=10)
    assert engine_config_problems(config, ("auto",)) == [
        "lr_scheduler_type 'cosine' needs total_training_steps > lr_warmup_steps, got 10 and 10"]


def test_the_engines_own_counts_are_checked_like_the_shared_ones():
    config = SharedKeys(model_config=TINY, logprob_chunk_size=0, forward_micro_batch_size_per_gpu=0)
    assert engine_config_problems(config, ("auto",), counts=("logprob_chunk_size",),
                                  optional_counts=("forward_micro_batch_size_per_gpu",)) == [
        "logprob_chunk_size must be >= 1, got 0", "forward_micro_batch_size_per_gpu must be >= 1 or None, got 0"]


def test_the_fsdp2_config_lists_shared_and_own_problems_in_one_error_naming_the_engine():
    with pytest.raises(ValueError) as raised:
        FSDP2EngineConfig(model_config=TINY, betas=[0.9], reduce_dtype="auto", ulysses_sequence_parallel_size=0)
    message = str(raised.value)
    assert message.startswith("invalid fsdp2 engine config: ")
    for problem in ("betas needs two values, got [0.9]", "ulysses_sequence_parallel_size must be >= 1, got 0",
                    "reduce_dtype 'auto' is not one of ['float32', 'bfloat16', 'float16']"):
        assert problem in message
