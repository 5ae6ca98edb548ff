"""The Ray backend on a local cluster: dispatch, futures through the object store, colocation, failures."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rlplat import DataProto, Dispatch, RayWorkerGroup, ResourcePool, Worker, WorkerError, WorkerSpec, register

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`


class RowWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"row": data.batch["row"], "rank": torch.full((len(data),), self.rank)},
                                   {"uid": data.non_tensor_batch["uid"]})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag_later(self, data: DataProto) -> DataProto:
        return self.tag(data)

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        import torch.distributed as dist

        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return value.item()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"reward file not found on rank {self.rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def stall(self, marker_dir: str) -> int:
        """Announce the call has started, then wait (at most a minute) for a release file that never comes."""
        Path(marker_dir, f"rank{self.rank}").touch()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not Path(marker_dir, "release").exists():
            time.sleep(0.05)
        return self.rank


def rows(count: int) -> DataProto:
    return DataProto.from_dict({"row": torch.arange(count)}, {"uid": [f"u{i}" for i in range(count)]})


@pytest.fixture(scope="module")
def four_workers(local_ray):
    pool = ResourcePool([4], cpus_per_process=1)
    workers = RayWorkerGroup(pool, WorkerSpec(RowWorker), role="rows")
    yield workers
    workers.shutdown()
    pool.release()


def test_ten_rows_over_four_ray_workers_come_back_as_exactly_those_rows(four_workers):
    result = four_workers.tag(rows(10))
    assert result.batch["row"].tolist() == list(range(10))
    assert result.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(10)]
    assert result.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]


def test_one_rank_takes_a_whole_call_and_the_others_stay_free(four_workers, tmp_path):
    stalled = four_workers.call_rank(1, "stall", str(tmp_path))  # rank 1 busy until released
    started = time.monotonic()
    while not (tmp_path / "rank1").exists():
        assert time.monotonic() - started < 30
        time.sleep(0.02)
    whole = four_workers.call_rank(2, "tag", rows(10)).get()  # rank 2 answers at once, with all ten rows
    assert whole.batch["row"].tolist() == list(range(10)) and whole.batch["rank"].tolist() == [2] * 10
    assert not (tmp_path / "rank0").exists()
    (tmp_path / "release").touch()
    assert stalled.get() == 1
    with pytest.raises(ValueError, match="rank 4 is out of range"):
        four_workers.call_rank(4, "tag", rows(2))


def test_workers_share_a_gloo_process_group(four_workers):
    assert four_workers.all_reduce_rank() == [10.0] * 4  # 1 + 2 + 3 + 4


def test_a_future_passed_on_is_fetched_by_the_workers_not_the_driver(four_workers, monkeypatch):
    import ray

    future = four_workers.tag_later(rows(10))
    first_refs = set(future.results) | set(future.pads)
    fetched_by_driver = []
    real_get = ray.get

    def recording_get(refs, *args, **kwargs):
        fetched_by_driver.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "get", recording_get)
    chained = four_workers.tag(future)
    assert chained.batch["row"].tolist() == list(range(10))
    assert fetched_by_driver and not first_refs & set(fetched_by_driver)


def test_remote_exceptions_reraise_with_role_rank_method_and_remote_traceback(four_workers):
    with pytest.raises(WorkerError) as raised:
        four_workers.fail_on_rank(2)
    error = raised.value
    assert (error.role, error.rank, error.method) == ("rows", 2, "fail_on_rank")
    assert "ValueError: reward file not found on rank 2" in str(error)
    assert "test_ray_backend.py" in error.remote_traceback and "fail_on_rank" in error.remote_traceback


def test_ray_put_maps_a_data_proto_instead_of_copying_it(local_ray):
    data = DataProto.from_dict({"input_ids": torch.arange(1 << 20).reshape(256, -1)})
    ref = local_ray.put(data)
    first, second = local_ray.get(ref), local_ray.get(ref)
    assert torch.equal(first.batch["input_ids"], data.batch["input_ids"])
    assert first.batch["input_ids"].data_ptr() == second.batch["input_ids"].data_ptr() != data.batch["input_ids"].data_ptr()


class Actor(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def describe(self):
        return ("actor", os.getpid(), self.rank)


class Reference(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def describe(self):
        return ("reference", os.getpid(), self.rank)


def test_colocated_roles_share_processes_and_keep_their_method_names(local_ray):
    pool = ResourcePool([2])
    groups = RayWorkerGroup.colocated(pool, {"actor": WorkerSpec(Actor), "ref": WorkerSpec(Reference)})
    try:
        actor, reference = groups["actor"].describe(), groups["ref"].describe()
        assert [role for role, _, _ in actor] == ["actor", "actor"]
        assert [role for role, _, _ in reference] == ["reference", "reference"]
        assert [pid for _, pid, _ in actor] == [pid for _, pid, _ in reference]
        assert len({pid for _, pid, _ in actor}) == 2
    finally:
        groups["actor"].shutdown()
        pool.release()


def test_separate_groups_share_bundles_fractionally_when_the_pool_allows_it(local_ray):
    pool = ResourcePool([2], cpus_per_process=1, max_colocate_count=2)
    first = RayWorkerGroup(pool, WorkerSpec(Actor), role="actor")
    second = RayWorkerGroup(pool, WorkerSpec(Reference), role="critic")
    try:
        pids_first = {pid for _, pid, _ in first.describe()}
        pids_second = {pid for _, pid, _ in second.describe()}
        assert len(pids_first) == len(pids_second) == 2 and not pids_first & pids_second
    finally:
        first.shutdown()
        second.shutdown()
        pool.release()


def test_a_worker_killed_mid_call_is_reported_within_ten_seconds(local_ray, tmp_path):
    pool = ResourcePool([2])
    workers = RayWorkerGroup(pool, WorkerSpec(RowWorker), role="actor")
    try:
        pids = workers.pids()
        future = workers.call_async("stall", str(tmp_path))
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank{rank}").exists() for rank in range(2)):
            assert time.monotonic() < deadline, "workers never started the call"
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerError) as raised:
            future.get()
        assert time.monotonic() - started < 10
        error = raised.value
        assert (error.role, error.rank, error.method) == ("actor", 1, "stall")
        assert "died" in error.cause
    finally:
        (tmp_path / "release").touch()
        workers.shutdown()
        pool.release()


def test_an_impossible_pool_fails_with_what_the_cluster_has(local_ray, monkeypatch):
    from rlplat.controller import ray_backend

    monkeypatch.setattr(ray_backend, "PLACEMENT_TIMEOUT_S", 2)
    with pytest.raises(RuntimeError, match="could not reserve \\[64\\] processes"):
        ResourcePool([64]).slots()


def test_the_local_cluster_listens_on_loopback_without_a_dashboard(local_ray):
    import ray._private.worker

    assert {node["NodeManagerAddress"] for node in local_ray.nodes()} == {"127.0.0.1"}
    assert local_ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert not ray._private.worker.get_dashboard_url()


def test_each_worker_process_runs_its_share_of_the_cores_in_torch_threads(four_workers, local_ray):
    import ray

    from rlplat.controller.host import cores_share

    threads = ray.get([host.torch_threads.remote() for host in four_workers.backend.hosts])
    assert threads == [cores_share(4)] * 4
    pool = ResourcePool([1], cpus_per_process=1, threads_per_process=3)
    try:
        group = RayWorkerGroup(pool, WorkerSpec(RowWorker), role="threads")
        assert ray.get(group.backend.hosts[0].torch_threads.remote()) == 3
        group.shutdown()
    finally:
        pool.release()
