"""Prompt data for the driver loop: parquet files -> tokenized prompts -> left-padded ``DataProto`` batches.

**Schema** (the field's, verl's): one row per prompt, with the columns

* ``data_source`` (string): which task the row comes from; the reward scorer dispatches on it;
* ``prompt`` (``data.prompt_key``): the chat messages, a list of ``{"role": str, "content": str}``
  (a plain string is accepted when ``data.apply_chat_template`` is false);
* ``reward_model`` (struct): ``ground_truth`` (any type, not null) and whatever else the scorer reads
  (``style``, ...);
* ``extra_info`` (struct, optional): passed to the scorer as is; a missing column or a null gives ``{}``;
  multi-turn rows carry ``tools_kwargs`` (per-tool arguments) and optionally ``tools`` here (verl's);
* ``agent_name`` (string, optional): the agent loop of the row (``tool``, ``env``, verl's
  ``tool_agent``, ...; see :mod:`rlplat_agents.manager` (rlplat-agents)); null: ``agent.loop``.

Other columns are ignored. :func:`rlplat.kits.data.write_parquet` writes such files.

**Pipeline.** :func:`load_datasets` builds an :class:`RLDataset` per split from a :class:`DataConfig`;
:class:`StatefulLoader` cuts the training set into batches of ``data.train_batch_size`` prompts, in a
seeded order per epoch, and its :meth:`~StatefulLoader.state_dict` belongs in every checkpoint;
:class:`ValidationLoader` walks the validation set in file order; :func:`collate` turns rows into a
``DataProto`` (``input_ids``, ``attention_mask``, ``position_ids``; non-tensor ``raw_prompt``,
``data_source``, ``reward_model``, ``extra_info``, ``index``, ``uid``). :func:`build_loaders` does all of it.

Every problem with the data is a :class:`DataError` that names the config key, the file, the row within
that file and the column, and says what to do.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# the config part lives in rlplat.data_config (no torch: the config schema reads it); its names stay importable here
from rlplat.data_config import TRUNCATIONS, DataConfig, DataError, as_file_list, read_data_config  # noqa: F401
from rlplat.deprecation import Deprecated, deprecated_names
from rlplat.kits import data as kit
from rlplat.protocol import DataProto

logger = logging.getLogger("rlplat.data")

REQUIRED_COLUMNS = ("data_source", "reward_model")
STATE_FORMAT = 1


class RLDataset:
    """The prompts of one split, validated and tokenized **eagerly**, when the dataset is built.

    Eager because the ``filter`` and ``error`` policies need every prompt's length anyway, because a
    malformed row found at step 900 wastes a run (here it fails in seconds, before any worker starts),
    and because the fingerprint a checkpoint is checked against covers every token. The cost is one
    pass of the tokenizer over the prompts and their ids in memory (4 bytes a token).

    Tokenization: with ``apply_chat_template`` and a tokenizer that has a chat template, the messages are
    rendered with ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)``
    and the text is encoded with ``add_special_tokens=False`` (the template already holds BOS and the
    like; adding them again would double them). A tokenizer without a chat template (the arithmetic
    one of the demo) gets the message contents concatenated with no separator, encoded with
    ``add_special_tokens=True``. With ``apply_chat_template`` false a string prompt is encoded the
    same way, as is. Then ``max_prompt_length`` applies by ``truncation``: see :class:`DataConfig`.

    ``dataset[i]`` is a dict: ``input_ids`` (list of ints, unpadded), ``raw_prompt`` (the messages or
    string of the file), ``data_source``, ``reward_model`` (dict), ``extra_info`` (dict) — fresh copies,
    so a consumer that changes them does not change the dataset — and ``index`` (``i``: the row's
    position among the kept rows of all the files, in order). :meth:`origin` says which file and row.
    """

    def __init__(
        self,
        files: Sequence[str] | str,
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        apply_chat_template: bool = True,
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        config_key: str = "data.train_files",
    ):
        if truncation not in TRUNCATIONS:
            raise DataError(f"data.truncation={truncation!r} is not one of {list(TRUNCATIONS)}")
        self.files = as_file_list(files)
        self._tokenizer = tokenizer  # private: a repr or an error message never dumps its vocabulary
        self.config_key = config_key
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.uses_chat_template = apply_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.pad_token_id = kit.pad_token_id_of(tokenizer)
        if not self.files:
            raise DataError(f"{config_key} is empty: give at least one parquet file")
        for path in self.files:
            kit.check_file(path, config_key)
        if apply_chat_template and not self.uses_chat_template:
            logger.info(
                "%s: the tokenizer has no chat template; each prompt is its message contents concatenated, "
                "encoded with the tokenizer's special tokens", config_key,
            )
        self.raw_prompts: list[Any] = []
        self.data_sources: list[str] = []
        self.reward_models: list[dict] = []
        self.extra_infos: list[dict] = []
        self.agent_names: list[str | None] = []
        self.has_agent_names = False
        """Whether a file has the ``agent_name`` column (rows then carry it, null where unset)."""
        self.origins: list[tuple[int, int]] = []
        """(file number, row within that file) of each kept row."""
        token_lists: list[list[int]] = []
        dropped: list[tuple[str, int, int]] = []
        for file_number, path in enumerate(self.files):
            dropped += [(path, row, length) for row, length in self._read_file(file_number, path, token_lists)]
        self.dropped_rows = len(dropped)
        """Rows dropped at load for being longer than ``max_prompt_length`` (``truncation="filter"``)."""
        if dropped:
            total = self.dropped_rows + len(token_lists)
            logger.warning(
                "%s: dropped %d of %d rows longer than data.max_prompt_length=%d (data.truncation=filter); "
                "the first: %s, row %d, %d tokens",
                config_key, self.dropped_rows, total, max_prompt_length, *dropped[0],
            )
        if not token_lists:
            raise DataError(
                f"{config_key}: all {self.dropped_rows} rows are longer than data.max_prompt_length="
                f"{max_prompt_length} and were filtered out; raise data.max_prompt_length or choose "
                f"data.truncation=left or right"
            )
        lengths = np.fromiter((len(ids) for ids in token_lists), dtype="<i8", count=len(token_lists))
        self.offsets = np.concatenate([np.zeros(1, dtype="<i8"), np.cumsum(lengths, dtype="<i8")])
        self.token_ids = np.fromiter(
            (token for ids in token_lists for token in ids), dtype="<i4", count=int(self.offsets[-1])
        )
        digest = hashlib.sha256(self.offsets.tobytes())
        digest.update(self.token_ids.tobytes())
        self.fingerprint = digest.hexdigest()[:16]
        """Hash of every prompt's token ids, in order: changes when the files, their order, the tokenizer,
        the template or the length policy change, not when the files move."""

    def _read_file(self, file_number: int, path: str, token_lists: list[list[int]]) -> list[tuple[int, int]]:
        """Validate and tokenize one file, appending its kept rows to ``token_lists`` and the row lists;
        returns ``(row, length)`` of the rows the ``filter`` policy dropped."""
        where = f"{self.config_key}: {path}"
        try:
            names = pq.read_schema(path).names
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{where} is not a readable parquet file ({error})") from error
        for column in (self.prompt_key, *REQUIRED_COLUMNS):
            if column not in names:
                hint = " (data.prompt_key names the prompt column)" if column == self.prompt_key else ""
                raise DataError(
                    f"{where}: column {column!r} is missing{hint}; "
                    f"columns present: {', '.join(names) or 'none'}. "
                    f"Each row needs {self.prompt_key!r} (chat messages), 'data_source' and "
                    f"'reward_model' with 'ground_truth'; 'extra_info' is optional"
                )
        optional = [column for column in ("extra_info", "agent_name") if column in names]
        columns = [self.prompt_key, *REQUIRED_COLUMNS] + optional
        try:
            table = pq.read_table(path, columns=columns)
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{where} could not be read ({error})") from error
        prompts = table.column(self.prompt_key).to_pylist()
        data_sources = table.column("data_source").to_pylist()
        reward_models = table.column("reward_model").to_pylist()
        extra_infos = table.column("extra_info").to_pylist() if "extra_info" in names else [None] * table.num_rows
        agent_names = table.column("agent_name").to_pylist() if "agent_name" in names else [None] * table.num_rows
        self.has_agent_names |= "agent_name" in names
        texts = []
        for row in range(table.num_rows):
            texts.append(self._prompt_text(prompts[row], f"{where}, row {row}, column {self.prompt_key!r}"))
            check_row(data_sources[row], reward_models[row], extra_infos[row], f"{where}, row {row}")
            if agent_names[row] is not None and not isinstance(agent_names[row], str):
                raise DataError(f"{where}, row {row}, column 'agent_name': expected a string (an agent loop's name) or "
                                f"null, got {agent_names[row]!r:.60}")
            if isinstance(prompts[row], list):
                # Parquet gives every message the union of the keys of all messages in the column, null
                # where one was not written; templates test `'tool_calls' in message`, so drop those.
                prompts[row] = [{key: value for key, value in message.items() if value is not None}
                                for message in prompts[row]]
        encoded = self._encode(texts) if texts else []
        dropped = []
        for row, ids in enumerate(encoded):
            if not ids:
                raise DataError(f"{where}, row {row}, column {self.prompt_key!r}: the prompt encodes to no tokens")
            if len(ids) > self.max_prompt_length:
                if self.truncation == "error":
                    raise DataError(
                        f"{where}, row {row}, column {self.prompt_key!r}: the prompt has {len(ids)} tokens, more "
                        f"than data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length, or "
                        f"set data.truncation to filter (drop such rows), left or right (cut them)"
                    )
                if self.truncation == "filter":
                    dropped.append((row, len(ids)))
                    continue
                ids = ids[-self.max_prompt_length:] if self.truncation == "left" else ids[: self.max_prompt_length]
            token_lists.append(ids)
            self.raw_prompts.append(prompts[row])
            self.data_sources.append(data_sources[row])
            self.reward_models.append(reward_models[row])
            self.extra_infos.append({} if extra_infos[row] is None else extra_infos[row])
            self.agent_names.append(agent_names[row])
            self.origins.append((file_number, row))
        return dropped

    def _prompt_text(self, prompt: Any, where: str) -> str:
        """The text to encode for one row's prompt; :class:`DataError` if the prompt is malformed."""
        if isinstance(prompt, str):
            if self.apply_chat_template:
                raise DataError(
                    f"{where}: expected a list of {{'role', 'content'}} messages, got the string {prompt!r:.60}; "
                    f"write the prompt as [{{'role': 'user', 'content': ...}}] or set "
                    f"data.apply_chat_template=false to tokenize strings as they are"
                )
            return prompt
        if not isinstance(prompt, list) or not prompt:
            got = "an empty list" if isinstance(prompt, list) else f"{type(prompt).__name__} {prompt!r:.60}"
            raise DataError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages, got {got}")
        for number, message in enumerate(prompt):
            well_formed = isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))
            if not well_formed:
                raise DataError(f"{where}: message {number} is {message!r:.80}, not a {{'role': str, 'content': str}} dict")
        if not self.uses_chat_template:
            return "".join(message["content"] for message in prompt)
        try:
            text = self._render_template(prompt)
        except Exception as error:
            raise DataError(f"{where}: the tokenizer's chat template failed on these messages: {error}") from error
        return text

    def _render_template(self, messages: list[dict]) -> str:
        return self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.apply_chat_template_kwargs
        )

    def _encode(self, texts: list[str]) -> list[list[int]]:
        encoded = self._tokenizer(texts, add_special_tokens=not self.uses_chat_template, return_attention_mask=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def __len__(self) -> int:
        return len(self.origins)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"RLDataset indices are ints, got {type(index).__name__}")
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} prompts")
        index = int(index)
        row = {
            "input_ids": self.token_ids[self.offsets[index]: self.offsets[index + 1]].tolist(),
            "raw_prompt": copy.deepcopy(self.raw_prompts[index]),
            "data_source": self.data_sources[index],
            "reward_model": copy.deepcopy(self.reward_models[index]),
            "extra_info": copy.deepcopy(self.extra_infos[index]),
            "index": index,
        }
        if self.has_agent_names:
            row["agent_name"] = self.agent_names[index]
        return row

    def origin(self, index: int) -> tuple[str, int]:
        """``(file, row within that file)`` of the prompt at ``index``."""
        file_number, row = self.origins[index]
        return self.files[file_number], row

    def __repr__(self) -> str:
        return f"RLDataset({len(self)} prompts from {len(self.files)} file(s), fingerprint {self.fingerprint})"


def check_row(data_source: Any, reward_model: Any, extra_info: Any, where: str) -> None:
    """:class:`DataError` naming the column if a row's ``data_source``, ``reward_model`` or ``extra_info``
    does not fit the schema."""
    if not isinstance(data_source, str):
        raise DataError(f"{where}, column 'data_source': expected a string, got {data_source!r:.60}")
    if not isinstance(reward_model, dict):
        raise DataError(
            f"{where}, column 'reward_model': expected a struct with 'ground_truth', got {reward_model!r:.60}"
        )
    if reward_model.get("ground_truth") is None:
        raise DataError(
            f"{where}, column 'reward_model': 'ground_truth' is missing or null (got {reward_model!r:.80}); "
            f"the reward scorer compares the response with it"
        )
    if extra_info is not None and not isinstance(extra_info, dict):
        raise DataError(f"{where}, column 'extra_info': expected a struct or null, got {extra_info!r:.60}")


def collate(rows: Sequence[Mapping[str, Any]], pad_token_id: int, uid_prefix: str = "") -> DataProto:
    """Rows of an :class:`RLDataset` -> one prompt batch, left-padded to the **longest prompt of the
    batch** (not to ``max_prompt_length``: rollout engines take any width, and narrower batches are
    cheaper to generate from and to train on).

    Tensors (int64, ``[B, W]``): ``input_ids`` (``pad_token_id`` on the left), ``attention_mask`` (1 on
    real tokens), ``position_ids`` (``clamp(cumsum(attention_mask) - 1, 0)``: 0 on the padding and the
    first real token, counting up from there). Non-tensors: ``raw_prompt``, ``data_source``,
    ``reward_model``, ``extra_info``, ``agent_name`` (when the rows have it), ``index`` and
    ``uid = f"{uid_prefix}i{index}"``. The uid depends
    only on the row and the prefix, never on a counter or a random draw, so a resumed run gives the
    same uids; the training loader's prefix is ``e{epoch}-`` (unique over the whole run), the validation
    loader's ``val-``. A batch that holds one dataset index twice raises ``ValueError``: its two rows
    would share a uid, so group-based estimators would pool them; repeat samples with
    ``DataProto.repeat`` after collating instead.
    """
    if not rows:
        raise ValueError("collate needs at least one row")
    indices = [int(row["index"]) for row in rows]
    if len(set(indices)) != len(indices):
        repeated = sorted({index for index in indices if indices.count(index) > 1})
        raise ValueError(f"dataset index(es) {repeated} appear more than once in one batch; their uids would collide")
    tensors = kit.left_padded([row["input_ids"] for row in rows], pad_token_id)
    keys = ("raw_prompt", "data_source", "reward_model", "extra_info") + (("agent_name",) if "agent_name" in rows[0] else ())
    non_tensors = {key: [row.get(key) for row in rows] for key in keys}
    non_tensors["index"] = np.asarray(indices, dtype=np.int64)
    non_tensors["uid"] = [f"{uid_prefix}i{index}" for index in indices]
    return DataProto.from_dict(tensors, non_tensors)


class StatefulLoader:
    """Training batches of ``batch_size`` prompts, epoch after epoch, resumable exactly.

    Epoch ``e`` visits the prompts in the order ``numpy.random.default_rng((seed, e)).permutation(n)``
    (dataset order when ``shuffle`` is false), ``batch_size`` at a time; with ``drop_last`` the last
    ``n % batch_size`` prompts of that order are skipped. The state is two numbers: ``epoch`` and
    ``position`` (prompts of that epoch's order already handed out). Both advance *before* a batch is
    handed over, so :meth:`state_dict` taken after receiving batch ``k`` resumes at batch ``k + 1``;
    after an epoch's last batch the state is already ``(epoch + 1, 0)``.

    Two ways to consume it: :meth:`next_batch` for a loop counted in steps (it crosses epochs by
    itself), or ``for batch in loader`` for the remaining batches of the current epoch (verl's
    ``for epoch ...: for batch in dataloader`` loop). ``len(loader)`` is the number of batches per epoch.
    """

    def __init__(
        self,
        dataset: RLDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_token_id: int | None = None,
    ):
        if batch_size < 1:
            raise DataError(f"data.train_batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the {len(dataset)} prompts of the training set, "
                f"and data.drop_last=true drops the short batch: no batch would ever be formed; lower "
                f"data.train_batch_size or add prompts"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad_token_id = dataset.pad_token_id if pad_token_id is None else pad_token_id
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        rows = len(self.dataset)
        return rows // self.batch_size if self.drop_last else math.ceil(rows / self.batch_size)

    @property
    def rows_per_epoch(self) -> int:
        """Prompts handed out per epoch (all of them unless ``drop_last`` skips a short tail)."""
        return len(self) * self.batch_size if self.drop_last else len(self.dataset)

    def order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch`` in the order they are handed out."""
        if self._order is None or self._order[0] != epoch:
            rows = len(self.dataset)
            permutation = np.random.default_rng((self.seed, epoch)).permutation(rows) if self.shuffle else np.arange(rows)
            self._order = (epoch, permutation)
        return self._order[1]

    def next_batch(self) -> DataProto:
        """The next batch; moves on to the next epoch after the current one's last batch."""
        indices = self.order(self.epoch)[self.position: self.position + self.batch_size]
        epoch = self.epoch
        self.position += len(indices)
        if self.position >= self.rows_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return collate([self.dataset[int(index)] for index in indices], self.pad_token_id, uid_prefix=f"e{epoch}-")

    def __iter__(self):
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands, as a JSON-serialisable dict: ``epoch`` and ``position`` (prompts of
        that epoch already handed out), the settings that fix the order (``seed``, ``shuffle``,
        ``batch_size``, ``drop_last``) and the dataset's ``dataset_length`` and ``dataset_fingerprint``."""
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "dataset_length": len(self.dataset),
            "dataset_fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the next batch is the one an uninterrupted
        loader would have handed out next.

        Raises :class:`DataError` when the state cannot give that: another training set (length or
        fingerprint differ: files, tokenizer, template or length policy changed), or another ``seed`` or
        ``shuffle`` (another order). A different ``batch_size`` or ``drop_last`` is accepted with a
        warning: the order of the prompts continues exactly, only their grouping into batches changes.
        """
        needed = ("epoch", "position", "seed", "shuffle", "dataset_length", "dataset_fingerprint")
        missing = [key for key in needed if key not in state]
        if missing:
            raise DataError(f"the data loader state lacks {missing}; it is not a StatefulLoader.state_dict()")
        advice = "restore the data and config the checkpoint was taken with, or start a fresh run (trainer.resume=disable)"
        if (state["dataset_length"], state["dataset_fingerprint"]) != (len(self.dataset), self.dataset.fingerprint):
            raise DataError(
                f"cannot resume the training data loader: the checkpoint was taken over {state['dataset_length']} "
                f"prompts (fingerprint {state['dataset_fingerprint']}), the training set now has {len(self.dataset)} "
                f"(fingerprint {self.dataset.fingerprint}): data.train_files, the tokenizer, the chat template or "
                f"data.max_prompt_length / data.truncation changed since; {advice}"
            )
        for key in ("seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the training data loader: the checkpoint has data.{key}={state[key]}, the config "
                    f"data.{key}={getattr(self, key)}, which gives another order of prompts; set data.{key}={state[key]} "
                    f"to resume, or {advice}"
                )
        for key in ("batch_size", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                logger.warning(
                    "resuming the data loader with %s=%s instead of the checkpoint's %s: the prompts continue in the "
                    "same order, grouped differently", key, getattr(self, key), state[key],
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise DataError(f"the data loader state has a negative epoch or position: {epoch}, {position}")
        self.epoch, self.position = (epoch + 1, 0) if position >= self.rows_per_epoch else (epoch, position)


class ValidationLoader:
    """The validation set in dataset order (files in order, rows in order), ``batch_size`` prompts at a
    time (None: one batch of everything), the last batch possibly shorter. Every iteration starts from
    the first prompt; there is no state to checkpoint. Uids are ``val-i{index}``."""

    def __init__(self, dataset: RLDataset, batch_size: int | None = None, *, pad_token_id: int | None = None):
        if batch_size is not None and batch_size < 1:
            raise DataError(f"data.val_batch_size must be >= 1 or null (the whole set), got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size or len(dataset)
        self.pad_token_id = dataset.pad_token_id if pad_token_id is None else pad_token_id

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.dataset), self.batch_size):
            stop = min(start + self.batch_size, len(self.dataset))
            yield collate([self.dataset[index] for index in range(start, stop)], self.pad_token_id, uid_prefix="val-")


def load_datasets(config: Any, tokenizer: Any) -> tuple[RLDataset, RLDataset | None]:
    """The training set and the validation set (None when ``data.val_files`` is empty) of ``config``
    (a :class:`DataConfig`, a Mapping or a DictConfig of the ``data`` node). Every file is checked to
    exist before any is read, so a typo in the second list is reported without reading the first."""
    config = read_data_config(config)
    if not config.train_files:
        raise DataError("data.train_files is empty: give at least one parquet file of training prompts")
    for key, files in (("data.train_files", config.train_files), ("data.val_files", config.val_files)):
        for path in files:
            kit.check_file(path, key)
    settings = dict(
        prompt_key=config.prompt_key, max_prompt_length=config.max_prompt_length, truncation=config.truncation,
        apply_chat_template=config.apply_chat_template, apply_chat_template_kwargs=config.apply_chat_template_kwargs,
    )
    train = RLDataset(config.train_files, tokenizer, config_key="data.train_files", **settings)
    val = RLDataset(config.val_files, tokenizer, config_key="data.val_files", **settings) if config.val_files else None
    return train, val


def build_loaders(config: Any, tokenizer: Any) -> tuple[StatefulLoader, ValidationLoader | None]:
    """:func:`load_datasets`, then the training loader and the validation loader as ``config`` says."""
    config = read_data_config(config)
    train, val = load_datasets(config, tokenizer)
    train_loader = StatefulLoader(
        train, config.train_batch_size, shuffle=config.shuffle, seed=config.seed, drop_last=config.drop_last
    )
    return train_loader, (ValidationLoader(val, config.val_batch_size) if val is not None else None)


#: The helpers plugins use moved to rlplat.kits.data at plugin API 1.3; their old names here warn until 1.4.
__getattr__ = deprecated_names(__name__, {name: Deprecated(f"rlplat.kits.data:{name}", "1.4")
                                          for name in ("check_file", "pad_token_id_of", "left_padded", "write_parquet")})
