"""The tool demo's assets, built: the warm start that gives RL its starting point and :func:`build`, which
writes ``assets/tools/`` (``python -m rlplat_demo.build --only tools``). The task, the tokenizer, the
scorer and :func:`rlplat_demo.tools.measure` are :mod:`rlplat_demo.tools`'.

**Warm start** (:func:`warm_start`): supervised steps on a mixture of conversations, stopped by thresholds
on the validation split (:class:`WarmStartTargets`), so that RL starts from a model that answers
multiplication directly under greedy decoding (mostly wrong), calls the tool in a fair share of samples at
temperature 1 and copies the tool's result when it does, and that adds two-digit numbers about as well as
the arithmetic demo's model. :func:`rlplat_demo.tools.measure` checks that start state with real generation.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rlplat_demo.tools import (BYTE_LEVEL, CALL_START, CHAT_DATA_SOURCE, FEEDBACK, IM_END, IM_START, MAX_ATTEMPTS,
                               TOOL_DATA_SOURCE, TOOL_SCHEMA, VOCABULARY, call_message, measure, render_ids,
                               split_pairs, task_rows, tool_tokenizer, tools_config)

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

    from rlplat.kits.data import write_parquet
    from rlplat_demo.build import folder_bytes
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
        "command": f"python -m rlplat_demo.build --only tools --seed {seed}",
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
