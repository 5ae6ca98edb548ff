"""The megatron engine passes rlplat's training-engine conformance suite (one rank, in this process, on
CPU through the scoped substitutes), with fixed-size and token-budget micro-batches."""

from __future__ import annotations

import pytest

from rlplat.testing import TrainingEngineConformance
from rlplat_engine_megatron.engine import MegatronEngine


class TestMegatronEngine(TrainingEngineConformance):
    @pytest.fixture
    def engine_factory(self, tiny_config):
        return lambda: MegatronEngine(tiny_config)

    @pytest.fixture
    def engine_batch(self, batch_of):
        return batch_of(6)


@pytest.mark.slow
class TestMegatronEngineWithATokenBudget(TrainingEngineConformance):
    @pytest.fixture
    def engine_factory(self, tiny_config):
        return lambda: MegatronEngine(tiny_config, use_dynamic_bsz=True, max_token_len_per_gpu=20)

    @pytest.fixture
    def engine_batch(self, batch_of):
        return batch_of(6, seed=1)
