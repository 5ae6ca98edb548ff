"""Configuration of the ``sglang`` rollout (the ``rollout.config`` node)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlplat.kits.rollout_server import ServerSettings

MODES = ("hybrid", "server")
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclasses.dataclass
class SGLangRolloutConfig(ServerSettings):
    mode: str = "hybrid"
    """``hybrid``: an ``sglang.Engine`` owned by the worker process, beside the training engine on the
    same GPU. ``server``: an SGLang HTTP server (``python -m sglang.launch_server``), started by the
    engine or found at ``server_url``."""

    model_path: str | None = None
    """Local Hugging Face directory (config and tokenizer files; the weights too when ``load_weights``)."""

    load_weights: bool = True
    """Load the weights in ``model_path``; False starts from random weights (SGLang
    ``load_format='dummy'``) and the training engine's ``update_weights`` supplies the real ones, as in
    RL training."""

    dtype: str = "bfloat16"
    """Parameter dtype of the rollout model (``auto``, ``bfloat16``, ``float16``, ``float32``). Weight
    updates are cast to it before they travel."""

    tp_size: int = 1
    """GPUs one rollout engine spans (SGLang tensor parallelism); 1 in hybrid mode, where each GPU worker
    holds one engine on its own GPU."""

    mem_fraction_static: float | None = 0.5
    """Fraction of the GPU memory that is free when SGLang starts (after the training engine took its
    share, in hybrid mode) that SGLang takes for weights and KV cache (None: SGLang chooses, which
    assumes it has the GPU to itself). Not used by SGLang's CPU engine (see ``cpu_kv_cache_gib``)."""

    cpu_kv_cache_gib: float = 1.0
    """On SGLang's CPU engine (:mod:`rlplat_rollout_sglang.platform`): the KV cache's size in GiB of host memory,
    passed to SGLang as ``max_total_tokens`` (this size over the model's KV bytes per token, from its
    ``config.json``; an ``engine_kwargs`` ``max_total_tokens`` wins). Without it SGLang would take
    ``mem_fraction_static`` of the host's free memory. 1 GiB holds about 87k tokens of a 0.5B Qwen2 in bfloat16."""

    context_length: int | None = None
    """Prompt plus response tokens per sequence (None: from the model config)."""

    max_running_requests: int | None = None
    """Sequences decoded together (None: SGLang's default)."""

    enable_memory_saver: bool | None = None
    """Allocate weights, KV cache and CUDA graphs through ``torch_memory_saver`` so that ``sleep`` can
    give their GPU memory back. Without it ``sleep`` frees nothing (the state rules still apply). None: on
    GPUs, on CPUs off (``torch_memory_saver`` is CUDA-only: SGLang's CPU engine does not start with it, so
    True is refused there)."""

    disable_radix_cache: bool = False
    """Turn off SGLang's prefix (radix) cache. With it on, the ``n`` samples of one prompt share the
    prompt's KV cache; it is flushed after every weight update."""

    disable_cuda_graph: bool = False
    """Run decode and prefill without CUDA graphs (slower, starts faster, less memory); SGLang's
    ``disable_decode_cuda_graph`` and ``disable_prefill_cuda_graph``. Always on for the CPU engine."""

    enable_deterministic_inference: bool = False
    """SGLang's batch-invariant deterministic mode. Only in this mode does SGLang honour a request's
    ``sampling_seed``: turn it on when ``SamplingParams.seed`` must reproduce samples. It costs speed
    and forces SGLang's pytorch sampling backend. GPU only: SGLang refuses it with the CPU engine's
    ``torch_native`` attention (and its seeded sampler needs CUDA or XPU), so it is refused there; the CPU
    engine's samples are not reproducible from a seed (the rollout's ``honours_seeds`` is False)."""

    seed: int = 0
    """SGLang ``random_seed``; also seeds the per-sample seeds drawn when a call gives no seed."""

    pad_token_id: int | None = None
    """Token written after a response ends (default: the model config's pad, else its first EOS)."""

    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end a response besides a call's ``stop_token_ids`` (default: the model config's EOS)."""

    max_lora_rank: int = 0
    """LoRA adapters (``load_adapter``, for ``actor.lora.sync=adapter``): the largest adapter rank served,
    at or above ``actor.lora.rank``; 0 (the default) starts SGLang without LoRA support, and
    ``load_adapter`` is refused."""

    lora_target_modules: tuple[str, ...] = ("all",)
    """With ``max_lora_rank``: the modules adapters may target, for which SGLang reserves LoRA buffers
    (``all``: every module SGLang supports; or names such as ``q_proj``, ``v_proj``)."""

    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """More ``sglang.srt.server_args.ServerArgs`` fields, passed as they are and winning over the keys
    above (e.g. ``attention_backend``, ``kv_cache_dtype``, ``chunked_prefill_size``). In server mode
    each becomes its ``--flag``."""

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.tp_size < 1:
            problems.append(f"tp_size must be >= 1, got {self.tp_size}")
        if self.mode == "hybrid" and self.tp_size != 1:
            problems.append(f"hybrid mode runs one SGLang engine per GPU worker: tp_size must be 1 (use mode=server for more), got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            problems.append(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if not self.cpu_kv_cache_gib > 0:
            problems.append(f"cpu_kv_cache_gib must be above 0, got {self.cpu_kv_cache_gib}")
        if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 0:
            problems.append(f"max_lora_rank must be an int >= 0 (0: no LoRA), got {self.max_lora_rank!r}")
        if not self.lora_target_modules:
            problems.append("lora_target_modules is empty: name the modules adapters may target, or ('all',)")
        problems += self.server_problems(self.mode, self.model_path)
        if not isinstance(self.engine_kwargs, Mapping):
            problems.append(f"engine_kwargs must be a mapping of ServerArgs fields, got {type(self.engine_kwargs).__name__}")
        if problems:
            raise ValueError("sglang rollout config: " + "; ".join(problems))
