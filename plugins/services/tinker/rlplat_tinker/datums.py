"""Tinker datums as the rows of rlplat's engines, and the engines' outputs back as each datum's ``logprobs``.

A datum is ``N`` input tokens ``x`` and, per position, ``loss_fn_inputs`` of length ``N``: ``target_tokens[i]`` is
the token position ``i`` predicts (the next token, for the losses clients send). Its row: the prompt ``x[0]``,
the response ``x[1:] + [target_tokens[-1]]`` (``N`` tokens), so response position ``i`` is read after ``x[:i+1]``
exactly as Tinker's position ``i``; the engine gathers the log-prob of ``target_tokens[i]`` there (the loss's
``gather_ids``), whatever the targets are. Rows are right padded; ``response_mask`` marks the ``N`` positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from rlplat.protocol import DataProto
from rlplat_tinker.losses import ADVANTAGES, LOSSES, SAMPLED, TARGETS, WEIGHTS, RequestError

COLUMNS = {"weights": WEIGHTS, "advantages": ADVANTAGES, "logprobs": SAMPLED}
#: loss_fn_inputs keys a client may send that no loss here reads (the cookbook's ``mask`` is dropped by the SDK)
IGNORED = ("mask",)


@dataclasses.dataclass
class Datum:
    """One datum, read from a request: its input tokens and its loss_fn_inputs as flat lists."""

    tokens: list[int]
    inputs: dict[str, list[float]]


def check_datums(datums: Sequence[Datum], loss: str | None, vocabulary: int, max_length: int | None) -> None:
    """Refuse what no engine could run, naming the datum and the key: tokens outside the vocabulary, inputs of
    another length than the tokens, a key the loss needs and the datum lacks, non-finite values."""
    if not datums:
        raise RequestError("no datums: send at least one")
    needed = ("target_tokens", *(LOSSES[loss][0] if loss else ()))
    for index, datum in enumerate(datums):
        where = f"datum {index}"
        n = len(datum.tokens)
        if n == 0:
            raise RequestError(f"{where}: model_input has no tokens")
        if max_length is not None and n + 1 > max_length:
            raise RequestError(f"{where}: {n} tokens; the model takes at most {max_length - 1} per datum")
        for key in needed:
            if key not in datum.inputs:
                if key == "weights":
                    continue  # cross_entropy's weights default to ones
                raise RequestError(f"{where}: loss_fn_inputs lacks {key!r} (loss_fn {loss!r} reads {', '.join(needed)})")
        for key, values in datum.inputs.items():
            if key in IGNORED:
                continue
            if key not in ("target_tokens", *COLUMNS):
                raise RequestError(f"{where}: unknown loss_fn_inputs key {key!r} (known: target_tokens, {', '.join(COLUMNS)})")
            if len(values) != n:
                raise RequestError(f"{where}: loss_fn_inputs[{key!r}] has {len(values)} values for {n} input tokens")
            if key != "target_tokens" and not all(math.isfinite(value) for value in values):
                raise RequestError(f"{where}: loss_fn_inputs[{key!r}] holds a value that is not finite")
        for key, values in (("model_input", datum.tokens), ("target_tokens", datum.inputs.get("target_tokens", ()))):
            bad = [int(token) for token in values if not 0 <= int(token) < vocabulary]
            if bad:
                raise RequestError(f"{where}: {key} holds token {bad[0]}, outside the vocabulary (0..{vocabulary - 1})")


def rows_of(datums: Sequence[Datum], pad_token_id: int) -> DataProto:
    """The datums as engine rows (module docstring): ``input_ids``, ``attention_mask``, ``position_ids`` [B, 1 + R],
    ``responses``, ``response_mask`` [B, R], the targets [B, R, 1] and the loss columns [B, R]."""
    rows, width = len(datums), max(len(datum.tokens) for datum in datums)
    ids, masks, targets = [], [], []
    columns: dict[str, list[list[float]]] = {name: [] for name in COLUMNS.values()}
    for datum in datums:
        n, padding = len(datum.tokens), width - len(datum.tokens)
        target = [int(token) for token in datum.inputs["target_tokens"]]
        ids.append([*datum.tokens, target[-1]] + [pad_token_id] * padding)
        masks.append([1] * (n + 1) + [0] * padding)
        targets.append(target + [0] * padding)
        columns[WEIGHTS].append(list(datum.inputs.get("weights", [1.0] * n)) + [0.0] * padding)
        for key in ("advantages", "logprobs"):
            columns[COLUMNS[key]].append(list(datum.inputs.get(key, [0.0] * n)) + [0.0] * padding)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(masks, dtype=torch.long)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": torch.arange(1 + width).expand(rows, -1).clone(),
        "responses": input_ids[:, 1:].clone(), "response_mask": attention_mask[:, 1:].to(torch.float32),
        TARGETS: torch.tensor(targets, dtype=torch.long).unsqueeze(-1),
        **{name: torch.tensor(values, dtype=torch.float32) for name, values in columns.items()},
    })


def shifted(datums: Sequence[Datum]) -> bool:
    """Whether every datum's targets are its next input tokens (then the engine's plain log-probs are theirs)."""
    return all([int(token) for token in datum.inputs["target_tokens"][:-1]] == [int(token) for token in datum.tokens[1:]]
               for datum in datums)


def logprobs_of(log_probs: torch.Tensor, datums: Sequence[Datum]) -> list[list[float]]:
    """Per datum, its ``N`` log-probs from the engine's [B, R] output."""
    return [log_probs[row, : len(datum.tokens)].tolist() for row, datum in enumerate(datums)]
