"""From a padded prompt batch to per-prompt token lists, and from sampled token lists back to the batch
the :class:`~rlplat.contracts.rollout.RolloutEngine` contract returns.

Engines that sample one sequence at a time (vLLM, SGLang, a server) share these two steps; they keep
the padding, position and masking rules in one place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import threading
from typing import Any, Callable, Mapping, Sequence

import torch

from rlplat.contracts.rollout import RolloutEngine, SamplingParams, TokenOutput
from rlplat.kits.aio import run_async
from rlplat.protocol import DataProto

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def check_prompt_keys(prompts: DataProto, engine: str) -> None:
    missing = [key for key in PROMPT_KEYS if prompts.batch is None or key not in prompts.batch.keys()]
    if missing:
        raise KeyError(f"{engine} rollout: prompts lack {missing}; it needs left-padded {list(PROMPT_KEYS)}")


def prompt_token_lists(prompts: DataProto, engine: str) -> list[list[int]]:
    """The real tokens of each left-padded prompt (those with ``attention_mask`` 1), in row order."""
    check_prompt_keys(prompts, engine)
    input_ids, attention_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    token_lists = [row[keep].tolist() for row, keep in zip(input_ids, attention_mask)]
    empty = [row for row, tokens in enumerate(token_lists) if not tokens]
    if empty:
        raise ValueError(f"{engine} rollout: prompt rows {empty} have no token with attention_mask 1")
    return token_lists



def check_single_request(prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
    """The arguments ``generate_tokens`` accepts: a non-empty prompt and one sample."""
    if sampling.n != 1:
        raise ValueError(f"generate_tokens samples one response; got n={sampling.n}")
    if not prompt_ids:
        raise ValueError("generate_tokens needs at least one prompt token")

def assemble_rollout(prompts: DataProto, samples: Sequence[TokenOutput], n: int, max_new_tokens: int, pad_token_id: int) -> DataProto:
    """The contract's output batch from ``len(prompts) * n`` samples, those of one prompt adjacent.

    Responses are right padded with ``pad_token_id`` to ``max_new_tokens``; ``response_mask`` is 1 over
    each sample's tokens; positions continue from each prompt's last position. Samples that record their
    tokens' weights versions (``TokenOutput.versions``) give ``policy_version`` [rows, R] (-1 where none).
    """
    rows = len(prompts) * n
    if len(samples) != rows:
        raise ValueError(f"expected {rows} samples ({len(prompts)} prompts x n={n}), got {len(samples)}")
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32)
    response_mask = torch.zeros(rows, max_new_tokens, dtype=torch.long)
    versions: torch.Tensor | None = None
    for row, sample in enumerate(samples):
        if len(sample.token_ids) > max_new_tokens or len(sample.log_probs) != len(sample.token_ids):
            raise ValueError(
                f"sample {row} has {len(sample.token_ids)} tokens and {len(sample.log_probs)} log-probs "
                f"(max_new_tokens={max_new_tokens}); the engine returned an inconsistent sample"
            )
        length = len(sample.token_ids)
        responses[row, :length] = torch.tensor(sample.token_ids, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(sample.log_probs, dtype=torch.float32)
        response_mask[row, :length] = 1
        if sample.versions is not None:
            if len(sample.versions) != length:
                raise ValueError(f"sample {row} has {length} tokens and {len(sample.versions)} versions; the engine "
                                 "returned an inconsistent sample")
            if versions is None:
                versions = torch.full((rows, max_new_tokens), -1, dtype=torch.long)
            versions[row, :length] = torch.tensor(sample.versions, dtype=torch.long)
    repeated = prompts.repeat(n, interleave=True) if n > 1 else prompts
    prompt_ids, prompt_mask, prompt_positions = (repeated.batch[key] for key in PROMPT_KEYS)
    response_positions = prompt_positions[:, -1:] + torch.arange(1, max_new_tokens + 1)
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
            **({"policy_version": versions} if versions is not None else {}),
        },
        non_tensors=repeated.non_tensor_batch,
        meta_info=prompts.meta_info,
    )


def finish_reason(token_ids: Sequence[int], stop_token_ids: Sequence[int], max_new_tokens: int, reported: str | None) -> str:
    """``"stop"`` or ``"length"`` from what the engine reported, checked against the tokens themselves."""
    if reported in ("stop", "length"):
        return reported
    if token_ids and token_ids[-1] in set(stop_token_ids):
        return "stop"
    if len(token_ids) >= max_new_tokens:
        return "length"
    raise RuntimeError(f"the rollout engine ended a sample with finish reason {reported!r} (aborted or failed)")


def pad_and_eos_token_ids(model_path: str | None, pad_token_id: int | None, eos_token_ids: Sequence[int] | None, engine: str) -> tuple[int, tuple[int, ...]]:
    """The pad token and EOS ids of a rollout: as configured, else from the model's own config files
    (``config.json`` and, as vLLM and SGLang read it too, ``generation_config.json``; local files only).
    The pad falls back to the first EOS id."""
    eos, pad = eos_token_ids, pad_token_id
    if (eos is None or pad is None) and model_path is not None:
        from transformers import AutoConfig, GenerationConfig

        configs = [AutoConfig.from_pretrained(model_path, local_files_only=True)]
        try:
            configs.append(GenerationConfig.from_pretrained(model_path, local_files_only=True))
        except OSError:
            pass  # no generation_config.json
        if eos is None:
            found: list[int] = []
            for config in configs:
                ids = getattr(config, "eos_token_id", None)
                for token in ids if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else []):
                    if token not in found:
                        found.append(token)
            eos = tuple(found)
        if pad is None:
            pad = next((config.pad_token_id for config in configs if getattr(config, "pad_token_id", None) is not None), None)
    eos = tuple(int(token) for token in eos or ())
    if pad is None:
        if not eos:
            raise ValueError(f"{engine} rollout: no pad_token_id and no EOS token known; set rollout.config.pad_token_id")
        pad = eos[0]
    return int(pad), eos


#: Where a Hugging Face causal LM keeps its input embedding and its output layer.
INPUT_EMBEDDING, OUTPUT_LAYER = "model.embed_tokens.weight", "lm_head.weight"


def tied_weight_aliases(model_path: str | None) -> dict[str, tuple[str, ...]]:
    """``{name: other names of the same tensor}`` for a model whose output layer is its input embedding
    (``tie_word_embeddings``, the config class's default when ``config.json`` omits it; local files only).
    Training engines send a tied tensor once, under the embedding's name; a rollout engine that keeps its
    own copy of the output layer (vLLM's CPU backend packs one when the layer is processed) must get it
    under both names, or it samples from the stale copy. Empty when nothing is tied or no path is known."""
    if model_path is None:
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {INPUT_EMBEDDING: (OUTPUT_LAYER,)} if getattr(text_config, "tie_word_embeddings", False) else {}


def with_tied_aliases(bucket: Sequence[tuple[str, Any]], aliases: Mapping[str, Sequence[str]]) -> list[tuple[str, Any]]:
    """The bucket with each tied tensor also under its other names (:func:`tied_weight_aliases`), unless the
    bucket already names them."""
    named = [(name, tensor) for name, tensor in bucket]
    present = {name for name, _ in named}
    for name, tensor in list(named):
        for alias in aliases.get(name, ()):
            if alias not in present:
                named.append((alias, tensor))
                present.add(alias)
    return named


class RequestBatcher:
    """Gathers single-prompt requests made concurrently from asyncio code (agent loops calling
    ``generate_tokens``) into batches for an engine that is not safe to call from several threads: one
    daemon thread takes everything queued, calls ``run_batch(items)`` (which returns one result per item,
    in order) and hands each caller its result or the batch's exception. The thread ends after a second
    without requests and starts again with the next one."""

    def __init__(self, run_batch: Callable[[list[Any]], Sequence[Any]], name: str):
        self.run_batch, self.name = run_batch, name
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.starting = threading.Lock()

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.put((item, future, loop))
        with self.starting:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self.serve, name=self.name, daemon=True)
                self.thread.start()
        return await future

    def serve(self) -> None:
        while True:
            try:
                batch = [self.pending.get(timeout=1.0)]
            except queue.Empty:
                return
            while True:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            try:
                results = list(self.run_batch([item for item, _, _ in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"{self.name}: {len(results)} results for {len(batch)} requests")
                for (_, future, loop), result in zip(batch, results):
                    loop.call_soon_threadsafe(settle, future, result, None)
            except BaseException as error:
                for _, future, loop in batch:
                    loop.call_soon_threadsafe(settle, future, None, error)


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def transfer_copy(tensor: torch.Tensor, dtype: str, device: torch.device | int | None) -> torch.Tensor:
    """A weight as a rollout backend takes it: detached, floating point in ``dtype`` (a torch dtype name;
    ``"auto"`` keeps it: half the bytes of float32 masters otherwise), on ``device`` (None: where it
    is), contiguous."""
    tensor = tensor.detach()
    if dtype != "auto" and tensor.is_floating_point():
        tensor = tensor.to(dtype=getattr(torch, dtype))
    if device is not None:
        tensor = tensor.to(device=device)
    return tensor.contiguous()


class BackendRolloutEngine(RolloutEngine):
    """What the rollouts driving an inference library (vLLM, SGLang) share: ``wake_up`` is the staged
    wake-up in one go, and ``close`` ends the ``backend`` (an object with ``close()`` and
    ``owner_pid``), also when the engine is collected in the process that built it (a copy unpickled
    elsewhere does not own the engine or server)."""

    backend: Any

    def wake_up(self) -> None:
        self.wake_up_weights()
        self.wake_up_kv_cache()

    def close(self) -> None:
        """Stop the engine (hybrid) or the server this engine started (server mode)."""
        self.backend.close()

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None and os.getpid() == backend.owner_pid:
            try:
                backend.close()
            except Exception:
                pass


MIN_VERSION = "min_policy_version"
"""``meta_info`` key of a batch to generate: the policy version the rollout must hold before it starts (the
newest whose weights were sent before the batch); a rollout worker with partial rollouts waits for it."""

ABORTED_KEY = "rollout_aborted"
"""Per row of a batch generated through :func:`generate_through_tokens`: 1 where
:meth:`RolloutEngine.abort_generation` cut the sample short (its tokens so far are kept, to be continued)."""


def row_seed(seed: int, row: int, done: int = 0) -> int:
    """The sampling seed of row ``row`` of a generation seeded ``seed`` (``done``: tokens the row had before
    this call, so that a continued row draws a stream of its own)."""
    return (int(seed) * 1_000_003 + int(row) * 7_919 + int(done) * 104_729) % (2**63 - 1)


def generate_through_tokens(rollout: RolloutEngine, prompts: DataProto, sampling: SamplingParams, pad_token_id: int,
                            version: int) -> DataProto:
    """The contract's ``generate`` output for ``prompts``, made of one concurrent ``generate_tokens`` call per
    sample, so that the rollout can carry them over weight updates at token boundaries (partial rollouts)
    and record each token's weights version (``policy_version``, ``version`` where the rollout records none).

    A batch whose ``meta_info["continue"]`` is set is a stored output of this function (every key of it,
    ``sampling.n`` samples already made): its rows with :data:`ABORTED_KEY` 1 go on from their prompt and the
    tokens they have, up to ``sampling.max_new_tokens`` in all; the others are kept as they are. Rows seeded
    with ``sampling.seed`` draw from streams of their own (:func:`row_seed`). The output carries
    :data:`ABORTED_KEY`."""
    budget = sampling.max_new_tokens
    continuing = bool(prompts.meta_info.get("continue"))
    if continuing:
        width = prompts.batch["prompts"].shape[1]
        prompt_part = DataProto.from_dict(
            tensors={"input_ids": prompts.batch["prompts"], "attention_mask": prompts.batch["attention_mask"][:, :width],
                     "position_ids": prompts.batch["position_ids"][:, :width]},
            non_tensors=prompts.non_tensor_batch, meta_info={k: v for k, v in prompts.meta_info.items() if k != "continue"})
        n = 1
        mask = prompts.batch["response_mask"].bool()
        had = [TokenOutput(prompts.batch["responses"][row][mask[row]].tolist(),
                           prompts.batch["rollout_log_probs"][row][mask[row]].tolist(), "abort",
                           versions=prompts.batch["policy_version"][row][mask[row]].tolist())
               for row in range(len(prompts))]
        aborted = prompts.batch[ABORTED_KEY].bool().tolist()
    else:
        prompt_part, n = prompts, sampling.n
        had = [TokenOutput([], [], "abort", versions=[]) for _ in range(len(prompts) * n)]
        aborted = [True] * len(had)
    token_lists = prompt_token_lists(prompt_part, "partial")
    requests = []
    for row, sample in enumerate(had):
        if not aborted[row]:
            continue
        done = len(sample.token_ids)
        if done >= budget:
            raise ValueError(f"row {row} of the continued batch already has {done} tokens, the whole budget ({budget}); "
                             "it cannot have been cut short")
        seed = None if sampling.seed is None else row_seed(sampling.seed, row, done)
        params = dataclasses.replace(sampling, n=1, max_new_tokens=budget - done, seed=seed)
        requests.append((row, token_lists[row // n] + list(sample.token_ids), params))

    async def run_all() -> list[TokenOutput]:
        return await asyncio.gather(*(rollout.generate_tokens(prompt, params) for _, prompt, params in requests))

    outputs = run_async(run_all()) if requests else []
    samples, cut = list(had), [0] * len(had)
    for (row, _, _), output in zip(requests, outputs):
        before = had[row]
        versions = output.versions if output.versions is not None else [version] * len(output.token_ids)
        samples[row] = TokenOutput(before.token_ids + list(output.token_ids), before.log_probs + list(output.log_probs),
                                   output.finish_reason, versions=list(before.versions or []) + list(versions))
        cut[row] = int(output.finish_reason == "abort")
    result = assemble_rollout(prompt_part, samples, n, budget, pad_token_id)
    result.batch[ABORTED_KEY] = torch.tensor(cut, dtype=torch.int8)
    return result
