"""The two ways the ``vllm`` rollout reaches vLLM: a ``vllm.LLM`` in this process, or a vLLM server over
HTTP. Both offer the same methods: generation, sleep/wake, prefix-cache reset, the four calls of
vLLM's weight-sync client protocol (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``), ``load_weights`` (one bucket through the worker extension,
for the ``load`` weight path), one LoRA adapter served with every request (``load_adapter``,
``drop_adapter``), and what partial rollouts need: ``pause_generation`` (drained for a weight update, or kept
in flight at a token boundary), ``resume_generation`` (carrying the requests in flight over new weights),
``set_weights_label`` (the version vLLM records per sampled token) and ``abort_generation``; ``score`` (the prompt
log-probs of given token lists, for ``score_tokens``) and ``score_limits``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import os
import tempfile
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Mapping, Sequence

from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.kits.rollout_server import ServerError, request_json
from rlplat_rollout_vllm.config import VLLMRolloutConfig
from rlplat_rollout_vllm.token_loop import TokenLoop, TokenRequest
from rlplat_rollout_vllm.translate import (
    cache_salt,
    completion_payload,
    engine_kwargs,
    generate_payload,
    repeat_greedy,
    sample_from_completion,
    sample_from_generate_response,
    samples_from_completion_response,
    samples_per_request,
    sampling_kwargs,
    score_kwargs,
    score_payload,
    server_arguments,
)

#: Requests a seeded batch keeps in flight to a server (each prompt is a request of its own there).
SEEDED_REQUESTS_IN_FLIGHT = 64
#: The worker extension's method (:mod:`rlplat_rollout_vllm.worker_extension`).
LOAD_METHOD = "rlplat_load_weights"
#: Where buckets for an engine in another process are written: memory-backed where the node has it.
SHARED_MEMORY = "/dev/shm"

# Weight updates carry CUDA IPC handles (tuples of torch types) to vLLM's engine process: its msgpack
# RPC and its HTTP route accept them only with pickle allowed. The engine process is this worker's own
# child (hybrid) or a server it started on loopback.
INSECURE_SERIALIZATION = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
# /sleep, /wake_up, /reset_prefix_cache and the weight-transfer routes exist only in dev mode.
SERVER_ENV = {**INSECURE_SERIALIZATION, "VLLM_SERVER_DEV_MODE": "1"}
# /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with runtime LoRA updating on.
LORA_SERVER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
#: vLLM's token-in, token-out routes (``generate_tokens`` in server mode): the request's weights-version spans come
#: back, and a request named by its id can be aborted with the tokens it has. vLLM registers them with its
#: scale-out endpoints: ``vllm serve --enable-scale-out`` (:func:`scale_out_arguments`).
GENERATE_ROUTE, ABORT_ROUTE = "/inference/v1/generate", "/inference/v1/abort_requests"
#: The id vLLM's engine knows a token-route request by (the route prefixes the id it is given); the abort route
#: takes engine ids.
ENGINE_REQUEST_ID = "generate-tokens-{}"
#: How often an abort is sent again for calls that have not returned (one whose request had not reached the server
#: when the abort did is aborted by the next).
ABORT_RETRY_S = 0.25


# The worker's own torch.distributed rendezvous (set for the training engine). vLLM's engine processes,
# started by LLM(), inherit the environment and must form their own group, not join the trainer's.
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def without_distributed_env():
    saved = {name: os.environ.pop(name) for name in DISTRIBUTED_ENV if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment while the block runs (vLLM reads its variables when
    the engine starts), the previous ones restored after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def cpu_environment(config: VLLMRolloutConfig) -> dict[str, str]:
    """What vLLM's CPU platform needs in its environment. Threads are not bound (``nobind``): vLLM's
    ``auto`` pins the engine to one core and reserves another, which would pin the trainer sharing the
    process or the machine; a value the user set is kept."""
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}


def runs_in_process(config: VLLMRolloutConfig, cpu: bool) -> bool:
    """``rollout.config.in_process``, or its default: in process on CPU unless the worker belongs to a
    torch.distributed group of several processes (vLLM would take that group for its own world)."""
    if config.in_process is not None:
        return config.in_process
    if not cpu:
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def bucket_file(bucket: Sequence[tuple[str, Any]]) -> str:
    """The bucket as a safetensors file in shared memory (or the temporary folder), for an engine in another
    process on this node; the worker extension removes it once read. Tensors that share memory (a tied
    output layer under two names) are written as copies."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, tensor in bucket:
        tensor = tensor.detach().to("cpu")
        tensors[name] = tensor.clone() if tensor.untyped_storage().data_ptr() in seen else tensor.contiguous()
        seen.add(tensor.untyped_storage().data_ptr())
    folder = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK) else None
    descriptor, path = tempfile.mkstemp(prefix="rlplat-vllm-bucket-", suffix=".safetensors", dir=folder)
    os.close(descriptor)
    try:
        save_file(tensors, path)
    except BaseException:
        os.unlink(path)
        raise
    return path


class InProcessBackend:
    """A ``vllm.LLM`` owned by this worker. ``LLM`` is not thread safe, so calls are serialised by a lock.
    ``generate_one`` calls (agent loops) go through a :class:`~rlplat_rollout_vllm.token_loop.TokenLoop`, which
    steps the engine for all of them together, token by token; a batch ``generate`` is one ``LLM.generate`` call
    with a sampling-parameter object per prompt, given the engine to itself."""

    def __init__(self, config: VLLMRolloutConfig, cpu: bool = False):
        os.environ.update(INSECURE_SERIALIZATION)
        import vllm

        self.vllm = vllm
        self.in_process = runs_in_process(config, cpu)
        env = {**(cpu_environment(config) if cpu else {}), **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.in_process else {})}
        with without_distributed_env(), environment(env):
            self.llm = vllm.LLM(**engine_kwargs(config, cpu, in_process=self.in_process))
        self.owner_pid = os.getpid()
        self.adapter: Any = None  # the LoRARequest every generation uses, if any
        self.lock = threading.Lock()
        self.loop = TokenLoop(self.llm, self.lock, self.in_process)
        self.weights_loaded = 0  # weight updates finished: the prefix-cache salt (translate.cache_salt)

    def run(self, token_lists: Sequence[Sequence[int]], sampling_list: Sequence[SamplingParams], eos_token_ids: Sequence[int],
            first_rows: Sequence[int]) -> list[TokenOutput]:
        """One ``LLM.generate`` call; the samples prompt-major, ``n`` per prompt in vLLM's index order.
        ``first_rows``: each request's first row in its call (its seed, :func:`request_seed`)."""
        built: dict[tuple, Any] = {}  # unseeded requests of a batch share one setting: build it once
        params = []
        for sampling, first_row in zip(sampling_list, first_rows):
            key = (sampling, first_row if sampling.seed is not None else 0)
            if key not in built:
                built[key] = self.vllm.SamplingParams(**sampling_kwargs(sampling, eos_token_ids, key[1]))
            params.append(built[key])
        salt = cache_salt(self.weights_loaded)
        with self.loop.engine_to_itself(), self.lock:
            outputs = self.llm.generate([{"prompt_token_ids": list(tokens), "cache_salt": salt} for tokens in token_lists], params,
                                        use_tqdm=False, lora_request=self.adapter)
        samples = []
        for request, sampling in zip(outputs, sampling_list):
            completions = sorted(request.outputs, key=lambda completion: completion.index)
            if len(completions) != samples_per_request(sampling):
                raise RuntimeError(f"vllm returned {len(completions)} samples for a prompt, expected {samples_per_request(sampling)}")
            stop = set(sampling.stop_token_ids) | set(eos_token_ids)
            returned = [sample_from_completion(c.token_ids, c.logprobs, c.finish_reason, stop, sampling.max_new_tokens) for c in completions]
            samples += repeat_greedy(returned, sampling)
        return samples

    def generate(self, token_lists: Sequence[Sequence[int]], sampling: SamplingParams, eos_token_ids: Sequence[int]) -> list[TokenOutput]:
        per_request = samples_per_request(sampling)
        return self.run(token_lists, [sampling] * len(token_lists), eos_token_ids, [index * per_request for index in range(len(token_lists))])

    def score(self, token_lists: Sequence[Sequence[int]], top_k: int) -> list[Any]:
        """Per token list, vLLM's prompt log-probs of it (:func:`~rlplat_rollout_vllm.translate.score_kwargs`): one
        ``LLM.generate`` call, given the engine to itself as a batch ``generate`` is. ``flat_logprobs``: vLLM keeps them
        in flat lists instead of a dictionary per position (it scores every prompt position, the rollout reads the
        response's)."""
        params = self.vllm.SamplingParams(**score_kwargs(top_k), flat_logprobs=True)
        salt = cache_salt(self.weights_loaded)
        with self.loop.engine_to_itself(), self.lock:
            outputs = self.llm.generate([{"prompt_token_ids": list(tokens), "cache_salt": salt} for tokens in token_lists],
                                        [params] * len(token_lists), use_tqdm=False, lora_request=self.adapter)
        return [output.prompt_logprobs for output in outputs]

    def score_limits(self) -> tuple[int | None, int | None]:
        """The engine's ``max_logprobs`` and ``max_model_len``, which bound a scoring call."""
        model_config = self.llm.model_config
        return model_config.max_logprobs, model_config.max_model_len

    async def generate_one(self, token_ids: list[int], sampling: SamplingParams, eos_token_ids: Sequence[int]) -> TokenOutput:
        """One request to the token loop: sampled as row 0 of a ``generate`` with ``sampling.seed``, its tokens
        numbered with the weights version that sampled each."""
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = self.vllm.SamplingParams(**sampling_kwargs(sampling, eos_token_ids))
        params.output_kind = RequestOutputKind.DELTA  # every step's tokens, so that an abort has them
        request = TokenRequest(f"rlplat-{uuid.uuid4().hex}", tokens_input(list(token_ids), cache_salt=cache_salt(self.weights_loaded)),
                               params, frozenset(sampling.stop_token_ids) | frozenset(eos_token_ids), sampling.max_new_tokens,
                               self.adapter)
        return await asyncio.wrap_future(self.loop.submit(request))

    def pause_generation(self, keep: bool = False) -> None:
        """``keep``: stop at the next token boundary, the requests in flight kept (their KV cache too) until
        :meth:`resume_generation`. Otherwise drain: admit nothing new and wait for the requests in flight to end
        (a weight update between generations)."""
        if not keep:
            self.loop.drain()
            return
        if self.in_process and self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling:
            raise RuntimeError("vllm rollout: generations in flight stop at token boundaries only without vLLM's async scheduling "
                               "(rollout.config.engine_kwargs sets async_scheduling=true; remove it)")
        self.loop.pause()

    def resume_generation(self, carry: str | None = None) -> None:
        """Go on after :meth:`pause_generation`; ``carry`` (``keep`` or ``recompute``): the weights changed, and
        the requests in flight go on so (:meth:`TokenLoop.resume`)."""
        self.loop.resume(carry)

    def set_weights_label(self, version: int) -> None:
        """The weights now loaded are ``version``: recorded on every token sampled from now on."""
        self.loop.set_version(version)
        with self.lock:
            self.llm.llm_engine.set_weight_version(str(version))

    def abort_generation(self) -> None:
        self.loop.abort()

    def sleep(self, level: int) -> None:
        # vLLM drops the KV cache: generations still in flight end now, with the tokens they have
        self.loop.abort()
        with self.lock:
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str]) -> None:
        with self.lock:
            self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        with self.lock:
            self.llm.reset_prefix_cache()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        with self.lock:
            self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        with self.lock:
            self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self.lock:
            self.llm.finish_weight_update(weight_version=weight_version)
        if weight_version is not None:
            self.weights_loaded += 1
            self.loop.set_version(int(weight_version))

    def load_weights(self, bucket: Sequence[tuple[str, Any]]) -> None:
        """One bucket into the model through the worker extension: by reference in this process, else as a
        file in shared memory."""
        source = list(bucket) if self.in_process else bucket_file(bucket)
        try:
            with self.lock:
                self.llm.collective_rpc(LOAD_METHOD, args=(source,))
        finally:
            if isinstance(source, str) and os.path.exists(source):
                os.unlink(source)  # the worker failed before reading it

    def load_adapter(self, name: str, adapter_id: int, path: str) -> None:
        """Load the adapter folder ``path`` now (a bad adapter fails here, not at the next generation)
        and serve it from now on; the previous adapter is unloaded."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=name, lora_int_id=adapter_id, lora_path=path)
        with self.lock:
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vllm rollout: vLLM did not load the LoRA adapter in {path}")
        previous, self.adapter = self.adapter, request
        if previous is not None:
            with self.lock:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def drop_adapter(self) -> None:
        """Serve the base weights again (the adapter is unloaded)."""
        previous, self.adapter = self.adapter, None
        if previous is not None:
            with self.lock:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()


def scale_out_arguments() -> list[str]:
    """The ``vllm serve`` flag that registers the token-in, token-out routes (:data:`GENERATE_ROUTE`), where the
    installed vLLM's command line has it (``--enable-scale-out``, a field of its ``FrontendArgs``)."""
    for module in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"):
        try:
            frontend = importlib.import_module(module).FrontendArgs
        except (ImportError, AttributeError):
            continue
        return ["--enable-scale-out"] if "enable_scale_out" in {field.name for field in dataclasses.fields(frontend)} else []
    return []


class ServerBackend:
    """A vLLM OpenAI-compatible server: started here (``vllm serve`` with this environment's Python, on
    loopback, dev and scale-out routes on) or attached to at ``server_url``. An attached server must run with
    ``VLLM_SERVER_DEV_MODE=1`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` on the same node's GPUs, and with
    ``--enable-scale-out`` for ``generate_tokens``.

    ``generate_one`` calls go to vLLM's token-in, token-out route, one request each, named so that an abort can
    end them; the server batches concurrent requests itself."""

    def __init__(self, config: VLLMRolloutConfig, cpu: bool = False):
        self.config = config
        self.owner_pid = os.getpid()
        self.adapter: str | None = None  # the LoRA adapter's name, sent as the model of every completion
        env = {**SERVER_ENV, **(LORA_SERVER_ENV if config.max_lora_rank else {}), **(cpu_environment(config) if cpu else {})}
        self.base_url, self.server = config.start_or_attach(
            "rlplat_rollout_vllm.server_main", lambda host, port: server_arguments(config, host, port, cpu) + scale_out_arguments(),
            health_path="/health", env=env, name="vllm server",
        )
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.weights = HTTPVLLMWeightSyncClient(self.base_url, timeout=config.request_timeout_s)
        self.weights_loaded = 0  # weight updates finished: the prefix-cache salt (translate.cache_salt)
        self.condition = threading.Condition()
        self.in_flight: set[str] = set()  # ids of the generate_one requests sent and not answered
        self.batches = 0  # generate calls running
        self.held = False  # pause_generation(keep=True) until resume_generation

    def post(self, path: str, payload: Any = None, query: list[tuple[str, Any]] | None = None) -> Any:
        url = self.base_url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        return request_json(url, payload, method="POST", timeout=self.config.request_timeout_s)

    @contextlib.contextmanager
    def batch_call(self) -> Iterator[None]:
        """The block is a batch call (``generate``, ``score``): it waits while generation is paused with requests kept
        in flight (a batch is served with one version of the weights), and a pause waits for it."""
        with self.condition:
            while self.held:
                self.condition.wait()
            self.batches += 1
        try:
            yield
        finally:
            with self.condition:
                self.batches -= 1
                self.condition.notify_all()

    def generate(self, token_lists: Sequence[Sequence[int]], sampling: SamplingParams, eos_token_ids: Sequence[int]) -> list[TokenOutput]:
        """One ``/v1/completions`` request for the batch; a seeded call one request per prompt, sent at once
        (a request has one seed, and each prompt needs its own: :func:`request_seed`). A batch call
        (:meth:`batch_call`)."""
        with self.batch_call():
            return self.generate_batch(token_lists, sampling, eos_token_ids)

    def score(self, token_lists: Sequence[Sequence[int]], top_k: int) -> list[Any]:
        """Per token list, the JSON of vLLM's prompt log-probs of it: one ``/v1/completions`` request with
        ``prompt_logprobs`` (:func:`~rlplat_rollout_vllm.translate.score_payload`), a batch call. What the server
        refuses (``top_k`` above its ``--max-logprobs``, a sequence with no room left within its ``--max-model-len``)
        is raised as a ValueError with the settings to change."""
        payload = score_payload(token_lists, top_k, self.adapter, cache_salt(self.weights_loaded))
        with self.batch_call():
            try:
                response = self.post("/v1/completions", payload)
            except ServerError as error:
                if " answered 400" not in str(error):
                    raise
                raise ValueError(f"vllm rollout: score_tokens: the server refused the scoring request ({error}); a top_k above "
                                 "its max_logprobs (rollout.config.engine_kwargs.max_logprobs) or a sequence without room for one "
                                 "generated token within its max_model_len (rollout.config.max_model_len) is refused so") from None
        choices = sorted(response.get("choices") or [], key=lambda choice: choice["index"])
        if len(choices) != len(token_lists):
            raise RuntimeError(f"vllm server returned {len(choices)} choices for {len(token_lists)} scoring requests")
        return [choice.get("prompt_logprobs") for choice in choices]

    def score_limits(self) -> tuple[int | None, int | None]:
        """Unknown here (an attached server has its own): the server refuses what exceeds them (:meth:`score`)."""
        return None, None

    def generate_batch(self, token_lists: Sequence[Sequence[int]], sampling: SamplingParams, eos_token_ids: Sequence[int]) -> list[TokenOutput]:
        per_request, stop = samples_per_request(sampling), set(sampling.stop_token_ids) | set(eos_token_ids)
        salt = cache_salt(self.weights_loaded)
        if sampling.seed is None or sampling.greedy or len(token_lists) == 1:
            response = self.post("/v1/completions", completion_payload(token_lists, sampling, eos_token_ids, self.adapter, salt=salt))
            samples = samples_from_completion_response(response, len(token_lists), per_request, stop, sampling.max_new_tokens)
            return repeat_greedy(samples, sampling)

        def one(index: int) -> list[TokenOutput]:
            payload = completion_payload([token_lists[index]], sampling, eos_token_ids, self.adapter, first_row=index * per_request, salt=salt)
            return samples_from_completion_response(self.post("/v1/completions", payload), 1, per_request, stop, sampling.max_new_tokens)

        with ThreadPoolExecutor(max_workers=min(SEEDED_REQUESTS_IN_FLIGHT, len(token_lists)), thread_name_prefix="vllm-seeded") as pool:
            return [sample for samples in pool.map(one, range(len(token_lists))) for sample in samples]

    async def generate_one(self, token_ids: list[int], sampling: SamplingParams, eos_token_ids: Sequence[int]) -> TokenOutput:
        """One request to vLLM's token-in, token-out route: sampled as row 0 of a ``generate`` with
        ``sampling.seed``, its tokens numbered with the weights version vLLM recorded sampling each."""
        request_id = f"rlplat-{uuid.uuid4().hex}"
        payload = generate_payload(request_id, token_ids, sampling, eos_token_ids, self.adapter, cache_salt(self.weights_loaded))
        return await asyncio.to_thread(self.generate_named, request_id, payload, set(sampling.stop_token_ids) | set(eos_token_ids),
                                       sampling.max_new_tokens)

    def generate_named(self, request_id: str, payload: Mapping[str, Any], stop: set[int], max_new_tokens: int) -> TokenOutput:
        with self.condition:
            self.in_flight.add(request_id)
            self.condition.notify_all()
        try:
            response = self.post(GENERATE_ROUTE, payload)
        except ServerError as error:
            if " answered 404" in str(error) or " answered 403" in str(error):
                raise RuntimeError(f"vllm rollout: the server at {self.base_url} does not serve {GENERATE_ROUTE}, which generate_tokens "
                                   "uses (token ids out with the weights version of each): start it with --enable-scale-out") from error
            raise
        finally:
            with self.condition:
                self.in_flight.discard(request_id)
                self.condition.notify_all()
        return sample_from_generate_response(response, stop, max_new_tokens)

    def pause_generation(self, keep: bool = False) -> None:
        """``keep``: stop at the next token boundary (vLLM's ``/pause?mode=keep``), the requests in flight kept
        with their KV cache until :meth:`resume_generation`; batch ``generate`` calls running are waited for
        first, and new ones wait. Otherwise let requests in flight finish and hold new ones (a weight update
        between generations: the weights are meta tensors during an update)."""
        if not keep:
            self.post("/pause", query=[("mode", "wait")])
            return
        with self.condition:
            self.held = True
            while self.batches:
                self.condition.wait()
        self.post("/pause", query=[("mode", "keep"), ("clear_cache", "false")])

    def resume_generation(self, carry: str | None = None) -> None:
        """Go on after :meth:`pause_generation`. ``carry`` (``keep`` or ``recompute``): the weights changed, and
        the requests in flight keep their KV cache, or are preempted with the prefix cache
        (``/reset_prefix_cache?reset_running_requests=true``), which makes vLLM rebuild each from its prompt and
        tokens so far with the new weights. The prefix cache is reset too where no request in flight holds it
        (new requests never meet stale entries anyway: their cache salt names the weights)."""
        with self.condition:
            in_flight = bool(self.in_flight)
        if carry == "recompute":
            self.post("/reset_prefix_cache", query=[("reset_running_requests", "true")])
        elif carry == "keep" and not in_flight:
            self.post("/reset_prefix_cache")
        self.post("/resume")
        with self.condition:
            self.held = False
            self.condition.notify_all()

    def set_weights_label(self, version: int) -> None:
        """The weights now loaded are ``version``: vLLM records it on every token sampled from now on."""
        self.post("/update_weight_version", {"new_version": str(version)})

    def abort_generation(self) -> None:
        """End every ``generate_one`` call in flight now (vLLM answers each with the tokens it has and
        ``finish_reason="abort"``); the abort is sent again for calls that have not returned, until they have."""
        with self.condition:
            targets = set(self.in_flight)
        deadline = time.monotonic() + self.config.request_timeout_s
        while targets:
            self.post(ABORT_ROUTE, {"request_ids": [ENGINE_REQUEST_ID.format(request_id) for request_id in sorted(targets)]})
            with self.condition:
                self.condition.wait_for(lambda: not targets & self.in_flight, timeout=ABORT_RETRY_S)
                targets &= self.in_flight
            if targets and time.monotonic() > deadline:
                raise RuntimeError(f"vllm rollout: {len(targets)} generate_tokens calls did not end within "
                                   f"rollout.config.request_timeout_s={self.config.request_timeout_s} s of their abort")

    def sleep(self, level: int) -> None:
        self.post("/sleep", query=[("level", level)])

    def wake_up(self, tags: list[str]) -> None:
        self.post("/wake_up", query=[("tags", tag) for tag in tags])

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.weights.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.weights.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.weights.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.weights.finish_weight_update(weight_version)
        if weight_version is not None:
            self.weights_loaded += 1

    def load_weights(self, bucket: Sequence[tuple[str, Any]]) -> None:
        """One bucket through the worker extension (``/collective_rpc``, a dev route): the server reads it
        from a file in this node's shared memory, so it must run on this node."""
        path = bucket_file(bucket)
        try:
            self.post("/collective_rpc", {"method": LOAD_METHOD, "args": [path]})
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def load_adapter(self, name: str, adapter_id: int, path: str) -> None:
        """Load the adapter folder ``path`` into the server (which reads it from this node's disk) under
        ``name``, serve it from now on and unload the previous one."""
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        previous, self.adapter = self.adapter, name
        if previous is not None:
            self.post("/v1/unload_lora_adapter", {"lora_name": previous})

    def drop_adapter(self) -> None:
        previous, self.adapter = self.adapter, None
        if previous is not None:
            self.post("/v1/unload_lora_adapter", {"lora_name": previous})

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
