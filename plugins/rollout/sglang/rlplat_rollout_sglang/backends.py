"""The two ways the ``sglang`` rollout reaches SGLang: an ``sglang.Engine`` in this process, or an SGLang
HTTP server. Both offer the same methods: batched generation, weight updates from tensors, release and
resume of tagged GPU memory, a radix-cache flush, one LoRA adapter loaded from tensors and used by every
request (``load_adapter``, ``drop_adapter``), and close.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Mapping, Sequence

import torch

from rlplat.kits.rollout_batch import RequestBatcher
from rlplat.kits.rollout_server import ServerError, request_json
from rlplat_rollout_sglang.config import SGLangRolloutConfig
from rlplat_rollout_sglang.translate import generate_request, server_argv

# GET /health answers 200 once the server left its "Starting" state (http_server.health_generate).
HEALTH_PATH = "/health"


def share_by_device_uuid(named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Before CUDA tensors are pickled: make them carry their GPU's UUID instead of its index (SGLang's
    own patch of torch's reductions), so that a process with another ``CUDA_VISIBLE_DEVICES`` finds the
    same GPU; SGLang's scheduler applies the matching unpickling side itself.

    SGLang's patch is process-wide and breaks the pickling of CPU tensors (their reduction has no
    device argument), which this trainer process still needs (multiprocessing queues, data loaders):
    the patched reduction is kept for CUDA tensors only."""
    if not any(tensor.is_cuda for _, tensor in named_tensors):
        return
    from torch.multiprocessing import reductions

    if getattr(reductions.reduce_tensor, "rlplat_cuda_only", False):
        return
    from sglang.srt.utils.patch_torch import _reduce_tensor_modified, monkey_patch_torch_reductions

    monkey_patch_torch_reductions()

    def reduce_tensor(tensor):
        return _reduce_tensor_modified(tensor) if tensor.is_cuda else reductions._reduce_tensor_original(tensor)

    reduce_tensor.rlplat_cuda_only = True
    reductions.reduce_tensor = reduce_tensor
    reductions.init_reductions()


def serialized_named_tensors(named_tensors: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], tp_size: int) -> list[str]:
    """``serialized_named_tensors`` of ``UpdateWeightsFromTensorReqInput`` (a list of pairs) or
    ``LoadLoRAAdapterFromTensorsReqInput`` (a dict) for HTTP: pickled by SGLang's
    ``MultiprocessingSerializer`` (handles, not the data: CUDA IPC handles, or the shared-memory files of CPU
    tensors) once per TP rank, each as base64 text because JSON has no bytes (the routes decode it with
    ``Base64Bytes``).

    CPU tensors are pickled with torch's ``file_system`` sharing strategy: with the default
    (``file_descriptor``) the server's scheduler cannot open them (``AuthenticationError: digest sent was
    rejected``) and exits. Pickling moves a CPU tensor's storage into shared memory, so CPU tensors are sent
    as copies of their own: never a training engine's live parameter."""
    from sglang.srt.utils import MultiprocessingSerializer

    pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    share_by_device_uuid(pairs)
    if not any(not tensor.is_cuda for _, tensor in pairs):
        return [MultiprocessingSerializer.serialize(named_tensors, output_str=True) for _ in range(tp_size)]
    copies = [(name, tensor if tensor.is_cuda else tensor.clone()) for name, tensor in pairs]
    payload = dict(copies) if isinstance(named_tensors, Mapping) else copies
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(tp_size)]
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


class InProcessBackend:
    """An ``sglang.Engine`` owned by this worker (its scheduler and detokenizer are child processes).
    ``Engine`` runs its own event loop on the calling thread, so calls are serialised by a lock and
    concurrent :meth:`generate_one` calls (agent loops) are gathered into one ``Engine.generate`` batch."""

    def __init__(self, config: SGLangRolloutConfig, engine_kwargs: Mapping[str, Any]):
        import multiprocessing

        import sglang

        self.config = config
        kwargs = dict(engine_kwargs)
        if kwargs.get("device") != "cpu" and torch.cuda.is_available():
            kwargs.setdefault("base_gpu_id", torch.cuda.current_device())  # the worker's GPU, not always 0
        # Engine() sets NCCL and CUDA variables and the spawn start method for its own processes; the
        # training engine's later NCCL groups and data loaders must not inherit them
        environment, start_method = dict(os.environ), multiprocessing.get_start_method(allow_none=True)
        try:
            self.engine = sglang.Engine(**kwargs)
        finally:
            for name in {*os.environ, *environment}:
                if name.startswith("NCCL_") or name == "CUDA_DEVICE_MAX_CONNECTIONS":
                    if name in environment:
                        os.environ[name] = environment[name]
                    else:
                        os.environ.pop(name, None)
            if start_method is not None:
                multiprocessing.set_start_method(start_method, force=True)
        self.owner_pid = os.getpid()
        self.adapter: str | None = None  # the loaded LoRA adapter every request uses
        self.lock = threading.Lock()
        self.batcher = RequestBatcher(self.run_pending, "sglang-rollout-batcher")
        self.closed = False

    def generate(self, token_lists: Sequence[Sequence[int]], params: Sequence[Mapping[str, Any]]) -> list[dict]:
        with self.lock:
            return self.engine.generate(**generate_request(token_lists, params, self.adapter))

    async def generate_one(self, token_ids: list[int], params: Mapping[str, Any]) -> dict:
        return await self.batcher.submit((token_ids, params))

    def run_pending(self, items: list[tuple]) -> list[dict]:
        """One ``Engine.generate`` call for queued single-prompt requests."""
        outputs = self.generate([item[0] for item in items], [item[1] for item in items])
        return [outputs] if isinstance(outputs, Mapping) else outputs

    def begin_weight_update(self) -> None:
        with self.lock:
            success, message = self.engine.begin_weight_update()
        if not success:
            raise RuntimeError(f"sglang begin_weight_update failed: {message}")

    def end_weight_update(self) -> None:
        with self.lock:
            success, message = self.engine.end_weight_update()
        if not success:
            raise RuntimeError(f"sglang end_weight_update failed: {message}")

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        share_by_device_uuid(named_tensors)
        with self.lock:
            success, message = self.engine.update_weights_from_tensor(named_tensors=named_tensors, flush_cache=flush_cache)
        if not success:
            raise RuntimeError(f"sglang update_weights_from_tensor failed: {message}")

    def load_adapter(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Load the adapter now (SGLang checks it here, not at the next generation), serve it from now on
        and unload the previous one."""
        share_by_device_uuid(list(tensors.items()))
        with self.lock:
            result = self.engine.load_lora_adapter_from_tensors(lora_name=name, tensors=tensors, config_dict=config)
        if not getattr(result, "success", False):
            raise RuntimeError(f"sglang refused the LoRA adapter: {getattr(result, 'error_message', None) or result}")
        previous, self.adapter = self.adapter, name
        if previous is not None:
            self.unload(previous)

    def drop_adapter(self) -> None:
        """Serve the base weights again (the adapter is unloaded)."""
        previous, self.adapter = self.adapter, None
        if previous is not None:
            self.unload(previous)

    def unload(self, name: str) -> None:
        with self.lock:
            result = self.engine.unload_lora_adapter(lora_name=name)
        if not getattr(result, "success", False):
            raise RuntimeError(f"sglang could not unload LoRA adapter {name!r}: {getattr(result, 'error_message', None) or result}")

    def release_memory(self, tags: list[str]) -> None:
        with self.lock:
            self.engine.release_memory_occupation(tags=tags)

    def resume_memory(self, tags: list[str]) -> None:
        with self.lock:
            self.engine.resume_memory_occupation(tags=tags)

    def flush_cache(self) -> None:
        with self.lock:
            result = self.engine.flush_cache()
        if not getattr(result, "success", True):
            raise RuntimeError(f"sglang flush_cache failed: {getattr(result, 'message', '') or 'requests still running'}")

    def close(self) -> None:
        if self.closed:
            return
        with self.lock:
            self.engine.shutdown()
            # the engine's event loop still holds its request-handling tasks, which asyncio would report as
            # "destroyed but pending" at exit (to streams that may be closed by then): end them here
            loop = getattr(self.engine, "loop", None)
            if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed() and not loop.is_running():
                pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.closed = True


class ServerBackend:
    """An SGLang HTTP server: started here (``python -m sglang.launch_server`` with this environment's
    Python, on loopback) or attached to at ``server_url``. Weight updates pass CUDA IPC handles, or the
    shared-memory files of CPU tensors, so the server must run on this node (on its GPUs, or its CPUs)."""

    def __init__(self, config: SGLangRolloutConfig, engine_kwargs: Mapping[str, Any]):
        self.config = config
        self.owner_pid = os.getpid()
        self.adapter: str | None = None  # the loaded LoRA adapter every request uses
        self.base_url, self.server = config.start_or_attach(
            "sglang.launch_server", lambda host, port: server_argv(engine_kwargs, host, port), health_path=HEALTH_PATH, name="sglang server",
        )

    def post(self, path: str, payload: Any = None) -> Any:
        return request_json(self.base_url + path, payload, method="POST", timeout=self.config.request_timeout_s)

    def generate(self, token_lists: Sequence[Sequence[int]], params: Sequence[Mapping[str, Any]]) -> list[dict]:
        return self.post("/generate", generate_request(token_lists, params, self.adapter))

    async def generate_one(self, token_ids: list[int], params: Mapping[str, Any]) -> dict:
        # concurrent requests are batched by the server itself
        outputs = await asyncio.to_thread(self.generate, [token_ids], [params])
        return outputs[0] if isinstance(outputs, list) else outputs

    def begin_weight_update(self) -> None:
        self.post("/begin_weight_update", {"selector": "all"})

    def end_weight_update(self) -> None:
        self.post("/end_weight_update", {})

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        payload = {"serialized_named_tensors": serialized_named_tensors(named_tensors, self.config.tp_size), "flush_cache": flush_cache}
        answer = self.post("/update_weights_from_tensor", payload)
        if not (isinstance(answer, Mapping) and answer.get("success")):
            raise ServerError(f"sglang server {self.base_url} refused the weight update: {answer}")

    def load_adapter(self, name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        payload = {"lora_name": name, "config_dict": config,
                   "serialized_named_tensors": serialized_named_tensors(tensors, self.config.tp_size)}
        answer = self.post("/load_lora_adapter_from_tensors", payload)
        if not (isinstance(answer, Mapping) and answer.get("success")):
            raise ServerError(f"sglang server {self.base_url} refused the LoRA adapter: {answer}")
        previous, self.adapter = self.adapter, name
        if previous is not None:
            self.unload(previous)

    def drop_adapter(self) -> None:
        previous, self.adapter = self.adapter, None
        if previous is not None:
            self.unload(previous)

    def unload(self, name: str) -> None:
        answer = self.post("/unload_lora_adapter", {"lora_name": name})
        if not (isinstance(answer, Mapping) and answer.get("success")):
            raise ServerError(f"sglang server {self.base_url} could not unload LoRA adapter {name!r}: {answer}")

    def release_memory(self, tags: list[str]) -> None:
        self.post("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str]) -> None:
        self.post("/resume_memory_occupation", {"tags": tags})

    def flush_cache(self) -> None:
        self.post("/flush_cache")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
