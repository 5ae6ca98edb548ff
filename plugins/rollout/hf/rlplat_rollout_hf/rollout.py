"""The ``hf`` rollout engine: a transformers causal LM sampled token by token with its KV cache."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from rlplat.contracts.rollout import RolloutEngine, SamplingParams, TokenOutput
from rlplat.protocol import DataProto
from rlplat.kits.moe import ROUTES, RouteHooks, RoutingCall
from rlplat.kits.rollout_batch import check_single_request
from rlplat.config_node import read_config_node
from rlplat_rollout_hf.adapters import AdapterError, read_adapter
from rlplat_rollout_hf.batching import TokenBatcher, TokenRequest
from rlplat_rollout_hf.config import HFRolloutConfig
from rlplat_rollout_hf.experts import checkpoint_aliases
from rlplat_rollout_hf.sampling import choose, choose_per_row, stream_keys

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device: name its index, so
        device = torch.device("cuda", torch.cuda.current_device())  # it compares equal to the engine's weights
    return device


def build_model(config: HFRolloutConfig, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    dtype = getattr(torch, config.dtype)
    if config.model_path is not None:
        from pathlib import Path

        if not Path(config.model_path).is_dir():
            raise FileNotFoundError(f"hf rollout: model_path {config.model_path!r} is not a directory (a local Hugging Face model folder is expected)")
        if config.load_weights:
            model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model_path), dtype=dtype)
    elif config.model_config is not None:
        model_config = config.model_config
        if not isinstance(model_config, PretrainedConfig):
            values = dict(model_config)
            model_config = AutoConfig.for_model(values.pop("model_type"), **values)
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    else:
        raise ValueError("hf rollout needs model_path (a local Hugging Face directory) or model_config")
    return model.to(device).eval()


def holding_model_lock(method):
    """Run ``method`` holding the engine's ``model_lock``: no decoding step of batched
    ``generate_tokens`` requests runs meanwhile."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.model_lock:
            return method(self, *args, **kwargs)

    return locked


class HFRollout(RolloutEngine):
    """See the :class:`~rlplat.contracts.rollout.RolloutEngine` contract for the keys it reads and writes.

    ``generate`` samples in slices of ``max_batch_rows`` rows. With ``sampling.seed`` row ``r`` of the
    ``n``-repeated batch draws from its own stream, keyed by the seed and ``r``
    (:mod:`rlplat_rollout_hf.sampling`), so the same seed, weights and prompts give the same samples, on
    this engine or another; without, every row draws from the engine's generator, seeded once with
    ``config.seed``. Concurrent ``generate_tokens`` calls are batched continuously (up to
    ``max_batch_rows`` rows): a request with a seed draws from the stream of row 0 of its seed, so it
    samples what it would alone and what ``generate`` samples for its prompt alone; weight changes
    (``update_weights``, ``load_adapter``, ``sleep``, ...) wait for the decoding step in progress.

    **LoRA adapters** (:meth:`load_adapter`) are merged into the served weights of their modules; the
    weights those modules had when last loaded in full are kept aside (``adapter_base``) so the next
    adapter replaces this one exactly, and full weights loaded later become the new base (the adapter is
    then off until loaded again).
    """

    supports_adapters = True
    scores_tokens = True

    def __init__(self, config: Any = None, **_: Any):
        self.config = read_config_node(config, HFRolloutConfig, "rollout.config")
        self.device = resolve_device(self.config.device)
        self.model = build_model(self.config, self.device)
        model_config = self.model.config
        eos = self.config.eos_token_ids if self.config.eos_token_ids is not None else model_config.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else model_config.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.generator = torch.Generator(self.device).manual_seed(self.config.seed)
        self.targets = dict(self.model.state_dict(keep_vars=True))
        self.aliases = checkpoint_aliases(self.model)  # per-expert checkpoint names of fused expert tensors
        self.asleep = False
        self.saved_buffers: dict[str, torch.Tensor] = {}
        self.missing_weights: set[int] = set()
        self.dtype = getattr(torch, self.config.dtype)
        self.bound = False  # parameters are views of a training engine's (bind_weights)
        # held by the token batcher around each forward and by every change to the weights, so weights
        # change between decoding steps, never inside one
        self.model_lock = threading.RLock()
        self.weights_version = 0
        self.continue_mode = "keep"
        self.batcher = TokenBatcher(self, self.config.max_batch_rows)
        self.vocabulary_size = self.model.get_input_embeddings().num_embeddings
        # weight name -> that weight as last loaded in full, for the modules an adapter targeted
        self.adapter_base: dict[str, torch.Tensor] = {}
        self.adapter_weights: tuple[str, ...] = ()  # weights served with the adapter merged in

    @classmethod
    def estimate_memory(cls, config: Any, model_config: Mapping[str, Any], context: Any) -> Any:
        """One process's memory while generating, from the config and ``config.json`` alone (:mod:`rlplat_rollout_hf.memory`)."""
        from rlplat_rollout_hf.memory import estimate

        return estimate(config, model_config, context)

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        self.check_ready()
        missing = [key for key in PROMPT_KEYS if prompts.batch is None or key not in prompts.batch.keys()]
        if missing:
            raise KeyError(f"hf rollout: prompts lack {missing}; it needs left-padded {list(PROMPT_KEYS)}")
        repeated = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        keys = None if sampling.seed is None else stream_keys(sampling.seed, range(len(repeated))).tolist()
        inputs = {key: repeated.batch[key].to(self.device) for key in PROMPT_KEYS}
        parts = []
        for start in range(0, len(repeated), self.config.max_batch_rows):
            end = start + self.config.max_batch_rows
            window = {key: value[start:end] for key, value in inputs.items()}
            parts.append(self.sample(window["input_ids"], window["attention_mask"], window["position_ids"], sampling,
                                     None if keys is None else keys[start:end]))
        responses = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, sampling.max_new_tokens, dtype=torch.long)
        log_probs = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, sampling.max_new_tokens)
        response_mask = torch.cat([p[2] for p in parts]) if parts else torch.zeros(0, sampling.max_new_tokens, dtype=torch.long)
        routes = torch.cat([p[3] for p in parts]) if parts and self.config.record_routes else None
        prompt_ids, prompt_mask, prompt_positions = (inputs[key].cpu() for key in PROMPT_KEYS)
        steps = torch.arange(1, responses.shape[1] + 1)
        response_positions = prompt_positions[:, -1:] + steps
        output = DataProto.from_dict(
            tensors={
                "prompts": prompt_ids,
                "responses": responses.cpu(),
                "response_mask": response_mask.cpu(),
                "rollout_log_probs": log_probs.cpu(),
                "input_ids": torch.cat([prompt_ids, responses.cpu()], dim=1),
                "attention_mask": torch.cat([prompt_mask, response_mask.cpu()], dim=1),
                "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
                **({} if routes is None else {ROUTES: routes}),
            },
            non_tensors=repeated.non_tensor_batch,
            meta_info=prompts.meta_info,
        )
        return output

    @torch.no_grad()
    def sample(self, input_ids, attention_mask, position_ids, sampling: SamplingParams, keys):
        """Token-by-token sampling with the KV cache, row ``i`` from the stream ``keys[i]``, or every row
        from the engine's generator when ``keys`` is None; returns responses, log-probs and the response
        mask ([B, max_new_tokens] each), the mask 1 up to and including the first stop token; with
        ``record_routes``, the routes too ([B, P + max_new_tokens, moe_layers, top_k], see the config)."""
        if not self.config.record_routes:
            return self.sample_tokens(input_ids, attention_mask, position_ids, sampling, keys, None)
        hooks = RouteHooks(self.model)
        if not hooks.routers:
            hooks.remove()
            raise ValueError(f"hf rollout: record_routes is set, but {type(self.model).__name__} has no MoE routers "
                             "(router replay is for mixture-of-experts models)")
        calls: list[RoutingCall] = []
        try:
            responses, log_probs, response_mask = self.sample_tokens(
                input_ids, attention_mask, position_ids, sampling, keys,
                lambda tokens: calls.append(hooks.begin(RoutingCall(tokens, record=True))))
        finally:
            hooks.remove()
        rows, prompt_length = input_ids.shape
        seen = torch.cat([hooks.stacked(call).view(rows, -1, len(hooks.routers), hooks.top_k) for call in calls], dim=1)
        routes = torch.full((rows, prompt_length + sampling.max_new_tokens, len(hooks.routers), hooks.top_k), -1, dtype=torch.int16)
        routes[:, : seen.shape[1]] = seen
        valid = torch.cat([attention_mask.cpu().bool(), response_mask.cpu().bool()], dim=1)
        routes[~valid] = -1  # padding, and what was fed after a row finished
        return responses, log_probs, response_mask, routes

    @torch.no_grad()
    def sample_tokens(self, input_ids, attention_mask, position_ids, sampling: SamplingParams, keys,
                      before_call: Callable[[int], None] | None):
        """:meth:`sample` without routes; ``before_call(tokens)`` runs before each model call."""
        from transformers import DynamicCache

        rows, length = input_ids.shape[0], sampling.max_new_tokens
        stop = torch.tensor(sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids)), device=self.device, dtype=torch.long)
        responses = torch.full((rows, length), self.pad_token_id, dtype=torch.long, device=self.device)
        log_probs = torch.zeros(rows, length, dtype=torch.float32, device=self.device)
        response_mask = torch.zeros(rows, length, dtype=torch.long, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        cache = DynamicCache()
        mask = attention_mask
        if before_call is not None:
            before_call(input_ids.numel())
        output = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True)
        positions = position_ids[:, -1:]
        for step in range(length):
            if keys is None:
                tokens, token_log_probs = choose(output.logits[:, -1, :], sampling, self.generator)
            else:
                tokens, token_log_probs = choose_per_row(output.logits[:, -1, :], sampling, keys, [step] * rows, self.generator)
            active = ~finished
            responses[:, step] = torch.where(active, tokens, responses[:, step])
            log_probs[:, step] = torch.where(active, token_log_probs, log_probs[:, step])
            response_mask[:, step] = active.long()
            finished |= active & torch.isin(tokens, stop)
            if finished.all() or step == length - 1:
                break
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions + 1
            if before_call is not None:
                before_call(rows)
            output = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        return responses, log_probs, response_mask

    @torch.no_grad()
    @holding_model_lock
    def score_tokens(self, batch: DataProto, *, temperature: float = 1.0, top_k: int = 0) -> DataProto:
        """One forward of the served model per ``max_batch_rows`` rows (see the contract); float32 log-probs."""
        self.check_ready()
        missing = [key for key in (*PROMPT_KEYS, "responses") if key not in batch.batch.keys()]
        if missing:
            raise KeyError(f"hf rollout: score_tokens needs {missing} (the full sequences and their responses)")
        if top_k and not 1 <= top_k <= self.vocabulary_size:
            raise ValueError(f"hf rollout: top_k={top_k} must be between 1 and the vocabulary size {self.vocabulary_size}")
        width = batch.batch["responses"].shape[1]
        columns: dict[str, list[torch.Tensor]] = {"log_probs": [], "top_k_log_probs": [], "top_k_ids": []}
        for start in range(0, len(batch), self.config.max_batch_rows):
            rows = {key: batch.batch[key][start : start + self.config.max_batch_rows].to(self.device)
                    for key in (*PROMPT_KEYS, "responses")}
            logits = self.model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                                position_ids=rows["position_ids"], use_cache=False).logits[:, -width - 1 : -1]
            log_softmax = (logits.float() / temperature).log_softmax(-1)
            mask = rows["attention_mask"][:, -width:].to(log_softmax.dtype)
            columns["log_probs"].append((log_softmax.gather(-1, rows["responses"].unsqueeze(-1))[..., 0] * mask).cpu())
            if top_k:
                top = log_softmax.topk(top_k, dim=-1)
                columns["top_k_log_probs"].append(top.values.cpu())
                columns["top_k_ids"].append(top.indices.cpu())
        return DataProto.from_dict({key: torch.cat(values) for key, values in columns.items() if values})

    async def generate_tokens(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TokenOutput:
        """One sample for ``prompt_ids``; concurrent calls (from any event loop or thread) share forward
        passes (:mod:`rlplat_rollout_hf.batching`). With ``sampling.seed`` the tokens do not depend on
        the other requests batched with this one: they are those of ``generate`` for this prompt alone."""
        check_single_request(prompt_ids, sampling)
        prompt_ids = self.checked_prompt(prompt_ids)
        self.check_ready()
        stops = frozenset(self.eos_token_ids).union(sampling.stop_token_ids)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.batcher.submit(TokenRequest(prompt_ids, sampling, stops, waiter, loop))
        # the worker starts after every task ready in this event-loop iteration has queued its request
        loop.call_soon(self.batcher.start)
        return await waiter

    partial_rollout_modes = ("keep", "recompute")

    def pause_generation(self) -> None:
        """The token batcher stops at its next token boundary; sequences in flight keep their state."""
        self.batcher.hold()

    def resume_generation(self) -> None:
        self.batcher.release()

    def abort_generation(self) -> None:
        """Every ``generate_tokens`` call in flight or queued returns at the next token boundary with the
        tokens it has (``finish_reason="abort"``)."""
        self.batcher.abort()

    def set_weights_version(self, version: int, mode: str = "keep") -> None:
        """At its next step the token batcher carries its sequences in flight over to these weights per
        ``mode`` (:meth:`rlplat_rollout_hf.batching.RunningBatch.continue_with`)."""
        if mode not in self.partial_rollout_modes:
            raise ValueError(f"hf rollout: mode must be one of {self.partial_rollout_modes}, got {mode!r}")
        with self.model_lock:
            self.weights_version, self.continue_mode = int(version), mode

    def checked_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        vocabulary = self.vocabulary_size
        prompt = [int(token) for token in prompt_ids]
        wrong = [(position, token) for position, token in enumerate(prompt) if not 0 <= token < vocabulary]
        if wrong:
            raise ValueError(f"hf rollout: generate_tokens prompt has token ids outside the vocabulary [0, {vocabulary}) "
                             f"at (position, id) {wrong[:5]}")
        return prompt

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["model_lock"], state["batcher"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.model_lock = threading.RLock()
        self.batcher = TokenBatcher(self, self.config.max_batch_rows)

    # -- weights and memory ----------------------------------------------------------------------------

    @holding_model_lock
    def bind_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Make every parameter a view of the given tensor of the same name (see the contract): only
        when all of them are there, on this device, in this dtype and shape, and no adapter is in use
        (merging it would write into the training engine's tensors); else False, nothing bound."""
        if self.adapter_weights:
            return False
        given = dict(named_tensors)
        parameters = dict(self.model.named_parameters())  # tied weights once, as the engine names them
        for name, parameter in parameters.items():
            tensor = given.get(name)
            if (tensor is None or tensor.shape != parameter.shape or tensor.dtype != self.dtype
                    or tensor.device != self.device):
                return False
        if self.asleep:  # real parameters (and buffers) again, then bound: their own storage goes
            self.wake_up()
            parameters = dict(self.model.named_parameters())
        for name, parameter in parameters.items():
            parameter.data = given[name]
        self.missing_weights = set()
        self.adapter_base = {}  # bound weights change with every optimizer step: no base to keep
        self.bound = True
        return True

    @holding_model_lock
    def unbind_weights(self) -> None:
        """Own copies of bound weights again (before anything writes into them)."""
        if self.bound:
            with torch.no_grad():
                for parameter in self.model.parameters():
                    parameter.data = parameter.data.clone()
            self.bound = False

    @holding_model_lock
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.asleep:
            raise RuntimeError("hf rollout is asleep: call wake_up() before update_weights()")
        self.unbind_weights()  # never write into the training engine's parameters
        self.remove_adapter()  # full weights are a new base: the adapter is off until loaded again
        with torch.no_grad():
            # a bucket at a time: its names and shapes checked, then one batched copy (a copy per tensor costs
            # more than the bytes at a small model's sizes)
            pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            for name, tensor in named_tensors:
                target, given = self.targets.get(name), name
                if target is None and name in self.aliases:  # one expert's projection of a fused expert tensor
                    alias = self.aliases[name]
                    name, target = alias.target, alias.view(self.targets[alias.target])
                    given = f"{given} (in {name})"
                if target is None:
                    raise KeyError(f"hf rollout: the model has no weight named {name!r}")
                if target.shape != tensor.shape:
                    raise ValueError(f"hf rollout: weight {given!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
                pairs.append((name, target, tensor))
                if len(pairs) == 256:
                    self.copy_weights(pairs)
                    pairs = []
            self.copy_weights(pairs)

    def copy_weights(self, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        targets = [target.data for _, target, _ in pairs]
        torch._foreach_copy_(targets, [tensor.to(device=target.device, dtype=target.dtype, non_blocking=True)
                                       for _, target, tensor in pairs])
        for name, target, _ in pairs:
            self.missing_weights.discard(id(self.targets.get(name, target)))  # an expert's slice: its fused tensor
            base = self.adapter_base.get(name)
            if base is not None:
                base.copy_(target.data)

    @holding_model_lock
    def weight_fingerprints(self) -> dict[str, Any] | None:
        from rlplat.kits.weights import fingerprint

        if self.asleep:
            return None
        return {name: fingerprint(target.data) for name, target in self.targets.items()}

    @holding_model_lock
    def load_adapter(self, config: Mapping[str, Any], named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Serve the base weights with this LoRA adapter merged in, replacing the previous adapter (see
        :mod:`rlplat_rollout_hf.adapters` for what is accepted). Everything is checked before any weight
        changes: a refused adapter leaves the rollout serving what it served."""
        if self.asleep or self.missing_weights:
            raise RuntimeError("hf rollout: load_adapter needs the base weights loaded: call wake_up() and "
                               "update_weights() with the full weights first")
        modules = dict(self.model.named_modules())
        updates = read_adapter(config, named_tensors, modules)
        owners: dict[int, list[str]] = {}
        for name, parameter in self.model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(parameter), []).append(name)
        for update in updates:
            names = owners[id(modules[update.module].weight)]
            if len(names) > 1:
                raise AdapterError(f"hf rollout: adapter module {update.module!r} has its weight tied to "
                                   f"{[name for name in names if name != update.module + '.weight']}; merging the "
                                   "adapter would change those too")
        self.unbind_weights()  # never write into the training engine's parameters
        self.remove_adapter()
        with torch.no_grad():
            for update in updates:
                weight = modules[update.module].weight
                name = f"{update.module}.weight"
                base = self.adapter_base.get(name)
                if base is None:
                    base = self.adapter_base[name] = weight.detach().clone()
                weight.copy_((base.float() + update.delta(weight.device)).to(weight.dtype))
        self.adapter_weights = tuple(f"{update.module}.weight" for update in updates)

    @holding_model_lock
    def remove_adapter(self) -> None:
        """Serve the base weights again (those last loaded in full); nothing to do without an adapter."""
        with torch.no_grad():
            for name in self.adapter_weights:
                self.targets[name].copy_(self.adapter_base[name])
        self.adapter_weights = ()

    @holding_model_lock
    def sleep(self) -> None:
        """Release every parameter and buffer (the KV cache lives only inside ``generate`` and the
        running batch of ``generate_tokens`` requests, whose waiting callers then get the "asleep"
        error). Bound weights are the training engine's: nothing of the rollout's own to release, they
        stay."""
        if self.asleep or self.bound:
            return
        self.adapter_base, self.adapter_weights = {}, ()  # weights come back with update_weights, adapter off
        self.saved_buffers = {name: buffer.detach().to("cpu", copy=True) for name, buffer in self.model.named_buffers()}
        self.model.to_empty(device="meta")
        # the name map held the old tensors too (so sleep freed nothing on CUDA): map the meta ones
        self.targets = dict(self.model.state_dict(keep_vars=True))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    @holding_model_lock
    def wake_up(self) -> None:
        """Allocate the weights again (their values must come from ``update_weights``) and restore buffers."""
        if not self.asleep:
            return
        # moving off the meta device makes new Parameter objects: tie shared weights again and re-map names
        self.model.to_empty(device=self.device)
        self.model.tie_weights()
        self.targets = dict(self.model.state_dict(keep_vars=True))
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(self.saved_buffers[name])
        self.saved_buffers = {}
        self.missing_weights = {id(parameter) for parameter in self.model.parameters()}
        self.asleep = False

    def check_ready(self) -> None:
        if self.asleep:
            raise RuntimeError("hf rollout is asleep: call wake_up() and update_weights() before generating")
        if self.missing_weights:
            raise RuntimeError(
                f"hf rollout woke up but {len(self.missing_weights)} weight tensors were not updated since; "
                "call update_weights() with the full weights before generating"
            )

    def parameter_bytes(self) -> int:
        """Bytes of parameter storage held on real devices (0 while asleep)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.device.type != "meta")
