"""Measured tensor memory on CPU, the counterpart of CUDA's ``max_memory_allocated``.

CPU has no caching allocator with statistics. PyTorch's CPU allocator reports every allocation and
every free to the profiler when memory profiling is on (``profile_memory=True``): each ``[memory]``
event carries the bytes of one tensor storage (negative for a free) and its time. The running sum of
those events is the bytes of live tensor storage allocated since profiling started, which is what
``torch.cuda.memory_allocated()`` counts on a GPU (live blocks, without the allocator's cached free
blocks; CUDA rounds each block up to 512 bytes, negligible for tensors of this size). Storages that
existed before the meter started are not seen (their frees are not reported either), so a
measurement starts before the engine or rollout is built. The profiler sees the allocations and frees
of the measuring thread only; :class:`LiveStorageMeter` counts the storages themselves and sees frees
in any thread (a process group's collectives).

:class:`TensorMemoryMeter` records one run; :meth:`TensorMemoryMeter.phase` marks a span of it, and
:meth:`TensorMemoryMeter.peaks` gives the peak live bytes within each span.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

PHASE_PREFIX = "rlplat.plan.phase:"


class TensorMemoryMeter:
    """``with TensorMemoryMeter() as meter:`` ... ``with meter.phase("update"):`` ...; then
    ``meter.peaks()`` -> ``{phase: peak live tensor bytes}`` and ``meter.live_bytes()`` at the end."""

    def __init__(self) -> None:
        self.profiler = None
        self.events: list[tuple[int, int]] = []
        self.spans: dict[str, list[tuple[int, int]]] = {}

    def __enter__(self) -> "TensorMemoryMeter":
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.profiler.__exit__(*exc_info)
        from torch._C._autograd import DeviceType

        for event in self.profiler.profiler.kineto_results.events():
            name = event.name()
            if name == "[memory]" and event.device_type() == DeviceType.CPU and event.nbytes():
                self.events.append((event.start_ns(), int(event.nbytes())))
            elif name.startswith(PHASE_PREFIX):
                self.spans.setdefault(name[len(PHASE_PREFIX):], []).append((event.start_ns(), event.end_ns()))
        self.events.sort()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function

        with record_function(PHASE_PREFIX + name):
            yield

    def peaks(self) -> dict[str, int]:
        """Peak live tensor bytes within each marked phase (every span of that name)."""
        peaks = {name: 0 for name in self.spans}
        live = 0
        for time, nbytes in self.events:
            live += nbytes
            for name, spans in self.spans.items():
                if any(start <= time <= end for start, end in spans):
                    peaks[name] = max(peaks[name], live)
        return peaks

    def live_bytes(self) -> int:
        """Live tensor bytes at the end of the recording."""
        return sum(nbytes for _, nbytes in self.events)


class LiveStorageMeter:
    """Live tensor storage bytes counted from the storages themselves, whichever thread frees them.

    :class:`TensorMemoryMeter` sees the frees of the thread that measures only: a collective's buffer that
    gloo's worker thread releases would stay live for ever. This meter follows every storage an operator
    returns in the measuring thread (a ``TorchDispatchMode``; the local tensors of FSDP2's DTensors too),
    reads each one's current size after every operator (FSDP2 frees and re-allocates gathered
    parameters by resizing their storage) and forgets a storage when it is freed, in any thread (a
    weak-reference finalizer). It misses what an operator allocates and frees inside itself, so its peaks
    sit a little below the allocator's."""

    def __init__(self) -> None:
        import threading
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self
        self.storages: dict[int, "weakref.ref"] = {}
        self.lock = threading.Lock()
        self.current: list[str] = []
        self.results: dict[str, int] = {}
        self.last = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                output = func(*args, **(kwargs or {}))
                meter.observe(output)
                return output

        self.mode = Mode()

    def observe(self, output) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(output):
            if not isinstance(leaf, torch.Tensor):
                continue
            leaf = getattr(leaf, "_local_tensor", leaf)
            if leaf.device.type == "meta":
                continue
            storage = leaf.untyped_storage()
            key = id(storage)
            with self.lock:
                if key not in self.storages:
                    self.storages[key] = weakref.ref(storage)
                    weakref.finalize(storage, self.forget, key)
        live = self.live_bytes()
        for name in self.current:
            self.results[name] = max(self.results.get(name, 0), live)

    def forget(self, key: int) -> None:
        with self.lock:
            self.storages.pop(key, None)

    def live_bytes(self) -> int:
        with self.lock:
            alive = [reference() for reference in self.storages.values()]
        return sum(storage.nbytes() for storage in alive if storage is not None)

    def __enter__(self) -> "LiveStorageMeter":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.mode.__exit__(*exc_info)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current.append(name)
        self.results[name] = max(self.results.get(name, 0), self.live_bytes())
        try:
            yield
        finally:
            self.current.remove(name)

    def peaks(self) -> dict[str, int]:
        return dict(self.results)


# -- measuring an engine or a rollout in phases, for comparing with the plan ----------------------------

def synthetic_batch(rows: int, prompt_length: int, response_length: int, vocab_size: int, seed: int = 0):
    """Full-length rows (no padding: the plan's worst case) with ``advantages`` for a policy-gradient loss."""
    import torch

    from rlplat.protocol import DataProto

    generator = torch.Generator().manual_seed(seed)
    length = prompt_length + response_length
    input_ids = torch.randint(0, vocab_size, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
        "responses": input_ids[:, prompt_length:], "response_mask": mask[:, prompt_length:].float(),
        "advantages": torch.randn(rows, response_length, generator=generator),
    })


class PolicyGradientLoss:
    """``-sum(advantages x log_probs x mask) / global_token_count``: what an actor's loss keeps alive."""

    def __call__(self, outputs, micro_batch):
        batch = micro_batch.batch
        loss = -(batch["advantages"] * outputs["log_probs"] * batch["response_mask"]).sum() / micro_batch.meta_info["global_token_count"]
        return loss, {}


class CudaPeaks:
    """The same interface as :class:`TensorMemoryMeter` over CUDA's allocator statistics: like it, a peak
    counts the bytes allocated since the meter was entered (what an earlier measurement in the process left
    allocated, such as an engine its reference cycles keep alive until a collection, is not counted)."""

    def __init__(self) -> None:
        self.results: dict[str, int] = {}
        self.base = 0

    def __enter__(self) -> "CudaPeaks":
        import gc

        import torch

        gc.collect()
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        self.results[name] = max(self.results.get(name, 0), torch.cuda.max_memory_allocated() - self.base)

    def peaks(self) -> dict[str, int]:
        return dict(self.results)


def cpu_meter():
    """A CPU meter: :class:`LiveStorageMeter` in a process group (collectives free buffers in other
    threads), :class:`TensorMemoryMeter` (the allocator's own accounting) otherwise."""
    import torch

    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    return LiveStorageMeter() if distributed else TensorMemoryMeter()


def measure_engine(engine_name: str, config: dict, rows: int, prompt_length: int, response_length: int) -> dict[str, int]:
    """Build the engine, run an update (the optimizer states exist from then on), then measure a forward
    (``forward``) and a second update (``update``): the steady state of a run's step. ``rows`` per process."""
    import torch

    from rlplat import registry

    cuda = torch.cuda.is_available()
    vocab = int((config.get("model_config") or {}).get("vocab_size", 16))
    data = synthetic_batch(rows, prompt_length, response_length, vocab)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    data.meta_info["ppo_mini_batch_size"] = rows * world
    with (CudaPeaks() if cuda else cpu_meter()) as meter:
        engine = registry.get("engine", engine_name)(config)
        engine.init_model()
        engine.train_batch(data, PolicyGradientLoss())
        with meter.phase("forward"):
            engine.forward(data)
        with meter.phase("update"):
            engine.train_batch(data, PolicyGradientLoss())
    return meter.peaks()


def measure_rollout(rollout_name: str, config: dict, rows: int, prompt_length: int, response_length: int) -> dict[str, int]:
    """Build the rollout and measure one generation of ``rows`` prompts (``generate``)."""
    import torch

    from rlplat import registry
    from rlplat.contracts.rollout import SamplingParams

    vocab = int((config.get("model_config") or {}).get("vocab_size", 16))
    prompts = synthetic_batch(rows, prompt_length, 0, vocab).select(["input_ids", "attention_mask", "position_ids"])
    with (CudaPeaks() if torch.cuda.is_available() else cpu_meter()) as meter:
        rollout = registry.get("rollout", rollout_name)(config)
        with meter.phase("generate"):
            rollout.generate(prompts, SamplingParams(max_new_tokens=response_length))
    return meter.peaks()


def main(argv: list[str] | None = None) -> None:
    """``python -m rlplat.testing.memory SPECS_JSON``: measure each spec (``{"kind": "engine"|"rollout",
    "name", "config", "rows", "prompt_length", "response_length"}``) in this process and print one JSON
    list of peaks. Under ``torchrun``-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) every rank joins one gloo group first, and each prints its own line."""
    import gc
    import json
    import os
    import sys

    import torch

    specs = json.loads((argv or sys.argv[1:])[0])
    threads = os.environ.get("RLPLAT_MEASURE_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    results = []
    for spec in specs:
        measure = measure_engine if spec["kind"] == "engine" else measure_rollout
        results.append(measure(spec["name"], spec["config"], spec["rows"], spec["prompt_length"], spec["response_length"]))
        gc.collect()  # what the spec built goes before the next one is measured
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps(results), flush=True)
    if distributed:
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort at interpreter exit after a clean run (DESIGN.md)


if __name__ == "__main__":
    main()
