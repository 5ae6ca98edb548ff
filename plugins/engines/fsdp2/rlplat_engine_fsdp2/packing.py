"""Sequence packing (verl's ``use_remove_padding``): a micro-batch's rows as one row of only their valid
tokens, with causal attention inside each sequence.

:func:`pack` takes verl's padded layout (``input_ids``, ``attention_mask``, ``position_ids`` ``[B, T]``:
a left-padded prompt then a right-padded response; ``responses`` the last ``R`` columns) and gives one
row of the ``attention_mask == 1`` tokens with the batch's own position ids (0 at each sequence's
start), the cumulative sequence lengths Hugging Face's varlen kernels read (``cu_seq_lens_q/k``,
``max_length_q/k``), and which packed positions predict a response token, so the model computes
logits only there (``logits_to_keep`` as indices) and :meth:`Pack.unpack` scatters per-token results
back to ``[B, R]`` (0 where a response token is padding or has no valid token before it).

Attention. With ``flash_attention_2`` Hugging Face's own varlen path reads those kwargs. For the others
(``sdpa``, ``eager``), :func:`attention_implementation` registers a Hugging Face attention function
(``rlplat_packed_<base>``) that the model is built with: a call that carries ``cu_seq_lens_q`` is
packed, and runs :func:`grouped_causal_attention`; any other call goes to ``<base>`` unchanged, with
``<base>``'s attention mask. No ``[N, N]`` block-diagonal mask is ever built (quadratic in the pack):
sequences of similar length are gathered into right-padded sub-batches, one ``is_causal``
``scaled_dot_product_attention`` each. Causality alone keeps every valid query off the padding keys
(they come after it), so the padding inside attention needs no mask, and its outputs are dropped.

``packed_attention`` picks the kernel of packed calls (:func:`resolve_kernel`): ``grouped`` as above (any device);
``varlen``, torch's flash-attention varlen kernel over the whole pack from ``cu_seq_lens`` (CUDA, bf16 / fp16; the
default there); ``flex``, flex attention with a document-causal block mask built once per pack (:class:`DocumentMask`;
CUDA, compiled). The pack carries its kernel in the call's kwargs.

The dispatch is by the call's kwargs rather than a switch of ``config._attn_implementation`` around
packed calls, because activation checkpointing re-runs decoder layers in backward, after any such
switch would have been undone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from typing import Any, Iterator, NamedTuple

import torch
import torch.nn.functional as F

from rlplat_engine_fsdp2.config import PACKED_KERNELS

PACKED_ATTENTION_PREFIX = "rlplat_packed_"

#: A sequence joins the attention group of the longest ungrouped one while it holds at least this
#: share of that length (groups of sequences up to SHORT_SEQUENCE tokens take any shorter one): padding
#: inside attention stays under half of a group's tokens, and 1-400 token sequences make about 5 groups.
GROUP_LENGTH_RATIO = 0.5
SHORT_SEQUENCE = 32

#: Attention terms some models pass that plain causal attention does not compute; a packed call refuses them.
UNSUPPORTED_ATTENTION_TERMS = ("softcap", "s_aux", "position_bias")

_packing = contextvars.ContextVar("rlplat_packed_forward", default=False)


# -- the packed layout ---------------------------------------------------------------------------------


class AttentionGroup(NamedTuple):
    """Sequences of similar length, attended as one right-padded sub-batch."""

    rows: int
    length: int
    """The longest one's length: the sub-batch's width."""
    start: int
    """Pack position of the first sequence's first token."""
    gather: torch.Tensor | None
    """Pack positions to gather, ``[rows * length]`` (padding repeats a sequence's last token); None
    when the group is the pack's ``rows * length`` tokens from ``start`` on, equal lengths in pack order."""
    keep: torch.Tensor | None
    """Gathered positions that are not padding (None when none is)."""


@dataclasses.dataclass
class AttentionGroups:
    """How :func:`grouped_causal_attention` lays a pack out: the groups, and the permutation from their
    concatenated kept tokens back to pack order (None when that is pack order already)."""

    groups: list[AttentionGroup]
    restore: torch.Tensor | None


def plan_attention_groups(lengths: list[int], device: torch.device) -> AttentionGroups:
    """Groups of similar-length sequences (see :data:`GROUP_LENGTH_RATIO`) for sequence lengths
    ``lengths`` laid end to end (no zero lengths)."""
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    members: list[list[int]] = []
    for index in order:
        if members and (lengths[index] >= GROUP_LENGTH_RATIO * lengths[members[-1][0]] or lengths[members[-1][0]] <= SHORT_SEQUENCE):
            members[-1].append(index)
        else:
            members.append([index])
    groups, sources = [], []
    for member in members:
        longest = lengths[member[0]]
        group_starts = torch.tensor([starts[index] for index in member], dtype=torch.long)
        group_lengths = torch.tensor([lengths[index] for index in member], dtype=torch.long)
        offsets = torch.arange(longest)
        gather = (group_starts[:, None] + torch.minimum(offsets[None, :], group_lengths[:, None] - 1)).flatten()
        valid = (offsets[None, :] < group_lengths[:, None]).flatten()
        keep = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        sources.append(gather if keep is None else gather[keep])
        start = starts[member[0]]
        if keep is None and torch.equal(gather, torch.arange(start, start + len(gather))):
            groups.append(AttentionGroup(len(member), longest, start, None, None))
        else:
            groups.append(AttentionGroup(len(member), longest, start, gather.to(device), None if keep is None else keep.to(device)))
    source = torch.cat(sources)
    restore = None
    if not torch.equal(source, torch.arange(len(source))):
        restore = torch.empty_like(source)
        restore[source] = torch.arange(len(source))
        restore = restore.to(device)
    return AttentionGroups(groups, restore)


class DocumentMask:
    """Which sequence each position of a pack belongs to (``sequence``, ``[N]``), and the document-causal flex-attention
    block mask of it (position ``q`` sees ``k <= q`` of its own sequence), built once per pack on first use and shared
    by every layer's call."""

    def __init__(self, sequence: torch.Tensor):
        self.sequence = sequence
        self._mask: Any = None

    def block_mask(self) -> Any:
        if self._mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            sequence = self.sequence

            def document_causal(batch, head, query, key):
                return (sequence[query] == sequence[key]) & (query >= key)

            length = len(sequence)
            self._mask = create_block_mask(document_causal, None, None, length, length, device=sequence.device)
        return self._mask


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10 on) and a CUDA device to run it."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_kernel(kernel: str, device_type: str, dtype: torch.dtype, sequence_parallel: bool) -> str:
    """The packed attention kernel ``packed_attention: kernel`` gives on ``device_type`` computing in ``dtype``; raises,
    naming what is missing, where it cannot run."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"packed_attention {kernel!r} is not one of {list(PACKED_KERNELS)}")
    half = dtype in (torch.bfloat16, torch.float16)
    varlen = device_type == "cuda" and half and varlen_available()
    if kernel == "auto":
        return "varlen" if varlen and not sequence_parallel else "grouped"
    if kernel != "grouped" and sequence_parallel:
        raise ValueError(f"packed_attention {kernel!r}: Ulysses sequence parallelism runs its packs' attention grouped; "
                         "set packed_attention: grouped (or auto)")
    if kernel == "varlen" and not varlen:
        raise ValueError("packed_attention 'varlen' runs torch's flash-attention varlen kernel (torch.nn.attention.varlen), "
                         f"which needs torch >= 2.10, a CUDA device and bfloat16 or float16 compute; this process has torch "
                         f"{torch.__version__} on {device_type} computing in {str(dtype).replace('torch.', '')}: use grouped, "
                         "flex or auto")
    if kernel == "flex" and device_type != "cuda":
        raise ValueError(f"packed_attention 'flex': flex attention has no backward on {device_type} (torch "
                         f"{torch.__version__}); use grouped or auto there")
    return kernel


@functools.lru_cache(maxsize=1)
def varlen_parameters() -> frozenset[str]:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                            max_length: int, scaling: float | None) -> torch.Tensor:
    """Causal attention within each sequence of a pack through ``varlen_attn``: ``[1, heads, N, d]`` query and
    ``[1, kv_heads, N, d]`` key / value -> ``[1, N, heads, d]``."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = varlen_parameters()
    query, key, value = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # [N, heads, d]
    options: dict[str, Any] = {}
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    if "window_size" in parameters:  # torch 2.11 on: (-1, 0) is causal
        options["window_size"] = (-1, 0)
    else:  # torch 2.10
        options["is_causal"] = True
    if scaling is not None:
        if "scale" in parameters:
            options["scale"] = scaling
        else:
            query = query * (scaling * query.shape[-1] ** 0.5)  # the kernel's own 1/sqrt(d), undone
    cu_seq_lens = cu_seq_lens.to(torch.int32)
    output = varlen_attn(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, **options)
    return output.unsqueeze(0)


@functools.lru_cache(maxsize=2)
def flex_function(device_type: str) -> Any:
    """flex attention, compiled on CUDA (its eager form materialises every score), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


def flex_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: DocumentMask,
                          scaling: float | None) -> torch.Tensor:
    """Causal attention within each sequence of a pack through flex attention with ``documents``' block mask:
    ``[1, heads, N, d]`` query -> ``[1, N, heads, d]``."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        output = flex_function(query.device.type)(query, key, value, block_mask=documents.block_mask(), scale=scaling,
                                                  enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2)


@dataclasses.dataclass
class Pack:
    """One micro-batch packed: model inputs ``[1, N]`` and where its per-token outputs go."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    attention_groups: AttentionGroups | None
    predictors: torch.Tensor
    """Pack positions whose next token is a response token, ascending: ``[K]``."""
    targets: torch.Tensor
    """The response token each of them predicts: ``[K]``."""
    slots: torch.Tensor
    """Where each lands in the flattened ``[B, R]`` output: ``[K]``."""
    rows: int
    response_length: int
    kernel: str = "grouped"
    """The attention kernel of the pack's calls (:data:`PACKED_KERNELS`)."""
    documents: DocumentMask | None = None
    """``flex``: the sequence of every pack position, and the block mask built from it on first use."""

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of a Hugging Face model call on this pack (no attention mask)."""
        arguments = dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=self.cu_seq_lens,
            cu_seq_lens_k=self.cu_seq_lens,
            max_length_q=self.max_length,
            max_length_k=self.max_length,
        )
        if self.attention_groups is not None:
            arguments["packed_attention_groups"] = self.attention_groups
        if self.kernel != "grouped":
            arguments["packed_attention_kernel"] = self.kernel
        if self.documents is not None:
            arguments["packed_documents"] = self.documents
        return arguments

    def to(self, device: torch.device) -> "Pack":
        """The pack with its tensors on ``device`` (non-blocking copies: the plan was made on the host)."""
        groups = self.attention_groups
        if groups is not None:
            move = lambda tensor: None if tensor is None else tensor.to(device, non_blocking=True)  # noqa: E731
            groups = AttentionGroups([group._replace(gather=move(group.gather), keep=move(group.keep)) for group in groups.groups],
                                     move(groups.restore))
        tensors = {name: getattr(self, name).to(device, non_blocking=True)
                   for name in ("input_ids", "position_ids", "cu_seq_lens", "predictors", "targets", "slots")}
        documents = None if self.documents is None else DocumentMask(self.documents.sequence.to(device, non_blocking=True))
        return dataclasses.replace(self, attention_groups=groups, documents=documents, **tensors)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[K, ...]`` per-predictor values -> ``[B, R, ...]``, 0 elsewhere (keeps the autograd graph)."""
        trailing = tuple(values.shape[1:])
        flat = values.new_zeros((self.rows * self.response_length, *trailing)).index_copy(0, self.slots, values)
        return flat.view(self.rows, self.response_length, *trailing)

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, R, ...]`` per-response-position values -> ``[K, ...]`` of the pack's predictors (:meth:`unpack`'s inverse)."""
        return values.flatten(0, 1)[self.slots]


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    *,
    grouped_attention: bool,
    kernel: str = "grouped",
) -> Pack:
    """The pack of a padded micro-batch (see the module docstring). ``grouped_attention`` plans the
    groups :func:`grouped_causal_attention` runs (not needed by flash-attention's varlen kernel); ``kernel``: the
    packed attention the pack's calls run (:data:`PACKED_KERNELS`; ``flex`` gets the pack's document ids)."""
    valid = attention_mask.bool()
    rows, columns = valid.shape
    response_length = responses.shape[1]
    pack_position = (valid.flatten().long().cumsum(0) - 1).view(rows, columns)
    lengths = [length for length in valid.sum(-1).tolist() if length > 0]
    cu_seq_lens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(input_ids.device)
    # Column c predicts column c + 1: a response token is predicted when it and the token before it are valid.
    before = F.pad(valid[:, :-1], (1, 0))
    predicted = (valid & before)[:, columns - response_length :]
    predictor_position = F.pad(pack_position[:, :-1], (1, 0))[:, columns - response_length :]
    return Pack(
        input_ids=input_ids[valid].unsqueeze(0),
        position_ids=position_ids[valid].unsqueeze(0),
        cu_seq_lens=cu_seq_lens,
        max_length=max(lengths, default=0),
        attention_groups=plan_attention_groups(lengths, input_ids.device) if grouped_attention and lengths else None,
        predictors=predictor_position[predicted],
        targets=responses[predicted],
        slots=predicted.flatten().nonzero().squeeze(1),
        rows=rows,
        response_length=response_length,
        kernel=kernel,
        documents=DocumentMask(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long)).to(input_ids.device))
        if kernel == "flex" else None,
    )


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """Marks a model call as packed, so the registered mask function builds no mask for it."""
    token = _packing.set(True)
    try:
        yield
    finally:
        _packing.reset(token)


# -- attention -----------------------------------------------------------------------------------------


def grouped_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: AttentionGroups,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention within each sequence of a pack: ``query`` ``[1, heads, N, head_dim]``, ``key``
    and ``value`` ``[1, kv_heads, N, head_dim]`` -> ``[1, N, heads, head_dim]`` (Hugging Face's layout
    of an attention function's output)."""
    query, key, value = query[0], key[0], value[0]
    heads, key_heads = query.shape[0], key.shape[0]
    options: dict[str, Any] = dict(is_causal=True, scale=scaling, dropout_p=dropout)
    if heads != key_heads:
        if key.shape[-1] == value.shape[-1]:
            options["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // key_heads, dim=0)
            value = value.repeat_interleave(heads // key_heads, dim=0)
    pieces = []
    for rows, length, start, gather, keep in groups.groups:
        if gather is None:
            grouped = [tensor[:, start : start + rows * length] for tensor in (query, key, value)]
        else:
            grouped = [tensor.index_select(1, gather) for tensor in (query, key, value)]
        grouped = [tensor.unflatten(1, (rows, length)).transpose(0, 1) for tensor in grouped]
        output = F.scaled_dot_product_attention(*grouped, **options)
        output = output.transpose(1, 2).reshape(rows * length, heads, -1)
        pieces.append(output if keep is None else output.index_select(0, keep))
    output = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if groups.restore is not None:
        output = output.index_select(0, groups.restore)
    return output.unsqueeze(0)


def attention_implementation(base: str, sequence_parallel: bool = False) -> str:
    """The attention implementation a model packed calls can run on, given its configured ``base``:
    flash-attention as it is (its varlen path reads ``cu_seq_lens_*``), otherwise
    ``rlplat_packed_<base>``, registered with Hugging Face's attention and mask interfaces on first use.
    ``sequence_parallel``: calls may carry a ``sequence_parallel`` kwarg (:mod:`rlplat_engine_fsdp2.ulysses`),
    whose all-to-alls surround the attention; flash-attention then gets the wrapper too."""
    flash = base.startswith("flash_attention")
    if flash and not sequence_parallel:
        return base
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = PACKED_ATTENTION_PREFIX + base
    if name in AttentionInterface._global_mapping:
        return name
    if base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"use_remove_padding: attn_implementation {base!r} is not one Hugging Face knows a mask for; use "
            "sdpa, eager or flash_attention_2"
        )

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("cu_seq_lens_q") is None:
            return unpacked_attention(module, base)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        sp = kwargs.pop("sequence_parallel", None)
        if sp is not None:
            from rlplat_engine_fsdp2 import ulysses

            query, key, value = ulysses.split_heads(query, key, value, sp)
            output, weights = packed_attention(module, query, key, value, scaling, dropout, kwargs)
            return ulysses.sequence_to_heads(output, sp), weights
        return packed_attention(module, query, key, value, scaling, dropout, kwargs)

    @torch.compiler.disable  # a pack's layout (its groups, its lengths) changes every call: eager, not recompiled
    def packed_attention(module, query, key, value, scaling, dropout, kwargs):
        if flash:
            return unpacked_attention(module, base)(module, query, key, value, None, scaling=scaling, dropout=dropout, **kwargs)
        unsupported = [key for key in UNSUPPORTED_ATTENTION_TERMS if kwargs.get(key) is not None]
        if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
            unsupported.append("is_causal=False")
        window = kwargs.get("sliding_window")
        if window is not None and kwargs["max_length_q"] > window:
            unsupported.append(f"a sliding window of {window} tokens, shorter than a sequence ({kwargs['max_length_q']})")
        if unsupported:
            raise NotImplementedError(
                f"use_remove_padding: {type(module).__name__} attends with {', '.join(unsupported)}, which packed "
                f"{base} attention does not implement; set use_remove_padding=False (or use flash_attention_2)"
            )
        kernel = kwargs.get("packed_attention_kernel", "grouped")
        if kernel != "grouped" and dropout:
            raise NotImplementedError(f"use_remove_padding: packed_attention {kernel!r} has no attention dropout "
                                      f"({type(module).__name__} asks for {dropout}); use packed_attention: grouped")
        if kernel == "varlen":
            return varlen_causal_attention(query, key, value, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scaling), None
        if kernel == "flex":
            return flex_causal_attention(query, key, value, kwargs["packed_documents"], scaling), None
        groups = kwargs.get("packed_attention_groups")
        if groups is None:
            lengths = kwargs["cu_seq_lens_q"].diff().tolist()
            groups = plan_attention_groups([length for length in lengths if length > 0], query.device)
        return grouped_causal_attention(module, query, key, value, groups, scaling, dropout), None

    def mask(**kwargs):
        return None if _packing.get() else ALL_MASK_ATTENTION_FUNCTIONS[base](**kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


#: Attention layer kinds of Hugging Face decoders, the keys of the mask mapping a model's forward accepts in place of
#: ``attention_mask`` (``causal_mask_mapping := attention_mask, dict`` in their modeling files).
MASK_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")


@functools.lru_cache(maxsize=None)
def takes_mask_mapping(model_class: type) -> bool:
    """Whether the decoder inside ``model_class`` takes a ready mapping of masks as its ``attention_mask`` (read from
    its modeling file): then a packed call hands it masks of None and Hugging Face skips building them, and its
    search of the position ids for packed sequences, which reads a device tensor on the host every call."""
    import inspect

    module = sys.modules.get(model_class.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in source


def no_masks(model: torch.nn.Module) -> dict[str, None] | None:
    """The ``attention_mask`` of a packed call of ``model``: masks of None for every layer kind (:func:`takes_mask_mapping`),
    or None where the model builds its masks itself (the packing mask function then returns None)."""
    if not takes_mask_mapping(type(model)):
        return None
    return dict.fromkeys([*MASK_KINDS, *(getattr(model.config, "layer_types", None) or ())])


def set_kernel(model: torch.nn.Module, kernel: str) -> None:
    """The packed attention kernel (:func:`resolve_kernel`'s) ``model``'s packed calls run."""
    model.rlplat_packed_kernel = kernel


def packed_kernel(model: torch.nn.Module) -> str:
    """The kernel :func:`set_kernel` gave ``model`` (``grouped`` when none was given)."""
    return getattr(model, "rlplat_packed_kernel", "grouped")


def plans_groups(model: torch.nn.Module) -> bool:
    """Whether ``model``'s packed calls run :func:`grouped_causal_attention` (and so want their groups planned
    once per call, not once per layer): its attention is ``rlplat_packed_<base>`` of a base other than flash, and its
    kernel is ``grouped``."""
    name = model.config._attn_implementation
    packed = name.startswith(PACKED_ATTENTION_PREFIX) and not name[len(PACKED_ATTENTION_PREFIX):].startswith("flash_attention")
    return packed and packed_kernel(model) == "grouped"


def pack_kernel(model: torch.nn.Module, sequence_parallel: bool) -> str:
    """The kernel a pack of ``model`` is made for: ``grouped`` under sequence parallelism (Ulysses plans its own) and
    for a flash-attention base (whose own varlen path runs it; the kernel is then unused), else :func:`packed_kernel`."""
    name = model.config._attn_implementation
    if sequence_parallel or not name.startswith(PACKED_ATTENTION_PREFIX) or name[len(PACKED_ATTENTION_PREFIX):].startswith("flash_attention"):
        return "grouped"
    return packed_kernel(model)


def unpacked_attention(module: torch.nn.Module, base: str) -> Any:
    """``base``'s attention function for ``module``: Hugging Face's registered one, or for ``eager``
    the one in the module's own modeling file (eager attention is per model)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"use_remove_padding: {type(module).__name__}'s modeling file has no eager_attention_forward for {base!r}")
    return function
