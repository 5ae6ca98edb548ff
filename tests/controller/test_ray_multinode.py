"""A worker group spanning two (simulated) machines: Ray's local multi-node cluster, one CPU per node."""

from __future__ import annotations

import pytest
import torch

from rlplat import Dispatch, RayWorkerGroup, ResourcePool, Worker, WorkerSpec, register

pytestmark = pytest.mark.slow  # starts processes or clusters: left out of `make test-fast`


class NodeWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        tensor = torch.tensor(values) * (self.rank + 1)
        dist.all_reduce(tensor)
        return tensor.tolist()


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from rlplat.controller.ray_backend import start_ray

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    start_ray(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_a_group_of_two_spans_both_nodes_and_all_reduces_across_them(two_nodes):
    import ray

    pool = ResourcePool([1, 1])
    workers = RayWorkerGroup(pool, WorkerSpec(NodeWorker), role="actor")
    try:
        nodes = workers.node_id()
        assert len(set(nodes)) == 2
        assert set(nodes) == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        # rank 0 contributes [1, 2, 3], rank 1 contributes [2, 4, 6]
        assert workers.all_reduce([1.0, 2.0, 3.0]) == [[3.0, 6.0, 9.0]] * 2
    finally:
        workers.shutdown()
        pool.release()


def test_rank_order_is_the_same_when_the_group_is_built_again(two_nodes):
    orders = []
    for _ in range(2):
        pool = ResourcePool([1, 1])
        workers = RayWorkerGroup(pool, WorkerSpec(NodeWorker), role="actor", init_distributed=False)
        try:
            orders.append(workers.node_id())
        finally:
            workers.shutdown()
            pool.release()
    assert orders[0] == orders[1]
    pool = ResourcePool([1, 1])
    try:
        addresses = [address for _, _, address, _ in pool.slots()]
    finally:
        pool.release()
    assert addresses == sorted(addresses)
