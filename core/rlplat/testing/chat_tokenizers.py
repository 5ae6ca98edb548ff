"""Tiny tokenizers carrying the chat templates vendored in ``rlplat/testing/templates``, made locally.

Each is byte-level with no merges (one token per byte, ids below 256, so any text round-trips) plus the
template's control tokens as added tokens: the turn markers and end-of-text tokens as special tokens
(ids from 256, in the order of :data:`TEMPLATE_TOKENS`), the tool and reasoning tags as ordinary added
tokens, as the tokenizers of the model families do. The Llama-3-style one prepends its BOS token when
encoding with special tokens, as Llama 3's does (its template writes BOS too). Tests of multi-turn rollouts and
``rlplat check-template`` use them instead of a hub download.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

CHATML_TOOLS = "chatml_tools"
"""ChatML in the style of Qwen2.5: tools in the system turn, ``<tool_call>`` JSON, ``<tool_response>``."""
THINKING = "thinking"
"""ChatML in the style of Qwen3: ``<think>`` reasoning, dropped from turns before the last user message."""
LLAMA3_TOOLS = "llama3_tools"
"""Llama-3.1 style: header ids, ``<|eot_id|>``, tool results in ``ipython`` blocks."""
TEMPLATES = (CHATML_TOOLS, THINKING, LLAMA3_TOOLS)

BYTE_VOCABULARY_SIZE = 256


@dataclasses.dataclass(frozen=True)
class TemplateTokens:
    """The added tokens a template's tokenizer carries and which of them play the named roles."""

    special: tuple[str, ...]
    """Control tokens (never split, skipped by ``decode(..., skip_special_tokens=True)``)."""
    added: tuple[str, ...]
    """Tags kept whole but decoded as text (tool and reasoning markers)."""
    eos: str
    pad: str
    bos: Optional[str] = None


CHATML_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TEMPLATE_TOKENS = {
    CHATML_TOOLS: TemplateTokens(special=CHATML_SPECIAL, added=TOOL_TAGS, eos="<|im_end|>", pad="<|endoftext|>"),
    THINKING: TemplateTokens(
        special=CHATML_SPECIAL, added=(*TOOL_TAGS, "<think>", "</think>"), eos="<|im_end|>", pad="<|endoftext|>"
    ),
    LLAMA3_TOOLS: TemplateTokens(
        special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
        added=(), eos="<|eot_id|>", pad="<|end_of_text|>", bos="<|begin_of_text|>",
    ),
}


VENDORED_TEMPLATES = ("chatml_tools", "thinking", "llama3_tools")
"""Chat templates shipped in ``rlplat/testing/templates`` (see :func:`vendored_template`)."""


def vendored_template(name: str) -> str:
    """The text of the vendored chat template ``name`` (one of :data:`VENDORED_TEMPLATES`)."""
    from importlib import resources

    if name not in VENDORED_TEMPLATES:
        raise ValueError(f"no vendored chat template {name!r}; choose one of {list(VENDORED_TEMPLATES)}")
    return resources.files("rlplat.testing").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def chat_tokenizer(template: str):
    """A ``PreTrainedTokenizerFast`` for the vendored template named ``template`` (one of
    :data:`TEMPLATES`), its ``chat_template`` set to that template's text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast


    if template not in TEMPLATE_TOKENS:
        raise ValueError(f"no tiny tokenizer for template {template!r}; choose one of {list(TEMPLATE_TOKENS)}")
    tokens = TEMPLATE_TOKENS[template]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={symbol: index for index, symbol in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokens.special])
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in tokens.added])
    special_roles = {"eos_token": tokens.eos, "pad_token": tokens.pad}
    if tokens.bos is not None:
        # Like Llama 3's tokenizer: plain encoding prepends BOS, which the template also writes.
        special_roles["bos_token"] = tokens.bos
        core.post_processor = processors.TemplateProcessing(
            single=f"{tokens.bos} $A", special_tokens=[(tokens.bos, core.token_to_id(tokens.bos))]
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, padding_side="left", **special_roles)
    tokenizer.chat_template = vendored_template(template)
    return tokenizer


def save_chat_tokenizer(directory, template: str) -> str:
    """Write :func:`chat_tokenizer` ``(template)`` to ``directory`` with ``save_pretrained``, so that
    ``AutoTokenizer.from_pretrained(directory)`` loads it with its chat template; returns the path."""
    chat_tokenizer(template).save_pretrained(directory)
    return str(directory)
