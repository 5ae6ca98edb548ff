"""Supervised data: parquet conversations -> token ids with a loss mask -> ``DataProto`` batches the
engines train with :class:`rlplat.losses.NLLLoss`.

**Two schemas**, chosen per file by its columns:

* ``messages`` (``data.messages_key``): a chat, a list of ``{"role", "content"}`` messages (``system``,
  ``user``, ``assistant``, ``tool``), assistant messages optionally with ``tool_calls`` (Hugging Face's
  convention: ``[{"type": "function", "function": {"name": str, "arguments": dict or JSON string}}]``)
  and tool results as ``{"role": "tool", "content": str, "name": str}``. An optional ``tools`` column
  (a list of OpenAI function schemas, or its JSON string) is passed to the template as ``tools=``.
* ``prompt`` / ``response`` (``data.prompt_key`` / ``data.response_key``): the prompt as a string (one
  user message) or a list of messages (the RL data's ``prompt`` column), the response a string (one
  assistant message).

**Rendering.** With a chat template, the conversation is rendered once with
``apply_chat_template(messages, tools=..., tokenize=False)`` and encoded without added special tokens
(the template writes them), as the RL data loader and the agent loops do. Assistant turn ``i`` spans
the characters from the end of ``render(messages[:i], add_generation_prompt=True)`` through the end of
its end-of-turn token (:attr:`rlplat_agents.chat.ChatRenderer.end_of_turn_ids`: ``<|im_end|>``,
``<|eot_id|>``), what a rollout samples; what the template writes after it (ChatML's newline) and every
system, user and tool token carry no loss. A token is trained when its first character lies in such a
span. This needs the template to render earlier turns the same once later ones follow (append-only,
``rlplat check-template``); a row where it does not is an error that names it (``data.last_turn_only``
trains only the last turn, which needs it only there).

Without a chat template (the demo's arithmetic tokenizer), consecutive non-assistant messages are
concatenated and encoded with the tokenizer's special tokens for the first piece (the RL data loader's
prompt rule), each assistant message's content is encoded without them and followed by EOS, and the
loss is on the assistant pieces and their EOS.

**Batches.** Each example is split at its first trained token: the tokens before it are the prompt
(left padded), the rest the response (right padded) with ``response_mask`` 1 on trained tokens, so a
batch has the RL layout the engine contract reads (``input_ids``, ``attention_mask``, ``position_ids``
[B, P + R], ``responses`` and ``response_mask`` [B, R]); the engine's log-probs of ``responses`` are then
exactly the log-likelihoods of the trained tokens (and of the later user and tool tokens, masked).

Every problem is a :class:`rlplat.data.DataError` naming the config key, the file, the row and the
column, raised when the dataset is built: in the driver, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlplat.config_node import read_config_node
from rlplat.data import DataError, StatefulLoader, as_file_list
from rlplat.kits.data import check_file, pad_token_id_of
from rlplat.protocol import DataProto

logger = logging.getLogger("rlplat_sft.data")

TRUNCATIONS = ("error", "filter", "right")
ROLES = ("system", "user", "assistant", "tool", "ipython")


@dataclasses.dataclass
class SFTDataConfig:
    """The ``data`` node of ``rlplat sft``: where the conversations are and how they become batches."""

    train_files: List[str] = dataclasses.field(default_factory=list)
    """Parquet files of training examples (a ``messages`` column, or ``prompt`` and ``response``)."""
    val_files: List[str] = dataclasses.field(default_factory=list)
    """Parquet files of validation examples; empty: no validation loss."""
    messages_key: str = "messages"
    """Column of the chat conversations."""
    prompt_key: str = "prompt"
    """Column of the prompt (a string or a list of messages) in files without ``messages_key``."""
    response_key: str = "response"
    """Column of the response (a string) in files without ``messages_key``."""
    last_turn_only: bool = False
    """Train on the last assistant turn of each conversation only (earlier ones are context)."""
    max_length: int = 1024
    """Most tokens an example may have (prompt and response together); longer ones per ``truncation``."""
    truncation: str = "error"
    """A longer example: ``error`` (stop at load, naming the file and row), ``filter`` (drop it, logged
    with a count) or ``right`` (keep its first ``max_length`` tokens)."""
    train_batch_size: int = 64
    """Examples per training step (one optimizer step unless ``actor.ppo_mini_batch_size`` is smaller)."""
    val_batch_size: Optional[int] = None
    """Examples per validation batch; None: the whole validation set at once."""
    shuffle: bool = True
    """Visit the examples in a fresh seeded order each epoch."""
    seed: int = 0
    """Seed of the shuffle (epoch ``e`` uses ``numpy.random.default_rng((seed, e))``)."""
    drop_last: bool = True
    """Skip an epoch's last batch when it is short."""
    apply_chat_template_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments for ``tokenizer.apply_chat_template`` (``{"enable_thinking": False}``)."""

    def __post_init__(self) -> None:
        self.train_files = as_file_list(self.train_files)
        self.val_files = as_file_list(self.val_files)
        problems = []
        if self.truncation not in TRUNCATIONS:
            problems.append(f"data.truncation={self.truncation!r} is not one of {list(TRUNCATIONS)}")
        for name, least in (("max_length", 2), ("train_batch_size", 1)):
            if getattr(self, name) < least:
                problems.append(f"data.{name} must be >= {least}, got {getattr(self, name)}")
        if self.val_batch_size is not None and self.val_batch_size < 1:
            problems.append(f"data.val_batch_size must be >= 1 or null (the whole set), got {self.val_batch_size}")
        if problems:
            raise DataError("invalid data config: " + "; ".join(problems))


def read_sft_data_config(config: Any) -> SFTDataConfig:
    if isinstance(config, Mapping):
        config = {key: [value] if key in ("train_files", "val_files") and isinstance(value, str) else value
                  for key, value in config.items()}
    return read_config_node(config, SFTDataConfig, "data")


@dataclasses.dataclass
class Example:
    """One tokenized example: ``input_ids`` and ``loss_mask`` (1 on trained tokens), same length."""

    input_ids: list[int]
    loss_mask: list[int]


class ExampleEncoder:
    """Turns a conversation into an :class:`Example` (see the module docstring for the rules)."""

    def __init__(self, tokenizer: Any, *, last_turn_only: bool = False, template_kwargs: Mapping[str, Any] | None = None):
        from rlplat_agents.chat import ChatRenderer

        self.tokenizer = tokenizer
        self.last_turn_only = last_turn_only
        self.renderer = ChatRenderer(tokenizer, template_kwargs)
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)

    def encode(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> Example:
        """The example of ``messages``; ``ValueError`` saying what is wrong (the caller adds where)."""
        assistants = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        if not assistants:
            raise ValueError("the conversation has no assistant message, so no token would carry loss")
        trained = assistants[-1:] if self.last_turn_only else assistants
        if self.renderer.has_chat_template:
            return self.encode_with_template(messages, tools, trained)
        if tools:
            raise ValueError("the row offers tools, but the tokenizer has no chat template to render them")
        return self.encode_plain(messages, set(trained))

    def encode_with_template(self, messages: Sequence[Mapping[str, Any]], tools: Any, trained: list[int]) -> Example:
        from rlplat_agents.chat import TemplateError

        render = self.renderer.render
        full = render(messages, tools)
        spans = []
        for index in trained:
            before = render(messages[:index], tools, add_generation_prompt=True) if index else ""
            through = render(messages[: index + 1], tools)
            if not (through.startswith(before) and full.startswith(through)):
                raise ValueError(
                    f"the chat template renders assistant message {index} differently once later messages follow "
                    "(it is not append-only there), so its tokens cannot be located; `rlplat check-template` shows "
                    "where, or set data.last_turn_only=true to train the last turn only")
            start, end = len(before), len(through)
            try:
                closing = self.renderer.end_of_turn_text
            except TemplateError:
                closing = ""
            if closing:
                found = full.rfind(closing, start, end)
                if found >= 0:
                    end = found + len(closing)
            spans.append((start, end))
        ids, offsets = self.renderer.encode_with_offsets(full)
        mask = [int(any(start <= begin < end for start, end in spans) and stop > begin) for begin, stop in offsets]
        return Example(ids, mask)

    def encode_plain(self, messages: Sequence[Mapping[str, Any]], trained: set[int]) -> Example:
        if self.eos_token_id is None:
            raise ValueError("the tokenizer has no chat template and no EOS token to end the assistant's turns with")
        ids: list[int] = []
        mask: list[int] = []
        pending: list[str] = []

        def flush() -> None:
            if pending:
                piece = self.tokenizer("".join(pending), add_special_tokens=not ids)["input_ids"]
                ids.extend(piece)
                mask.extend([0] * len(piece))
                pending.clear()

        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                pending.append(message.get("content") or "")
                continue
            flush()
            piece = list(self.tokenizer(message.get("content") or "", add_special_tokens=not ids)["input_ids"])
            piece.append(self.eos_token_id)
            ids.extend(piece)
            mask.extend([int(index in trained)] * len(piece))
        flush()
        return Example(ids, mask)


def parse_json_value(value: Any, where: str) -> Any:
    """A JSON string as its value; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not valid JSON ({error}): {value!r:.60}") from None
    return value


def clean_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """The row's messages checked and cleaned: Parquet gives every message (and every tool call's
    arguments) the union of the keys over the column, null where one was not written; those nulls are
    dropped, and tool-call arguments written as JSON strings are parsed."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else f"{type(messages).__name__} {messages!r:.60}"
        raise DataError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages, got {got}")
    cleaned = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"{where}: message {number} is {message!r:.80}, not a dict with a string 'role'")
        message = {key: value for key, value in message.items() if value is not None}
        role = message["role"]
        if role not in ROLES:
            raise DataError(f"{where}: message {number} has role {role!r}; the roles are {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise DataError(f"{where}: message {number}: tool_calls must be a list on an assistant message")
            message["tool_calls"] = [clean_tool_call(call, f"{where}: message {number}, tool call {position}")
                                     for position, call in enumerate(calls)]
        content = message.get("content")
        if content is None and calls is None:
            raise DataError(f"{where}: message {number} ({role}) has no content")
        if content is not None and not isinstance(content, str):
            raise DataError(f"{where}: message {number} ({role}): content must be a string, got {content!r:.60}")
        cleaned.append(message)
    return cleaned


def clean_tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise DataError(f"{where}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}, got {call!r:.80}")
    call = {key: value for key, value in call.items() if value is not None}
    function = {key: value for key, value in call["function"].items() if value is not None}
    if not isinstance(function.get("name"), str):
        raise DataError(f"{where}: the function has no string 'name'")
    arguments = parse_json_value(function.get("arguments", {}), f"{where}, arguments")
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: arguments must be a mapping (or its JSON string), got {arguments!r:.60}")
    function["arguments"] = {key: value for key, value in arguments.items() if value is not None}
    return {**call, "function": function}


class SFTDataset:
    """The examples of one split, validated and tokenized eagerly (see the module docstring).

    ``dataset[i]`` is ``{"input_ids": list, "loss_mask": list, "index": i}``; :meth:`origin` says which
    file and row it came from; :attr:`fingerprint` hashes every token and mask, so a resume on other data
    is refused (:class:`rlplat.data.StatefulLoader`)."""

    def __init__(self, files: Sequence[str] | str, tokenizer: Any, config: SFTDataConfig, *, config_key: str = "data.train_files"):
        self.files = as_file_list(files)
        self.config_key = config_key
        self.config = config
        self.pad_token_id = pad_token_id_of(tokenizer)
        self._encoder = ExampleEncoder(tokenizer, last_turn_only=config.last_turn_only,
                                       template_kwargs=config.apply_chat_template_kwargs)
        if not self.files:
            raise DataError(f"{config_key} is empty: give at least one parquet file")
        for path in self.files:
            check_file(path, config_key)
        examples: list[Example] = []
        self.origins: list[tuple[int, int]] = []
        dropped: list[tuple[str, int, int]] = []
        for number, path in enumerate(self.files):
            dropped += self._read_file(number, path, examples)
        self.dropped_rows = len(dropped)
        if dropped:
            logger.warning("%s: dropped %d of %d examples longer than data.max_length=%d (data.truncation=filter); "
                           "the first: %s, row %d, %d tokens", config_key, len(dropped), len(dropped) + len(examples),
                           config.max_length, *dropped[0])
        if not examples:
            raise DataError(f"{config_key}: no example is left (all {self.dropped_rows} are longer than data.max_length="
                            f"{config.max_length}); raise data.max_length or set data.truncation=right")
        lengths = np.fromiter((len(example.input_ids) for example in examples), dtype="<i8", count=len(examples))
        self.offsets = np.concatenate([np.zeros(1, dtype="<i8"), np.cumsum(lengths)])
        self.token_ids = np.fromiter((t for e in examples for t in e.input_ids), dtype="<i4", count=int(self.offsets[-1]))
        self.loss_masks = np.fromiter((m for e in examples for m in e.loss_mask), dtype="<i1", count=int(self.offsets[-1]))
        digest = hashlib.sha256(self.offsets.tobytes())
        digest.update(self.token_ids.tobytes())
        digest.update(self.loss_masks.tobytes())
        self.fingerprint = digest.hexdigest()[:16]
        self.splits = first_trained(self.loss_masks, self.offsets[:-1], lengths)
        """Where each example's response starts (:func:`collate_examples`)."""

    def collate(self, indices: Sequence[int]) -> DataProto:
        """The batch of the examples at ``indices`` (:func:`collate_examples`)."""
        indices = np.asarray(indices, dtype=np.int64)
        starts = self.offsets[indices]
        return collate_flat(self.token_ids, self.loss_masks, starts, self.offsets[indices + 1] - starts, indices,
                            self.pad_token_id, self.splits[indices])

    def _read_file(self, file_number: int, path: str, examples: list[Example]) -> list[tuple[str, int, int]]:
        config, where = self.config, f"{self.config_key}: {path}"
        try:
            names = pq.read_schema(path).names
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{where} is not a readable parquet file ({error})") from error
        chat = config.messages_key in names
        wanted = [config.messages_key] if chat else [config.prompt_key, config.response_key]
        missing = [column for column in wanted if column not in names]
        if missing:
            raise DataError(
                f"{where}: column {missing[0]!r} is missing; columns present: {', '.join(names) or 'none'}. An SFT file "
                f"holds either {config.messages_key!r} (chat messages; data.messages_key) or {config.prompt_key!r} and "
                f"{config.response_key!r} (data.prompt_key, data.response_key)")
        columns = wanted + (["tools"] if chat and "tools" in names else [])
        try:
            table = pq.read_table(path, columns=columns)
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{where} could not be read ({error})") from error
        values = {column: table.column(column).to_pylist() for column in columns}
        dropped = []
        for row in range(table.num_rows):
            at = f"{where}, row {row}"
            if chat:
                column = config.messages_key
                messages = clean_messages(values[column][row], f"{at}, column {column!r}")
                tools = parse_json_value(values["tools"][row], f"{at}, column 'tools'") if "tools" in values else None
                if tools is not None and not isinstance(tools, list):
                    raise DataError(f"{at}, column 'tools': expected a list of function schemas, got {tools!r:.60}")
            else:
                column = config.prompt_key
                messages = self._prompt_messages(values[column][row], f"{at}, column {column!r}")
                response = values[config.response_key][row]
                if not isinstance(response, str) or not response:
                    raise DataError(f"{at}, column {config.response_key!r}: expected a non-empty string, got {response!r:.60}")
                messages.append({"role": "assistant", "content": response})
                tools = None
            try:
                example = self._encoder.encode(messages, tools)
            except DataError:
                raise
            except Exception as error:
                raise DataError(f"{at}, column {column!r}: {error}") from None
            if len(example.input_ids) > config.max_length:
                if config.truncation == "error":
                    raise DataError(f"{at}, column {column!r}: the example has {len(example.input_ids)} tokens, more than "
                                    f"data.max_length={config.max_length}; raise data.max_length, or set data.truncation "
                                    "to filter (drop such rows) or right (cut them)")
                if config.truncation == "filter":
                    dropped.append((path, row, len(example.input_ids)))
                    continue
                example = Example(example.input_ids[: config.max_length], example.loss_mask[: config.max_length])
            if not any(example.loss_mask[1:]):
                raise DataError(f"{at}, column {column!r}: no token after the first carries loss (an empty assistant "
                                "turn, or cut away by data.truncation=right)")
            examples.append(example)
            self.origins.append((file_number, row))
        return dropped

    @staticmethod
    def _prompt_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
        if isinstance(prompt, str):
            if not prompt:
                raise DataError(f"{where}: the prompt is empty")
            return [{"role": "user", "content": prompt}]
        return clean_messages(prompt, where)

    def __len__(self) -> int:
        return len(self.origins)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} examples")
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return {"input_ids": self.token_ids[start:stop].tolist(), "loss_mask": self.loss_masks[start:stop].tolist(),
                "index": int(index)}

    def origin(self, index: int) -> tuple[str, int]:
        """``(file, row within that file)`` of the example at ``index``."""
        file_number, row = self.origins[index]
        return self.files[file_number], row

    @property
    def trained_tokens(self) -> int:
        return int(self.loss_masks.sum())

    def __repr__(self) -> str:
        return f"SFTDataset({len(self)} examples from {len(self.files)} file(s), fingerprint {self.fingerprint})"


def collate_examples(rows: Sequence[Mapping[str, Any]], pad_token_id: int) -> DataProto:
    """Examples (dicts with ``input_ids``, ``loss_mask`` and ``index``) -> one batch in the engine contract's
    layout (see the module docstring): the prompt (the tokens before the first trained one, at least one
    token) left padded, the response right padded, ``response_mask`` 1 on its trained tokens; non-tensor
    ``index``."""
    if not rows:
        raise ValueError("collate_examples needs at least one example")
    lengths = np.asarray([len(row["input_ids"]) for row in rows], dtype=np.int64)
    starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)[:-1]])
    token_ids = np.concatenate([np.asarray(row["input_ids"], dtype=np.int64) for row in rows])
    loss_masks = np.concatenate([np.asarray(row["loss_mask"], dtype=np.int64) for row in rows])
    return collate_flat(token_ids, loss_masks, starts, lengths, np.asarray([int(row["index"]) for row in rows]), pad_token_id)


def first_trained(loss_masks: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Where each example's response starts: its first trained token after the first token (at least 1)."""
    splits = np.empty(len(starts), dtype=np.int64)
    for number, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        trained = np.flatnonzero(loss_masks[start + 1: start + length])
        splits[number] = 1 + (int(trained[0]) if len(trained) else length - 1)
    return splits


def collate_flat(token_ids: np.ndarray, loss_masks: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 indices: np.ndarray, pad_token_id: int, splits: np.ndarray | None = None) -> DataProto:
    """:func:`collate_examples` of examples stored end to end (``token_ids`` and ``loss_masks`` flat,
    example ``i`` at ``starts[i]``, ``lengths[i]`` tokens), gathered in one vectorised pass."""
    if splits is None:
        splits = first_trained(loss_masks, starts, lengths)
    prompt_width, response_width = int(splits.max()), int((lengths - splits).max())
    columns = np.arange(prompt_width + response_width)[None, :]
    source = starts[:, None] + splits[:, None] - prompt_width + columns
    valid = (columns >= prompt_width - splits[:, None]) & (columns < prompt_width + (lengths - splits)[:, None])
    source = np.where(valid, source, 0)
    input_ids = torch.from_numpy(np.where(valid, token_ids[source], pad_token_id).astype(np.int64))
    attention_mask = torch.from_numpy(valid.astype(np.int64))
    trained = torch.from_numpy((np.where(valid, loss_masks[source], 0) != 0).astype(np.int64))
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
               "prompts": input_ids[:, :prompt_width], "responses": input_ids[:, prompt_width:],
               "response_mask": trained[:, prompt_width:]}
    return DataProto.from_dict(tensors, {"index": np.asarray(indices, dtype=np.int64)})


class SFTLoader(StatefulLoader):
    """:class:`rlplat.data.StatefulLoader` over an :class:`SFTDataset`: the same seeded order per epoch
    and the same resumable state, batches from :func:`collate_examples`."""

    def next_batch(self) -> DataProto:
        indices = self.order(self.epoch)[self.position: self.position + self.batch_size]
        self.position += len(indices)
        if self.position >= self.rows_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return self.dataset.collate(indices)


def validation_batches(dataset: SFTDataset, batch_size: int | None) -> list[DataProto]:
    """The validation set in order, ``batch_size`` examples at a time (None: one batch)."""
    size = batch_size or len(dataset)
    return [dataset.collate(np.arange(start, min(start + size, len(dataset)))) for start in range(0, len(dataset), size)]


def build_sft_data(config: Any, tokenizer: Any) -> tuple[SFTLoader, SFTDataset | None]:
    """The training loader and the validation set (None without ``data.val_files``) of a ``data`` node."""
    config = read_sft_data_config(config)
    for key, files in (("data.train_files", config.train_files), ("data.val_files", config.val_files)):
        for path in files:
            check_file(path, key)
    train = SFTDataset(config.train_files, tokenizer, config, config_key="data.train_files")
    val = SFTDataset(config.val_files, tokenizer, config, config_key="data.val_files") if config.val_files else None
    loader = SFTLoader(train, config.train_batch_size, shuffle=config.shuffle, seed=config.seed, drop_last=config.drop_last)
    return loader, val

