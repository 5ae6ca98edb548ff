"""``TinkerWorker``: the training engine and the sampler behind the service, driven through rlplat's contracts only.

One engine per LoRA shape (rank and targets); the clients of one shape take turns on it: each client's adapter, its
gradients so far, its optimizer state and step count are its :meth:`~rlplat.contracts.engine.TrainingEngine.trainable_state`,
put in place before each of its calls (nothing is copied when the same client calls again). So one base model
serves several adapters, and a client's weights change only by its own steps.

The sampler is the configured rollout (``hf`` by default) in the same process. A sampler snapshot is the client's
full weights (adapter merged) at the time it was saved; sampling from a snapshot loads it into the rollout when
another is loaded. When a snapshot is taken the rollout samples a few tokens of a fixed prompt with it and the
engine scores them: a mean difference per token above ``probe_tolerance`` is refused (the sync probe of
:mod:`rlplat.trainer.sync_probe`, for the service).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlplat.config_node import read_config_node
from rlplat.contracts.rollout import SamplingParams
from rlplat.controller.decorator import Dispatch, register
from rlplat.controller.worker import Worker, without_padding_weight
from rlplat.protocol import DataProto
from rlplat.registry import EngineRegistry

PROBE_PROMPT_TOKENS, PROBE_NEW_TOKENS = 4, 8


@dataclasses.dataclass
class TinkerWorkerConfig:
    engine: str = "fsdp2"
    engine_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's build config, LoRA left out (each client's shape adds its own ``lora``)."""
    rollout: str = "hf"
    rollout_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    probe_tolerance: float = 0.05
    """Largest mean absolute difference per token between the sampler's and the engine's log-probs of a snapshot."""


def broadcast_from_first(value: Any) -> Any:
    """Rank 0's ``value`` on every rank of the process group (itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def lora_key(lora: Optional[Dict[str, Any]]) -> str:
    return "full" if not lora else "lora:" + ",".join(f"{key}={lora[key]}" for key in sorted(lora))


#: What the service needs of an engine: each client's step run as the client asks, clients kept apart.
REQUIRED_FEATURES = frozenset({"split_step", "trainable_state"})


def check_engine_features(name: str, features: Any) -> None:
    missing = REQUIRED_FEATURES - set(features)
    if missing:
        raise ValueError(f"engine {name!r} lacks {', '.join(sorted(missing))} (TrainingEngine.features), which the "
                         "service needs to run each client's step as the client asks and to keep clients apart")


class TinkerWorker(Worker):
    def __init__(self, config: Any):
        super().__init__()
        self.config = read_config_node(config, TinkerWorkerConfig, "tinker worker config")
        self.engines: dict[str, Any] = {}
        self.fresh: dict[str, Any] = {}  # per engine: its trainable state as built (a new client's)
        self.active: dict[str, Optional[str]] = {}  # per engine: the client whose state is in place
        self.clients: dict[str, str] = {}  # client -> engine key
        self.states: dict[str, Any] = {}  # client -> its state while another client's is in place
        self.snapshots: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.loaded: Optional[str] = None  # the snapshot the rollout holds
        self.rollout: Any = None

    # -- clients ------------------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def create(self, client: str, lora: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """A new client on the engine of its LoRA shape (built on first use); returns the engine's facts."""
        key = lora_key(lora)
        if key not in self.engines:
            engine = EngineRegistry("engine").build(self.config.engine, {**self.config.engine_config, "lora": lora})
            engine.init_model()
            check_engine_features(self.config.engine, getattr(engine, "features", ()))
            self.engines[key], self.fresh[key], self.active[key] = engine, engine.trainable_state(), None
            self.set_dispatch_info(*engine.data_parallel_info())
        self.clients[client] = key
        self.states[client] = self.fresh[key]
        engine = self.engines[key]
        hf_config = getattr(engine, "hf_config", None)
        return {"vocab_size": int(getattr(hf_config, "vocab_size", 0) or 0),
                "max_position_embeddings": getattr(hf_config, "max_position_embeddings", None),
                "model_type": getattr(hf_config, "model_type", None)}

    @register(Dispatch.ONE_TO_ALL)
    def unload(self, client: str) -> None:
        key = self.clients.pop(client)
        self.states.pop(client, None)
        if self.active.get(key) == client:
            self.active[key] = None

    def engine_of(self, client: str) -> Any:
        """The client's engine with the client's state in place."""
        if client not in self.clients:
            raise KeyError(f"no training client {client!r} on this worker")
        key = self.clients[client]
        engine, current = self.engines[key], self.active[key]
        if current != client:
            if current is not None:
                self.states[current] = engine.trainable_state()
            engine.load_trainable_state(self.states.pop(client))
            self.active[key] = client
        return engine

    # -- training ------------------------------------------------------------------------------------------

    @register(Dispatch.DP_MESH)
    def forward_backward(self, client: str, batch: DataProto, loss_fn: Any) -> DataProto:
        return self.engine_of(client).forward_backward(without_padding_weight(batch, self.padding_rows), loss_fn)

    @register(Dispatch.DP_MESH)
    def forward(self, client: str, batch: DataProto) -> DataProto:
        return self.engine_of(client).forward(batch)

    @register(Dispatch.ONE_TO_ALL)
    def optimizer_step(self, client: str, settings: Dict[str, Any]) -> Dict[str, float]:
        return self.engine_of(client).optimizer_step(settings)

    @register(Dispatch.ONE_TO_ALL)
    def save_state(self, client: str, path: str) -> None:
        self.engine_of(client).save(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, client: str, path: str, optimizer: bool) -> None:
        """The weights saved at ``path``; with ``optimizer`` its optimizer state and step count too, else those of
        a new client."""
        engine = self.engine_of(client)
        if not Path(path).is_dir():
            raise FileNotFoundError(f"no saved state at {path}")
        engine.load(path)
        if not optimizer:
            state, fresh = engine.trainable_state(), self.fresh[self.clients[client]]
            engine.load_trainable_state({**state, **{key: fresh[key] for key in ("optimizer", "lr_scheduler", "global_step")}})

    # -- sampling ----------------------------------------------------------------------------------------------

    def require_rollout(self) -> Any:
        if self.rollout is None:
            self.rollout = EngineRegistry("rollout").build(self.config.rollout, dict(self.config.rollout_config))
        return self.rollout

    @register(Dispatch.ONE_TO_ALL)
    def snapshot(self, client: str, name: str) -> Dict[str, float]:
        """The client's weights now, kept as sampler snapshot ``name`` and loaded into rank 0's rollout; probed
        (every rank scores the probe's tokens: the engine's forward is a collective)."""
        engine = self.engine_of(client)
        named = [(key, tensor.detach()) for bucket in engine.named_weights() for key, tensor in bucket]  # every rank: gathers
        sampled = None
        if self.rank == 0:
            self.snapshots[name] = self.kept_weights(named)
            self.loaded = None  # the name may be one the rollout holds older weights of
            self.load_snapshot(name)
            prompt = torch.arange(1, PROBE_PROMPT_TOKENS + 1).unsqueeze(0)
            prompts = DataProto.from_dict({"input_ids": prompt, "attention_mask": torch.ones_like(prompt),
                                           "position_ids": torch.arange(PROBE_PROMPT_TOKENS).unsqueeze(0)})
            sampled = self.rollout.generate(prompts, SamplingParams(max_new_tokens=PROBE_NEW_TOKENS, seed=0))
        sampled = broadcast_from_first(sampled)
        trained = engine.forward(sampled).batch["log_probs"]
        if self.rank != 0:
            return {}
        mask = sampled.batch["response_mask"].bool()
        difference = float(((trained - sampled.batch["rollout_log_probs"]).abs() * mask).sum() / mask.sum().clamp(min=1))
        if difference > self.config.probe_tolerance:
            raise RuntimeError(f"sync probe: the sampler's log-probs differ from the trained weights' by {difference:.3g} per token "
                               f"(tolerance {self.config.probe_tolerance:g}): the weights did not reach the sampler")
        return {"sync_probe/mean_abs_diff": difference}

    def kept_weights(self, named: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
        """Copies of ``named`` to keep as a snapshot, sharing every tensor equal to the newest snapshot's of that
        name: a LoRA client's frozen weights (embeddings, norms, modules without adapters) are held once however
        many snapshots there are, not once per snapshot."""
        newest = dict(self.snapshots[next(reversed(self.snapshots))]) if self.snapshots else {}
        kept = []
        for key, tensor in named:
            held = newest.get(key)
            same = (held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype
                    and held.device == tensor.device and torch.equal(held, tensor))
            kept.append((key, held if same else tensor.clone()))
        return kept

    def load_snapshot(self, name: str) -> None:
        if self.loaded != name:
            if name not in self.snapshots:
                raise KeyError(f"no sampler weights {name!r}")
            self.require_rollout().update_weights(self.snapshots[name])
            self.loaded = name

    @register(Dispatch.ONE_TO_ALL)
    def drop_snapshot(self, name: str) -> None:
        self.snapshots.pop(name, None)
        if self.loaded == name:
            self.loaded = None

    @register(Dispatch.ONE_TO_ALL)
    def sample(self, name: str, prompts: List[List[int]], sampling: SamplingParams) -> Optional[DataProto]:
        """``sampling.n`` samples of each prompt (left padded into one batch) from snapshot ``name`` (rank 0's
        rollout): ``B * n`` rows, each prompt's samples adjacent."""
        if self.rank != 0:
            return None
        self.load_snapshot(name)
        width = max(len(prompt) for prompt in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
        return self.rollout.generate(batch, sampling)

    @register(Dispatch.ONE_TO_ALL)
    def score(self, name: str, tokens: List[int]) -> Optional[List[float]]:
        """Log-probs of ``tokens[1:]`` under snapshot ``name``, each given the tokens before it (rank 0)."""
        if self.rank != 0:
            return None
        self.load_snapshot(name)
        ids = torch.tensor([tokens[:1]])
        batch = DataProto.from_dict({"input_ids": torch.tensor([tokens]), "attention_mask": torch.ones(1, len(tokens), dtype=torch.long),
                                     "position_ids": torch.arange(len(tokens)).unsqueeze(0), "prompts": ids,
                                     "responses": torch.tensor([tokens[1:]]), "response_mask": torch.ones(1, len(tokens) - 1)})
        return self.rollout.score_tokens(batch).batch["log_probs"][0].tolist()
