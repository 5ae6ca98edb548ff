"""The memory-plan types of the contracts: what an engine, a rollout or a plugin role tells the planner about its
memory, and the model shapes it computes from (:mod:`rlplat.kits.memory` has the helpers an estimate computes
with; ``rlplat plan``'s planner, :mod:`rlplat.cli.planner`, sums them per phase).

An engine's or rollout's ``estimate_memory(config, model_config, context)`` (an optional classmethod of
:class:`rlplat.contracts.engine.TrainingEngine` and :class:`rlplat.contracts.rollout.RolloutEngine`, or
the torch-free function its registration names in ``metadata["estimate_memory"]``, which the planner
prefers: :func:`rlplat.cli.planner.estimate_function`) reads only its own config node, the model's ``config.json`` (a dict) and a :class:`MemoryContext`
(where and how it runs), and returns a :class:`MemoryEstimate`: a list of :class:`MemoryItem`, each the
bytes one device holds for one thing (parameters, gradients, optimizer states, activations, KV cache,
...) during the **calls** named in ``calls``:

``resident``  always (between calls too)
``forward``   an engine's forward without gradients (log-probs, reference log-probs, values, scores)
``update``    an engine's ``train_batch``
``export``    an engine's ``named_weights`` (the weight sync)
``generate``  a rollout's generation
``wake_up``   a rollout's wake-up and weight load (the weight sync)

The planner maps the calls to the run's phases by role (the actor's ``forward`` is the old-log-prob
pass, the reference's the reference pass, ...; see :mod:`rlplat.cli.planner`). A plugin role adds
:class:`PlannedComponent` s (``metadata["plan"]`` of its ``role`` entry). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

CALLS = ("resident", "forward", "update", "export", "generate", "wake_up")

@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer, read from its Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int = 0
    """Routed experts of a mixture-of-experts MLP (0: a dense MLP)."""
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0
    """Decoder layers with experts (Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers`` leave the
    others dense, with ``intermediate_size``)."""
    qk_norm: bool = False
    """Qwen3's RMSNorm of each head's queries and keys (``2 x head_dim`` parameters a layer)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "config.json") -> "ModelShape":
        """Read from a ``config.json`` dict (the text config of a multimodal model when it has one)."""
        config = dict(config.get("text_config") or config)
        missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if key not in config]
        if missing:
            raise ValueError(f"{where}: no {', '.join(missing)}; the plan reads a decoder model's sizes from its config.json")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        experts = int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0)
        model_type = str(config.get("model_type", ""))
        layers = int(config["num_hidden_layers"])
        dense_only = set(config.get("mlp_only_layers") or ())
        step = int(config.get("decoder_sparse_step") or 1)
        moe_layers = sum(1 for index in range(layers) if index not in dense_only and (index + 1) % step == 0) if experts else 0
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type.startswith("qwen2"))),
            num_experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0),
            expert_intermediate_size=int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0) if experts else 0,
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            moe_layers=moe_layers,
            qk_norm=model_type.startswith("qwen3"),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_parameters(self, sparse: bool | None = None) -> int:
        """Parameters of one decoder layer: attention, MLP (or experts, router and shared expert with its
        gate), two norms. ``sparse``: a layer with experts or a dense one; None: the larger (a MoE model's
        sparse layer)."""
        h = self.hidden_size
        attention = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attention += 2 * self.head_dim
        if sparse is None:
            sparse = self.moe_layers > 0
        if sparse:
            mlp = self.num_experts * 3 * h * self.expert_intermediate_size + self.num_experts * h
            if self.shared_expert_intermediate_size:
                mlp += 3 * h * self.shared_expert_intermediate_size + h  # and its sigmoid gate
        else:
            mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h

    def expert_parameters(self) -> int:
        """Parameters of the routed experts and their routers, over every layer."""
        return self.moe_layers * self.num_experts * (3 * self.hidden_size * self.expert_intermediate_size + self.hidden_size)

    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_parameters(self, head: str = "lm") -> int:
        """The output head: ``lm`` (tied embeddings: none of its own), ``value`` / ``score`` (one output)."""
        if head == "lm":
            return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.hidden_size + 1

    def parameters(self, head: str = "lm") -> int:
        """All parameters: embeddings, layers, final norm and the head."""
        layers = self.moe_layers * self.layer_parameters(True) + (self.num_layers - self.moe_layers) * self.layer_parameters(False)
        return self.embedding_parameters() + layers + self.hidden_size + self.head_parameters(head)

    def kv_cache_bytes_per_token(self, element_bytes: int) -> int:
        """``2 x layers x KV heads x head dim x bytes``: one token's keys and values in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    def active_intermediate(self) -> int:
        """MLP width one token passes through (its experts and the shared expert for a MoE model)."""
        if self.num_experts:
            return max(self.experts_per_token, 1) * self.expert_intermediate_size + self.shared_expert_intermediate_size
        return self.intermediate_size


@dataclasses.dataclass(frozen=True)
class MemoryContext:
    """Where and how a component runs, as the planner derives it from the run config."""

    role: str
    """``actor``, ``reference``, ``critic``, ``reward_model`` or ``rollout``."""
    processes: int
    """Processes (devices) of the component's worker group: the engine shards over them."""
    device: str
    """``cuda`` or ``cpu``."""
    prompt_length: int
    """``data.max_prompt_length``."""
    response_length: int
    """``rollout.response_length``."""
    sequences_per_process: int
    """Sequences (prompts x ``rollout.n``) one process holds in a step."""
    device_memory: Optional[int] = None
    """Bytes of one device, when known (rollouts that take a fraction of it need it)."""
    shares_actor_weights: bool = False
    """The rollout reads the actor engine's parameters in place (``rollout.share_weights`` in one process)."""
    free_between_phases: bool = False
    """``rollout.free_between_phases``: the rollout sleeps after generating and wakes at the weight sync."""
    weight_bucket_bytes: int = 256 << 20
    """Bytes of one bucket of the weight sync."""
    lora_rank: int = 0
    """``actor.lora.rank`` (0: full fine-tuning) for the actor and its reference."""

    @property
    def sequence_length(self) -> int:
        return self.prompt_length + self.response_length


@dataclasses.dataclass(frozen=True)
class MemoryItem:
    """Bytes one device holds for one thing during some calls (see the module docstring)."""

    name: str
    """What it is: ``parameters``, ``gradients``, ``optimizer states``, ``activations``, ``KV cache``, ..."""
    bytes: int
    calls: tuple[str, ...]
    """When the device holds it: ``("resident",)`` or some of :data:`CALLS`."""
    detail: str = ""
    """How the number is made (``7.6e9 x 4 B (float32) / 8 shards``), for people."""

    def __post_init__(self) -> None:
        unknown = [call for call in self.calls if call not in CALLS]
        if unknown or not self.calls:
            raise ValueError(f"memory item {self.name!r}: calls must be some of {CALLS}, got {self.calls}")
        if self.bytes < 0:
            raise ValueError(f"memory item {self.name!r}: bytes must be >= 0, got {self.bytes}")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """A component's items on one device, and notes (what it assumed, what it left out) for people."""

    items: tuple[MemoryItem, ...]
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    """What makes the component fail whatever the device's total (e.g. a memory fraction that leaves no
    room for a KV cache); ``rlplat run`` refuses these like a peak beyond the device."""

    def during(self, call: str) -> int:
        """Bytes held during ``call`` (resident items included)."""
        return sum(item.bytes for item in self.items if "resident" in item.calls or call in item.calls)


@dataclasses.dataclass
class PlannedComponent:
    """One component a plugin role adds to the plan (``metadata["plan"]`` of its ``role`` entry names a
    function ``(config, gpu) -> list[PlannedComponent]``, empty when the run does not enable the role)."""

    kind: str
    """``engine`` or ``rollout``: whose memory estimate prices it."""
    name: str
    """The engine's or rollout's registered name."""
    role: str
    """The role, as :class:`~rlplat.contracts.memory.MemoryContext` names it (e.g. ``reward_model``)."""
    placement: str
    """``colocated`` (the actor's pool) or ``separate``."""
    nnodes: Any
    devices_per_node: Any
    key: str
    """The run-config node that places it (``reward.model``), for the pool's source and messages."""
    node: dict
    """What the engine's or rollout's factory receives."""
    model_path: str
    """Its Hugging Face model folder (``config.json`` gives the shapes)."""
    phase: str
    """The phase of a step in which it runs (e.g. ``reward_model``)."""
    resident_phases: Any = None
    """The phases in which its weights are resident (None: all)."""
