"""The model side of the engine: building a Hugging Face model, and turning its outputs into per-token
log-probs, entropy and values of the response tokens.

Log-probs and entropy are computed a chunk of tokens at a time from ``logits / temperature`` in
float32, so a float32 ``[batch, response, vocab]`` tensor never exists at once. With gradients each
chunk is recomputed in backward (``torch.utils.checkpoint``), so autograd does not keep every
chunk's float32 copy either, unless the whole float32 tensor is small (:data:`KEEP_FLOAT32_BYTES`:
a tiny vocabulary), where recomputing would save nothing worth its time. The temperature is applied exactly as Hugging Face ``generate`` and
vLLM sample: the logits are cast to float32, then divided.

With ``remove_padding`` the rows run as one pack of their valid tokens (:mod:`rlplat_engine_fsdp2.packing`)
and the same ``[B, R]`` outputs come back.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from rlplat_engine_fsdp2 import packing
from rlplat_engine_fsdp2.config import FSDP2EngineConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Log-probs and entropy of a micro-batch whose whole float32 ``[batch, response, vocab]`` tensor is at
#: most this large are computed in one piece and kept for backward, not chunked and recomputed: 16 MiB
#: is a few thousand tokens of a vocabulary of a thousand, and under 30 tokens of a 150k one.
KEEP_FLOAT32_BYTES = 16 << 20


def hf_config(config: FSDP2EngineConfig) -> Any:
    """The Hugging Face config of the model ``config`` describes (from ``model_path`` or ``model_config``)."""
    from transformers import AutoConfig

    if config.model_path is not None:
        if not os.path.isfile(os.path.join(config.model_path, "config.json")):
            raise FileNotFoundError(
                f"model_path {config.model_path!r} is not a local Hugging Face model directory (no config.json "
                "there); give the directory save_pretrained wrote, or model_config to build one from a config"
            )
        model_config = AutoConfig.from_pretrained(config.model_path, trust_remote_code=config.trust_remote_code)
    else:
        settings = dict(config.model_config)
        model_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    if config.value_model:
        model_config.num_labels = 1
        model_config.classifier_dropout = 0.0  # as verl's critic: a value head without dropout
    if config.reward_model:
        trained_head = any(name.endswith("ForSequenceClassification") for name in getattr(model_config, "architectures", None) or ())
        if trained_head and model_config.num_labels != 1:
            raise ValueError(
                f"reward model {config.model_path!r} is a sequence classifier with {model_config.num_labels} labels; "
                "a reward model has one (a scalar score)"
            )
        model_config.num_labels = 1
        if getattr(model_config, "pad_token_id", None) is None:
            # Hugging Face's pooling refuses batches without a pad id; the engine reads the score by the
            # attention mask instead, so any id serves.
            model_config.pad_token_id = 0
    return model_config


def model_class(config: FSDP2EngineConfig) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    if config.reward_model:
        return AutoModelForSequenceClassification
    return AutoModelForTokenClassification if config.value_model else AutoModelForCausalLM


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The linear head of a sequence-classification model (``score`` in Llama, Qwen2, Mistral, Gemma, GPT-2)."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no 'score' head; the fsdp2 engine reads a reward model's per-token "
            "scores from it (decoder models with Hugging Face's *ForSequenceClassification have one)"
        )
    return head


@contextlib.contextmanager
def per_token_scores(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects the score head's per-token output ``[B, T, 1]`` of the model calls made inside; Hugging
    Face pools it at the last token that is not the pad id, which is wrong when the pad id is also the
    EOS a response ends with, so the engine pools by the attention mask instead."""
    captured: list[torch.Tensor] = []
    handle = score_head(model).register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        yield captured
    finally:
        handle.remove()


def build_model(config: FSDP2EngineConfig) -> torch.nn.Module:
    """The full (unsharded) float32 model on CPU, identical on every rank: weights from ``model_path``
    or fresh ones drawn under ``seed`` (a value head on a causal-LM checkpoint is drawn under it too)."""
    model_config = hf_config(config)
    loader = model_class(config)
    options = dict(dtype=torch.float32, attn_implementation=config.attn_implementation, trust_remote_code=config.trust_remote_code)
    torch.manual_seed(config.seed)
    if config.model_path is not None:
        return loader.from_pretrained(config.model_path, config=model_config, **options)
    return loader.from_config(model_config, **options)


def enable_packing(model: torch.nn.Module, attn_implementation: str) -> bool:
    """Make ``model`` able to run packed calls (:func:`run_packed_model`): its attention becomes
    :func:`packing.attention_implementation` of ``attn_implementation``, the same kernel for unpacked
    calls. False, and ``model`` unchanged, when the model does not route attention through Hugging
    Face's attention interface (``_supports_attention_backend``), so a pack would attend across sequences."""
    if not getattr(model, "_supports_attention_backend", False):
        return False
    name = packing.attention_implementation(attn_implementation)
    if name != attn_implementation:
        model.set_attn_implementation(name)
    return True


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules Hugging Face marks as not to be split (``_no_split_modules``: the decoder layers),
    each of which gets its own ``fully_shard``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder-layer class in _no_split_modules ({sorted(names)}); "
            "the fsdp2 engine shards per decoder layer and cannot tell what they are"
        )
    return layers


def response_log_probs(logits: torch.Tensor, responses: torch.Tensor, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """float32 ``log softmax(logits / temperature)`` at ``responses``: logits ``[B, R, V]`` (position ``t``
    predicting ``responses[:, t]``) -> ``[B, R]``."""

    def chunk_log_probs(chunk: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        scaled = chunk.float() / temperature
        return scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)

    return over_chunks(chunk_log_probs, logits, responses, chunk_tokens)


def response_entropy(logits: torch.Tensor, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """float32 entropy of ``softmax(logits / temperature)`` per position: ``[B, R, V]`` -> ``[B, R]``."""

    def chunk_entropy(chunk: torch.Tensor) -> torch.Tensor:
        scaled = chunk.float() / temperature
        return scaled.logsumexp(-1) - (scaled.softmax(-1) * scaled).sum(-1)

    return over_chunks(chunk_entropy, logits, None, chunk_tokens)


def response_gathered_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """float32 ``log softmax(logits / temperature)`` at ``ids``: logits ``[B, R, V]``, ids ``[B, R, k]`` -> ``[B, R, k]``."""

    def chunk_gathered(chunk: torch.Tensor, chunk_ids: torch.Tensor) -> torch.Tensor:
        scaled = chunk.float() / temperature
        return scaled.gather(-1, chunk_ids) - scaled.logsumexp(-1, keepdim=True)

    return over_chunks(chunk_gathered, logits, ids, chunk_tokens)


def response_top_k(logits: torch.Tensor, temperature: float, k: int, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest float32 log-probs of ``softmax(logits / temperature)`` at each position and their ids
    (``[B, R, k]`` each, log-probs in descending order), a window of positions at a time; no gradient."""
    rows, positions, vocabulary = logits.shape
    if not 1 <= k <= vocabulary:
        raise ValueError(f"top_k={k}: it must be between 1 and the vocabulary size {vocabulary}")
    width = max(1, chunk_tokens // max(rows, 1))
    values, ids = [], []
    with torch.no_grad():
        for start in range(0, positions, width):
            scaled = logits[:, start : start + width].float() / temperature
            top = (scaled - scaled.logsumexp(-1, keepdim=True)).topk(k, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    if not values:
        return logits.new_zeros((rows, 0, k), dtype=torch.float32), torch.zeros((rows, 0, k), dtype=torch.long)
    return torch.cat(values, dim=1), torch.cat(ids, dim=1)


def over_chunks(function: Callable[..., torch.Tensor], logits: torch.Tensor, tokens: torch.Tensor | None, chunk_tokens: int) -> torch.Tensor:
    """``function`` over windows of positions holding about ``chunk_tokens`` tokens each, concatenated;
    under autograd each window is recomputed in backward instead of kept. All in one window, kept, when
    the float32 tensor is at most :data:`KEEP_FLOAT32_BYTES`."""
    rows, positions = logits.shape[:2]
    keep = logits.numel() * 4 <= KEEP_FLOAT32_BYTES
    width = positions if keep else max(1, chunk_tokens // max(rows, 1))
    pieces = []
    for start in range(0, positions, max(width, 1)):
        arguments = [logits[:, start : start + width]]
        if tokens is not None:
            arguments.append(tokens[:, start : start + width])
        if not keep and torch.is_grad_enabled() and logits.requires_grad:
            pieces.append(checkpoint(function, *arguments, use_reentrant=False))
        else:
            pieces.append(function(*arguments))
    if not pieces:
        # No position (a packed micro-batch without response tokens): still part of the graph, so its
        # backward reaches every parameter, as FSDP2's gradient reduction needs on every rank.
        return logits[:, :0, 0].float()
    return torch.cat(pieces, dim=1)


#: The output a loss function's ``gather_ids`` asks for (:class:`rlplat.contracts.engine.LossFunction`).
GATHERED = "gathered_log_probs"


class ModelOutputs(Mapping):
    """What the loss function receives: ``log_probs`` (or ``values``) ``[B, R]``, with ``entropy``
    computed only if the loss function reads it. Values keep their gradients.

    ``logits`` are those of the response positions: ``[B, R, V]`` padded, or ``[1, K, V]`` packed, where
    ``place`` scatters a ``[K]`` result into ``[B, R]`` (so the loss function never sees the packing)."""

    def __init__(
        self,
        values: dict[str, torch.Tensor],
        logits: torch.Tensor | None,
        temperature: float,
        chunk_tokens: int,
        place: Callable[[torch.Tensor], torch.Tensor] | None = None,
        gather_ids: torch.Tensor | None = None,
    ):
        self._values = values
        self._logits = logits
        self._temperature = temperature
        self._chunk_tokens = chunk_tokens
        self._place = place
        self._gather_ids = gather_ids

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "entropy" and key not in self._values and self._logits is not None:
            self.compute_entropy()
        if key == GATHERED and key not in self._values and self._logits is not None and self._gather_ids is not None:
            gathered = response_gathered_log_probs(self._logits, self._gather_ids, self._temperature, self._chunk_tokens)
            self._values[key] = gathered if self._place is None else self._place(gathered[0])
        return self._values[key]

    def top_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest log-probs at each response position and their ids, ``[B, R, k]`` each (0 at padding)."""
        values, ids = response_top_k(self._logits, self._temperature, k, self._chunk_tokens)
        if self._place is None:
            return values, ids
        return self._place(values[0]), self._place(ids[0])

    def compute_entropy(self) -> None:
        entropy = response_entropy(self._logits, self._temperature, self._chunk_tokens)
        self._values["entropy"] = entropy if self._place is None else self._place(entropy[0])

    def __iter__(self) -> Iterator[str]:
        keys = list(self._values)
        if self._logits is not None and "entropy" not in keys:
            keys.append("entropy")
        if self._logits is not None and self._gather_ids is not None and GATHERED not in keys:
            keys.append(GATHERED)
        return iter(keys)

    def __len__(self) -> int:
        return len(list(iter(self)))


def run_model(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor],
    *,
    value_model: bool,
    temperature: float,
    chunk_tokens: int,
    calculate_entropy: bool,
    remove_padding: bool = False,
    reward_model: bool = False,
    gather_ids: torch.Tensor | None = None,
) -> ModelOutputs:
    """One forward of ``model`` on ``input_ids``, ``attention_mask``, ``position_ids`` and
    ``responses`` (``[B, R]``, the last ``R`` tokens of ``input_ids``).

    ``remove_padding``: run the rows as one pack of their valid tokens (:mod:`rlplat_engine_fsdp2.packing`;
    the model must have passed :func:`enable_packing`). Outputs are
    the same ``[B, R]`` tensors, 0 at response positions that are padding. A ``reward_model`` returns
    ``rm_scores`` [B] instead (:func:`run_reward_model`)."""
    if reward_model:
        return run_reward_model(model, inputs, remove_padding=remove_padding)
    if remove_padding:
        return run_packed_model(model, inputs, value_model=value_model, temperature=temperature, chunk_tokens=chunk_tokens,
                                calculate_entropy=calculate_entropy, gather_ids=gather_ids)
    response_length = inputs["responses"].shape[1]
    arguments = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"], use_cache=False)
    if value_model:
        with quiet_value_head_view():
            values = model(**arguments).logits[:, -response_length - 1 : -1, 0].float()
        return ModelOutputs({"values": values}, None, temperature, chunk_tokens)
    # Only the logits that predict response tokens: positions T-R-1 .. T-2.
    logits = model(**arguments, logits_to_keep=response_length + 1).logits[:, :-1]
    outputs = ModelOutputs(
        {"log_probs": response_log_probs(logits, inputs["responses"], temperature, chunk_tokens)}, logits, temperature, chunk_tokens,
        gather_ids=gather_ids,
    )
    if calculate_entropy:
        outputs.compute_entropy()
    return outputs


def run_packed_model(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor],
    *,
    value_model: bool,
    temperature: float,
    chunk_tokens: int,
    calculate_entropy: bool,
    gather_ids: torch.Tensor | None = None,
) -> ModelOutputs:
    """:func:`run_model` on the rows packed into one row of their valid tokens."""
    grouped = model.config._attn_implementation.startswith(packing.PACKED_ATTENTION_PREFIX)
    packed = packing.pack(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"], inputs["responses"], grouped_attention=grouped)
    arguments = packed.model_kwargs()
    if value_model:
        with quiet_value_head_view(), packing.packed_forward():
            values = model(**arguments).logits[0, packed.predictors, 0].float()
        return ModelOutputs({"values": packed.unpack(values)}, None, temperature, chunk_tokens)
    with packing.packed_forward():
        logits = model(**arguments, logits_to_keep=packed.predictors).logits
    log_probs = response_log_probs(logits, packed.targets.unsqueeze(0), temperature, chunk_tokens)[0]
    packed_ids = None if gather_ids is None else packed.select(gather_ids).unsqueeze(0)
    outputs = ModelOutputs({"log_probs": packed.unpack(log_probs)}, logits, temperature, chunk_tokens, place=packed.unpack,
                           gather_ids=packed_ids)
    if calculate_entropy:
        outputs.compute_entropy()
    return outputs


def run_reward_model(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor], *, remove_padding: bool) -> ModelOutputs:
    """``rm_scores`` [B] float32: the score head's output at each row's last token with ``attention_mask``
    1 (0 for a row without one). Packed, the rows run as one row of their valid tokens."""
    mask = inputs["attention_mask"].bool()
    rows, width = mask.shape
    has_tokens = mask.any(-1)
    with quiet_value_head_view(), per_token_scores(model) as captured:
        if remove_padding:
            grouped = model.config._attn_implementation.startswith(packing.PACKED_ATTENTION_PREFIX)
            no_responses = inputs["input_ids"][:, :0]  # the pack's inputs only: nothing here predicts tokens
            packed = packing.pack(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"], no_responses,
                                  grouped_attention=grouped)
            with packing.packed_forward():
                model(**packed.model_kwargs())
            cu_seq_lens = packed.cu_seq_lens
            last = (cu_seq_lens[1:] - 1).long()
            picked = captured[-1][0, last, 0].float()
        else:
            model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"], use_cache=False)
            last = width - 1 - mask.flip(-1).int().argmax(-1)
            picked = captured[-1][torch.arange(rows, device=mask.device), last, 0].float()[has_tokens]
    scores = picked.new_zeros(rows).index_put((has_tokens.nonzero().squeeze(1),), picked)
    return ModelOutputs({"rm_scores": scores}, None, 1.0, 0)


@contextlib.contextmanager
def quiet_value_head_view() -> Iterator[None]:
    # The value head's nn.Linear returns a view of its 2-D matmul; nothing here modifies it in place.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        yield


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's rule for left-padded rows: count of attended tokens before each position, 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
