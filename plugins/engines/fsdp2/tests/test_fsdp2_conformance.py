"""The fsdp2 engine passes rlplat's training-engine conformance suite (one rank, in this process), and
the suite fails an engine that breaks the contract (run in a subprocess: torch cannot be imported
twice in one process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree

import pytest

from rlplat.testing import TrainingEngineConformance
from rlplat_engine_fsdp2.engine import FSDP2Engine


class TestFSDP2Engine(TrainingEngineConformance):
    @pytest.fixture
    def engine_factory(self, tiny_config):
        return lambda: FSDP2Engine(tiny_config)

    @pytest.fixture
    def engine_batch(self, batch_of):
        return batch_of(6)


class TestFSDP2EngineWithATokenBudget(TrainingEngineConformance):
    @pytest.fixture
    def engine_factory(self, tiny_config):
        return lambda: FSDP2Engine(tiny_config, use_dynamic_bsz=True, max_token_len_per_gpu=20)

    @pytest.fixture
    def engine_batch(self, batch_of):
        return batch_of(6, seed=1)


BROKEN_ENGINE_SUITE = '''
import pytest
import torch

from rlplat import DataProto
from rlplat.testing import TrainingEngineConformance
from rlplat_engine_fsdp2.engine import FSDP2Engine

TINY = dict(model_type="qwen2", vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32)


class BrokenEngine(FSDP2Engine):
    """Sorts rows by length before its forward and never puts them back, and ignores the bucket bound."""

    def forward(self, batch, **kwargs):
        order = torch.argsort(batch.batch["attention_mask"].sum(-1), stable=True)
        return super().forward(batch.select_idxs(order), **kwargs)

    def named_weights(self, bucket_bytes=512 << 20):
        yield [pair for bucket in super().named_weights() for pair in bucket]


class TestBrokenEngine(TrainingEngineConformance):
    @pytest.fixture
    def engine_factory(self):
        return lambda: BrokenEngine(dict(model_config=TINY, lr=1e-3, dtype="float32"))

    @pytest.fixture
    def engine_batch(self):
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 4, 5, 6, 7, 0], [0, 0, 9, 8, 7, 6], [4, 4, 5, 5, 0, 0]])
        return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                                    "responses": ids[:, 3:], "response_mask": mask[:, 3:].float()})
'''


@pytest.mark.slow
def test_the_suite_fails_an_engine_that_reorders_rows_and_overfills_buckets(tmp_path):
    (tmp_path / "test_broken_engine.py").write_text(textwrap.dedent(BROKEN_ENGINE_SUITE))
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(tmp_path / "test_broken_engine.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    cases = ElementTree.parse(report).getroot().iter("testcase")
    failed = {case.get("name") for case in cases if case.find("failure") is not None or case.find("error") is not None}
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert failed == {
        "test_forward_keeps_row_order",
        "test_named_weights_respect_the_bucket_bound",
        "test_export_hf_loads_and_predicts_what_the_engine_predicts",
    }, run.stdout[-3000:]
