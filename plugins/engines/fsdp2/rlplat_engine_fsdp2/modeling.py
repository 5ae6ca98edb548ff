"""The model side of the engine: building a Hugging Face model, and turning its outputs into per-token
log-probs, entropy and values of the response tokens.

Log-probs and entropy are computed a chunk of tokens at a time from ``logits / temperature`` in
float32, so a float32 ``[batch, response, vocab]`` tensor never exists at once. Where that tensor would
be larger than :data:`KEEP_FLOAT32_BYTES`, the logits themselves are never materialised either: the
model's output layer is applied a chunk of tokens at a time to the hidden states of the response positions
(:class:`ChunkedHead`, inside the model's forward), each chunk's log-probs (entropy, gathered log-probs,
top-k) computed from its logits and the logits dropped; with gradients each chunk's output layer and
log-softmax are recomputed in backward (``torch.utils.checkpoint``), so a step holds one chunk's logits
at a time. A small tensor (a tiny vocabulary) is computed in one piece and kept, where recomputing would
save nothing worth its time. The temperature is applied exactly as Hugging Face ``generate`` and vLLM
sample: the logits are cast to float32, then divided.

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

from rlplat_engine_fsdp2 import packing, ulysses
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


def enable_packing(model: torch.nn.Module, attn_implementation: str, sequence_parallel: bool = False) -> bool:
    """Make ``model`` able to run packed calls (:func:`run_packed_model`): its attention becomes
    :func:`packing.attention_implementation` of ``attn_implementation``, the same kernel for unpacked
    calls (``sequence_parallel``: one that also runs Ulysses' all-to-alls). False, and ``model`` unchanged,
    when the model does not route attention through Hugging Face's attention interface
    (``_supports_attention_backend``), so a pack would attend across sequences."""
    if not getattr(model, "_supports_attention_backend", False):
        return False
    name = packing.attention_implementation(attn_implementation, sequence_parallel)
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


def compile_problem(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device_type`` here, or None. On CPU it compiles C++ that links
    against torch's own libraries, and torch's builder passes their folder unquoted: a path with a space breaks the
    link (measured with torch 2.13 in a clone under "a clone/")."""
    folder = os.path.dirname(torch.__file__)
    if device_type == "cpu" and any(character.isspace() for character in folder):
        return (f"compile=true on CPU: torch.compile builds C++ kernels linked against torch's libraries in {folder!r}, and "
                f"torch {torch.__version__}'s builder does not quote a path with a space, so the link fails; install the "
                "environment at a path without spaces, or leave compile off on CPU")
    return None


def compile_layers(model: torch.nn.Module, device_type: str) -> None:
    """``torch.compile`` on the ``forward`` of every decoder layer (:func:`decoder_layers`), in place: hooks on the
    layer (FSDP2's gathers, the MoE routing's records) run around the compiled code, not inside it. Refused, with
    :func:`compile_problem`'s reason, where the kernels cannot be built."""
    problem = compile_problem(device_type)
    if problem is not None:
        raise ValueError(f"fsdp2 engine: {problem}")
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward)


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


def token_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool,
                 ids: torch.Tensor | None) -> torch.Tensor:
    """``[b, w, V]`` logits of a chunk -> ``[b, w, C]`` float32: the log-prob of ``targets``, then the entropy
    (``entropy``), then the log-probs at ``ids`` [b, w, k] (when given), all of ``softmax(logits / temperature)``."""
    scaled = logits.float() / temperature
    normaliser = scaled.logsumexp(-1, keepdim=True)
    columns = [scaled.gather(-1, targets.unsqueeze(-1)) - normaliser]
    if entropy:
        columns.append(normaliser - (scaled.softmax(-1) * scaled).sum(-1, keepdim=True))
    if ids is not None:
        columns.append(scaled.gather(-1, ids) - normaliser)
    return torch.cat(columns, dim=-1)


class FusedHeadScores(torch.autograd.Function):
    """:func:`token_scores` of ``linear(hidden, weight, bias)`` for one chunk of tokens, the vocabulary taken
    ``vocabulary_chunk`` rows of ``weight`` at a time (None: all at once), with its own backward: the forward
    keeps only the log-sum-exp and the entropy per token (running over the vocabulary chunks), and the backward
    recomputes each vocabulary chunk's logits to form their gradient in place, so neither pass holds more than
    a few ``[tokens, vocabulary_chunk]`` float32 buffers. Gradients reach ``hidden``, ``weight`` and ``bias``
    through autograd as the output layer's own would.

    With ``z = logits / temperature``, ``p = softmax(z)`` and ``lse = logsumexp(z)``: ``d(z_t - lse)/dz = onehot_t - p``
    and ``d(entropy)/dz = -p (z - lse + entropy)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ids, temperature: float, entropy: bool, vocabulary_chunk: int | None):
        rows = hidden.shape[0]
        vocabulary = weight.shape[0]
        step = vocabulary_chunk or vocabulary
        high = torch.full((rows,), float("-inf"), device=hidden.device)
        total = torch.zeros(rows, device=hidden.device)
        weighted = torch.zeros(rows, device=hidden.device)  # sum of exp(z - high) * z
        picked = torch.zeros(rows, device=hidden.device)
        gathered = torch.zeros(ids.shape, device=hidden.device) if ids is not None else None
        for start in range(0, vocabulary, step):
            z = torch.nn.functional.linear(hidden, weight[start : start + step], None if bias is None else bias[start : start + step])
            z = z.float().div_(temperature)  # in place: a fresh float32 tensor either way
            width = z.shape[1]
            inside = (targets >= start) & (targets < start + width)
            picked = torch.where(inside, z.gather(-1, (targets - start).clamp(0, width - 1)[:, None])[:, 0], picked)
            if ids is not None:
                within = (ids >= start) & (ids < start + width)
                gathered = torch.where(within, z.gather(-1, (ids - start).clamp(0, width - 1)), gathered)
            chunk_high = torch.maximum(high, z.max(-1).values)
            scale = torch.exp(high - chunk_high)
            shifted = (z - chunk_high[:, None]).exp_()  # the second [tokens, chunk] buffer
            total = total * scale + shifted.sum(-1)
            if entropy:
                weighted = weighted * scale + shifted.mul_(z).sum(-1)
            del shifted, z
            high = chunk_high
        lse = high + total.log()
        columns = [(picked - lse)[:, None]]
        value_entropy = lse - weighted / total
        if entropy:
            columns.append(value_entropy[:, None])
        if ids is not None:
            columns.append(gathered - lse[:, None])
        ctx.save_for_backward(hidden, weight, bias, targets, ids, lse, value_entropy)
        ctx.settings = (temperature, entropy, step, bias is not None, ids is not None)
        return torch.cat(columns, dim=-1)

    @staticmethod
    def backward(ctx, grad_scores):
        hidden, weight, bias, targets, ids, lse, value_entropy = ctx.saved_tensors
        temperature, entropy, step, has_bias, has_ids = ctx.settings
        grad_scores = grad_scores.float()
        grad_picked = grad_scores[:, 0]
        grad_entropy = grad_scores[:, 1] if entropy else None
        grad_gathered = grad_scores[:, 1 + int(entropy):] if has_ids else None
        every = grad_picked + (grad_gathered.sum(-1) if has_ids else 0.0)  # each log-prob's -p term
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if has_bias and ctx.needs_input_grad[2] else None
        for start in range(0, weight.shape[0], step):
            piece = weight[start : start + step]
            z = torch.nn.functional.linear(hidden, piece, bias[start : start + step] if has_bias else None).float().div_(temperature)
            width = z.shape[1]
            probability = (z - lse[:, None]).exp_()
            if entropy:  # -p (z - lse + H) * g_H - p * every
                gradient = z.sub_(lse[:, None]).add_(value_entropy[:, None]).mul_(grad_entropy[:, None]).add_(every[:, None])
            else:
                gradient = z.copy_(every[:, None].expand_as(z))
            gradient.mul_(probability).neg_()
            del probability
            inside = (targets >= start) & (targets < start + width)
            gradient.scatter_add_(-1, (targets - start).clamp(0, width - 1)[:, None], (grad_picked * inside)[:, None])
            if has_ids:
                within = (ids >= start) & (ids < start + width)
                gradient.scatter_add_(-1, (ids - start).clamp(0, width - 1), grad_gathered * within)
            gradient.div_(temperature)
            grad_hidden += gradient @ piece.float()
            if grad_weight is not None:
                grad_weight[start : start + width] = gradient.t() @ hidden.float()
            if grad_bias is not None:
                grad_bias[start : start + width] = gradient.sum(0)
            del gradient, z  # before the next chunk's logits exist
        return (grad_hidden.to(hidden.dtype), None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


def fused_head_layer(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer when it is a plain ``nn.Linear`` (None otherwise: a LoRA-wrapped one runs through its
    own forward, a chunk of tokens at a time). Its ``weight`` is read during the model's forward, when FSDP2
    has put the full (unsharded) tensor there."""
    return layer if isinstance(layer, torch.nn.Linear) and type(layer).forward is torch.nn.Linear.forward else None


class ChunkedHead:
    """Stands in for the model's output layer's ``forward`` during one model call: from the hidden states of
    the kept positions (``[b, P, h]``; ``drop_last``: the last position predicts nothing) it returns
    :func:`token_scores` ``[b, P', C]`` a chunk of ``chunk_tokens`` tokens at a time, never the whole logits.
    Inside the model's forward, so FSDP2 holds the layer's full weight and its pre-backward hook sees the
    result. ``top_k`` values and ids (no gradient) are kept in :attr:`top_k`."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor] | None, targets: torch.Tensor, *, temperature: float,
                 chunk_tokens: int, entropy: bool, ids: torch.Tensor | None, top_k: int, drop_last: bool,
                 vocabulary_chunk: int | None = None):
        self.forward = forward
        self.linear: torch.nn.Module | None = None  # a plain nn.Linear output layer: the fused path
        self.vocabulary_chunk = vocabulary_chunk
        self.targets, self.ids = targets, ids
        self.temperature, self.chunk_tokens, self.entropy, self.k, self.drop_last = temperature, chunk_tokens, entropy, top_k, drop_last
        self.top_k: tuple[torch.Tensor, torch.Tensor] | None = None

    def chunk(self, hidden: torch.Tensor, targets: torch.Tensor, *ids: torch.Tensor) -> torch.Tensor:
        return token_scores(self.forward(hidden), targets, self.temperature, self.entropy, ids[0] if ids else None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.drop_last:
            hidden = hidden[:, :-1]
        rows, positions = hidden.shape[:2]
        width = max(1, self.chunk_tokens // max(rows, 1))
        pieces, values, indices = [], [], []
        recompute = torch.is_grad_enabled() and hidden.requires_grad
        for start in range(0, positions, width):
            arguments = [hidden[:, start : start + width], self.targets[:, start : start + width]]
            if self.ids is not None:
                arguments.append(self.ids[:, start : start + width])
            if self.linear is not None and not self.k:  # fused: the vocabulary a chunk at a time too, its own backward
                weight, bias = self.linear.weight, self.linear.bias
                flat = [argument.flatten(0, 1) for argument in arguments]
                scores = FusedHeadScores.apply(flat[0], weight, bias, flat[1], flat[2] if len(flat) > 2 else None, self.temperature,
                                               self.entropy, self.vocabulary_chunk)
                pieces.append(scores.view(*arguments[0].shape[:2], -1))
                continue
            if recompute:
                pieces.append(checkpoint(self.chunk, *arguments, use_reentrant=False))
                continue
            logits = self.forward(arguments[0])
            pieces.append(token_scores(logits, arguments[1], self.temperature, self.entropy, arguments[2] if len(arguments) > 2 else None))
            if self.k:
                scaled = logits.float() / self.temperature
                top = (scaled - scaled.logsumexp(-1, keepdim=True)).topk(self.k, dim=-1)
                values.append(top.values)
                indices.append(top.indices)
        if self.k:
            self.top_k = ((torch.cat(values, dim=1), torch.cat(indices, dim=1)) if values else
                          (hidden.new_zeros((rows, 0, self.k), dtype=torch.float32), torch.zeros((rows, 0, self.k), dtype=torch.long)))
        if not pieces:  # no position: still part of the graph, so its backward reaches every parameter (FSDP2)
            columns = 1 + int(self.entropy) + (self.ids.shape[-1] if self.ids is not None else 0)
            return hidden[:, :0, :1].float().expand(rows, 0, columns)
        return torch.cat(pieces, dim=1)


@contextlib.contextmanager
def chunked_head(model: torch.nn.Module, head: ChunkedHead, fused: bool = True) -> Iterator[None]:
    """The model's output layer computes ``head`` during the block (its ``forward`` replaced on the instance); ``fused``:
    through :class:`FusedHeadScores` where the layer allows it, else its own forward a chunk at a time, recomputed."""
    layer = model.get_output_embeddings()
    head.forward = layer.forward
    head.linear = fused_head_layer(layer) if fused else None
    layer.forward = head
    try:
        yield
    finally:
        del layer.forward  # the class's forward again


def head_is_chunkable(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its output layer's output as they are (no soft-capping or scaling after
    it, which the chunked head would skip): true of the Qwen, Llama and Mistral families and their MoE kin."""
    config = getattr(model, "config", None)
    if model.get_output_embeddings() is None or config is None:
        return False
    return not any(getattr(config, name, None) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def chunks_the_head(model: torch.nn.Module, rows: int, positions: int, chunk_tokens: int) -> bool:
    """Whether :func:`run_model` applies the output layer a chunk at a time: the whole float32 logits of the
    response positions would exceed :data:`KEEP_FLOAT32_BYTES` (and the model allows it)."""
    vocabulary = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 0
    return rows * positions * vocabulary * 4 > KEEP_FLOAT32_BYTES and head_is_chunkable(model)


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
        self._top_k: tuple[torch.Tensor, torch.Tensor] | str | None = None  # the chunked head's, or "absent"

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "entropy" and key not in self._values and self._logits is not None:
            self.compute_entropy()
        if key == "entropy" and key not in self._values and self._top_k is not None:
            raise KeyError("entropy was not computed: the output layer ran a chunk of tokens at a time (the logits are never "
                           "kept), so a loss reading entropy must say so up front (needs_entropy = True)")
        if key == GATHERED and key not in self._values and self._logits is not None and self._gather_ids is not None:
            gathered = response_gathered_log_probs(self._logits, self._gather_ids, self._temperature, self._chunk_tokens)
            self._values[key] = gathered if self._place is None else self._place(gathered[0])
        return self._values[key]

    def top_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest log-probs at each response position and their ids, ``[B, R, k]`` each (0 at padding)."""
        if self._logits is None:
            if not isinstance(self._top_k, tuple) or self._top_k[0].shape[-1] != k:
                raise KeyError(f"top_k({k}) was not computed with the chunked output layer's call")
            values, ids = self._top_k
        else:
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
    top_k: int = 0,
    vocabulary_chunk: int | None = None,
    sequence_parallel: Any = None,
    device: torch.device | None = None,
    fused_head: bool = True,
) -> ModelOutputs:
    """One forward of ``model`` on ``input_ids``, ``attention_mask``, ``position_ids`` and
    ``responses`` (``[B, R]``, the last ``R`` tokens of ``input_ids``). ``top_k``: also the ``k`` largest
    log-probs (:meth:`ModelOutputs.top_k`) where the output layer runs a chunk at a time; ``vocabulary_chunk``:
    rows of the output layer's weight taken at a time there (None: all).

    ``remove_padding``: run the rows as one pack of their valid tokens (:mod:`rlplat_engine_fsdp2.packing`;
    the model must have passed :func:`enable_packing`). Outputs are
    the same ``[B, R]`` tensors, 0 at response positions that are padding. A ``reward_model`` returns
    ``rm_scores`` [B] instead (:func:`run_reward_model`). ``sequence_parallel`` (packed only): this rank's
    Ulysses group (:mod:`rlplat_engine_fsdp2.ulysses`); every rank of it gets the same outputs. ``device``: where the
    model runs, when the inputs are elsewhere (the engine passes them from host memory, so that a pack is planned
    there, with no wait on the device, and moved after); None: where the inputs are."""
    packs_on_host = device is not None and remove_padding and not reward_model
    if device is not None and not packs_on_host:
        inputs = {key: value.to(device) for key, value in inputs.items()}
        gather_ids = None if gather_ids is None else gather_ids.to(device)
    if sequence_parallel is not None and not remove_padding:
        raise ValueError("Ulysses sequence parallelism runs packed micro-batches: it needs remove_padding")
    if reward_model:
        return run_reward_model(model, inputs, remove_padding=remove_padding, sequence_parallel=sequence_parallel)
    if remove_padding:
        return run_packed_model(model, inputs, value_model=value_model, temperature=temperature, chunk_tokens=chunk_tokens,
                                calculate_entropy=calculate_entropy, gather_ids=gather_ids, top_k=top_k, vocabulary_chunk=vocabulary_chunk,
                                sequence_parallel=sequence_parallel, fused_head=fused_head, device=device)
    response_length = inputs["responses"].shape[1]
    arguments = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"], use_cache=False)
    if value_model:
        with quiet_value_head_view():
            values = model(**arguments).logits[:, -response_length - 1 : -1, 0].float()
        return ModelOutputs({"values": values}, None, temperature, chunk_tokens)
    rows = inputs["responses"].shape[0]
    if chunks_the_head(model, rows, response_length, chunk_tokens):
        head = ChunkedHead(None, inputs["responses"], temperature=temperature, chunk_tokens=chunk_tokens, entropy=calculate_entropy,
                           ids=gather_ids, top_k=top_k, drop_last=True, vocabulary_chunk=vocabulary_chunk)
        with chunked_head(model, head, fused_head):
            scores = model(**arguments, logits_to_keep=response_length + 1).logits
        return scored_outputs(scores, head, temperature, chunk_tokens)
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
    top_k: int = 0,
    vocabulary_chunk: int | None = None,
    sequence_parallel: Any = None,
    device: torch.device | None = None,
    fused_head: bool = True,
) -> ModelOutputs:
    """:func:`run_model` on the rows packed into one row of their valid tokens; with ``sequence_parallel``
    (:class:`rlplat_engine_fsdp2.ulysses.SequenceParallel`) this rank runs its slice of the pack and the outputs
    are gathered from the group's ranks."""
    grouped = packing.plans_groups(model)
    # with sequence parallelism the groups are those of the padded pack, planned by ulysses.shard
    packed = packing.pack(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"], inputs["responses"],
                          grouped_attention=grouped and sequence_parallel is None,
                          kernel=packing.pack_kernel(model, sequence_parallel is not None))
    packed_ids = None if gather_ids is None else packed.select(gather_ids)
    if device is not None:
        packed = packed.to(device)
        packed_ids = None if packed_ids is None else packed_ids.to(device)
    arguments, predictors, targets = packed.model_kwargs(), packed.predictors, packed.targets
    arguments["attention_mask"] = packing.no_masks(model)
    place: Callable[[torch.Tensor], torch.Tensor] = packed.unpack
    widest = int(predictors.numel())
    if sequence_parallel is not None:
        shard = ulysses.shard(packed, sequence_parallel, grouped_attention=grouped)
        mine, predictors, counts = shard.local(packed.predictors)
        arguments, targets, widest = {**shard.kwargs, "attention_mask": arguments["attention_mask"]}, packed.targets[mine], max(counts)
        packed_ids = None if packed_ids is None else packed_ids[mine]
        place = lambda values: packed.unpack(shard.gather(values, counts))  # noqa: E731
    packed_ids = None if packed_ids is None else packed_ids.unsqueeze(0)
    if value_model:
        with quiet_value_head_view(), packing.packed_forward():
            values = model(**arguments).logits[0, predictors, 0].float()
        return ModelOutputs({"values": place(values)}, None, temperature, chunk_tokens)
    if chunks_the_head(model, 1, widest, chunk_tokens):
        head = ChunkedHead(None, targets.unsqueeze(0), temperature=temperature, chunk_tokens=chunk_tokens,
                           entropy=calculate_entropy, ids=packed_ids, top_k=top_k, drop_last=False, vocabulary_chunk=vocabulary_chunk)
        with packing.packed_forward(), chunked_head(model, head, fused_head):
            scores = model(**arguments, logits_to_keep=predictors).logits
        return scored_outputs(scores, head, temperature, chunk_tokens, place=lambda values: place(values[0]))
    with packing.packed_forward():
        logits = model(**arguments, logits_to_keep=predictors).logits
    log_probs = response_log_probs(logits, targets.unsqueeze(0), temperature, chunk_tokens)[0]
    outputs = ModelOutputs({"log_probs": place(log_probs)}, logits, temperature, chunk_tokens, place=place, gather_ids=packed_ids)
    if calculate_entropy:
        outputs.compute_entropy()
    return outputs


def scored_outputs(scores: torch.Tensor, head: ChunkedHead, temperature: float, chunk_tokens: int,
                   place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ModelOutputs:
    """The :class:`ModelOutputs` of a chunked head's ``[b, P, C]`` scores (``place``: a pack's ``[1, K, ...]`` ->
    ``[B, R, ...]``)."""
    place = place or (lambda values: values)
    values = {"log_probs": place(scores[..., 0])}
    column = 1
    if head.entropy:
        values["entropy"] = place(scores[..., column])
        column += 1
    if head.ids is not None:
        values[GATHERED] = place(scores[..., column:])
    outputs = ModelOutputs(values, None, temperature, chunk_tokens)
    outputs._top_k = tuple(place(part) for part in head.top_k) if head.top_k is not None else "absent"
    return outputs


def run_reward_model(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor], *, remove_padding: bool,
                     sequence_parallel: Any = None) -> ModelOutputs:
    """``rm_scores`` [B] float32: the score head's output at each row's last token with ``attention_mask``
    1 (0 for a row without one). Packed, the rows run as one row of their valid tokens (with
    ``sequence_parallel``, this rank's slice of it; the scores gathered from the group)."""
    mask = inputs["attention_mask"].bool()
    rows, width = mask.shape
    has_tokens = mask.any(-1)
    with quiet_value_head_view(), per_token_scores(model) as captured:
        if remove_padding:
            grouped = packing.plans_groups(model)
            no_responses = inputs["input_ids"][:, :0]  # the pack's inputs only: nothing here predicts tokens
            packed = packing.pack(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"], no_responses,
                                  grouped_attention=grouped and sequence_parallel is None)
            last = (packed.cu_seq_lens[1:] - 1).long()
            if sequence_parallel is None:
                with packing.packed_forward():
                    model(**packed.model_kwargs())
                picked = captured[-1][0, last, 0].float()
            else:
                shard = ulysses.shard(packed, sequence_parallel, grouped_attention=grouped)
                with packing.packed_forward():
                    model(**shard.kwargs)
                _, local, counts = shard.local(last)
                picked = shard.gather(captured[-1][0, local, 0].float(), counts)
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
