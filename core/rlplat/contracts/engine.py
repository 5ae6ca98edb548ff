"""The training-engine contract: what the actor, reference and critic workers need from a trainer.

DataProto keys (verl's names) are listed per method. Shapes: ``B`` rows, ``P`` prompt tokens (left
padded), ``R`` response tokens (right padded), ``T = P + R``. All log-probs are float32.
"""

from __future__ import annotations

import abc
import dataclasses
import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Iterator, List, Mapping, NamedTuple, Optional, Protocol

if TYPE_CHECKING:
    import torch

    from rlplat.contracts.memory import MemoryContext, MemoryEstimate
    from rlplat.protocol import DataProto


@dataclasses.dataclass
class EngineBuildConfig:
    """The keys every engine factory receives from the run config, whatever the engine.

    The trainer builds the engine of a role (``actor``, reference, ``critic``) with
    ``registry.get("engine", name)({**build_config, **engine_config})``: these keys, filled from the
    run config as listed, and the user's ``<role>.engine_config`` node on top. An engine's registered
    ``config_schema`` therefore extends this class (``class MyEngineConfig(EngineBuildConfig)``) with its
    own keys; ``load_config`` checks the combined node against it before any worker starts, and refuses
    a key of this class in ``engine_config`` (it names the run-config key to set instead).
    """

    model_path: Optional[str] = None
    """``model.path``: local Hugging Face directory of the model."""
    seed: int = 0
    """``trainer.seed``: seeds initialisation and the engine's RNGs."""
    lr: float = 1e-6
    """``<role>.optim.lr``: peak learning rate."""
    weight_decay: float = 0.01
    """``<role>.optim.weight_decay``."""
    betas: List[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """``<role>.optim.betas``: AdamW (beta1, beta2)."""
    lr_warmup_steps: int = 0
    """``<role>.optim.warmup_steps``: optimizer steps of linear warm-up."""
    lr_scheduler_type: str = "constant"
    """``<role>.optim.lr_scheduler_type``: ``constant`` or ``cosine`` after warm-up."""
    min_lr_ratio: float = 0.0
    """``<role>.optim.min_lr_ratio``: floor of the cosine schedule, as a fraction of ``lr``."""
    grad_clip: Optional[float] = 1.0
    """``<role>.optim.grad_clip``: global gradient-norm clip (None: none)."""
    total_training_steps: int = 0
    """Optimizer steps of the whole run, the unit of the LR schedule: training steps x
    (``data.train_batch_size`` / ``<role>.ppo_mini_batch_size``) x ``<role>.ppo_epochs``."""
    ppo_mini_batch_size: Optional[int] = None
    """Rows (responses) of the global batch per optimizer step: ``<role>.ppo_mini_batch_size`` prompts
    x ``rollout.n``. A batch's ``meta_info["ppo_mini_batch_size"]`` overrides it per call."""
    ppo_epochs: int = 1
    """``<role>.ppo_epochs``: passes over each batch in ``train_batch``."""
    micro_batch_size_per_gpu: int = 8
    """``<role>.micro_batch_size_per_gpu``: rows per micro-batch when ``use_dynamic_bsz`` is off."""
    use_dynamic_bsz: bool = False
    """``<role>.use_dynamic_bsz``: micro-batches by a token budget instead of a row count."""
    max_token_len_per_gpu: int = 16384
    """``<role>.max_token_len_per_gpu``: the token budget of one micro-batch."""
    value_model: bool = False
    """True for the critic: a scalar value head, ``forward`` returns ``values``."""
    reward_model: bool = False
    """True for a reward model: a sequence-classification model with one label (Hugging Face's
    ``AutoModelForSequenceClassification``); ``forward`` returns ``rm_scores`` [B], the head's output at
    each row's last token with ``attention_mask`` 1, and reads only ``input_ids``, ``attention_mask`` and
    ``position_ids`` (no ``responses``)."""
    lora: Optional[Dict[str, Any]] = None
    """``actor.lora`` when its rank is above 0 (:class:`rlplat.lora.LoraConfig`), else None: train
    adapters only; engines with ``supports_lora`` take it, the others are refused at load."""
    moe: Optional[Dict[str, Any]] = None
    """``actor.moe`` when a setting differs from its default (:class:`rlplat.config.moe.MoEConfig`: router
    replay, router losses), else None; engines whose registry metadata has ``"moe": True`` take it, the
    others are refused at load. Router replay reads the batch column ``routed_experts``
    (:mod:`rlplat.kits.moe`)."""


class DataParallelInfo(NamedTuple):
    """This rank's place for data dispatch (:meth:`TrainingEngine.data_parallel_info`)."""

    dp_rank: int
    """Index of this rank's data-parallel group: ranks with the same ``dp_rank`` get the same rows."""
    dp_size: int
    """Number of data-parallel groups: the batch is split into this many shards."""
    collect: bool
    """Whether the driver takes its output from this rank (exactly one rank per ``dp_rank``)."""


class LossFunction(Protocol):
    """What :meth:`TrainingEngine.train_batch` calls once per micro-batch.

    ``outputs`` holds what :meth:`TrainingEngine.forward` would return for the micro-batch, with
    gradients: ``log_probs`` [b, R], and ``entropy`` [b, R] when asked, ``values`` [b, R] for a value
    model. ``micro_batch.meta_info`` carries ``global_token_count`` (valid response tokens of the whole
    mini-batch summed over every data-parallel rank) and ``global_sequence_count`` (its rows with at
    least one valid response token, over every rank), so the returned loss can be normalised globally: the engine *sums* gradients over
    micro-batches and ranks, which makes every aggregation mode independent of how the mini-batch was
    split. Returns ``(loss, metrics)``: a scalar tensor and a dict of numbers for logging, each a float or a
    detached 0-dim tensor; an engine reads tensors once after its micro-batch loop (:func:`float`), so a loss whose
    metrics are tensors never makes the host wait for the device between micro-batches.

    Metrics are contributions, like the loss: the engine *sums* each metric over the micro-batches and
    ranks of a mini-batch (and averages over optimizer steps). A globally normalised quantity (the loss
    and its parts) is reported as it is; a mean over the micro-batch's tokens is scaled by the
    micro-batch's share of ``global_token_count``. Every metric is then independent of the split too.
    :mod:`rlplat.losses` implements these rules (``aggregate_with_settings``, ``as_contributions``) and
    the actor's and critic's losses.

    An optional attribute ``needs_entropy`` (default False) asks the engine to compute ``entropy`` in
    ``outputs`` (it costs a pass over the vocabulary, so it is computed only when asked). A loss function
    must pickle: the driver may build it and ship it to the workers by value.

    Two more optional attributes, for engines that list them in :attr:`TrainingEngine.features`:
    ``count_masks`` (names of ``[b, R]`` mask columns of the batch) makes the engine put
    ``meta_info["global_counts"][name] = {"tokens": ..., "sequences": ...}`` of each mask (within
    ``response_mask``) over the whole mini-batch and every rank, as it does ``global_token_count``;
    ``gather_ids`` (the name of an int64 ``[b, R, k]`` column of token ids) makes ``outputs`` hold
    ``gathered_log_probs`` ``[b, R, k]``: ``log softmax(logits / temperature)`` at those ids, with gradients
    (a distillation loss's student side at the teacher's top-k ids).
    """

    def __call__(self, outputs: Mapping[str, "torch.Tensor"], micro_batch: "DataProto") -> tuple["torch.Tensor", dict[str, float]]: ...


class TrainingEngine(abc.ABC):
    """A model with its optimizer and schedule, sharded over the data-parallel ranks of its worker group.

    Built by the registry factory from ``(config, **kwargs)``; the constructor only records the config.
    :meth:`init_model` runs inside the worker process after ``torch.distributed`` is set up.

    **LoRA** (optional, ``supports_lora = True``): with ``EngineBuildConfig.lora`` the engine trains
    adapters only; :meth:`named_weights` and :meth:`export_hf` give the weights with the adapter merged in,
    :meth:`adapter_weights` and :meth:`export_adapter` the adapter alone, :meth:`adapter_disabled` the
    base model (the reference policy), and :meth:`save` / :meth:`load` hold the adapter and its optimizer
    state only.
    """

    supports_lora: ClassVar[bool] = False
    """Whether the engine takes ``EngineBuildConfig.lora`` (checked at load)."""
    features: ClassVar[frozenset] = frozenset()
    """Optional abilities, checked before a run relies on them: ``count_masks`` and ``gather_ids`` (a loss
    function's attributes of those names, see :class:`LossFunction`), ``top_k`` (:meth:`forward` takes
    ``top_k=k``), ``split_step`` (:meth:`forward_backward` and :meth:`optimizer_step`) and ``trainable_state``
    (:meth:`trainable_state` and :meth:`load_trainable_state`)."""

    @abc.abstractmethod
    def init_model(self) -> None:
        """Build the model (from ``model.path``, a local Hugging Face directory, or from a config),
        the optimizer and the LR schedule; deterministic under the configured seed."""

    @abc.abstractmethod
    def forward(self, batch: "DataProto", *, temperature: float = 1.0, calculate_entropy: bool = False) -> "DataProto":
        """Evaluate without gradients.

        Reads ``input_ids``, ``attention_mask``, ``position_ids`` [B, T] and ``responses`` [B, R].
        Returns a new DataProto with ``log_probs`` [B, R] (log-probabilities of the response tokens
        under logits divided by ``temperature``, exactly as the rollout samples), ``entropy`` [B, R]
        when ``calculate_entropy``, ``values`` [B, R] for a value model, and only ``rm_scores`` [B] for a
        reward model (``EngineBuildConfig.reward_model``, which reads no ``responses``). Row order is preserved.
        Only positions inside the response mask are defined; an engine that skips padding (packing)
        returns 0 outside it.

        An engine with ``top_k`` in :attr:`features` takes ``top_k=k`` (> 0) and adds ``top_k_log_probs`` and
        ``top_k_ids`` [B, R, k]: the ``k`` largest log-probs at each response position and their token ids
        (a teacher's side of a top-k distillation loss). Callers pass it only to such an engine.
        """

    @abc.abstractmethod
    def train_batch(self, batch: "DataProto", loss_fn: LossFunction) -> dict[str, float]:
        """One optimizer step per mini-batch of ``batch`` (``meta_info["ppo_mini_batch_size"]`` rows,
        ``meta_info["ppo_epochs"]`` passes), accumulating gradients over micro-batches (fixed size or a
        token budget), clipping them and stepping the LR schedule. A row count that the mini-batch size
        does not divide ends with a smaller mini-batch (a batch smaller than it is one step);
        ``meta_info["ppo_mini_batch_size"] = None`` makes the whole batch one mini-batch. Each
        mini-batch is normalised by its own global counts.

        Reads what ``loss_fn`` needs (typically ``responses``, ``response_mask``, ``old_log_probs``,
        ``advantages``, ``ref_log_prob``, ``values``, ``returns``) plus the model inputs. Returns
        metrics averaged over steps: at least ``grad_norm`` and ``lr`` and the loss function's own.
        """

    @abc.abstractmethod
    def named_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
        """Full (unsharded) parameters in Hugging Face naming, yielded in buckets of at most
        ``bucket_bytes`` (a single tensor larger than that forms its own bucket), for the rollout."""

    def shared_weights(self) -> "list[tuple[str, torch.Tensor]] | None":
        """The full weights in the names of :meth:`named_weights`, as tensors that share storage with the
        engine's own parameters (views, no copy), or None (the default) when this rank does not hold
        whole parameters (sharded, offloaded). A rollout in the same process binds them
        (:meth:`RolloutEngine.bind_weights`) so that a weight sync copies nothing. The views are valid
        until the engine re-materialises its parameters; callers ask again at every sync."""
        return None

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Write a resumable, sharded checkpoint (model, optimizer, LR schedule, RNG) into ``path``."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        """Restore exactly what :meth:`save` wrote; raises if ``path`` is missing or incomplete."""

    @abc.abstractmethod
    def export_hf(self, path: str) -> None:
        """Write a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""

    @abc.abstractmethod
    def offload(self) -> None:
        """Move parameters and optimizer state off the accelerator between phases (no-op on CPU)."""

    @abc.abstractmethod
    def onload(self) -> None:
        """Undo :meth:`offload`."""

    def data_parallel_info(self) -> DataParallelInfo:
        """This rank's data-parallel place, asked by the worker after :meth:`init_model` so that batch
        methods dispatch by the engine's mesh: with tensor or pipeline parallelism the ranks of one
        data-parallel group get the same rows and one of them (e.g. TP rank 0 of the last pipeline stage)
        answers. The default is flat: every rank is its own data-parallel group
        (``torch.distributed``'s rank and world size, ``(0, 1, True)`` without a process group)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return DataParallelInfo(dist.get_rank(), dist.get_world_size(), True)
        return DataParallelInfo(0, 1, True)

    def adapter_disabled(self) -> "contextlib.AbstractContextManager[None]":
        """A context in which :meth:`forward` runs the base model, adapters off (the reference policy
        of a LoRA run). Engines without LoRA have no adapters to switch off: they refuse."""
        raise RuntimeError(f"{type(self).__name__} has no LoRA adapters to disable (TrainingEngine.supports_lora)")

    def adapter_weights(self) -> "tuple[dict[str, Any], list[tuple[str, torch.Tensor]]] | None":
        """The LoRA adapter for a rollout that loads adapters: ``(peft adapter config as a dict, [(name,
        full tensor)])`` in ``peft``'s naming (``base_model.model.<module>.lora_A.weight``); None without
        LoRA."""
        return None

    def export_adapter(self, path: str) -> None:
        """Write the adapter as a folder ``peft.PeftModel.from_pretrained`` loads (``adapter_config.json``
        and ``adapter_model.safetensors``). Engines without LoRA refuse."""
        raise RuntimeError(f"{type(self).__name__} has no LoRA adapter to export (TrainingEngine.supports_lora)")

    def forward_backward(self, batch: "DataProto", loss_fn: LossFunction, *, temperature: float = 1.0) -> "DataProto":
        """Half of :meth:`train_batch`, for callers that step the optimizer themselves (``split_step`` in
        :attr:`features`): forward and backward over ``batch`` in micro-batches, the gradients *added* to those of
        earlier calls since the last :meth:`optimizer_step`. ``loss_fn`` is called as in :meth:`train_batch`, with the
        whole batch as the mini-batch of its global counts. Returns ``log_probs`` [B, R] (and ``gathered_log_probs``
        when ``loss_fn`` has ``gather_ids``) of the batch's rows, detached, and ``meta_info["metrics"]``: the loss
        function's metrics and ``loss``, summed over micro-batches and ranks."""
        raise RuntimeError(f"{type(self).__name__} does not split its step (TrainingEngine.features has no 'split_step')")

    def optimizer_step(self, settings: "Mapping[str, Any] | None" = None) -> dict[str, float]:
        """Apply the gradients :meth:`forward_backward` accumulated: reduce them over the ranks, clip, step the
        optimizer and the LR schedule, and clear them; a non-finite norm skips the update. ``settings`` override the
        engine's for this step only: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``grad_clip``
        (:func:`rlplat.kits.engine.check_optimizer_settings`). Returns ``grad_norm``, ``lr`` and ``skipped_step``."""
        raise RuntimeError(f"{type(self).__name__} does not split its step (TrainingEngine.features has no 'split_step')")

    def trainable_state(self) -> Any:
        """What training changes, in memory (``trainable_state`` in :attr:`features`): the trainable parameters
        (with LoRA the adapter only: the base is shared), their gradients so far, the optimizer's state, the LR
        schedule and the step count; this rank's part, valid for this engine only. Several LoRA adapters on one
        base take turns in one engine by :meth:`load_trainable_state`."""
        raise RuntimeError(f"{type(self).__name__} cannot hand out its trainable state (TrainingEngine.features)")

    def load_trainable_state(self, state: Any) -> None:
        """Put back what :meth:`trainable_state` returned (it stays valid: it may be loaded again)."""
        raise RuntimeError(f"{type(self).__name__} cannot load a trainable state (TrainingEngine.features)")

    def state(self) -> Mapping[str, Any]:
        """Small facts for logging (``step``, ``lr``, parameter count); override to add more."""
        return {}

    @classmethod
    def estimate_memory(cls, config: Mapping[str, Any], model_config: Mapping[str, Any],
                        context: "MemoryContext") -> "MemoryEstimate | None":
        """The memory one process of this engine holds, per call, predicted before anything is built
        (``rlplat plan`` and the check of ``rlplat run``): ``config`` is the engine's node as the factory
        would receive it, ``model_config`` the model's ``config.json`` as a dict, ``context`` the role,
        process count, device and sequence lengths (:class:`rlplat.contracts.memory.MemoryContext`). Reads no
        weights, starts no process group, allocates nothing. Returns a
        :class:`rlplat.contracts.memory.MemoryEstimate`; None (the default) when the engine cannot say, and
        the plan then names it as unknown.

        The planner calls this classmethod only when the engine's registration names no estimate of its
        own: ``metadata={"estimate_memory": "package.memory:estimate"}`` (a function with this signature,
        without ``cls``) lets ``rlplat plan`` and the refusal of ``rlplat run`` reach it without importing
        the engine's module, so without torch, as the built-in engines do; the classmethod then returns
        the same."""
        return None
