"""The megatron engine passes rlplat's training-engine conformance suite (one rank, in this process, on
CPU through the scoped substitutes). Token-budget micro-batches are checked against TP=1 in
test_megatron_numerics.py."""

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
