"""rlplat's settings in SGLang's terms, and SGLang's outputs in rlplat's; no sglang import here, so that
the translation is testable (and tested) where sglang is not installed.

Every key below is checked against the installed SGLang by ``tests/test_api_compat.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.lora import json_value, without_adapter_name  # noqa: F401 (json_value: used by the rollout)
from rlplat.kits.rollout_batch import finish_reason
from rlplat.kits.rollout_server import cli_flags
from rlplat_rollout_sglang.config import SGLangRolloutConfig

# sglang/srt/sampling/sampling_params.py: TOP_K_ALL = 1 << 30, "whole vocabulary" (SGLang's top_k off;
# rlplat's is 0). Hard-coded so that this module needs no sglang; the compat test compares the two.
TOP_K_ALL = 1 << 30

# sglang/srt/constants.py: the memory regions torch_memory_saver can release and resume.
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
ALL_MEMORY_TAGS = [WEIGHTS, KV_CACHE, CUDA_GRAPH]
KV_CACHE_TAGS = [KV_CACHE, CUDA_GRAPH]

SEED_RANGE = 2**63  # SGLang checks sampling_seed in [-2**63, 2**63 - 1]


def sampling_params(sampling: SamplingParams, eos_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """One request's ``sampling_params`` dict (the keys of SGLang's ``SamplingParams``).

    ``greedy`` is temperature 0, which SGLang turns into its greedy path (``top_k=1``); the filters are
    off then. ``top_k=0`` (rlplat's off) is SGLang's :data:`TOP_K_ALL`. The configured EOS ids join
    ``stop_token_ids`` so that generation stops where rlplat expects whatever the model's generation
    config says. ``no_stop_trim`` keeps the stop token in ``output_ids`` (the response mask covers it);
    ``skip_special_tokens=False`` keeps any text SGLang makes consistent with the ids.
    ``sampling_seed`` is honoured by SGLang only with ``enable_deterministic_inference``.
    """
    stop = sorted(set(sampling.stop_token_ids) | set(eos_token_ids))
    return {
        "n": sampling.n,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": TOP_K_ALL if sampling.greedy or sampling.top_k == 0 else sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "min_new_tokens": 0,
        "stop_token_ids": stop or None,
        "ignore_eos": False,
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "sampling_seed": sampling.seed,
    }


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a call seeded with ``seed``. SGLang's seeded sampling depends only
    on the seed and the position, so every sample needs its own seed or the ``n`` samples of a prompt
    would be identical."""
    return (seed * 1_000_003 + index) % SEED_RANGE


def per_sample_params(sampling: SamplingParams, count: int, eos_token_ids: Sequence[int], seeds: Sequence[int | None]) -> list[dict[str, Any]]:
    """``count`` single-sample dicts (``n=1``), sample ``i`` with ``sampling_seed=seeds[i]``.

    rlplat sends one request per sample instead of SGLang's ``n``: SGLang would give the ``n`` copies of
    a request one ``sampling_seed`` and so, in deterministic mode, ``n`` identical samples."""
    base = {**sampling_params(sampling, eos_token_ids), "n": 1}
    return [{**base, "sampling_seed": seeds[index]} for index in range(count)]


def generate_request(token_lists: Sequence[Sequence[int]], params: Sequence[Mapping[str, Any]], adapter: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine.generate`` and, the same names, the JSON of ``POST /generate``:
    a batch of token-id prompts (a list of lists, so the answer is always a list), one sampling dict
    each, the log-prob of every sampled token (``meta_info.output_token_logprobs``), and the name of
    the loaded LoRA adapter every request uses (``lora_path`` takes a loaded adapter's name), if any."""
    if len(token_lists) != len(params):
        raise ValueError(f"{len(token_lists)} prompts but {len(params)} sampling dicts")
    request = {"input_ids": [list(tokens) for tokens in token_lists], "sampling_params": [dict(p) for p in params], "return_logprob": True}
    if adapter is not None:
        request["lora_path"] = adapter
    return request


def server_args_kwargs(config: SGLangRolloutConfig, cpu: bool = False, kv_cache_tokens: int | None = None) -> dict[str, Any]:
    """``ServerArgs`` fields (the keyword arguments of ``sglang.Engine``), ``engine_kwargs`` last so it wins.

    The tokenizer is never loaded (``skip_tokenizer_init``): prompts go in as ids and only ids come out.
    ``cpu``: for SGLang's CPU engine (:data:`CPU_ENGINE_SETTINGS`, the KV cache of ``kv_cache_tokens`` tokens
    instead of a fraction of free memory, no memory saver).
    """
    values: dict[str, Any] = {
        "model_path": config.model_path,
        "skip_tokenizer_init": True,
        "load_format": "auto" if config.load_weights else "dummy",
        "dtype": config.dtype,
        "tp_size": config.tp_size,
        "mem_fraction_static": None if cpu else config.mem_fraction_static,
        "context_length": config.context_length,
        "max_running_requests": config.max_running_requests,
        "enable_memory_saver": memory_saver(config, cpu),
        "disable_radix_cache": config.disable_radix_cache,
        "enable_deterministic_inference": config.enable_deterministic_inference,
        "random_seed": config.seed,
    }
    if config.max_lora_rank:
        values.update(enable_lora=True, max_lora_rank=config.max_lora_rank, lora_target_modules=list(config.lora_target_modules))
    if config.disable_cuda_graph or cpu:
        # `disable_cuda_graph` is a deprecated, command-line-less field in 0.5.23; these are its successors
        values["disable_decode_cuda_graph"] = True
        values["disable_prefill_cuda_graph"] = True
    if cpu:
        values.update(CPU_ENGINE_SETTINGS, max_total_tokens=kv_cache_tokens)
    values = {key: value for key, value in values.items() if value is not None}
    return {**values, **dict(config.engine_kwargs)}


#: ``ServerArgs`` of SGLang's CPU engine without Intel AMX (measured with 0.5.23): its pure-torch attention and
#: sampler; what runs on CUDA only (memory saver, CUDA graphs, deterministic mode) is off or refused. The scheduler
#: waits on its sockets when idle (``sleep_on_idle``; a request still wakes it at once): its busy loop otherwise
#: holds a core the training engine shares (the demo's update took 2.8x the hf rollout's beside it).
CPU_ENGINE_SETTINGS = {"device": "cpu", "attention_backend": "torch_native", "sampling_backend": "pytorch", "sleep_on_idle": True}


def memory_saver(config: SGLangRolloutConfig, cpu: bool) -> bool:
    """``enable_memory_saver``: the config's, else on for GPUs and off for the CPU engine."""
    return (not cpu) if config.enable_memory_saver is None else config.enable_memory_saver


def cpu_engine_problems(config: SGLangRolloutConfig) -> list[str]:
    """What SGLang's CPU engine cannot do of what ``config`` asks, as sentences (empty: nothing)."""
    problems = []
    if config.enable_memory_saver:
        problems.append("enable_memory_saver=true needs torch_memory_saver, which is CUDA-only: SGLang's CPU engine does "
                        "not start with it (leave it unset; sleep() then frees no memory)")
    if config.enable_deterministic_inference:
        problems.append("enable_deterministic_inference=true is refused by SGLang with the CPU engine's torch_native "
                        "attention, and its seeded sampler needs CUDA or XPU: samples on CPU are not reproducible from a seed")
    if config.tp_size != 1:
        problems.append(f"tp_size={config.tp_size}: the CPU engine runs one process per engine here (tp_size=1)")
    if config.max_lora_rank:
        problems.append(f"max_lora_rank={config.max_lora_rank}: SGLang 0.5.23's LoRA layers allocate pinned host memory, which "
                        "needs CUDA, so its CPU engine cannot serve LoRA adapters (measured); train LoRA with "
                        "actor.lora.sync=merged instead (the merged weights reach the rollout as full updates)")
    return problems


def kv_cache_tokens(config: SGLangRolloutConfig, model_config: Mapping[str, Any]) -> int:
    """The CPU engine's ``max_total_tokens``: ``cpu_kv_cache_gib`` over the KV-cache bytes per token (every
    layer's keys and values in the rollout's dtype) of the model whose ``config.json`` is ``model_config``."""
    from rlplat.contracts.memory import ModelShape
    from rlplat.kits.memory import dtype_bytes

    dtype = config.dtype if config.dtype != "auto" else str(model_config.get("torch_dtype") or model_config.get("dtype") or "bfloat16")
    per_token = ModelShape.from_config(model_config, f"{config.model_path}/config.json").kv_cache_bytes_per_token(
        dtype_bytes(dtype, "rollout.config.dtype of sglang"))
    return max(1, int(config.cpu_kv_cache_gib * 2**30 // per_token))


def server_argv(engine_kwargs: Mapping[str, Any], host: str, port: int) -> list[str]:
    """Arguments of ``python -m sglang.launch_server`` for the ``ServerArgs`` fields ``engine_kwargs``
    (:func:`server_args_kwargs`): one flag per field. SGLang's boolean flags are ``store_true``, so a False
    one is left out (every boolean here defaults to False)."""
    values = {**engine_kwargs, "host": host, "port": port}
    return cli_flags(values, boolean_style="store_true", list_style="separate")


def sample_from_output(output: Mapping[str, Any], stop_token_ids: Iterable[int], max_new_tokens: int) -> TokenOutput:
    """One SGLang generate result (``{"output_ids", "meta_info": {"finish_reason",
    "output_token_logprobs"}}``) as a TokenOutput.

    ``output_token_logprobs`` holds ``(logprob, token_id, text)`` per sampled token (lists once they went
    through JSON); its ids must be the output ids. SGLang reports ``log_softmax(logits / temperature)``
    of the sampled token: the temperature is applied, top-k / top-p renormalisation is not. A finish
    reason of type ``abort`` is an error carrying SGLang's message.
    """
    meta = output.get("meta_info") or {}
    reason = meta.get("finish_reason")
    reported = reason.get("type") if isinstance(reason, Mapping) else reason
    if reported == "abort":
        message = reason.get("message") if isinstance(reason, Mapping) else None
        raise RuntimeError(f"sglang aborted request {meta.get('id')!r}: {message or 'no message'}")
    tokens = [int(token) for token in output.get("output_ids") or []]
    entries = meta.get("output_token_logprobs")
    if entries is None or len(entries) != len(tokens):
        raise RuntimeError(
            f"sglang returned {0 if entries is None else len(entries)} output_token_logprobs for {len(tokens)} "
            "tokens; the rollout asks return_logprob=True on every request"
        )
    values = []
    for position, (entry, token) in enumerate(zip(entries, tokens)):
        if int(entry[1]) != token:
            raise RuntimeError(f"sglang log-prob entry {position} is for token {entry[1]}, but output token {position} is {token}")
        values.append(float(entry[0]))
    return TokenOutput(tokens, values, finish_reason(tokens, list(stop_token_ids), max_new_tokens, reported))


def samples_from_outputs(outputs: Any, count: int, stop_token_ids: Iterable[int], max_new_tokens: int) -> list[TokenOutput]:
    """The ``count`` results of a batched generate call, in request order."""
    if isinstance(outputs, Mapping):
        outputs = [outputs]
    if not isinstance(outputs, list) or len(outputs) != count:
        size = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise RuntimeError(f"sglang returned {size} results for {count} requests")
    stop = list(stop_token_ids)
    return [sample_from_output(output, stop, max_new_tokens) for output in outputs]





def adapter_tensors(named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The adapter's tensors by peft name without an adapter name (``<module>.lora_A.weight``), detached
    and contiguous, as ``load_lora_adapter_from_tensors`` takes them."""
    tensors = {}
    for name, tensor in named_tensors:
        stored = without_adapter_name(name)
        if stored in tensors:
            raise ValueError(f"sglang rollout: adapter tensors name {stored!r} twice (one adapter is loaded at a time)")
        tensors[stored] = tensor.detach().contiguous()
    if not tensors:
        raise ValueError("sglang rollout: load_adapter got no adapter tensors")
    return tensors


def read_model_config(model_path: str) -> dict[str, Any]:
    """The ``config.json`` of the local model directory ``model_path``, as a dict."""
    file = Path(model_path) / "config.json"
    try:
        return json.loads(file.read_text())
    except OSError as error:
        raise FileNotFoundError(f"sglang rollout: model_path {model_path!r} has no readable config.json ({error})") from None
    except ValueError as error:
        raise ValueError(f"sglang rollout: {file} is not valid JSON ({error})") from None
