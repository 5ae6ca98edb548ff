"""``FSDP2Engine``: the :class:`rlplat.TrainingEngine` on PyTorch FSDP2.

Sharding: ``fully_shard`` on every decoder layer and on the root, over one data-parallel mesh of the
whole process group (gloo on CPU, NCCL on GPU). Master weights and AdamW state are float32 shards;
forward and backward run in ``dtype`` (``MixedPrecisionPolicy``: bfloat16 with a float32 reduction on
GPU, float32 on CPU unless asked). One rank needs no FSDP2 (``shard_one_rank``): in float32 it trains the plain
module; in bfloat16 or float16 it trains the plain float32 module through compute-dtype copies of the weights made for
each call, the gradients cast and accumulated in float32 (:class:`~rlplat_engine_fsdp2.data_parallel.ComputeCopies`),
what FSDP2's mixed precision computes over one rank, bit for bit, without its per-layer hooks, collectives and
DTensor dispatch (with LoRA or parameter offload FSDP2 stays: its layer-by-layer gathers hold less than a whole copy).
``data_parallel: replicate`` trains the plain module on every rank instead (DDP's layout): rank 0's weights
broadcast at start, gradients all-reduced in flat buckets once per optimizer step, AdamW on plain tensors.

Gradients: the loss function returns each micro-batch's share of the mini-batch loss (normalised by
the global token or sequence counts the engine puts in ``meta_info``), and the engine *sums* gradients
over micro-batches and ranks. FSDP2's reduce-scatter averages over ranks, so each micro-batch loss is
multiplied by the data-parallel size before backward (gloo has no pre-multiplied sum to do it in the
collective). The result is the gradient of the unsplit mini-batch, however it was split.

Micro-batches run as padded rows, or with ``use_remove_padding`` as one pack of their valid tokens
(:mod:`rlplat_engine_fsdp2.packing`); the loss function gets the same ``[B, R]`` outputs either way.
With ``ulysses_sequence_parallel_size`` ``sp`` > 1, groups of ``sp`` consecutive ranks share each pack
(:mod:`rlplat_engine_fsdp2.ulysses`): the batch is dispatched over ``world / sp`` data-parallel groups
(:meth:`data_parallel_info`), every rank of a group computes the same loss on the gathered outputs, and the
global counts and metrics count each group once; FSDP2 still shards over every rank.

LoRA (``lora``, :mod:`rlplat_engine_fsdp2.lora`): ``peft`` puts adapters into the Hugging Face model
before it is sharded; the base weights are frozen and the optimizer holds only the adapter. The engine
calls the same Hugging Face module either way, so every forward path is the same code.
:meth:`adapter_disabled` switches the adapter off for the reference policy; :meth:`named_weights` and
:meth:`export_hf` give the weights with the adapter merged in, computed as they are read; checkpoints
hold the adapter and its optimizer state only.

Optional features live in modules of their own, the engine's methods for them in base classes there:
:mod:`~rlplat_engine_fsdp2.lora` (:class:`~rlplat_engine_fsdp2.lora.LoraMethods`),
:mod:`~rlplat_engine_fsdp2.offload` (``param_offload``, ``optimizer_offload``),
:mod:`~rlplat_engine_fsdp2.data_parallel` (the ``shard`` and ``replicate`` layouts), :mod:`~rlplat_engine_fsdp2.moe`
(routing replay and router losses), :mod:`~rlplat_engine_fsdp2.ulysses` (sequence parallelism) and
:mod:`~rlplat_engine_fsdp2.checkpoint` (checkpoints and the Hugging Face export).

Every collective-bearing method (``init_model``, ``forward``, ``train_batch``, ``named_weights``,
``adapter_weights``, ``save``, ``load``, ``export_hf``, ``export_adapter``) must be called on every rank
of the group, with batches of the same number of rows (the worker group's data-parallel dispatch
guarantees both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlplat.contracts.engine import DataParallelInfo, LossFunction, TrainingEngine
from rlplat.kits.engine import WarmupSchedule, check_optimizer_settings, fixed_size_partition, token_budget_partition, tokenizer_folder, weight_buckets
from rlplat.lora import LoraConfig, read_lora
from rlplat.losses.aggregation import deferred_metrics
from rlplat.protocol import DataProto
from rlplat.kits.moe import ROUTES
from rlplat_engine_fsdp2 import checkpoint, data_parallel, lora, modeling, packing, ulysses
from rlplat_engine_fsdp2.config import FSDP2EngineConfig, read_engine_config
from rlplat_engine_fsdp2.data_parallel import full_tensor
from rlplat_engine_fsdp2.lora import LoraMethods
from rlplat_engine_fsdp2.moe import EngineRouting, build_routing
from rlplat_engine_fsdp2.offload import Offload

MODEL_INPUTS = ("input_ids", "attention_mask", "responses")
REWARD_MODEL_INPUTS = ("input_ids", "attention_mask")


class FSDP2Engine(LoraMethods, Offload, TrainingEngine):
    """See the module docstring. ``FSDP2Engine(config, **overrides)``: ``config`` is an
    :class:`~rlplat_engine_fsdp2.config.FSDP2EngineConfig`, a mapping or an OmegaConf node; keyword
    arguments override its fields (``FSDP2Engine(config, lr=1e-5)``)."""

    supports_lora = True
    features = frozenset({"count_masks", "gather_ids", "top_k", "split_step", "trainable_state"})

    def __init__(self, config: Any, **overrides: Any):
        config = read_engine_config(config)
        if overrides:
            config = read_engine_config({**dataclasses.asdict(config), **overrides})
        self.config: FSDP2EngineConfig = config
        self.module: torch.nn.Module | None = None
        self.persistent_buffer_names: set[str] | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.hf_config: Any = None
        self.global_step = 0
        self.params_offloaded = False
        self.optimizer_offloaded = False
        self.remove_padding = False
        self.sharded = True
        self.sharded_parameters: dict[str, torch.nn.Parameter] = {}
        self.lora: LoraConfig | None = read_lora(config.lora, "lora") if config.lora is not None else None
        self.peft_model: Any = None
        self.adapter_off = False
        self.trainable_params = 0
        self.routing: EngineRouting | None = None
        self.sequence_parallel: ulysses.SequenceParallel | None = None
        self.sp_size = config.ulysses_sequence_parallel_size
        self.compute_copies: data_parallel.ComputeCopies | None = None

    # -- building ----------------------------------------------------------------------------------

    def init_model(self) -> None:
        config = self.config
        if not dist.is_initialized():
            # A lone engine (a notebook, a test) gets a one-rank group of its own.
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.hf_config = modeling.hf_config(config)
        if self.sp_size > 1:
            ulysses.check_heads(self.hf_config, self.sp_size)
            self.sequence_parallel = ulysses.new_groups(self.sp_size)
        model = modeling.build_model(config)
        self.remove_padding = config.use_remove_padding and modeling.enable_packing(model, config.attn_implementation, self.sp_size > 1)
        if self.sp_size > 1 and not self.remove_padding:
            raise ValueError(f"fsdp2 engine: ulysses_sequence_parallel_size={self.sp_size} splits packed micro-batches, but "
                             f"{type(model).__name__} does not route attention through Hugging Face's attention interface, "
                             "so its rows cannot be packed")
        if self.remove_padding:
            packing.set_kernel(model, packing.resolve_kernel(config.packed_attention, self.device.type, self.compute_dtype(),
                                                             self.sp_size > 1))
        if config.use_remove_padding and not self.remove_padding:
            warnings.warn(
                f"use_remove_padding: {type(model).__name__} does not route attention through Hugging Face's "
                "attention interface, so its rows cannot be packed; the fsdp2 engine runs them padded",
                stacklevel=2,
            )
        if config.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            # peft changes the Hugging Face module in place; the PeftModel around it is kept for its switches.
            self.peft_model = lora.attach_adapter(model, self.lora, config.seed, config.model_path)
        self.routing = build_routing(model, config.moe)
        reduce_dtype = modeling.TORCH_DTYPES[config.reduce_dtype]
        full_precision = (self.compute_dtype(), reduce_dtype) == (torch.float32, torch.float32)
        replicate = config.data_parallel == "replicate"
        if replicate and not full_precision:
            raise ValueError(f"fsdp2 engine: data_parallel 'replicate' computes in float32, but dtype {config.dtype!r} is "
                             f"{self.compute_dtype()} on {self.device.type}; set dtype: float32 or data_parallel: shard")
        # One rank without FSDP2: in float32 there is nothing to shard or cast; in bf16 / fp16 the weights are cast per
        # call (ComputeCopies), unless a frozen LoRA base or offloaded parameters would make a whole copy cost more
        # than FSDP2's layer-by-layer gathers.
        copies_fit = self.lora is None and not (config.param_offload and self.device.type == "cuda")
        self.sharded = not replicate and (self.world_size > 1 or config.shard_one_rank or not (full_precision or copies_fit))
        # every rank holds the whole model; gradients are all-reduced once per optimizer step
        self.replicated = not self.sharded and self.world_size > 1
        if self.sharded:
            data_parallel.shard(model, self.device.type, self.world_size, self.compute_dtype(), reduce_dtype, config.reshard_after_forward)
        else:
            model.to(self.device)
            if not full_precision:  # one rank in bf16 / fp16: cast copies per call, no FSDP2
                self.compute_copies = data_parallel.ComputeCopies(model, self.compute_dtype(), reduce_dtype)
            if self.replicated:  # the ranks built the same weights from the same seed or files; rank 0's are the truth
                data_parallel.broadcast_from_rank0([*model.parameters(), *model.buffers()])
        if config.compile:
            modeling.compile_layers(model, self.device.type)
        self.module = model
        self.persistent_buffer_names: set[str] | None = None
        # The parameters the optimizer updates (FSDP2's shards, or the plain module's own); between a forward
        # and its backward FSDP2 registers gathered copies on the module in their place, so shared_weights
        # reads them from here.
        self.sharded_parameters = dict(model.named_parameters())
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
        self.trainable_params = sum(parameter.numel() for parameter in trainable)
        implementation = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
        self.optimizer = torch.optim.AdamW(
            trainable, lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay,
            **implementation[config.optimizer_implementation],
        )
        schedule = WarmupSchedule(config.lr_scheduler_type, config.lr_warmup_steps, config.total_training_steps, config.min_lr_ratio)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        # Training-time randomness (dropout, if a model has it) may differ per rank, reproducibly.
        torch.manual_seed(config.seed + self.rank)
        if config.param_offload:
            self.offload_parameters()

    def data_parallel_info(self) -> DataParallelInfo:
        """``(dp_rank, dp_size, collect)``: with Ulysses the ``sp`` consecutive ranks of a group share the rows, the
        first answers."""
        self.require_model("data_parallel_info")
        return DataParallelInfo(self.rank // self.sp_size, self.world_size // self.sp_size, self.rank % self.sp_size == 0)

    def compute_dtype(self) -> torch.dtype:
        if self.config.dtype == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return modeling.TORCH_DTYPES[self.config.dtype]

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Around a call's forwards and backwards: the compute-dtype copies of the weights on one rank
        (:class:`~rlplat_engine_fsdp2.data_parallel.ComputeCopies`), else nothing to do."""
        return contextlib.nullcontext() if self.compute_copies is None else self.compute_copies.active()

    def require_model(self, method: str) -> torch.nn.Module:
        if self.module is None:
            raise RuntimeError(f"FSDP2Engine.{method}() needs the model: call init_model() first")
        return self.module

    # -- forward -----------------------------------------------------------------------------------

    def forward(self, batch: DataProto, *, temperature: float = 1.0, calculate_entropy: bool = False, top_k: int = 0) -> DataProto:
        model = self.require_model("forward")
        self.check_inputs(batch, "forward")
        if top_k and (self.config.value_model or self.config.reward_model):
            raise ValueError("FSDP2Engine.forward(top_k=...): a value or reward model has no token distribution")
        self.onload_parameters()
        model.eval()
        size = self.config.forward_micro_batch_size_per_gpu or self.config.micro_batch_size_per_gpu
        groups = self.plan_micro_batches(batch, size)
        pieces: list[dict[str, torch.Tensor]] = []
        with torch.no_grad(), self.computing():
            for rows in groups:
                micro_batch = self.micro_batch(batch, rows)
                call = None if self.routing is None else self.routing.begin(micro_batch.batch, self.remove_padding, update=False,
                                                                              sequence_parallel=self.sequence_parallel)
                outputs = self.run(micro_batch, temperature, calculate_entropy, top_k=top_k)
                if rows:
                    pieces.append({key: outputs[key].detach() for key in self.output_keys(calculate_entropy)})
                    if top_k:
                        pieces[-1]["top_k_log_probs"], pieces[-1]["top_k_ids"] = outputs.top_k(top_k)
                    if call is not None and call.record:  # router_replay r2: the routes the update replays
                        pieces[-1][ROUTES] = self.routing.recorded(call, micro_batch.batch, self.remove_padding)
        if self.routing is not None:
            self.routing.end()
        self.offload_parameters_if_configured()
        order = [row for rows in groups for row in rows]
        restore = torch.empty(len(order), dtype=torch.long)
        restore[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        keys = self.output_keys(calculate_entropy) + (["top_k_log_probs", "top_k_ids"] if top_k else [])
        keys += [ROUTES] if pieces and ROUTES in pieces[0] else []
        columns = {key: torch.cat([piece[key] for piece in pieces])[restore].cpu() for key in keys}
        return DataProto.from_dict(columns)

    def model_inputs(self) -> tuple[str, ...]:
        return REWARD_MODEL_INPUTS if self.config.reward_model else MODEL_INPUTS

    def output_keys(self, calculate_entropy: bool) -> list[str]:
        if self.config.reward_model:
            return ["rm_scores"]
        if self.config.value_model:
            return ["values"]
        return ["log_probs", "entropy"] if calculate_entropy else ["log_probs"]

    def check_inputs(self, batch: DataProto, method: str, extra: tuple[str, ...] = ()) -> None:
        present = set(batch.tensor_keys())
        missing = [key for key in (*self.model_inputs(), *extra) if key not in present]
        if missing:
            reads = "input_ids and attention_mask [B, T]" if self.config.reward_model else "input_ids, attention_mask and position_ids [B, T] and responses [B, R]"
            raise KeyError(
                f"FSDP2Engine.{method}(): the batch has no {missing} (it holds {sorted(map(str, present))}); "
                f"{method} reads {reads}"
            )
        if len(batch) == 0:
            raise ValueError(f"FSDP2Engine.{method}(): the batch has no rows")

    def run(self, micro_batch: DataProto, temperature: float, calculate_entropy: bool,
            gather_ids: str | None = None, top_k: int = 0) -> modeling.ModelOutputs:
        batch = micro_batch.batch
        inputs = {key: batch[key] for key in self.model_inputs()}
        inputs["position_ids"] = batch["position_ids"] if "position_ids" in batch.keys() else modeling.position_ids_from(batch["attention_mask"])
        return modeling.run_model(
            self.module,
            inputs,
            value_model=self.config.value_model,
            reward_model=self.config.reward_model,
            temperature=temperature,
            chunk_tokens=self.config.logprob_chunk_size,
            calculate_entropy=calculate_entropy,
            remove_padding=self.remove_padding,
            gather_ids=None if gather_ids is None else batch[gather_ids],
            top_k=top_k,
            vocabulary_chunk=self.config.logprob_vocab_chunk_size,
            sequence_parallel=self.sequence_parallel,
            device=self.device,
            fused_head=self.config.fused_head,
        )

    @staticmethod
    def micro_batch(batch: DataProto, rows: list[int]) -> DataProto:
        # An empty group runs on a stand-in row so this rank joins the collectives; its result is dropped.
        return batch.select_idxs(rows or [0])

    # -- micro-batches -----------------------------------------------------------------------------

    def plan_micro_batches(self, batch: DataProto, micro_batch_size: int) -> list[list[int]]:
        """Row groups of ``batch``, as many on every rank (padded with empty groups where fewer)."""
        if self.config.use_dynamic_bsz:
            tokens = batch.batch["attention_mask"].sum(-1).tolist()
            budget = self.config.max_token_len_per_gpu * self.sp_size  # each rank of a group holds 1/sp of a pack
            groups = token_budget_partition(tokens, budget)
            agreed = self.all_reduce_max(len(groups))
            if agreed > len(groups):
                groups = token_budget_partition(tokens, budget, min_parts=min(agreed, len(tokens)))
        else:
            groups = fixed_size_partition(len(batch), micro_batch_size)
        agreed = self.all_reduce_max(len(groups))
        return groups + [[] for _ in range(agreed - len(groups))]

    def all_reduce_max(self, value: int) -> int:
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def all_reduce_sum(self, values: list[float], every_rank: bool = False) -> list[float]:
        """``values`` summed over the data-parallel groups (a sequence-parallel group's ranks hold the same rows:
        its first rank's values count), or over ``every_rank`` (values of each rank's own tokens)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.rank % self.sp_size and not every_rank:
            tensor.zero_()
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor.tolist()

    # -- training ----------------------------------------------------------------------------------

    def train_batch(self, batch: DataProto, loss_fn: LossFunction) -> dict[str, float]:
        model = self.require_model("train_batch")
        if self.adapter_off:
            raise RuntimeError("FSDP2Engine.train_batch() inside adapter_disabled(): the base model is the frozen reference "
                               "policy; leave the context to train the adapter")
        self.check_inputs(batch, "train_batch")
        meta = batch.meta_info
        mini_batch_rows = self.local_mini_batch_rows(batch)
        epochs = int(meta.get("ppo_epochs", self.config.ppo_epochs))
        temperature = float(meta.get("temperature", 1.0))
        # the loss's own needs_entropy (the contract's way to ask), or the worker's meta_info
        calculate_entropy = bool(meta.get("calculate_entropy", False) or getattr(loss_fn, "needs_entropy", False))
        self.onload_parameters()
        model.train()
        steps = []
        for _ in range(epochs):
            for mini_batch in batch.split(mini_batch_rows):
                steps.append(self.train_mini_batch(mini_batch, loss_fn, temperature, calculate_entropy))
        self.offload_parameters_if_configured()
        keys = sorted({key for step in steps for key in step})
        metrics = {key: sum(step[key] for step in steps if key in step) / sum(key in step for step in steps) for key in keys}
        return {**metrics, "trainable_params": float(self.trainable_params), "optimizer_state_bytes": float(checkpoint.optimizer_state_bytes(self.optimizer))}

    def local_mini_batch_rows(self, batch: DataProto) -> int:
        """Rows of this rank's shard per optimizer step: ``ppo_mini_batch_size / dp``.

        The batch's row count may vary from call to call (rejection sampling, group filtering): the
        shard is cut into mini-batches of that many rows and the last one takes the remainder, so a
        ``ppo_mini_batch_size`` larger than the batch gives one step on the whole batch. Each mini-batch
        is normalised by its own global token and sequence counts, so every step gets the exact
        gradient of the rows it holds; dispatch padding has no weight (its ``response_mask`` is zero).
        """
        rows = len(batch)
        low, high = -self.all_reduce_max(-rows), self.all_reduce_max(rows)
        if low != high:
            raise ValueError(f"train_batch: ranks hold different row counts ({low} to {high}); dispatch equal shards")
        global_rows = batch.meta_info.get("ppo_mini_batch_size", self.config.ppo_mini_batch_size)
        if global_rows is None:
            return rows
        groups = self.world_size // self.sp_size
        per_rank, remainder = divmod(int(global_rows), groups)
        if remainder or per_rank == 0:
            raise ValueError(
                f"train_batch: ppo_mini_batch_size={global_rows} rows of the global batch do not split over "
                f"{groups} data-parallel rank(s); make it a multiple of {groups} "
                "(<role>.ppo_mini_batch_size x rollout.n in a run config; the engine config's "
                "ppo_mini_batch_size or the batch's meta_info['ppo_mini_batch_size'] from Python)"
            )
        return min(per_rank, rows)

    def train_mini_batch(self, mini_batch: DataProto, loss_fn: LossFunction, temperature: float, calculate_entropy: bool) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, metrics, _ = self.accumulate(mini_batch, loss_fn, temperature, calculate_entropy)
        return {**metrics, "loss": loss_total, **self.apply_gradients()}

    def accumulate(self, mini_batch: DataProto, loss_fn: LossFunction, temperature: float, calculate_entropy: bool,
                   keep_outputs: bool = False) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
        """Forward and backward over the micro-batches of ``mini_batch``, adding to the gradients there are; returns
        the loss summed over micro-batches and ranks, the loss function's metrics summed likewise, and with
        ``keep_outputs`` the rows' ``log_probs`` (and ``gathered_log_probs``) detached, in the batch's row order."""
        response_mask = self.response_mask(mini_batch)
        rows_with_tokens = float((response_mask.sum(-1) > 0).sum())
        masks = loss_masks(mini_batch, response_mask, loss_fn)
        counts = self.all_reduce_sum([float(response_mask.sum()), rows_with_tokens,
                                      *(value for mask in masks.values() for value in mask_counts(mask)),
                                      float(mini_batch.batch["attention_mask"].sum())])
        global_tokens, global_rows, global_input_tokens = counts[0], counts[1], counts[-1]
        meta_info = {**mini_batch.meta_info, "global_token_count": global_tokens, "global_sequence_count": int(global_rows)}
        if masks:
            meta_info["global_counts"] = {name: {"tokens": counts[2 + 2 * index], "sequences": int(counts[3 + 2 * index])}
                                          for index, name in enumerate(masks)}
        # Nothing in this loop waits for the device: the loss and the metrics stay tensors until it ends.
        loss_total, loss_metrics, kept = torch.zeros((), dtype=torch.float64, device=self.device), [], {}
        gather_ids = getattr(loss_fn, "gather_ids", None)
        groups = self.plan_micro_batches(mini_batch, self.config.micro_batch_size_per_gpu)
        with self.computing(), deferred_metrics():
            for index, rows in enumerate(groups):
                if self.sharded and not self.config.gradient_sync_every_micro_batch:
                    self.module.set_requires_gradient_sync(index == len(groups) - 1)
                host_batch = self.micro_batch(mini_batch, rows)  # where the pack is planned: no device sync
                micro_batch = host_batch.with_meta_info(meta_info).to(self.device)
                call = None if self.routing is None else self.routing.begin(micro_batch.batch, self.remove_padding, update=True,
                                                                              counted=bool(rows), sequence_parallel=self.sequence_parallel)
                outputs = self.run(host_batch, temperature, calculate_entropy, gather_ids)
                if rows:
                    loss, metrics = loss_fn(outputs, micro_batch)
                    loss_total += loss.detach()
                    loss_metrics.append(metrics)
                    if keep_outputs:
                        for key in ("log_probs", "gathered_log_probs"):
                            if key in outputs:
                                kept.setdefault(key, []).append((rows, outputs[key].detach()))
                else:
                    loss = sum(outputs[key].sum() for key in self.output_keys(False)) * 0.0
                if call is not None:  # the router losses, weighted by this call's share of the mini-batch's tokens
                    share = float(host_batch.batch["attention_mask"].sum()) / max(global_input_tokens, 1.0) if rows else 0.0
                    term, moe_metrics = self.routing.loss_term(call, share)
                    loss = loss + term
                    loss_metrics.append(moe_metrics)
                    self.routing.count_replay(call)
                (loss * self.world_size).backward()
        kept = {key: in_row_order(pieces, len(mini_batch)) for key, pieces in kept.items()}
        summed = self.gather_metrics(loss_metrics)
        if self.routing is not None:
            self.routing.end()
            summed.update(self.routing.step_metrics(functools.partial(self.all_reduce_sum, every_rank=True)))
        (loss_total,) = self.all_reduce_sum([float(loss_total)])
        return loss_total, summed, kept

    def apply_gradients(self, settings: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Reduce (``replicate``), clip and apply the gradients accumulated so far and step the LR schedule; a
        non-finite norm skips the update and clears them. ``settings`` (:meth:`optimizer_step`) apply to this
        update only."""
        settings = check_optimizer_settings(settings)
        if self.replicated:
            data_parallel.all_reduce_gradients(self.module, self.world_size)
        grad_norm = self.clip_gradients(settings.get("grad_clip", self.config.grad_clip))
        group = self.optimizer.param_groups[0]
        kept = {key: group[key] for key in ("lr", "betas", "eps", "weight_decay")}
        group.update({key: value for key, value in settings.items() if key in kept})
        lr = group["lr"]
        try:
            if math.isfinite(grad_norm):
                self.onload_optimizer()
                self.optimizer.step()
                self.offload_optimizer_if_configured()
                self.global_step += 1
        finally:
            group.update(kept)
        if math.isfinite(grad_norm):
            self.lr_scheduler.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": float(lr), "skipped_step": float(not math.isfinite(grad_norm))}

    # -- the step in two calls, and the trainable state (TrainingEngine's optional methods) -------------

    def forward_backward(self, batch: DataProto, loss_fn: LossFunction, *, temperature: float = 1.0) -> DataProto:
        model = self.require_model("forward_backward")
        if self.adapter_off:
            raise RuntimeError("FSDP2Engine.forward_backward() inside adapter_disabled(): leave the context to train the adapter")
        self.check_inputs(batch, "forward_backward")
        rows = len(batch)
        low, high = -self.all_reduce_max(-rows), self.all_reduce_max(rows)
        if low != high:
            raise ValueError(f"forward_backward: ranks hold different row counts ({low} to {high}); dispatch equal shards")
        self.onload_parameters()
        model.train()
        calculate_entropy = bool(getattr(loss_fn, "needs_entropy", False))
        loss_total, metrics, outputs = self.accumulate(batch, loss_fn, temperature, calculate_entropy, keep_outputs=True)
        self.offload_parameters_if_configured()
        return DataProto.from_dict(outputs, meta_info={"metrics": {**metrics, "loss": loss_total}})

    def optimizer_step(self, settings: Mapping[str, Any] | None = None) -> dict[str, float]:
        self.require_model("optimizer_step")
        self.onload_parameters()
        metrics = self.apply_gradients(settings)
        self.optimizer.zero_grad(set_to_none=True)
        self.offload_parameters_if_configured()
        return metrics

    def trainable_state(self) -> dict[str, Any]:
        self.require_model("trainable_state")
        self.onload_parameters()
        self.onload_optimizer()
        state = checkpoint.trainable_state(self.sharded_parameters, self.optimizer, self.lr_scheduler, self.global_step)
        self.offload_optimizer_if_configured()
        self.offload_parameters_if_configured()
        return state

    def load_trainable_state(self, state: Mapping[str, Any]) -> None:
        self.require_model("load_trainable_state")
        self.onload_parameters()
        self.onload_optimizer()
        self.global_step = checkpoint.load_trainable_state(state, self.sharded_parameters, self.optimizer, self.lr_scheduler)
        self.offload_optimizer_if_configured()
        self.offload_parameters_if_configured()

    def response_mask(self, batch: DataProto) -> torch.Tensor:
        if "response_mask" in batch.batch.keys():
            return batch.batch["response_mask"]
        response_length = batch.batch["responses"].shape[1]
        return batch.batch["attention_mask"][:, -response_length:]

    def clip_gradients(self, grad_clip: float | None) -> float:
        max_norm = grad_clip if grad_clip is not None else math.inf
        parameters = [p for p in self.module.parameters() if p.grad is not None]
        return float(full_tensor(torch.nn.utils.clip_grad_norm_(parameters, max_norm=max_norm)))

    def gather_metrics(self, metrics: list[dict[str, float]]) -> dict[str, float]:
        """Sum of every loss-function metric over the micro-batches of every rank (metrics are
        contributions; see :class:`rlplat.contracts.engine.LossFunction`)."""
        metrics = [{key: float(value) for key, value in entry.items()} for entry in metrics]  # tensors read once, here
        gathered: list[Any] = [metrics]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            # a sequence-parallel group's ranks computed the same loss: its first rank's metrics count
            dist.all_gather_object(gathered, [] if self.rank % self.sp_size else metrics)
        values: dict[str, list[float]] = {}
        for rank_metrics in gathered:
            for entry in rank_metrics:
                for key, value in entry.items():
                    values.setdefault(key, []).append(value)
        return {key: sum(items) for key, items in values.items()}

    # -- weights, checkpoints, export --------------------------------------------------------------

    def named_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every parameter (tied ones once) and persistent buffer, full and detached, in HF naming.
        With LoRA: the base weights with the adapter merged in (``W + (B @ A) * scale``, computed here,
        the training model unchanged), under their plain names, and no adapter tensors; inside
        :meth:`adapter_disabled`, the base weights alone under the same names (for a rollout that then
        loads the adapter separately). A collective: every rank must consume the whole generator."""
        self.require_model("named_weights")
        self.onload_parameters()
        yield from weight_buckets(self.full_weights(), bucket_bytes)
        self.offload_parameters_if_configured()

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face name, full detached tensor)`` of every parameter and persistent buffer, one at a
        time (LoRA: merged unless the adapter is off, see :meth:`named_weights`). A collective."""
        named = list(self.module.named_parameters()) + self.persistent_buffers()
        if self.peft_model is not None:
            yield from lora.merged_weights(named, lora.adapter_layers(self.module), merge=not self.adapter_off)
            return
        for name, tensor in named:
            yield name, full_tensor(tensor).detach()

    def shared_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The model's full weights under the names :meth:`named_weights` gives (tied parameters once,
        then persistent buffers), as tensors that share storage with the engine's own: views, no copy.
        None when no such views exist: more than one rank (each holds a shard), ``param_offload``
        (parameters move between devices), any parameter whose local tensor is not the whole of it, or
        LoRA (the merged weights are computed, not stored).

        They are the float32 master weights the optimizer updates in place (not the compute-dtype copies
        a forward gathers), so after ``train_batch`` they hold the new weights with no call. They stay
        valid until the engine's parameters are re-materialised (offload and onload, a load that
        replaces storage): a caller keeps them across syncs only while each ``data_ptr()`` is unchanged,
        or calls again at every sync. Not a collective; callers must not write to them."""
        model = self.require_model("shared_weights")
        if self.peft_model is not None or self.sharded and self.world_size > 1 or self.config.param_offload or self.params_offloaded:
            return None
        shared = []
        for name, parameter in self.sharded_parameters.items():
            local = parameter.detach()
            if isinstance(local, DTensor):
                local = local.to_local()
            if local.shape != parameter.shape:
                return None
            shared.append((name, local))
        shared += [(name, buffer.detach()) for name, buffer in self.persistent_buffers()]
        return shared

    def persistent_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The module's buffers that its state dict holds (their names found once: a state dict costs more than
        the weight sync of a small model)."""
        if self.persistent_buffer_names is None:
            keys = set(self.module.state_dict().keys())
            self.persistent_buffer_names = {name for name, _ in self.module.named_buffers() if name in keys}
        return [(name, buffer) for name, buffer in self.module.named_buffers() if name in self.persistent_buffer_names]

    def save(self, path: str) -> None:
        self.require_model("save")
        self.onload_parameters()
        self.onload_optimizer()
        facts = {"engine": "fsdp2", "global_step": self.global_step, "config": dataclasses.asdict(self.config)}
        engine_state = {"lr_scheduler": self.lr_scheduler.state_dict(), "global_step": self.global_step}
        checkpoint.save_checkpoint(path, self.module, self.optimizer, engine_state, facts, adapter_only=self.peft_model is not None)
        self.offload_optimizer_if_configured()
        self.offload_parameters_if_configured()

    def load(self, path: str) -> None:
        self.require_model("load")
        self.onload_parameters()
        self.onload_optimizer()
        engine_state = checkpoint.load_checkpoint(path, self.module, self.optimizer, adapter_only=self.peft_model is not None)
        self.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])
        self.global_step = int(engine_state["global_step"])
        self.offload_optimizer_if_configured()
        self.offload_parameters_if_configured()

    def export_hf(self, path: str) -> None:
        self.require_model("export_hf")
        self.onload_parameters()
        if self.peft_model is None:
            checkpoint.export_hf(path, self.module, self.hf_config, modeling.model_class(self.config), self.tokenizer_path())
        else:
            merged = {}
            for name, tensor in self.full_weights():  # a collective: every rank reads, rank 0 keeps
                if self.rank == 0:
                    merged[name] = tensor.cpu()
            checkpoint.write_hf(path, merged, self.hf_config, modeling.model_class(self.config), self.tokenizer_path())
        self.offload_parameters_if_configured()

    def tokenizer_path(self) -> str | None:
        return tokenizer_folder(self.config.tokenizer_path, self.config.model_path)

    # -- facts -------------------------------------------------------------------------------------

    @classmethod
    def estimate_memory(cls, config: Any, model_config: Mapping[str, Any], context: Any) -> Any:
        """One process's memory per call, from the config and ``config.json`` alone (:mod:`rlplat_engine_fsdp2.memory`)."""
        from rlplat_engine_fsdp2.memory import estimate

        return estimate(config, model_config, context)

    def state(self) -> Mapping[str, Any]:
        if self.module is None:
            return {"step": self.global_step}
        return {
            "step": self.global_step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "parameters": sum(parameter.numel() for parameter in self.module.parameters()),
            "world_size": self.world_size,
            "value_model": self.config.value_model,
            "reward_model": self.config.reward_model,
            "remove_padding": self.remove_padding,
            "ulysses_sequence_parallel_size": self.sp_size,
            "sharded": self.sharded,
            "trainable_parameters": self.trainable_params,
            "lora_rank": self.lora.rank if self.lora is not None else 0,
        }


def loss_masks(batch: DataProto, response_mask: torch.Tensor, loss_fn: LossFunction) -> dict[str, torch.Tensor]:
    """The masks a loss function counts (its ``count_masks``: columns of the batch), each within the response mask."""
    masks = {}
    for name in getattr(loss_fn, "count_masks", ()) or ():
        if name not in batch.batch.keys():
            raise KeyError(f"train_batch: the loss function counts the mask {name!r}, which the batch does not hold")
        masks[name] = batch.batch[name].to(response_mask.dtype) * response_mask
    return masks


def in_row_order(pieces: list[tuple[list[int], torch.Tensor]], rows: int) -> torch.Tensor:
    """float32 CPU ``[rows, ...]`` from each micro-batch's ``(row indices, values)``."""
    first = pieces[0][1]
    placed = torch.zeros((rows, *first.shape[1:]), dtype=torch.float32)
    for indices, values in pieces:
        placed[indices] = values.float().cpu()
    return placed


def mask_counts(mask: torch.Tensor) -> tuple[float, float]:
    """Valid tokens of ``mask`` and its rows with one."""
    return float(mask.sum()), float((mask.sum(-1) > 0).sum())

