"""The ``sglang`` rollout engine: SGLang 0.5.23 in the worker process (hybrid) or behind its HTTP server, on
GPUs or through SGLang's CPU engine (:mod:`rlplat_rollout_sglang.platform`).

Weights move with ``update_weights_from_tensor``: each bucket is pickled as CUDA IPC handles (SGLang's
``MultiprocessingSerializer``) and loaded by the scheduler straight from the trainer's GPU memory; on CPUs, as
shared-memory copies. Memory is freed with ``release_memory_occupation`` (torch_memory_saver, GPUs only) and
resumed in two stages, weights then KV cache and CUDA graphs, so that the buckets load before the KV cache
claims its memory.

LoRA adapters (``rollout.config.max_lora_rank`` above 0) go through SGLang's LoRA support: each
:meth:`load_adapter` hands the tensors over with ``load_lora_adapter_from_tensors`` (server: ``POST
/load_lora_adapter_from_tensors``) under a new name, every later request names it (``lora_path``) and the
previous adapter is unloaded. Full weights loaded later are the new base: the adapter is dropped until
loaded again.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, Iterable, Mapping, Sequence

import torch

from rlplat.config_node import read_config_node
from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.protocol import DataProto
from rlplat.kits.rollout_batch import (BackendRolloutEngine, assemble_rollout, check_single_request, pad_and_eos_token_ids, prompt_token_lists,
                                       tied_weight_aliases, transfer_copy)
from rlplat_rollout_sglang.backends import InProcessBackend, ServerBackend
from rlplat_rollout_sglang.config import SGLangRolloutConfig
from rlplat_rollout_sglang.platform import cpu_engine, use_cpu_engine
from rlplat_rollout_sglang.weights import check_bucket, expected_shapes
from rlplat_rollout_sglang.translate import (
    ALL_MEMORY_TAGS,
    KV_CACHE_TAGS,
    SEED_RANGE,
    WEIGHTS,
    adapter_tensors,
    cpu_engine_problems,
    json_value,
    kv_cache_tokens,
    read_model_config,
    per_sample_params,
    sample_from_output,
    sample_seed,
    samples_from_outputs,
    server_args_kwargs,
)

AWAKE, WEIGHTS_ONLY, ASLEEP = "awake", "weights only", "asleep"


class SGLangRollout(BackendRolloutEngine):
    """See the :class:`~rlplat.contracts.rollout.RolloutEngine` contract and the module docstring.

    States: awake; weights only (after :meth:`wake_up_weights`); asleep. Generation needs awake and,
    after a sleep, at least one :meth:`update_weights` (released weights come back uninitialised).
    Weight updates leave the radix cache alone; it is flushed once, before the next generation.

    ``rollout_log_probs`` are SGLang's: ``log_softmax(logits / temperature)`` of the sampled token, before
    top-k / top-p renormalisation (greedy, and so ``top_k=1``: ``log_softmax(logits)``).
    """

    # SGLang 0.5.23's LoRA layers pin host memory (CUDA-only): its CPU engine serves no adapters, which a run's
    # actor.lora.sync=adapter learns at load (read where the rollout is looked up; no sglang import)
    supports_adapters = not cpu_engine()

    @classmethod
    def estimate_memory(cls, config: Any, model_config: Mapping[str, Any], context: Any) -> Any:
        """One GPU's memory while generating and waking up, from the config and ``config.json`` alone (:mod:`rlplat_rollout_sglang.memory`)."""
        from rlplat_rollout_sglang.memory import estimate

        return estimate(config, model_config, context)

    def __init__(self, config: Any = None, **_: Any):
        self.config = read_config_node(config, SGLangRolloutConfig, "rollout.config")
        self.cpu = use_cpu_engine()
        if self.cpu and (problems := cpu_engine_problems(self.config)):  # refused before an engine starts
            raise ValueError("sglang rollout on SGLang's CPU engine: " + "; ".join(problems))
        self.honours_seeds = self.config.enable_deterministic_inference
        self.pad_token_id, self.eos_token_ids = pad_and_eos_token_ids(self.config.model_path, self.config.pad_token_id, self.config.eos_token_ids, "sglang")
        engine_kwargs = server_args_kwargs(self.config, self.cpu, self.cpu_kv_cache_tokens() if self.cpu else None)
        # an attached server (no model_path) is taken at its word
        self.weight_shapes = expected_shapes(self.config.model_path) if self.config.model_path is not None else None
        # what a full update names (a tied output layer comes once, under the embedding's name)
        aliases = {alias for names in tied_weight_aliases(self.config.model_path).values() for alias in names}
        self.required_names = None if self.weight_shapes is None else set(self.weight_shapes) - aliases
        self.session_names: set[str] = set()  # sent in the open weight-update session
        self.session_lock = threading.Lock()
        self.backend = (InProcessBackend if self.config.mode == "hybrid" else ServerBackend)(self.config, engine_kwargs)
        self.seeds = random.Random(self.config.seed)
        self.state = AWAKE
        self.needs_weights = False
        self.cache_stale = False
        self.session_open = False
        self.adapters_loaded = 0

    def cpu_kv_cache_tokens(self) -> int | None:
        """The CPU engine's KV cache in tokens (``cpu_kv_cache_gib``); None for an attached server (its own)."""
        if self.config.model_path is None:
            return None
        return kv_cache_tokens(self.config, read_model_config(self.config.model_path))

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        token_lists = prompt_token_lists(prompts, "sglang")
        self.check_ready()
        requests = [tokens for tokens in token_lists for _ in range(sampling.n)]
        params = per_sample_params(sampling, len(requests), self.eos_token_ids, self.seeds_for(sampling, len(requests)))
        outputs = self.backend.generate(requests, params)
        stop = set(sampling.stop_token_ids) | set(self.eos_token_ids)
        samples = samples_from_outputs(outputs, len(requests), stop, sampling.max_new_tokens)
        return assemble_rollout(prompts, samples, sampling.n, sampling.max_new_tokens, self.pad_token_id)

    async def generate_tokens(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        check_single_request(prompt_ids, sampling)
        await asyncio.to_thread(self.check_ready)  # may flush the cache: Engine runs its own event loop
        params = per_sample_params(sampling, 1, self.eos_token_ids, self.seeds_for(sampling, 1))[0]
        output = await self.backend.generate_one(list(prompt_ids), params)
        return sample_from_output(output, set(sampling.stop_token_ids) | set(self.eos_token_ids), sampling.max_new_tokens)

    def seeds_for(self, sampling: SamplingParams, count: int) -> list[int | None]:
        """One seed per sample: derived from the call's seed, else drawn (SGLang's deterministic mode
        would otherwise give every unseeded request its default seed 42); None when SGLang ignores seeds."""
        if not self.honours_seeds:
            return [None] * count
        if sampling.seed is not None:
            return [sample_seed(sampling.seed, index) for index in range(count)]
        return [self.seeds.randrange(SEED_RANGE) for _ in range(count)]

    def check_ready(self) -> None:
        if self.state != AWAKE:
            step = "wake_up_kv_cache()" if self.state == WEIGHTS_ONLY else "wake_up() (or wake_up_weights(), update_weights(), wake_up_kv_cache())"
            raise RuntimeError(f"sglang rollout is {self.state}: call {step} before generating")
        if self.needs_weights:
            raise RuntimeError("sglang rollout woke up without its weights: call update_weights() with the full weights before generating")
        self.end_weight_update()  # flushes the radix-cache entries of the previous weights

    # -- weights ---------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.state == ASLEEP:
            raise RuntimeError("sglang rollout is asleep: call wake_up_weights() (or wake_up()) before update_weights()")
        bucket = [(name, self.for_transfer(tensor)) for name, tensor in named_tensors]
        if not bucket:
            return
        if self.weight_shapes is not None:
            try:
                check_bucket(bucket, self.weight_shapes)
            except ValueError:
                # nothing of this bucket was sent; earlier buckets of the same sync were: partly new weights
                self.needs_weights = self.needs_weights or self.session_open
                raise
        if not self.session_open:
            self.backend.drop_adapter()  # full weights are a new base: the adapter is off until loaded again
            # SGLang 0.5.23 loads tensors only inside a weight-update session
            self.backend.begin_weight_update()
            self.session_open = True
            self.session_names = set()
        try:
            # no flush per bucket: one flush before the next generation (and none while the KV cache is released)
            self.backend.update_weights(bucket, flush_cache=False)
        except BaseException:
            self.needs_weights = True  # partly loaded: only a full update makes the engine usable again
            raise
        self.session_names.update(name for name, _ in bucket)
        if self.needs_weights and (self.required_names is None or self.required_names <= self.session_names):
            self.needs_weights = False
        # a released KV cache (asleep on GPUs) comes back flushed; the CPU engine's is kept
        self.cache_stale = (self.state == AWAKE or self.cpu) and not self.config.disable_radix_cache

    def load_adapter(self, config: Mapping[str, Any], named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Serve the base weights with this LoRA adapter (see the module docstring); SGLang checks the
        adapter (rank, target modules, DoRA, ...) and refuses what it cannot serve. Each adapter gets a
        new name, so the radix cache (keyed by adapter) never reuses the previous adapter's entries."""
        rank = config.get("r")
        if not self.config.max_lora_rank:
            raise RuntimeError(f"sglang rollout: load_adapter needs SGLang's LoRA support: set rollout.config.max_lora_rank "
                               f"at or above the adapter's rank r={rank}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank <= self.config.max_lora_rank:
            raise ValueError(f"sglang rollout: adapter rank r={rank!r} is not in [1, rollout.config.max_lora_rank="
                             f"{self.config.max_lora_rank}]")
        if self.state == ASLEEP:
            raise RuntimeError("sglang rollout is asleep: call wake_up() and update_weights() before load_adapter()")
        tensors = {name: own_copy(tensor, tensor) if not tensor.is_cuda else tensor for name, tensor in adapter_tensors(named_tensors).items()}
        self.end_weight_update()
        self.adapters_loaded += 1
        self.backend.load_adapter(f"rlplat-adapter-{self.adapters_loaded}", json_value(dict(config)), tensors)

    def end_weight_update(self) -> None:
        """Close the weight-update session the last :meth:`update_weights` opened (if any). The radix-cache
        entries computed with the old weights are flushed first, by an update of no tensors with
        ``flush_cache``: SGLang's ``flush_cache`` call also runs a garbage-collection pass of its scheduler on
        CPUs (0.4-0.6 s a sync, measured), the update's flush does not (3 ms)."""
        with self.session_lock:  # concurrent generate_tokens calls each check that the session is closed
            if self.session_open:
                if self.cache_stale:
                    self.backend.update_weights([], flush_cache=True)
                    self.cache_stale = False
                self.session_open = False
                self.backend.end_weight_update()

    def for_transfer(self, tensor: torch.Tensor) -> torch.Tensor:
        """Floating-point tensors in the rollout's dtype (half the bytes of float32 masters), on this
        worker's GPU when it has one: CUDA tensors travel as IPC handles. CPU tensors (the CPU engine) travel
        through shared memory, into which pickling moves their storage: each is a copy of its own, never the
        training engine's parameter."""
        if self.cpu or not torch.cuda.is_available():
            return own_copy(transfer_copy(tensor, self.config.dtype, None), tensor)
        return transfer_copy(tensor, self.config.dtype, torch.cuda.current_device())

    # -- memory ----------------------------------------------------------------------------------------

    def sleep(self) -> None:
        if self.state == ASLEEP:
            return
        self.end_weight_update()
        if not self.cpu:  # the CPU engine has no memory saver: its memory stays where it is
            # releasing the KV cache flushes the radix cache too
            self.backend.release_memory(list(ALL_MEMORY_TAGS) if self.state == AWAKE else [WEIGHTS])
        self.state = ASLEEP
        self.cache_stale = False

    def wake_up_weights(self) -> None:
        if self.state != ASLEEP:
            return
        if not self.cpu:
            self.backend.resume_memory([WEIGHTS])
        self.state = WEIGHTS_ONLY
        self.needs_weights = not self.cpu  # released weights come back uninitialised; kept ones are intact

    def wake_up_kv_cache(self) -> None:
        self.end_weight_update()  # flushes the entries of the previous weights from a KV cache that was kept
        if self.state == ASLEEP:
            self.wake_up_weights()
        if self.state == WEIGHTS_ONLY:
            if not self.cpu:
                self.backend.resume_memory(list(KV_CACHE_TAGS))
                self.backend.flush_cache()  # the radix tree must not point into the resumed, uninitialised cache
            self.state = AWAKE
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # drop the IPC-shared buckets the scheduler has let go of

    def close(self) -> None:
        """Shut the engine down (hybrid) or stop the server this engine started (server mode); an open
        weight-update session is closed first (an attached server outlives this engine)."""
        self.cache_stale = False  # nothing generates after this: no flush
        try:
            self.end_weight_update()
        finally:
            super().close()


def own_copy(tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``tensor`` (made from ``source``), cloned when it still shares ``source``'s storage."""
    if tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return tensor.clone()
    return tensor
