"""``MegatronEngine``: the :class:`rlplat.TrainingEngine` on megatron-core (tensor, pipeline and data parallel).

Layout: the worker group's ranks form megatron's ``tp-cp-ep-dp-pp`` grid (``initialize_model_parallel``):
``tensor_parallel_size`` x ``context_parallel_size`` x ``pipeline_parallel_size`` ranks hold one model
replica (context-parallel ranks each run a share of every row's tokens:
:mod:`rlplat_engine_megatron.context_parallel`), the data-parallel size is what is left. Every rank of a
replica gets the same rows (:meth:`data_parallel_info`), and TP and CP rank 0 of the last pipeline stage
answer for them.

Model: megatron-core's ``GPTModel`` built from a local Hugging Face checkpoint through mbridge
(:mod:`rlplat_engine_megatron.bridge`), wrapped in megatron's ``DistributedDataParallel`` with its
optimizer (optionally the ``DistributedOptimizer``), gradient clipping and activation recompute.

Batches: rows are left-aligned before the model (each row's valid tokens start at position 0), so
megatron's RoPE positions ``0..T-1`` are Hugging Face's ``position_ids`` for every valid token; an
explicit causal-and-padding mask is passed. Log-probs and entropy come from the vocabulary-parallel
logits (:mod:`rlplat_engine_megatron.vocab_parallel`), never gathered on one rank.

Training: every micro-batch runs inside megatron's pipeline schedule (``get_forward_backward_func``),
the loss function called on the last stage with ``global_token_count`` / ``global_sequence_count`` of
the whole mini-batch over the data-parallel ranks. The engine *sums* gradients over micro-batches and
data-parallel ranks (per-token loss accounting, so neither the schedule nor DDP divides, and the
gradient finaliser is given no token count), which is the fsdp2 engine's rule: the gradient of the
unsplit mini-batch, however it was split.

Optional features live in modules of their own, the engine's methods for them in base classes there:
:mod:`~rlplat_engine_megatron.weights` (the full weights gathered for ``named_weights`` and ``export_hf``),
:mod:`~rlplat_engine_megatron.checkpoint` (``save`` and ``load``), :mod:`~rlplat_engine_megatron.moe` (expert
parallelism, routing replay and router losses) and :mod:`~rlplat_engine_megatron.context_parallel`.

On a CPU build of torch every call into megatron runs inside :func:`rlplat_engine_megatron.cpu.cpu_substitutes`
(gloo, CPU RNG states, CUDA device arguments answered by the CPU), a scoped context that is undone when
the call returns. Every method that touches the model is a collective: call it on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import tempfile
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from rlplat.config.moe import MoEConfig, read_moe
from rlplat.contracts.engine import DataParallelInfo, LossFunction, TrainingEngine
from rlplat.kits.engine import WarmupSchedule, fixed_size_partition, token_budget_partition
from rlplat.kits.moe import ROUTES
from rlplat.protocol import DataProto
from rlplat_engine_megatron import bridge as hf_bridge
from rlplat_engine_megatron import context_parallel, cpu, vocab_parallel
from rlplat_engine_megatron.checkpoint import Checkpoints
from rlplat_engine_megatron.config import MegatronEngineConfig, check_layout, read_engine_config
from rlplat_engine_megatron.moe import MegatronCall, MegatronRouting, aligned_routes, moe_overrides, moe_shape, original_routes
from rlplat_engine_megatron.weights import FullWeights

MODEL_INPUTS = ("input_ids", "attention_mask", "responses")
STAND_IN = "megatron_stand_in"


class MegatronEngine(FullWeights, Checkpoints, TrainingEngine):
    """See the module docstring. ``MegatronEngine(config, **overrides)``: ``config`` is a
    :class:`~rlplat_engine_megatron.config.MegatronEngineConfig`, a mapping or an OmegaConf node."""

    features = frozenset({"count_masks", "gather_ids", "top_k"})

    def __init__(self, config: Any, **overrides: Any):
        config = read_engine_config(config)
        if overrides:
            config = read_engine_config({**dataclasses.asdict(config), **overrides})
        self.config: MegatronEngineConfig = config
        self.chunks: list[torch.nn.Module] = []
        self.optimizer: Any = None
        self.hf_config: Any = None
        self.bridge: Any = None
        self.global_step = 0
        self.tracker = cpu.CpuRNGStatesTracker()
        self.on_cpu = not torch.cuda.is_available()
        self.moe = read_moe(config.moe, "moe") if config.moe is not None else MoEConfig()
        self.moe_shape: dict[str, Any] | None = None
        self.routing: MegatronRouting | None = None
        self.chunked_output: vocab_parallel.ChunkedOutput | None = None  # during a schedule whose logits are large
        self.schedule = WarmupSchedule(config.lr_scheduler_type, config.lr_warmup_steps, config.total_training_steps, config.min_lr_ratio)

    # -- building ----------------------------------------------------------------------------------

    def megatron(self) -> "contextlib.AbstractContextManager[None]":
        """The context every call into megatron runs in (CPU substitutes on a CPU build)."""
        return cpu.megatron_context(self.tracker, self.on_cpu)

    def init_model(self) -> None:
        config = self.config
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.hf_config = hf_bridge.hf_config_of(config)
        self.moe_shape = moe_shape(self.hf_config)
        if self.moe_shape is None and not self.moe.default:
            raise ValueError(f"megatron engine: moe is set ({config.moe}), but the {self.hf_config.model_type} model has no experts")
        if self.moe_shape is not None and self.on_cpu and config.pipeline_parallel_size > 1:
            raise ValueError(
                "megatron engine: a mixture-of-experts model with pipeline_parallel_size > 1 needs a GPU: on CPU the experts' "
                "tokens go through megatron-core's all-gather dispatcher (its all-to-all one creates CUDA streams), which "
                "needs every micro-batch's shape fixed, and the pipeline's micro-batches vary; use tensor and expert parallelism"
            )
        self.dp_size = check_layout(config, self.world_size, self.hf_config)
        with self.megatron():
            self.initialise_parallel_state()
            self.build()

    def initialise_parallel_state(self) -> None:
        from megatron.core import parallel_state

        config = self.config
        vpp = config.virtual_pipeline_parallel_size if (config.virtual_pipeline_parallel_size or 1) > 1 else None
        wanted = (config.tensor_parallel_size, config.pipeline_parallel_size, vpp, config.expert_model_parallel_size,
                  config.context_parallel_size)
        if parallel_state.model_parallel_is_initialized():
            current = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                       parallel_state.get_virtual_pipeline_model_parallel_world_size(),
                       parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_context_parallel_world_size())
            if current != wanted:
                raise ValueError(
                    f"megatron's parallel state of this process is already set up as (tp, pp, vpp, ep, cp) = {current}; a second "
                    f"megatron engine in the same process (e.g. the reference beside the actor) must use the same layout, not {wanted}"
                )
        else:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=config.tensor_parallel_size,
                pipeline_model_parallel_size=config.pipeline_parallel_size,
                virtual_pipeline_model_parallel_size=vpp,
                expert_model_parallel_size=config.expert_model_parallel_size, context_parallel_size=config.context_parallel_size,
            )
        self.cp_rank, self.cp_size = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()
        self.cp_group = parallel_state.get_context_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        self.etp_size = parallel_state.get_expert_tensor_parallel_world_size()
        self.is_last_stage = self.pp_rank == self.pp_size - 1

    def compute_dtype(self) -> torch.dtype:
        if self.config.dtype == "auto":
            return torch.float32 if self.on_cpu else torch.bfloat16
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.config.dtype]

    def transformer_overrides(self) -> dict[str, Any]:
        config = self.config
        dtype = self.compute_dtype()
        overrides: dict[str, Any] = dict(
            use_cpu_initialization=True, perform_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype is torch.bfloat16, sequence_parallel=False, masked_softmax_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            batch_p2p_comm=False, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", calculate_per_token_loss=True,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=getattr(self.hf_config, "initializer_range", 0.02),
            deallocate_pipeline_outputs=False, context_parallel_size=config.context_parallel_size,
        )
        if self.moe_shape is not None:
            overrides.update(moe_overrides(self.moe_shape, self.on_cpu, config.expert_model_parallel_size))
        if config.recompute_granularity == "full":
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif config.recompute_granularity == "selective":
            overrides.update(recompute_granularity="selective", recompute_modules=["core_attn"])
        return overrides

    def build(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = self.config
        self.tracker.seed(config.seed, self.tp_rank, self.ep_rank, self.etp_rank)
        if not self.on_cpu:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(config.seed)
        torch.manual_seed(config.seed)
        self.bridge = hf_bridge.make_bridge(self.hf_config, self.compute_dtype(), self.transformer_overrides())
        vpp = config.virtual_pipeline_parallel_size or 1
        use_te = not self.on_cpu and transformer_engine_available()
        chunks = hf_bridge.build_chunks(self.bridge, self.hf_config, value_model=config.value_model, use_te=use_te, vpp=vpp,
                                        context_parallel=config.context_parallel_size > 1)
        if not self.on_cpu:
            chunks = [chunk.cuda() for chunk in chunks]
        with contextlib.ExitStack() as stack:
            path = config.model_path
            if path is None:
                path = hf_bridge.materialise_model_config(config, self.hf_config, stack.enter_context(tempfile.TemporaryDirectory()))
            hf_bridge.load_hf_weights(self.bridge, chunks, path, tp_rank=self.tp_rank, tp_size=self.tp_size, seed=config.seed,
                                      ep_rank=self.ep_rank, ep_size=self.ep_size, etp_rank=self.etp_rank, etp_size=self.etp_size)
        transformer_config = self.bridge.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=config.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.chunks = [
            DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
        for chunk in self.chunks:
            chunk.broadcast_params()
        dtype = self.compute_dtype()
        optimizer_config = OptimizerConfig(
            optimizer="adam", lr=config.lr, min_lr=0.0, weight_decay=config.weight_decay, adam_beta1=config.betas[0],
            adam_beta2=config.betas[1], adam_eps=config.eps, clip_grad=config.grad_clip or 0.0,
            use_distributed_optimizer=config.use_distributed_optimizer, bf16=dtype is torch.bfloat16, params_dtype=dtype,
            optimizer_cpu_offload=config.optimizer_offload,
        )
        self.optimizer = get_megatron_optimizer(optimizer_config, self.chunks)
        transformer_config.grad_scale_func = self.optimizer.scale_loss
        transformer_config.no_sync_func = [chunk.no_sync for chunk in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        transformer_config.finalize_model_grads_func = functools.partial(summed_gradients, finalize_model_grads)
        self.set_lr(self.schedule(0) * config.lr)
        if self.moe_shape is not None:
            self.routing = MegatronRouting([chunk.module for chunk in self.chunks], self.moe, self.hf_config.num_hidden_layers,
                                           counts_here=self.tp_rank == 0, once_here=self.tp_rank == 0 and self.cp_rank == 0)

    def require_model(self, method: str) -> None:
        if not self.chunks:
            raise RuntimeError(f"MegatronEngine.{method}() needs the model: call init_model() first")

    # -- layout ------------------------------------------------------------------------------------

    def data_parallel_info(self) -> DataParallelInfo:
        """``(dp_rank, dp_size, collect)``: the ranks of one model replica share a data-parallel rank, and
        TP and CP rank 0 of the last pipeline stage collects."""
        self.require_model("data_parallel_info")
        return DataParallelInfo(int(self.dp_rank), int(self.dp_size), self.collects())

    def collects(self) -> bool:
        return bool(self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0)

    # -- batches -----------------------------------------------------------------------------------

    def check_inputs(self, batch: DataProto, method: str) -> None:
        present = set(batch.tensor_keys())
        missing = [key for key in MODEL_INPUTS if key not in present]
        if missing:
            raise KeyError(
                f"MegatronEngine.{method}(): the batch has no {missing} (it holds {sorted(map(str, present))}); "
                f"{method} reads input_ids, attention_mask [B, T] and responses [B, R]"
            )
        if len(batch) == 0:
            raise ValueError(f"MegatronEngine.{method}(): the batch has no rows")

    def plan(self, batch: DataProto, micro_batch_size: int) -> list[list[int]]:
        """Row groups of the micro-batches. The interleaved (virtual pipeline) schedule needs a multiple of
        the pipeline size: the rows are then spread over that many groups, and a group left empty (fewer
        rows than stages) is run as a stand-in that contributes nothing (:meth:`micro_batches_of`)."""
        if self.config.use_dynamic_bsz:
            budget = self.config.max_token_len_per_gpu * self.cp_size  # each context-parallel rank runs its share
            groups = token_budget_partition(batch.batch["attention_mask"].sum(-1).tolist(), budget)
        else:
            groups = fixed_size_partition(len(batch), micro_batch_size)
        if len(self.chunks) > 1 and len(groups) % self.pp_size:
            count = math.ceil(len(groups) / self.pp_size) * self.pp_size
            rows = len(batch)
            bounds = [rows * index // count for index in range(count + 1)]
            groups = [list(range(bounds[index], bounds[index + 1])) for index in range(count)]
        return groups

    @staticmethod
    def micro_batches_of(batch: DataProto, groups: list[list[int]], meta_info: dict[str, Any] | None = None) -> list[DataProto]:
        """The micro-batches of ``groups``; an empty group becomes row 0 marked ``stand_in`` in its meta_info."""
        micro_batches = []
        for rows in groups:
            micro_batch = batch.select_idxs(rows or [0])
            extra = {**(meta_info or {}), **({STAND_IN: True} if not rows else {})}
            micro_batches.append(micro_batch.with_meta_info(extra) if extra else micro_batch)
        return micro_batches

    def model_inputs(self, micro_batch: DataProto) -> dict[str, torch.Tensor]:
        """Left-aligned rows and what is needed to read the response positions back."""
        data = micro_batch.batch
        device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        attention = data["attention_mask"].bool()
        rows, width = attention.shape
        response_length = data["responses"].shape[1]
        left = torch.where(attention.any(-1), attention.int().argmax(-1), torch.zeros(rows, dtype=torch.long))
        columns = (torch.arange(width).unsqueeze(0) + left.unsqueeze(1)) % width
        tokens = data["input_ids"].gather(1, columns)
        valid = attention.gather(1, columns)
        causal = torch.ones(width, width, dtype=torch.bool).triu(1)
        mask = causal.unsqueeze(0) | ~valid.unsqueeze(1)
        predictors = (torch.arange(width - response_length - 1, width - 1).unsqueeze(0) - left.unsqueeze(1)).clamp(0, width - 1)
        inputs = {
            "tokens": tokens.to(device),
            "position_ids": torch.arange(width).unsqueeze(0).expand(rows, -1).contiguous().to(device),
            "attention_mask": mask.unsqueeze(1).to(device),
            "predictors": predictors.to(device),
            "responses": data["responses"].to(device),
        }
        if self.routing is not None:  # the routers' tokens are [sequence, batch] flattened (rlplat_engine_megatron.moe)
            inputs["columns"] = columns
            inputs["valid"] = valid.t().reshape(-1).to(device)
            if ROUTES in data.keys():
                inputs["routes"] = aligned_routes(data[ROUTES], valid, columns, self.hf_config.num_hidden_layers,
                                                  self.moe_shape["top_k"]).to(device)
        return context_parallel.shard_inputs(inputs, self.cp_size, self.cp_rank) if self.cp_size > 1 else inputs

    def routing_calls(self, update: bool, share_of: Any = None) -> Any:
        """``call_of(micro_batch, inputs)``: the :class:`MegatronCall` of a model call under ``actor.moe`` (None for a
        dense model). ``update``: a call of an optimizer step (replays under r2 and r3; observed with
        ``share_of(micro_batch)``, its weight in the router losses) or of ``forward`` (replays under r3, records
        under r2)."""
        if self.routing is None:
            return None
        mode = self.moe.router_replay

        def call_of(micro_batch: DataProto, inputs: Mapping[str, torch.Tensor]) -> MegatronCall:
            routes = inputs.get("routes")
            if routes is None and mode == "r3":
                raise KeyError(f"actor.moe.router_replay=r3: the batch has no {ROUTES!r} column, so the rollout recorded no routes "
                               "(rollout.config.record_routes, set by the trainer for r3 runs of the hf rollout)")
            replays = mode == "r3" or (mode == "r2" and update)
            stand_in = bool(micro_batch.meta_info.get(STAND_IN))
            share = share_of(micro_batch) if update and not stand_in else None
            return MegatronCall(inputs["valid"], routes if replays else None, record=mode == "r2" and not update, share=share,
                                cp_tokens=inputs.get("cp_tokens"))

        return call_of

    def outputs_of(self, output: torch.Tensor, inputs: Mapping[str, torch.Tensor], temperature: float, with_entropy: bool,
                   gather_ids: torch.Tensor | None = None, top_k: int = 0) -> dict[str, torch.Tensor]:
        """The last stage's model output [b, T, V/tp] (or [b, T, 1] values) -> ``log_probs`` (``entropy``)
        or ``values`` [b, R]; ``gathered_log_probs`` [b, R, k] at ``gather_ids``; ``top_k_log_probs`` and
        ``top_k_ids`` [b, R, top_k]."""
        if inputs.get("cp_slots") is not None:  # context parallel: this rank's response positions, then the group's [b, R]
            mine = self.outputs_of(output, {**inputs, "cp_slots": None}, temperature, with_entropy,
                                   None if gather_ids is None else context_parallel.compact(gather_ids, inputs), top_k)
            return context_parallel.spread_outputs(mine, inputs, self.cp_group)
        index = inputs["predictors"]
        if self.config.value_model:
            return {"values": output[..., 0].float().gather(1, index)}
        if self.chunked_output is not None:  # output: the final hidden states [b, T, h]
            hidden = output.gather(1, index.unsqueeze(-1).expand(-1, -1, output.shape[-1]))
            weight = self.chunked_output.weight if self.chunked_output.weight is not None else self.chunked_output.layer.weight
            vocab = weight.shape[0]  # this rank's slice of the vocabulary
            return self.chunked_output.outputs(hidden, inputs["responses"], temperature, with_entropy, self.tp_rank * vocab,
                                               vocab * self.tp_size, None if gather_ids is None else gather_ids.to(hidden.device), top_k)
        vocab = output.shape[-1]
        logits = output.gather(1, index.unsqueeze(-1).expand(-1, -1, vocab))
        log_probs, entropy = vocab_parallel.log_probs_and_entropy(logits, inputs["responses"], temperature, with_entropy, self.tp_rank * vocab)
        result = {"log_probs": log_probs}
        if entropy is not None:
            result["entropy"] = entropy
        if gather_ids is not None:
            result["gathered_log_probs"] = vocab_parallel.gathered_log_probs(logits, gather_ids.to(logits.device), temperature,
                                                                             self.tp_rank * vocab)
        if top_k:
            result["top_k_log_probs"], result["top_k_ids"] = vocab_parallel.top_k(logits, temperature, top_k, self.tp_rank * vocab,
                                                                                 vocab * self.tp_size)
        return result

    def run_schedule(self, micro_batches: list[DataProto], step: Any, forward_only: bool,
                     call_of: Any = None) -> list[tuple[dict[int, torch.Tensor], torch.Tensor | None]]:
        """megatron's pipeline schedule over ``micro_batches``; ``step(micro_batch, inputs, output)`` runs
        on the last stage and returns the micro-batch's loss. ``call_of(micro_batch, inputs)``: the routing
        of each model call (:meth:`routing_calls`). Returns each micro-batch's recorded routes (this stage's
        layers) with the columns that left-aligned its rows (None for a dense model)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        prepared = [(micro_batch, self.model_inputs(micro_batch)) for micro_batch in micro_batches]
        recorded: list[dict[int, torch.Tensor]] = [{} for _ in micro_batches]
        index_of = {id(inputs): index for index, (_, inputs) in enumerate(prepared)}

        def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
            micro_batch, inputs = next(data_iterator)
            call = call_of(micro_batch, inputs) if call_of is not None else None
            if call is not None:
                self.routing.begin(call)
            try:
                output = model(input_ids=inputs["tokens"], position_ids=inputs["position_ids"], attention_mask=inputs["attention_mask"])
            finally:
                if call is not None:
                    self.routing.end()
                    recorded[index_of[id(inputs)]].update(call.recorded)

            def loss_func(output_tensor: torch.Tensor):
                loss = step(micro_batch, inputs, output_tensor)
                return loss, torch.tensor(0, dtype=torch.int), {}

            return output, loss_func

        iterators: Any = [iter(prepared) for _ in self.chunks] if len(self.chunks) > 1 else iter(prepared)
        width = prepared[0][1]["attention_mask"].shape[-1]  # padded to a multiple of 2 x CP under context parallelism
        layer = self.chunks[-1].module.output_layer if self.is_last_stage else None
        rows = max(len(micro_batch) for micro_batch in micro_batches)
        logits_bytes = rows * micro_batches[0].batch["responses"].shape[1] * (self.hf_config.vocab_size // self.tp_size) * 4
        if layer is not None and not self.config.value_model and logits_bytes > vocab_parallel.KEEP_FLOAT32_BYTES:
            self.chunked_output = vocab_parallel.ChunkedOutput(layer, self.config.logprob_chunk_size)
            layer.forward = self.chunked_output
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators, model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(prepared), seq_length=width, micro_batch_size=len(micro_batches[0]), forward_only=forward_only,
            )
        finally:
            if self.chunked_output is not None:
                del layer.forward  # the class's forward again
                self.chunked_output = None
        return [(routes, inputs.get("columns")) for routes, (_, inputs) in zip(recorded, prepared)]

    # -- forward -----------------------------------------------------------------------------------

    def forward(self, batch: DataProto, *, temperature: float = 1.0, calculate_entropy: bool = False, top_k: int = 0) -> DataProto:
        self.require_model("forward")
        self.check_inputs(batch, "forward")
        if top_k and self.config.value_model:
            raise ValueError("MegatronEngine.forward(top_k=...): a value model has no token distribution")
        size = self.config.forward_micro_batch_size_per_gpu or self.config.micro_batch_size_per_gpu
        groups = self.plan(batch, size)
        keys = ["values"] if self.config.value_model else (["log_probs", "entropy"] if calculate_entropy else ["log_probs"])
        keys += ["top_k_log_probs", "top_k_ids"] if top_k else []
        pieces: list[dict[str, torch.Tensor]] = []

        def step(micro_batch: DataProto, inputs: Mapping[str, torch.Tensor], output: torch.Tensor) -> torch.Tensor:
            if micro_batch.meta_info.get(STAND_IN):
                return output.new_zeros(())
            outputs = self.outputs_of(output, inputs, temperature, calculate_entropy, top_k=top_k)
            pieces.append({key: outputs[key].detach().cpu() if key == "top_k_ids" else outputs[key].detach().float().cpu()
                           for key in keys})
            return output.new_zeros(())

        for chunk in self.chunks:
            chunk.eval()
        micro_batches = self.micro_batches_of(batch, groups)
        with torch.no_grad(), self.megatron():
            recorded = self.run_schedule(micro_batches, step, forward_only=True, call_of=self.routing_calls(update=False))
        rows, response_length = batch.batch["responses"].shape
        order = torch.tensor([row for rows_ in groups for row in rows_], dtype=torch.long)
        columns = {}
        if self.routing is not None and self.moe.router_replay == "r2":
            columns[ROUTES] = self.recorded_column(batch, groups, micro_batches, recorded)
        for key in keys:
            if pieces:  # the last stage computed them
                values = torch.cat([piece[key] for piece in pieces])
                columns[key] = torch.empty_like(values).index_copy_(0, order, values)
            else:  # other stages return zeros; the driver collects from the last stage
                shape = (rows, response_length, top_k) if key.startswith("top_k") else (rows, response_length)
                columns[key] = torch.zeros(shape, dtype=torch.long if key == "top_k_ids" else torch.float32)
        return DataProto.from_dict(columns)

    def recorded_column(self, batch: DataProto, groups: list[list[int]], micro_batches: list[DataProto],
                        recorded: list[tuple[dict[int, torch.Tensor], torch.Tensor | None]]) -> torch.Tensor:
        """The routes ``forward`` took, as the ``routed_experts`` column of ``batch`` (every stage's layers:
        the stages' columns are combined over the pipeline)."""
        from megatron.core import parallel_state

        rows, width = batch.batch["input_ids"].shape
        column = torch.full((rows, width, self.hf_config.num_hidden_layers, self.moe_shape["top_k"]), -1, dtype=torch.int16)
        for rows_, (routes, aligned_columns), micro_batch in zip(groups, recorded, micro_batches):
            if rows_:
                column[torch.tensor(rows_)] = original_routes(routes, aligned_columns, micro_batch.batch["attention_mask"],
                                                              self.hf_config.num_hidden_layers, self.moe_shape["top_k"])
        if self.pp_size > 1:  # -1 where another stage's layer is: the largest value is the recorded one
            combined = column.int()
            if not self.on_cpu:
                combined = combined.cuda()
            dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group())
            column = combined.cpu().to(torch.int16)
        return column

    # -- training ----------------------------------------------------------------------------------

    def train_batch(self, batch: DataProto, loss_fn: LossFunction) -> dict[str, float]:
        self.require_model("train_batch")
        self.check_inputs(batch, "train_batch")
        meta = batch.meta_info
        rows = self.local_mini_batch_rows(batch)
        epochs = int(meta.get("ppo_epochs", self.config.ppo_epochs))
        temperature = float(meta.get("temperature", 1.0))
        calculate_entropy = bool(getattr(loss_fn, "needs_entropy", False))
        for chunk in self.chunks:
            chunk.train()
        steps: list[dict[str, float]] = []
        for _ in range(epochs):
            for start in range(0, len(batch), rows):
                mini_batch = batch.select_idxs(list(range(start, min(start + rows, len(batch)))))
                steps.append(self.optimizer_step(mini_batch, loss_fn, temperature, calculate_entropy))
        keys = {key for step in steps for key in step}
        return {key: sum(step.get(key, 0.0) for step in steps) / len(steps) for key in sorted(keys)}

    def local_mini_batch_rows(self, batch: DataProto) -> int:
        """Rows of this data-parallel rank per optimizer step (see the fsdp2 engine for the rule)."""
        rows = len(batch)
        global_rows = batch.meta_info.get("ppo_mini_batch_size", self.config.ppo_mini_batch_size)
        if global_rows is None:
            return rows
        per_rank, remainder = divmod(int(global_rows), self.dp_size)
        if remainder or per_rank == 0:
            raise ValueError(
                f"train_batch: ppo_mini_batch_size={global_rows} rows of the global batch do not split over "
                f"{self.dp_size} data-parallel rank(s); make it a multiple of {self.dp_size}"
            )
        return min(per_rank, rows)

    def response_mask(self, batch: DataProto) -> torch.Tensor:
        if "response_mask" in batch.batch.keys():
            return batch.batch["response_mask"]
        return batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1]:]

    def dp_sum(self, values: list[float]) -> list[float]:
        return self.world_sum(values, self.dp_group) if self.dp_size > 1 else [float(value) for value in values]

    def optimizer_step(self, mini_batch: DataProto, loss_fn: LossFunction, temperature: float, calculate_entropy: bool) -> dict[str, float]:
        mask = self.response_mask(mini_batch)
        counted = {}
        for name in getattr(loss_fn, "count_masks", ()) or ():  # a loss's own masks, within the response mask
            if name not in mini_batch.batch.keys():
                raise KeyError(f"train_batch: the loss function counts the mask {name!r}, which the batch does not hold")
            counted[name] = mini_batch.batch[name].to(mask.dtype) * mask
        counts = self.dp_sum([float(mask.sum()), float((mask.sum(-1) > 0).sum()),
                              *(value for own in counted.values() for value in (float(own.sum()), float((own.sum(-1) > 0).sum()))),
                              float(mini_batch.batch["attention_mask"].sum())])
        tokens, sequences, input_tokens = counts[0], counts[1], counts[-1]
        meta_info = {**mini_batch.meta_info, "global_token_count": tokens, "global_sequence_count": int(sequences)}
        if counted:
            meta_info["global_counts"] = {name: {"tokens": counts[2 + 2 * index], "sequences": int(counts[3 + 2 * index])}
                                          for index, name in enumerate(counted)}
        groups = self.plan(mini_batch, self.config.micro_batch_size_per_gpu)
        micro_batches = self.micro_batches_of(mini_batch, groups, meta_info)
        losses: list[float] = []
        metrics: list[dict[str, float]] = []

        def step(micro_batch: DataProto, inputs: Mapping[str, torch.Tensor], output: torch.Tensor) -> torch.Tensor:
            if micro_batch.meta_info.get(STAND_IN):
                return output.sum() * 0.0
            gather = getattr(loss_fn, "gather_ids", None)
            outputs = self.outputs_of(output, inputs, temperature, calculate_entropy,
                                      gather_ids=None if gather is None else micro_batch.batch[gather])
            loss, loss_metrics = loss_fn(outputs, micro_batch)
            losses.append(float(loss.detach()))
            metrics.append({key: float(value) for key, value in loss_metrics.items()})
            return loss

        lr = self.schedule(self.global_step) * self.config.lr
        self.set_lr(lr)
        call_of = self.routing_calls(update=True, share_of=lambda micro_batch: float(micro_batch.batch["attention_mask"].sum()) / max(input_tokens, 1.0))
        if self.routing is not None and self.routing.once_here:  # the (token, layer) pairs whose routes matter, this stage's layers
            for micro_batch in micro_batches:
                if not micro_batch.meta_info.get(STAND_IN):
                    valid = micro_batch.batch["attention_mask"].bool()
                    self.routing.needed += (int(valid.sum()) - int(valid.any(-1).sum())) * len(self.routing.taps)
        with self.megatron():
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.run_schedule(micro_batches, step, forward_only=False, call_of=call_of)
            success, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        if success and math.isfinite(grad_norm):
            self.global_step += 1
        summed = self.gather_metrics(metrics + [{"loss": sum(losses)}])
        if self.routing is not None:
            summed.update(self.routing.step_metrics(self.world_sum))
        return {**summed, "grad_norm": grad_norm, "lr": float(lr), "skipped_step": float(not (success and math.isfinite(grad_norm)))}

    def world_sum(self, values: list[float], group: Any = None) -> list[float]:
        """``values`` summed over ``group`` (every rank by default)."""
        tensor = torch.tensor(values, dtype=torch.float64)
        if not self.on_cpu:
            tensor = tensor.cuda()
        if self.world_size > 1:
            dist.all_reduce(tensor, group=group)
        return tensor.cpu().tolist()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def gather_metrics(self, metrics: list[dict[str, float]]) -> dict[str, float]:
        """Sum of every metric over the micro-batches of the collecting rank of each data-parallel group."""
        collecting = self.collects()
        gathered: list[Any] = [metrics if collecting else []]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, metrics if collecting else [])
        totals: dict[str, float] = {}
        for rank_metrics in gathered:
            for entry in rank_metrics:
                for key, value in entry.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
        return totals

    # -- offload -----------------------------------------------------------------------------------

    def offload(self) -> None:
        """Nothing moves: megatron's DDP keeps the parameters and gradients in contiguous buffers that its
        optimizer and gradient reduction hold views of, so they stay where they are (on CPU there is
        nothing to free). The optimizer state offloads through megatron itself (``optimizer_offload``)."""

    def onload(self) -> None:
        """See :meth:`offload`."""

    # -- facts -------------------------------------------------------------------------------------

    @classmethod
    def estimate_memory(cls, config: Any, model_config: Mapping[str, Any], context: Any) -> Any:
        """One rank's memory per call, from the config and ``config.json`` alone (:mod:`rlplat_engine_megatron.memory`);
        raises ``ValueError`` naming the keys when the layout does not fit the role's processes or the model."""
        from rlplat_engine_megatron.memory import estimate

        return estimate(config, model_config, context)

    def state(self) -> Mapping[str, Any]:
        facts: dict[str, Any] = {"step": self.global_step}
        if self.chunks:
            facts.update(
                tensor_parallel_size=self.tp_size, pipeline_parallel_size=self.pp_size, data_parallel_size=self.dp_size,
                expert_model_parallel_size=self.ep_size, context_parallel_size=self.cp_size,
                local_parameters=sum(p.numel() for chunk in self.chunks for p in chunk.module.parameters()),
                value_model=self.config.value_model, lr=self.schedule(self.global_step) * self.config.lr,
            )
        return facts


def summed_gradients(finalize: Any, model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any) -> None:
    """megatron's gradient finaliser (DP all-reduce, tied-embedding sync) with no division by a token
    count: the loss function already normalised by the global counts, so gradients are summed."""
    finalize(model, None, **kwargs)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
