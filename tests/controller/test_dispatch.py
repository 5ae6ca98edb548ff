"""Dispatch modes and padding, run on real WorkerHosts in this process (no Ray, no collectives)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rlplat import DataProto, Dispatch, LocalWorkerGroup, Worker, WorkerError, WorkerSpec, register
from rlplat.controller.dispatch import DataFuture, Layout, RankCall, padding_in_parts
from rlplat.controller.host import WorkerHost
from rlplat.controller.worker_group import WorkerGroup, dispatch_mode


class SequentialBackend:
    """``world_size`` WorkerHosts in this process, called one after another (enough for dispatch logic)."""

    def __init__(self, world_size: int):
        self.hosts = [WorkerHost(rank, world_size) for rank in range(world_size)]

    def submit(self, role, method, calls: list[RankCall], data_parallel):
        results, pads = [], []
        for call in calls:
            output = self.hosts[call.rank].call(role, method, call.args, call.kwargs, call.pad_rows if data_parallel else None)
            if data_parallel:
                output, pad = output
                pads.append(pad)
            results.append(output)
        return results, pads

    def wait(self, values, calls, label):
        return list(values)

    def dispatch_infos(self, role):
        return [host.dispatch_info(role) for host in self.hosts]

    def shutdown(self):
        pass


class RowWorker(Worker):
    """Tags each row with the rank that computed it; ``tp`` > 1 declares a tensor-parallel mesh."""

    def __init__(self, tp: int = 1):
        super().__init__()
        self.set_dispatch_info(self.rank // tp, self.world_size // tp, collect=self.rank % tp == 0)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"row": data.batch["row"], "rank": torch.full((len(data),), self.rank)})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag_later(self, data: DataProto) -> DataProto:
        return self.tag(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def sample_twice(self, data: DataProto) -> DataProto:
        return data.repeat(2, interleave=True)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def drop_a_row(self, data: DataProto) -> DataProto:
        return data[1:]

    @register(Dispatch.DP_COMPUTE_PROTO)
    def weights(self, data: DataProto) -> DataProto:
        """Each row's weight once padding is discounted, as a training method sees it."""
        from rlplat.controller.worker import without_padding_weight

        return DataProto.from_dict({"weight": without_padding_weight(data, self.padding_rows).batch["response_mask"][:, 0]})

    @register(Dispatch.DP_MESH)
    def tag_mesh(self, data: DataProto) -> DataProto:
        return self.tag(data)

    @register(Dispatch.ONE_TO_ALL)
    def rank_plus(self, value: int) -> int:
        return self.rank + value

    @register(Dispatch.ALL_TO_ALL)
    def echo(self, value):
        return (self.rank, value)

    @register(Dispatch.RANK_ZERO)
    def only_rank_zero(self) -> int:
        return self.rank


def group(world_size: int, tp: int = 1) -> WorkerGroup:
    backend = SequentialBackend(world_size)
    for host in backend.hosts:
        host.create("rows", WorkerSpec(RowWorker, tp))
    return WorkerGroup("rows", RowWorker, backend, world_size)


def rows(count: int) -> DataProto:
    return DataProto.from_dict({"row": torch.arange(count)}, {"uid": [f"u{i}" for i in range(count)]})


def test_ten_rows_over_four_workers_come_back_as_exactly_those_rows_in_order():
    result = group(4).tag(rows(10))
    assert result.batch["row"].tolist() == list(range(10))
    assert result.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]


def test_workers_are_told_how_many_of_their_rows_are_padding():
    workers = group(4)
    data = DataProto.from_dict({"response_mask": torch.ones(5, 2, dtype=torch.long)})
    # 5 rows padded to 8: ranks 2 and 3 hold 1 and 2 padding rows, which get weight 0 there
    seen = [host.call("rows", "weights", (part,), {}, pad)[0] for host, part, pad in
            zip(workers.backend.hosts, data.pad_to_divisor(4)[0].chunk(4), [0, 0, 1, 2])]
    assert [p.batch["weight"].tolist() for p in seen] == [[1, 1], [1, 1], [1, 0], [0, 0]]
    assert workers.weights(data).batch["weight"].tolist() == [1, 1, 1, 1, 1]
    assert all(host.workers["rows"].padding_rows == 0 for host in workers.backend.hosts)


def test_padding_counts_per_part():
    # 10 rows padded to 12 and cut in 4 parts of 3: only the last part holds padding (2 rows)
    assert padding_in_parts(10, 12, 4) == [0, 0, 0, 2]
    # 5 rows padded to 8 over 4 parts of 2: parts 2 and 3 hold 1 and 2 padding rows
    assert padding_in_parts(5, 8, 4) == [0, 0, 1, 2]


def test_outputs_with_several_rows_per_input_row_lose_exactly_their_padding():
    result = group(4).sample_twice(rows(5))
    assert result.batch["row"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert result.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2", "u3", "u3", "u4", "u4"]


def test_a_method_that_changes_row_count_unevenly_is_an_error_when_padding_must_go():
    with pytest.raises(ValueError, match="whole number of rows per input row"):
        group(4).drop_a_row(rows(5))


def test_a_future_feeds_the_next_call_shard_for_shard():
    workers = group(4)
    future = workers.tag_later(rows(10))
    assert isinstance(future, DataFuture)
    chained = workers.tag(future)
    assert chained.batch["row"].tolist() == list(range(10))


def test_a_future_feeds_a_group_of_another_size():
    future = group(4).tag_later(rows(10))
    result = group(3).tag(future)
    assert result.batch["row"].tolist() == list(range(10))
    assert result.batch["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_mesh_mode_splits_over_data_parallel_ranks_and_collects_one_output_per_group():
    workers = group(4, tp=2)
    assert workers.layout() == Layout(4, (0, 0, 1, 1), 2, (True, False, True, False))
    result = workers.tag_mesh(rows(5))
    assert result.batch["row"].tolist() == [0, 1, 2, 3, 4]
    assert result.batch["rank"].tolist() == [0, 0, 0, 2, 2]


def test_one_to_all_all_to_all_and_rank_zero():
    workers = group(3)
    assert workers.rank_plus(10) == [10, 11, 12]
    assert workers.echo(["a", "b", "c"]) == [(0, "a"), (1, "b"), (2, "c")]
    assert workers.only_rank_zero() == 0
    with pytest.raises(ValueError, match="one value per worker \\(3\\); argument 0 is list of length 2"):
        workers.echo(["a", "b"])


def test_dispatch_modes_come_from_the_registry_and_unknown_ones_are_explained():
    assert type(dispatch_mode("DP_COMPUTE_PROTO")).__name__ == "DataParallelProto"
    with pytest.raises(LookupError, match="Did you mean 'DP_MESH'"):
        dispatch_mode("DP_MESSH")


def test_a_plugin_dispatch_mode_is_usable_by_name(register_temporary_plugin):
    from rlplat import hookimpl
    from rlplat.controller.dispatch import CallPlan

    class LastRankOnly:
        name = "LAST_RANK"

        def plan(self, layout, args, kwargs, execute=None):
            return CallPlan([RankCall(layout.world_size - 1, args, kwargs)], lambda outputs: outputs[0])

    class Plugin:
        @hookimpl
        def register_dispatch_modes(self, register):
            register("LAST_RANK", LastRankOnly)

    register_temporary_plugin(Plugin(), name="last-rank-mode")

    class LastWorker(RowWorker):
        @register("LAST_RANK")
        def whoami(self):
            return self.rank

    backend = SequentialBackend(3)
    for host in backend.hosts:
        host.create("last", WorkerSpec(LastWorker))
    assert WorkerGroup("last", LastWorker, backend, 3).whoami() == 2


class Roles:
    class Actor(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def name(self):
            return ("actor", threading.get_ident())

        @register(Dispatch.ONE_TO_ALL)
        def fail(self):
            raise KeyError("missing key 'responses' in batch")

    class Reference(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def name(self):
            return ("reference", threading.get_ident())


def test_in_process_backend_runs_colocated_roles_in_the_callers_thread():
    groups = LocalWorkerGroup.colocated({"actor": WorkerSpec(Roles.Actor), "ref": WorkerSpec(Roles.Reference)})
    try:
        # same thread as the test: breakpoint() inside a worker method stops right here
        assert groups["actor"].name() == [("actor", threading.get_ident())]
        assert groups["ref"].name() == [("reference", threading.get_ident())]
    finally:
        groups["actor"].shutdown()


def test_in_process_worker_errors_name_role_rank_method_and_keep_the_traceback():
    workers = LocalWorkerGroup(WorkerSpec(Roles.Actor), role="actor", init_distributed=False)
    with pytest.raises(WorkerError) as raised:
        workers.fail()
    error = raised.value
    assert (error.role, error.rank, error.method) == ("actor", 0, "fail")
    assert "KeyError" in error.cause and "missing key 'responses'" in str(error)
    assert 'raise KeyError("missing key' in error.remote_traceback


def test_the_host_closes_its_workers_before_its_process_group_and_a_failing_close_stops_no_other(capsys, monkeypatch):
    from rlplat.controller.host import WorkerHost

    monkeypatch.setenv("RANK", os.environ.get("RANK", "0"))  # the host sets RANK/WORLD_SIZE/LOCAL_RANK; monkeypatch restores them
    monkeypatch.setenv("WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    monkeypatch.setenv("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
    closed = []

    class Closing:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise RuntimeError("engine already gone")

    host = WorkerHost(rank=0, world_size=1)
    host.workers = {"rollout": Closing("rollout", fails=True), "critic": Closing("critic"), "plain": object()}
    host.shutdown()
    assert closed == ["rollout", "critic"]
    assert "closing the rollout worker failed: RuntimeError: engine already gone" in capsys.readouterr().err
