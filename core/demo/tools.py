"""The tool demo: a tiny model that answers ``a*b=`` better with a calculator than without, and ``a+b=``
in a conversation that may say "wrong, try again".

**Task.** Multiplication ``a*b=`` with ``a, b`` in 10..99 (data source :data:`TOOL_DATA_SOURCE`): a 0.5M
parameter model guesses products poorly, but copies a calculator's answer well. The ``calculator`` tool
(:data:`TOOL_SCHEMA`, written to ``tools.yaml``) is called in the hermes format of Qwen2.5-style
templates: the assistant turn holds ``<tool_call>\\n{"name": "calculator", "arguments": {"expression":
"37*48"}}\\n</tool_call>`` and the result comes back as a ``tool`` message, rendered inside a user turn as
``<tool_response>\\n1776\\n</tool_response>``. Addition ``a+b=`` (data source :data:`CHAT_DATA_SOURCE`) is
the task of the ``env`` loop: up to three attempts, the environment answering :data:`FEEDBACK` as a user
message after a wrong one.

**Tokenizer** (:func:`tool_tokenizer`): a Qwen2-style byte-level BPE without merges: one token per
printable ASCII character and newline, plus whole tokens for the ChatML markers, the role names, the
tool-call and tool-response tags, the fixed JSON around a calculator expression (:data:`CALL_PREFIX`,
:data:`CALL_SUFFIX`) and the words of the feedback; 114 tokens. The markers and role names are special
(dropped by ``skip_special_tokens=True``), the tool tags are not (a scorer and a tool-call parser see
them); ``<|im_end|>`` is EOS. A whole tool conversation is 56 tokens: a 22-token prompt, a 12-token
call, the tool result's 17-token delta, a 5-token answer.

**Chat template** (:data:`CHAT_TEMPLATE`): ChatML, with the newline between two messages written at the
start of the later one rather than at the end of the earlier one, so a model that stops at ``<|im_end|>``
has produced exactly the rendering of its turn: the prompt, the sampled tokens and the delta the template
adds for the next messages are, token for token, the rendering of the whole conversation (append-only).
Offered tools are named on one system line, ``<tools>calculator</tools>``; without tools there is no
system line.

**Scorer** (:func:`score`): the answer is the text after the last ``</tool_response>`` and after the last
:data:`FEEDBACK`; right when it equals the ground truth, wrong when a tool call is still pending.

**Warm start** (:func:`warm_start`): supervised steps on a mixture of conversations, stopped by thresholds
on the validation split (:class:`WarmStartTargets`), so that RL starts from a model that answers
multiplication directly under greedy decoding (mostly wrong), calls the tool in a fair share of samples at
temperature 1 and copies the tool's result when it does, and that adds two-digit numbers about as well as
the arithmetic demo's model. :func:`measure` checks that start state with real generation.

``python -m rlplat.demo.tools [MODEL_DIR]`` prints :func:`measure`'s figures (of the shipped model by
default). Assets (``python -m rlplat.demo.build --only tools``): ``assets/tools/model/``, ``data/train.parquet`` and
``data/val.parquet`` (multiplication, ``agent_name="tool"``), ``data/env_train.parquet`` and
``data/env_val.parquet`` (addition, ``agent_name="env"``), ``tools.yaml`` and ``build_info.json``.
Importing this module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

TOOL_DATA_SOURCE = "arith_tools"
CHAT_DATA_SOURCE = "arith_chat"
TOOL_AGENT = "tool"
ENV_AGENT = "env"
TOOL_NAME = "calculator"
FEEDBACK = "wrong, try again"
"""The environment's answer to a wrong attempt in the addition task (a user message)."""
MAX_ATTEMPTS = 3
OPERANDS = range(10, 100)
VALIDATION_PAIRS = 200

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"
CALL_PREFIX = '{"name": "calculator", "arguments": {"expression": "'
CALL_SUFFIX = '"}}'
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, "system", "user", "assistant"]
"""Dropped when decoding with ``skip_special_tokens=True``: what is left of a response is what a scorer
reads."""
WORD_TOKENS = [CALL_START, CALL_END, RESPONSE_START, RESPONSE_END, CALL_PREFIX, CALL_SUFFIX,
               "<tools>", "</tools>", TOOL_NAME, "wrong", "try", "again"]
"""Multi-character tokens that stay in decoded text."""
CHARACTERS = ["\n", *(c for c in string.printable if c not in "\t\n\r\x0b\x0c")]
"""One token each: newline and the printable ASCII characters, space included."""
BYTE_LEVEL = {"\n": "\u010a", " ": "\u0120"}
"""How GPT-2 style byte-level BPE spells a character in its vocabulary, where that is not the character
itself (``Ċ`` and ``Ġ``; the printable characters other than space are themselves)."""
VOCABULARY = [*SPECIAL_TOKENS, *WORD_TOKENS, *(BYTE_LEVEL.get(c, c) for c in CHARACTERS)]

TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression (integers, + - * / and parentheses) and return its value.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate, e.g. 37*48."},
            },
            "required": ["expression"],
        },
    },
}

CHAT_TEMPLATE = (
    "{%- set ns = namespace(open=false) -%}"
    "{%- set system_first = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system_first -%}{{- messages[0].content ~ '\\n' -}}{%- endif -%}"
    "{{- '<tools>' -}}"
    "{%- for tool in tools -%}"
    "{%- if not loop.first -%}{{- ',' -}}{%- endif -%}"
    "{{- (tool.function if tool.function is defined else tool).name -}}"
    "{%- endfor -%}"
    "{{- '</tools><|im_end|>' -}}"
    "{%- set ns.open = true -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and system_first and loop.first -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{%- if ns.open -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ message.content ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>' -}}{%- endif -%}"
    "{%- else -%}"
    "{%- if ns.open -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' ~ (message.content or '') -}}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set call = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' ~ call.name ~ '\", \"arguments\": ' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- set ns.open = true -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if ns.open -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
"""ChatML with the separating newline at the start of each later message (see the module docstring).
Consecutive ``tool`` messages share one user turn, as in Qwen2.5's template."""


# ---------------------------------------------------------------------------------------------- assets


def assets_dir() -> Path:
    """The tool demo's assets folder inside the installed package."""
    from rlplat.demo import _existing

    return _existing(Path(__file__).resolve().parent / "assets" / "tools", "the tool demo's assets folder")


def model_dir() -> Path:
    """The tool demo model's ``save_pretrained`` folder (model and tokenizer with its chat template)."""
    from rlplat.demo import _existing

    return _existing(assets_dir() / "model" / "config.json", "the tool demo model").parent


def data_file(name: str) -> Path:
    """``data/<name>.parquet`` of the tool demo: ``train`` and ``val`` (multiplication, tool loop),
    ``env_train`` and ``env_val`` (addition, env loop)."""
    from rlplat.demo import _existing

    return _existing(assets_dir() / "data" / f"{name}.parquet", f"the tool demo's {name} data")


def tools_config_file() -> Path:
    """``tools.yaml``: the calculator's OpenAI function schema, in the tool config format."""
    from rlplat.demo import _existing

    return _existing(assets_dir() / "tools.yaml", "the tool demo's tool config")


# ------------------------------------------------------------------------------------------- tokenizer


def tool_tokenizer():
    """The demo's tokenizer (see the module docstring): pad ``<|endoftext|>``, EOS ``<|im_end|>``, left
    padding, :data:`CHAT_TEMPLATE`, no BOS (the template holds every marker).

    It is built the way transformers builds a Qwen2 tokenizer (byte-level BPE, Qwen2's pre-tokenizer
    regex, NFC), with no merges: every character stays one token. ``AutoTokenizer`` loads a folder
    whose ``config.json`` says ``qwen2`` as a ``Qwen2Tokenizer``, rebuilt from the vocabulary with that
    pipeline; built this way, the rebuilt tokenizer is the same one (tested)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab = {token: index for index, token in enumerate(VOCABULARY)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                                end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(token, normalized=False, special=False) for token in WORD_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=IM_END, padding_side="left",
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def render_ids(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None, *,
               add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template (text first, then encoded without adding
    special tokens, as :class:`rlplat.data.RLDataset` does)."""
    text = tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


DELTA_PREFIX = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
"""The conversation :func:`message_delta` renders new messages after; any prefix ending with an assistant
turn gives the same delta with this template."""


def message_delta(tokenizer, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None) -> list[int]:
    """The token ids the template adds for ``messages`` (tool results, environment feedback) after an
    assistant turn, generation prompt included: what an agent loop appends after the sampled tokens."""
    base = render_ids(tokenizer, DELTA_PREFIX, tools=tools)
    full = render_ids(tokenizer, [*DELTA_PREFIX, *messages], tools=tools, add_generation_prompt=True)
    if full[: len(base)] != base:
        raise ValueError("the chat template is not append-only: rendering more messages changed earlier tokens")
    return full[len(base):]


# ------------------------------------------------------------------------------------ task and scoring


def call_message(expression: str) -> dict[str, Any]:
    """An assistant message calling the calculator on ``expression`` (OpenAI format)."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expression}}}]}


def final_answer(solution_str: str) -> str | None:
    """The answer in a decoded response: the text after the last ``</tool_response>`` and the last
    :data:`FEEDBACK`, stripped; None when a tool call is pending there (the model called a tool and the
    conversation ended before its result)."""
    tail = solution_str.rsplit(RESPONSE_END, 1)[-1]
    if CALL_START in tail:
        return None
    return tail.rsplit(FEEDBACK, 1)[-1].strip()


def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> dict:
    """``{"score": 1.0, "acc": True}`` when :func:`final_answer` of ``solution_str`` (the response decoded
    with special tokens skipped: model, tool and environment tokens) is ``ground_truth``, else 0 and False.
    For :data:`TOOL_DATA_SOURCE` and :data:`CHAT_DATA_SOURCE`; any other source is scored the same way."""
    answer = final_answer(solution_str)
    correct = answer is not None and answer == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": correct}


_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_PRODUCT = re.compile(r"\s*(\d{1,6})\s*([*+])\s*(\d{1,6})\s*")


def parse_calls(text: str) -> list[tuple[str, Any]]:
    """The hermes tool calls in ``text``: ``(name, arguments)`` for each JSON object between
    ``<tool_call>`` and ``</tool_call>``; ``("", None)`` for one that is not such an object."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            calls.append(("", None))
            continue
        ok = isinstance(call, dict) and isinstance(call.get("name"), str)
        calls.append((call["name"], call.get("arguments")) if ok else ("", None))
    return calls


def calculator(name: str, arguments: Any) -> str:
    """The demo's reference tool, for :func:`measure`: the value of ``<int> * <int>`` or ``<int> + <int>``,
    or an error text."""
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}"
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    match = _PRODUCT.fullmatch(expression) if isinstance(expression, str) else None
    if match is None:
        return "error: expected an expression like 37*48"
    left, operator, right = int(match[1]), match[2], int(match[3])
    return str(left * right if operator == "*" else left + right)


def split_pairs(seed: int) -> dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """``{"multiply": (train, val), "add": (train, val)}``. Addition is split as the arithmetic demo
    splits it (:func:`rlplat.demo.build.split_pairs`, same seed: same validation pairs). Multiplication
    holds out :data:`VALIDATION_PAIRS` pairs of its own shuffle, and keeps out of training the swapped
    pair of each (``b*a`` is the same product)."""
    import numpy as np

    from rlplat.demo.build import split_pairs as addition_split

    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    order = np.random.default_rng((seed, 1)).permutation(len(pairs))
    val = [pairs[index] for index in order[:VALIDATION_PAIRS]]
    held_out = {pair for a, b in val for pair in ((a, b), (b, a))}
    train = [pairs[index] for index in order[VALIDATION_PAIRS:] if pairs[index] not in held_out]
    return {"multiply": (train, val), "add": addition_split(seed)}


def task_rows(pairs: Sequence[tuple[int, int]], split: str, operation: str) -> list[dict[str, Any]]:
    """Rows in the schema of :mod:`rlplat.data` plus verl's multi-turn fields (``agent_name``,
    ``extra_info.tools_kwargs``). ``operation``: ``multiply`` (tool loop, the calculator offered; its
    per-row arguments are none, written as null because parquet cannot store an empty struct) or
    ``add`` (env loop, no tools)."""
    if operation not in ("multiply", "add"):
        raise ValueError(f"operation must be 'multiply' or 'add', got {operation!r}")
    multiply = operation == "multiply"
    rows = []
    for index, (a, b) in enumerate(pairs):
        extra_info: dict[str, Any] = {"split": split, "index": index}
        if multiply:
            extra_info["tools_kwargs"] = {TOOL_NAME: None}
        rows.append({
            "data_source": TOOL_DATA_SOURCE if multiply else CHAT_DATA_SOURCE,
            "agent_name": TOOL_AGENT if multiply else ENV_AGENT,
            "prompt": [{"role": "user", "content": f"{a}*{b}=" if multiply else f"{a}+{b}="}],
            "reward_model": {"ground_truth": str(a * b if multiply else a + b)},
            "extra_info": extra_info,
        })
    return rows


def tools_config() -> dict[str, Any]:
    """The content of ``tools.yaml``: ``{"tools": [{"name": "calculator", "tool_schema": ...}]}``."""
    return {"tools": [{"name": TOOL_NAME, "tool_schema": TOOL_SCHEMA}]}


# ---------------------------------------------------------------------------------------- warm start

CONVERSATION_KINDS = ("multiply_direct", "multiply_tool", "add_direct", "add_retry")
RETRY_ERRORS = (-11, -10, -9, -2, -1, 1, 2, 9, 10, 11)
"""How the wrong first answer of a retry conversation misses the sum: the slips of a half-trained model
(a lost or spurious carry, a digit off by one)."""


def conversation(kind: str, a: int, b: int, wrong: int | None = None) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """``(messages, tools)`` of one warm-start conversation about ``a`` and ``b``:

    * ``multiply_direct``: the product answered at once (the calculator offered);
    * ``multiply_tool``: a calculator call, its result, the result copied;
    * ``add_direct``: the sum answered at once (no tools);
    * ``add_retry``: ``wrong`` answered, :data:`FEEDBACK`, then the sum."""
    if kind == "add_retry" and (wrong is None or wrong == a + b):
        raise ValueError(f"an add_retry conversation needs a wrong first answer, got {wrong!r} for {a}+{b}")
    answer = a * b if kind.startswith("multiply") else a + b
    return _messages(kind, str(a), str(b), str(answer), str(wrong))


def _messages(kind: str, a: str, b: str, answer: str, wrong: str) -> tuple[list[dict[str, Any]], list[dict] | None]:
    operator = "*" if kind.startswith("multiply") else "+"
    user = {"role": "user", "content": f"{a}{operator}{b}="}
    if kind == "multiply_direct":
        return [user, {"role": "assistant", "content": answer}], [TOOL_SCHEMA]
    if kind == "multiply_tool":
        return [user, call_message(f"{a}*{b}"), {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer}], [TOOL_SCHEMA]
    if kind == "add_direct":
        return [user, {"role": "assistant", "content": answer}], None
    if kind == "add_retry":
        return [user, {"role": "assistant", "content": wrong}, {"role": "user", "content": FEEDBACK},
                {"role": "assistant", "content": answer}], None
    raise ValueError(f"unknown conversation kind {kind!r}; expected one of {CONVERSATION_KINDS}")


def assistant_turns(ids: Sequence[int], tokenizer) -> list[int]:
    """Per token: ``k`` (1-based) on the tokens the model produces in its ``k``-th turn (the content after
    ``<|im_start|>assistant\\n``, through ``<|im_end|>``), 0 elsewhere."""
    start, assistant, newline, end = tokenizer.convert_tokens_to_ids([IM_START, "assistant", BYTE_LEVEL["\n"], IM_END])
    turns, turn, inside = [0] * len(ids), 0, False
    for position, token in enumerate(ids):
        if inside:
            turns[position] = turn
            inside = token != end
        elif position >= 2 and ids[position - 2: position] == [start, assistant] and token == newline:
            turn, inside = turn + 1, True
    return turns


_SLOTS = ("A", "B", "C", "D")
"""Stand-ins for the first operand, the second, the answer and the wrong answer: characters the
template's own text never holds."""


def encode_conversations(tokenizer, kind: str, pairs: Sequence[tuple[int, int]], wrongs: Sequence[int] | None = None):
    """``(input_ids, turns)`` of one ``kind`` of conversation per pair, right-padded: ``turns`` as
    :func:`assistant_turns` gives it, -1 on padding.

    The conversations of one kind differ only in their numbers, and each digit is a token of its own, so
    the template renders the kind once with stand-ins for the numbers and each conversation is the ids of
    the text around them with its digits' ids in between: a rendering per conversation would cost tens of
    seconds of the build. The first conversation is checked against its full rendering."""
    import torch

    text = tokenizer.apply_chat_template(_messages(kind, *_SLOTS)[0], tools=_messages(kind, *_SLOTS)[1], tokenize=False)
    pieces = re.split(f"([{''.join(_SLOTS)}])", text)
    piece_ids = [tokenizer(piece, add_special_tokens=False)["input_ids"] if index % 2 == 0 else _SLOTS.index(piece)
                 for index, piece in enumerate(pieces)]
    digits = dict(zip("0123456789", tokenizer.convert_tokens_to_ids(list("0123456789"))))
    sequences = []
    for row, (a, b) in enumerate(pairs):
        answer = a * b if kind.startswith("multiply") else a + b
        values = [str(a), str(b), str(answer), str(wrongs[row]) if wrongs is not None else ""]
        sequences.append([token for piece in piece_ids
                          for token in (piece if isinstance(piece, list) else [digits[digit] for digit in values[piece]])])
    expected = render_ids(tokenizer, *conversation(kind, *pairs[0], None if wrongs is None else wrongs[0]))
    if sequences[0] != expected:
        raise RuntimeError(f"the {kind} conversations put together from pieces differ from the chat template's rendering")
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)
    turns = torch.full_like(input_ids, -1)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.as_tensor(sequence)
        turns[row, : len(sequence)] = torch.as_tensor(assistant_turns(sequence, tokenizer))
    return input_ids, turns


def retry_errors(pairs: Sequence[tuple[int, int]], seed: int) -> list[int]:
    """A wrong first answer per pair (the sum missed by one of :data:`RETRY_ERRORS`), drawn under ``seed``."""
    import numpy as np

    draws = np.random.default_rng((seed, 2)).integers(len(RETRY_ERRORS), size=len(pairs))
    return [a + b + RETRY_ERRORS[draw] for (a, b), draw in zip(pairs, draws)]


@dataclasses.dataclass(frozen=True)
class Mixture:
    """What a warm-start batch holds. Each row is multiplication with probability ``multiply``, else
    addition; ``multiply_at_target`` once greedy addition accuracy has reached its target (addition
    learns faster than the tool skills: it then waits near its target instead of running past it). A multiplication row is a tool conversation with probability ``tool_practice``, else a
    direct answer; the first token of a tool conversation (``<tool_call>``) is weighted in the loss so
    that the model learns to open with it with probability ``tool`` (the sampled tool-call rate RL starts
    from) however much copying it practises. An addition row is a retry conversation with probability
    ``retry`` (its wrong first answer is not trained on)."""

    multiply: float = 0.55
    multiply_at_target: float = 0.9
    tool: float = 0.28
    tool_practice: float = 0.4
    retry: float = 0.25

    @property
    def first_token_weight(self) -> float:
        """Loss weight of ``<tool_call>`` at the start of a tool conversation: with ``w`` on it and 1 on
        the first digit of a direct answer, the loss is least at ``P(<tool_call>) = tool``."""
        return self.tool / (1 - self.tool) * (1 - self.tool_practice) / self.tool_practice


@dataclasses.dataclass(frozen=True)
class WarmStartTargets:
    """Thresholds on the validation probe (:func:`probe`) that end the warm start, all at one evaluation."""

    add_accuracy: float = 0.35
    """Greedy addition accuracy at least this (the arithmetic demo's threshold)."""
    multiply_greedy_accuracy: float = 0.15
    """Greedy multiplication accuracy (through the tool when greedy calls it) below this."""
    tool_rate: tuple[float, float] = (0.2, 0.4)
    """Share of multiplication samples at temperature 1 that call the tool, within this range."""
    call_exact: float = 0.9
    """Given the tool is called, chance a temperature-1 sample writes the exact call, at least this."""
    copy_exact: float = 0.85
    """Given the tool's result, chance a temperature-1 sample answers it exactly, at least this."""

    def met(self, metrics: Mapping[str, float]) -> bool:
        low, high = self.tool_rate
        return (metrics["add/greedy_accuracy"] >= self.add_accuracy
                and metrics["multiply/greedy_accuracy"] < self.multiply_greedy_accuracy
                and low <= metrics["multiply/sampled_tool_rate"] <= high
                and metrics["multiply/sampled_call_exact"] >= self.call_exact
                and metrics["multiply/sampled_copy_exact"] >= self.copy_exact)


def probe(model, tokenizer, val: Mapping[str, Any]) -> dict[str, float]:
    """Validation figures from teacher-forced passes over the canonical conversations of ``val``
    (``{kind: (input_ids, turns)}`` for ``multiply_direct``, ``multiply_tool``, ``add_direct``): exact
    for greedy decoding (a greedy answer is right iff the argmax is the right token at each of its
    positions) and, for temperature 1, expectations (the chance a sample takes the canonical tokens)."""
    import torch

    tool_call = tokenizer.convert_tokens_to_ids(CALL_START)

    def pass_over(kind):
        input_ids, turns = val[kind]
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=(turns >= 0).long()).logits[:, :-1].float()
        targets, turns = input_ids[:, 1:], turns[:, 1:]
        log_probs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        hits = logits.argmax(-1) == targets
        first = (turns > 0).long().argmax(-1)
        return log_probs, hits, turns, first, logits

    def span(log_probs, hits, mask):
        return (log_probs * mask).sum(-1).exp(), (hits | ~mask).all(-1)

    was_training = model.training
    model.eval()
    log_probs, hits, turns, first, logits = pass_over("multiply_tool")
    rows = torch.arange(len(first))
    tool_probability = torch.softmax(logits[rows, first], -1)[:, tool_call]
    greedy_tool = logits[rows, first].argmax(-1) == tool_call
    after_first = turns.clone()
    after_first[rows, first] = 0
    call_probability, call_greedy = span(log_probs, hits, after_first == 1)
    copy_probability, copy_greedy = span(log_probs, hits, turns == 2)
    direct_log_probs, direct_hits, direct_turns, _, _ = pass_over("multiply_direct")
    _, direct_greedy = span(direct_log_probs, direct_hits, direct_turns == 1)
    add_log_probs, add_hits, add_turns, _, _ = pass_over("add_direct")
    _, add_greedy = span(add_log_probs, add_hits, add_turns == 1)
    model.train(was_training)
    greedy = torch.where(greedy_tool, call_greedy & copy_greedy, direct_greedy)
    return {
        "multiply/greedy_accuracy": greedy.float().mean().item(),
        "multiply/greedy_tool_rate": greedy_tool.float().mean().item(),
        "multiply/sampled_tool_rate": tool_probability.mean().item(),
        "multiply/sampled_call_exact": call_probability.mean().item(),
        "multiply/sampled_copy_exact": copy_probability.mean().item(),
        "multiply/greedy_direct_accuracy": direct_greedy.float().mean().item(),
        "add/greedy_accuracy": add_greedy.float().mean().item(),
    }


def warm_start(model, tokenizer, pairs: Mapping[str, tuple[list, list]], *, seed: int, mixture: Mixture = Mixture(),
               targets: WarmStartTargets = WarmStartTargets(), eval_every: int = 10, max_steps: int = 3000,
               batch_size: int = 128, lr: float = 1e-3, average: float = 0.95,
               log: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """Supervised steps (AdamW, loss on the tokens the model produces) on batches drawn by ``mixture``
    until :func:`probe` of the averaged weights on the validation pairs meets ``targets``; ``model``
    ends with the averaged weights. Returns the evaluations; raises RuntimeError when ``max_steps``
    pass without meeting the targets.

    The averaged weights are an exponential moving average of the trained ones (``average`` per step,
    a window of about 20 steps): at lr 1e-3 the trained weights swing from one step to the next (the
    greedy tool-call rate between 0.05 and 0.5, addition accuracy by 0.3), the average does not, so
    the state the build stops at and ships is the one it measured, not a draw from a swing."""
    import copy

    import torch

    (multiply_train, multiply_val), (add_train, add_val) = pairs["multiply"], pairs["add"]
    train = {
        "multiply_direct": encode_conversations(tokenizer, "multiply_direct", multiply_train),
        "multiply_tool": encode_conversations(tokenizer, "multiply_tool", multiply_train),
        "add_direct": encode_conversations(tokenizer, "add_direct", add_train),
        "add_retry": encode_conversations(tokenizer, "add_retry", add_train, retry_errors(add_train, seed)),
    }
    val = {kind: encode_conversations(tokenizer, kind, multiply_val if kind.startswith("multiply") else add_val)
           for kind in ("multiply_direct", "multiply_tool", "add_direct")}
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    averaged = copy.deepcopy(model).eval()
    model.train()
    history = [{"step": 0, **probe(averaged, tokenizer, val)}]
    started = time.monotonic()
    for step in range(1, max_steps + 1):
        add_open = history[-1]["add/greedy_accuracy"] < targets.add_accuracy
        draws = torch.rand(batch_size, 2, generator=generator)
        multiply = draws[:, 0] < (mixture.multiply if add_open else mixture.multiply_at_target)
        kinds = {
            "multiply_tool": multiply & (draws[:, 1] < mixture.tool_practice),
            "multiply_direct": multiply & (draws[:, 1] >= mixture.tool_practice),
            "add_retry": ~multiply & (draws[:, 1] < mixture.retry),
            "add_direct": ~multiply & (draws[:, 1] >= mixture.retry),
        }
        loss, total_weight = 0.0, 0.0
        for kind, chosen in kinds.items():
            count = int(chosen.sum())
            if not count:
                continue
            # One pass per kind: its rows have about the same length, so little compute goes to padding.
            source_ids, source_turns = train[kind]
            rows = torch.randint(len(source_ids), (count,), generator=generator)
            input_ids, turns = source_ids[rows], source_turns[rows]
            used = int((turns >= 0).any(0).nonzero().max()) + 1
            input_ids, turns = input_ids[:, :used], turns[:, :used]
            trained = turns == turns.max(-1, keepdim=True).values if kind == "add_retry" else turns > 0
            weights = trained[:, 1:].float()
            if kind == "multiply_tool":
                weights[torch.arange(count), trained[:, 1:].long().argmax(-1)] = mixture.first_token_weight
            logits = model(input_ids=input_ids, attention_mask=(turns >= 0).long()).logits[:, :-1]
            token_losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), input_ids[:, 1:], reduction="none")
            loss = loss + (token_losses * weights).sum()
            total_weight += float(weights.sum())
        loss = loss / total_weight
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(list(averaged.parameters()), list(model.parameters()), 1 - average)
        if step % eval_every == 0:
            metrics = probe(averaged, tokenizer, val)
            history.append({"step": step, "loss": loss.item(), **metrics})
            log(f"{time.monotonic() - started:.0f} s, step {step}: loss {loss.item():.3f}, " + ", ".join(f"{key} {value:.3f}" for key, value in metrics.items()))
            if targets.met(metrics):
                model.load_state_dict(averaged.state_dict())
                model.eval()
                return history
    raise RuntimeError(
        f"the tool demo's warm start did not meet {targets} within {max_steps} steps (last evaluation: "
        f"{history[-1]}); raise --max-steps or change the targets"
    )


# -------------------------------------------------------------------------------------------- measure


def generate_turn(model, tokenizer, contexts: Sequence[Sequence[int]], *, do_sample: bool, max_new_tokens: int = 16,
                  batch_size: int = 512) -> list[list[int]]:
    """One model turn after each context: the new tokens through the first ``<|im_end|>`` (or
    ``max_new_tokens`` of them), left-padded batches, temperature 1 with no top-k or top-p when
    sampling."""
    import torch

    from rlplat.data import left_padded

    pad, end = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    turns = []
    for start in range(0, len(contexts), batch_size):
        inputs = left_padded(contexts[start: start + batch_size], pad)
        width = inputs["input_ids"].shape[1]
        with torch.no_grad():
            output = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=max_new_tokens,
                                    eos_token_id=end, pad_token_id=pad, **sampling)
        for row in output[:, width:].tolist():
            turns.append(row[: row.index(end) + 1] if end in row else row)
    return turns


def tool_conversations(model, tokenizer, pairs: Sequence[tuple[int, int]], *, do_sample: bool,
                       max_turns: int = 2) -> list[dict[str, Any]]:
    """Multiplication conversations with the calculator offered, run the way the ``tool`` loop runs them:
    the sampled tokens appended verbatim, each turn's calls run by :func:`calculator` and their results
    appended as the template's delta for ``tool`` messages, at most ``max_turns`` model turns. Each
    result: ``solution`` (the response decoded without special tokens), ``calls`` (``(name, arguments)``
    of the first turn), ``tool_results``, ``answer`` (:func:`final_answer`), ``response_tokens``."""
    tools = [TOOL_SCHEMA]
    states = [{"context": render_ids(tokenizer, [{"role": "user", "content": f"{a}*{b}="}], tools=tools,
                                     add_generation_prompt=True),
               "response": [], "calls": None, "tool_results": [], "done": False} for a, b in pairs]
    for turn in range(max_turns):
        active = [state for state in states if not state["done"]]
        if not active:
            break
        for state, tokens in zip(active, generate_turn(model, tokenizer, [s["context"] for s in active], do_sample=do_sample)):
            state["context"] = state["context"] + tokens
            state["response"] = state["response"] + tokens
            calls = parse_calls(tokenizer.decode(tokens, skip_special_tokens=True))
            if state["calls"] is None:
                state["calls"] = calls
            finished = tokens[-1:] == [tokenizer.eos_token_id]
            if not calls or not finished or turn == max_turns - 1:
                state["done"] = True
                continue
            results = [calculator(name, arguments) for name, arguments in calls]
            state["tool_results"] += results
            delta = message_delta(tokenizer, [{"role": "tool", "content": result} for result in results], tools=tools)
            state["context"] = state["context"] + delta
            state["response"] = state["response"] + delta
    for state in states:
        state["solution"] = tokenizer.decode(state["response"], skip_special_tokens=True)
        state["answer"] = final_answer(state["solution"])
        state["response_tokens"] = len(state["response"])
    return states


def env_conversations(model, tokenizer, pairs: Sequence[tuple[int, int]], *, do_sample: bool,
                      attempts: int = MAX_ATTEMPTS) -> list[list[str]]:
    """Addition conversations the way the ``env`` loop runs them: up to ``attempts`` answers, each wrong
    one followed by :data:`FEEDBACK` (the template's delta for a user message). Returns each
    conversation's answers, in order (the last is right, or all ``attempts`` are wrong)."""
    states = [{"context": render_ids(tokenizer, [{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True),
               "truth": str(a + b), "answers": []} for a, b in pairs]
    feedback = message_delta(tokenizer, [{"role": "user", "content": FEEDBACK}])
    for attempt in range(attempts):
        active = [state for state in states if len(state["answers"]) == attempt
                  and (not state["answers"] or state["answers"][-1] != state["truth"])]
        if not active:
            break
        for state, tokens in zip(active, generate_turn(model, tokenizer, [s["context"] for s in active], do_sample=do_sample)):
            state["answers"].append(tokenizer.decode(tokens, skip_special_tokens=True).strip())
            state["context"] = state["context"] + tokens + feedback
    return [state["answers"] for state in states]


def measure(path: str | Path | None = None, *, samples: int = 4, seed: int = 0, model=None, tokenizer=None,
            pairs: Mapping[str, tuple[list, list]] | None = None) -> dict[str, float | None]:
    """The start-state figures of a tool demo model (the ``save_pretrained`` folder ``path``, the shipped
    one by default, or ``model`` and ``tokenizer``) on the validation pairs, with real generation and :func:`calculator` as the tool; sampled figures over ``samples``
    conversations per prompt at temperature 1 (seeded by ``seed``):

    * ``multiply/greedy_accuracy``, ``multiply/greedy_tool_call_rate``;
    * ``multiply/sampled_accuracy``, ``multiply/sampled_tool_call_rate``;
    * ``multiply/sampled_call_correct``: of the sampled conversations that call a tool, the share whose
      first turn is one well-formed calculator call of the prompt's product;
    * ``multiply/sampled_copy_accuracy``: of those that got a tool result, the share answering it exactly;
    * ``multiply/sampled_response_tokens``, ``multiply/sampled_conversation_tokens`` (means);
    * ``add/greedy_accuracy`` (first attempt), ``add/greedy_env_success`` (right within
      :data:`MAX_ATTEMPTS`), ``add/greedy_retry_changed`` (of the retries, the share that differ from
      the answer before), and the same three ``add/sampled_...``.

    A share of nothing (no conversation called the tool) is None."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None or tokenizer is None:
        folder = Path(path) if path is not None else model_dir()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"no model at {folder}: expected a save_pretrained folder with config.json")
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if pairs is None:
        pairs = split_pairs(seed)
    multiply_val, add_val = pairs["multiply"][1], pairs["add"][1]
    figures: dict[str, float] = {}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for mode, do_sample, copies in (("greedy", False, 1), ("sampled", True, samples)):
            prompts = [pair for pair in multiply_val for _ in range(copies)]
            results = tool_conversations(model, tokenizer, prompts, do_sample=do_sample)
            called = [(result, a * b) for result, (a, b) in zip(results, prompts) if result["calls"]]
            answered = [result for result, _ in called if result["tool_results"]]
            figures[f"multiply/{mode}_accuracy"] = _mean(
                score(TOOL_DATA_SOURCE, result["solution"], a * b)["acc"] for result, (a, b) in zip(results, prompts))
            figures[f"multiply/{mode}_tool_call_rate"] = len(called) / len(results)
            figures[f"multiply/{mode}_call_correct"] = _mean(
                len(result["calls"]) == 1 and calculator(*result["calls"][0]) == str(product) for result, product in called)
            figures[f"multiply/{mode}_copy_accuracy"] = _mean(result["answer"] == result["tool_results"][-1] for result in answered)
            prompt_tokens = len(render_ids(tokenizer, [{"role": "user", "content": "10*10="}], tools=[TOOL_SCHEMA],
                                           add_generation_prompt=True))
            figures[f"multiply/{mode}_response_tokens"] = _mean(result["response_tokens"] for result in results)
            figures[f"multiply/{mode}_conversation_tokens"] = prompt_tokens + figures[f"multiply/{mode}_response_tokens"]
            prompts = [pair for pair in add_val for _ in range(copies)]
            answers = env_conversations(model, tokenizer, prompts, do_sample=do_sample)
            retries = [(before, after) for attempt in answers for before, after in zip(attempt, attempt[1:])]
            figures[f"add/{mode}_accuracy"] = _mean(attempt[0] == str(a + b) for attempt, (a, b) in zip(answers, prompts))
            figures[f"add/{mode}_env_success"] = _mean(attempt[-1] == str(a + b) for attempt, (a, b) in zip(answers, prompts))
            figures[f"add/{mode}_retry_changed"] = _mean(before != after for before, after in retries)
    return {key: None if value is None else round(value, 4) for key, value in figures.items()}


def _mean(values) -> float | None:
    values = [float(value) for value in values]
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------- build


def build(out: str | Path, *, seed: int = 0, mixture: Mixture = Mixture(), targets: WarmStartTargets = WarmStartTargets(),
          eval_every: int = 10, max_steps: int = 3000, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Write the tool demo's assets under ``out``: ``data/`` (:func:`task_rows` of :func:`split_pairs`),
    ``tools.yaml``, ``model/`` (the demo architecture with this vocabulary, warm-started by
    :func:`warm_start`) and ``build_info.json`` (settings, the warm start's evaluations and the
    :func:`measure` figures); returns the build info."""
    import torch
    import transformers
    import yaml

    from rlplat.data import write_parquet
    from rlplat.demo.build import folder_bytes
    from rlplat.testing.tiny_models import tiny_causal_lm

    started = time.monotonic()
    out = Path(out)
    pairs = split_pairs(seed)
    for name, operation, split, index in (("train", "multiply", "train", 0), ("val", "multiply", "val", 1),
                                          ("env_train", "add", "train", 0), ("env_val", "add", "val", 1)):
        write_parquet(task_rows(pairs[operation][index], split, operation), out / "data" / f"{name}.parquet")
    (out / "tools.yaml").write_text(yaml.safe_dump(tools_config(), sort_keys=False))

    tokenizer = tool_tokenizer()
    model = tiny_causal_lm(seed, vocab_size=len(VOCABULARY), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                           eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        history = warm_start(model, tokenizer, pairs, seed=seed, mixture=mixture, targets=targets,
                             eval_every=eval_every, max_steps=max_steps, log=log)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    figures = measure(model=model, tokenizer=tokenizer, pairs=pairs, seed=seed)
    log("start state: " + ", ".join(f"{key} {value}" for key, value in figures.items()))
    info = {
        "command": f"python -m rlplat.demo.build --only tools --seed {seed}",
        "seed": seed,
        "tasks": {
            TOOL_DATA_SOURCE: "a*b= with a, b in 10..99, the calculator offered (data/train, data/val; agent tool)",
            CHAT_DATA_SOURCE: f"a+b= with a, b in 10..99, up to {MAX_ATTEMPTS} attempts (data/env_train, data/env_val; agent env)",
        },
        "prompts": {f"{operation}/{split}": len(pairs[operation][index])
                    for operation in pairs for index, split in enumerate(("train", "val"))},
        "vocabulary": len(VOCABULARY),
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "warm_start": {"optimizer": "AdamW", "lr": 1e-3, "batch_size": 128, "average": 0.95, "eval_every": eval_every,
                       "mixture": dataclasses.asdict(mixture), "targets": dataclasses.asdict(targets),
                       "steps": history[-1]["step"]},
        "probe": {key: round(value, 4) for key, value in history[-1].items() if key not in ("step", "loss")},
        "start_state": figures,
        "history": [{key: round(value, 4) if isinstance(value, float) else value for key, value in entry.items()}
                    for entry in history],
        "build_seconds": round(time.monotonic() - started, 1),
        "bytes": {"model": folder_bytes(out / "model"), "data": folder_bytes(out / "data")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


if __name__ == "__main__":
    import sys

    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else None), indent=2))
