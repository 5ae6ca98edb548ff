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

**Warm start** (:mod:`rlplat_demo.tools_build`, which also builds the assets): supervised steps that give
RL its starting point; :func:`measure` checks that start state with real generation. The warm start's
and the build's names (:data:`BUILD_NAMES`) are read here too.

``python -m rlplat_demo.tools [MODEL_DIR]`` prints :func:`measure`'s figures (of the shipped model by
default). Assets (``python -m rlplat_demo.build --only tools``): ``assets/tools/model/``, ``data/train.parquet`` and
``data/val.parquet`` (multiplication, ``agent_name="tool"``), ``data/env_train.parquet`` and
``data/env_val.parquet`` (addition, ``agent_name="env"``), ``tools.yaml`` and ``build_info.json``.
Importing this module imports nothing heavy.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any, Mapping, Sequence

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
    from rlplat_demo import _existing

    return _existing(Path(__file__).resolve().parent / "assets" / "tools", "the tool demo's assets folder")


def model_dir() -> Path:
    """The tool demo model's ``save_pretrained`` folder (model and tokenizer with its chat template)."""
    from rlplat_demo import _existing

    return _existing(assets_dir() / "model" / "config.json", "the tool demo model").parent


def data_file(name: str) -> Path:
    """``data/<name>.parquet`` of the tool demo: ``train`` and ``val`` (multiplication, tool loop),
    ``env_train`` and ``env_val`` (addition, env loop)."""
    from rlplat_demo import _existing

    return _existing(assets_dir() / "data" / f"{name}.parquet", f"the tool demo's {name} data")


def tools_config_file() -> Path:
    """``tools.yaml``: the calculator's OpenAI function schema, in the tool config format."""
    from rlplat_demo import _existing

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
    splits it (:func:`rlplat_demo.build.split_pairs`, same seed: same validation pairs). Multiplication
    holds out :data:`VALIDATION_PAIRS` pairs of its own shuffle, and keeps out of training the swapped
    pair of each (``b*a`` is the same product)."""
    import numpy as np

    from rlplat_demo.build import split_pairs as addition_split

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


# -------------------------------------------------------------------------------------------- measure


def generate_turn(model, tokenizer, contexts: Sequence[Sequence[int]], *, do_sample: bool, max_new_tokens: int = 16,
                  batch_size: int = 512) -> list[list[int]]:
    """One model turn after each context: the new tokens through the first ``<|im_end|>`` (or
    ``max_new_tokens`` of them), left-padded batches, temperature 1 with no top-k or top-p when
    sampling."""
    import torch

    from rlplat.kits.data import left_padded

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


BUILD_NAMES = ("CONVERSATION_KINDS", "RETRY_ERRORS", "conversation", "assistant_turns", "encode_conversations",
               "retry_errors", "Mixture", "WarmStartTargets", "probe", "warm_start", "build")
"""Names of :mod:`rlplat_demo.tools_build` that this module answers too (they lived here before it was split)."""


def __getattr__(name: str) -> Any:
    if name in BUILD_NAMES:
        from rlplat_demo import tools_build

        return getattr(tools_build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    import sys

    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else None), indent=2))
