"""Batch methods of the role workers dispatch by the engine's mesh: with tensor parallelism (TP=2 on
4 workers) the two ranks of a data-parallel group get the same rows and one of them answers.

The fake engine below is a real plugin distribution on disk, found by the Ray workers through
PYTHONPATH, so the workers build it through the registry as they would any engine.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlplat import DataProto, RayWorkerGroup, ResourcePool, WorkerSpec
from rlplat.controller.dispatch import Layout
from rlplat.workers.actor_rollout_ref import ActorRolloutRefWorker

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`

FAKE_ENGINE = '''
import torch
import torch.distributed as dist

from rlplat.contracts.engine import DataParallelInfo, TrainingEngine
from rlplat.protocol import DataProto

TP = 2


class FakeTensorParallelEngine(TrainingEngine):
    """Reports TP=2: ranks (0, 1) form data-parallel group 0, (2, 3) group 1; TP rank 0 answers.
    ``forward`` checks that its TP partner got the very same rows."""

    def __init__(self, config, **kwargs):
        self.config = dict(config)
        self.rows_trained = []

    def init_model(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pairs = [dist.new_group([first, first + 1]) for first in range(0, self.world, TP)]
        self.pair = self.pairs[self.rank // TP]

    def data_parallel_info(self):
        return DataParallelInfo(self.rank // TP, self.world // TP, self.rank % TP == 0)

    def same_rows_as_partner(self, row_ids):
        gathered = [torch.zeros_like(row_ids) for _ in range(TP)]
        dist.all_gather(gathered, row_ids, group=self.pair)
        if not torch.equal(gathered[0], gathered[1]):
            raise AssertionError(f"TP ranks of one group got different rows: {gathered}")

    def forward(self, batch, *, temperature=1.0, calculate_entropy=False):
        row_ids = batch.batch["row_id"]
        self.same_rows_as_partner(row_ids)
        width = batch.batch["responses"].shape[1]
        log_probs = row_ids.float().unsqueeze(-1).expand(len(batch), width).clone()
        return DataProto.from_dict({"log_probs": log_probs, "entropy": torch.full_like(log_probs, float(self.rank))})

    def train_batch(self, batch, loss_fn):
        self.same_rows_as_partner(batch.batch["row_id"])
        self.rows_trained.append(len(batch))
        return {"grad_norm": 0.0, "lr": 0.0, "rows_seen": float(len(batch))}

    def named_weights(self, bucket_bytes=512 << 20):
        yield []

    def save(self, path):
        pass

    def load(self, path):
        pass

    def export_hf(self, path):
        pass

    def offload(self):
        pass

    def onload(self):
        pass
'''

PLUGIN = '''
import rlplat


@rlplat.hookimpl
def register_engines(register):
    register("fake_tp", "fake_tp_engine.engine:FakeTensorParallelEngine", description="TP=2 test engine")
'''


@pytest.fixture(scope="module")
def ray_with_fake_engine(tmp_path_factory, write_distribution_to):
    """A local Ray cluster whose workers see the fake engine's distribution (PYTHONPATH)."""
    import ray

    from rlplat.controller.ray_backend import start_ray

    site = tmp_path_factory.mktemp("site")
    write_distribution_to(site, "fake-tp-engine", "0.1", {"fake-tp": "fake_tp_engine.plugin"},
                       {"fake_tp_engine.__init__": "", "fake_tp_engine.engine": FAKE_ENGINE, "fake_tp_engine.plugin": PLUGIN})
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), previous]))
    if ray.is_initialized():
        ray.shutdown()
    start_ray(num_cpus=8)
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


@pytest.fixture(scope="module")
def tp_group(ray_with_fake_engine):
    config = {"roles": ["actor"], "engine": "fake_tp", "engine_config": {}, "algorithm": "grpo",
              "sampling": {"n": 1, "max_new_tokens": 2}}
    pool = ResourcePool([4], cpus_per_process=0.5)
    group = RayWorkerGroup(pool, WorkerSpec(ActorRolloutRefWorker, config), role="actor")
    group.init_model()
    yield group
    group.shutdown()
    pool.release()


def batch_of(rows: int) -> DataProto:
    return DataProto.from_dict({
        "row_id": torch.arange(rows), "responses": torch.zeros(rows, 3, dtype=torch.long),
        "response_mask": torch.ones(rows, 3), "input_ids": torch.zeros(rows, 5, dtype=torch.long),
        "attention_mask": torch.ones(rows, 5, dtype=torch.long), "position_ids": torch.arange(5).repeat(rows, 1),
        "old_log_probs": torch.zeros(rows, 3), "advantages": torch.zeros(rows, 3),
    })


def test_the_workers_declare_the_engines_mesh_after_init_model(tp_group):
    assert tp_group.layout() == Layout(4, (0, 0, 1, 1), 2, (True, False, True, False))


@pytest.mark.parametrize("rows", [10, 9])
def test_each_data_parallel_group_gets_one_shard_and_one_rank_answers(tp_group, rows):
    # 10 rows: 5 per group; 9 rows: padded to 10 over the two groups, the padding row dropped again.
    output = tp_group.compute_log_prob(batch_of(rows))
    assert len(output) == rows
    assert output.batch["old_log_probs"][:, 0].tolist() == [float(row) for row in range(rows)]
    # the answering ranks are TP rank 0 of each group: global ranks 0 and 2
    assert sorted(set(output.batch["entropys"][:, 0].tolist())) == [0.0, 2.0]


def test_an_update_goes_to_both_ranks_of_each_group_with_half_the_rows(tp_group):
    output = tp_group.update_actor(batch_of(8))
    assert output.meta_info["metrics"]["actor/rows_seen"] == [4.0, 4.0]


def test_generation_is_not_mesh_dispatched_and_needs_the_rollout_role(tp_group):
    from rlplat import WorkerError

    with pytest.raises(WorkerError, match="needs the rollout role"):
        tp_group.generate_sequences(batch_of(4))
