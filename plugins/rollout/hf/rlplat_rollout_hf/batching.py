"""Continuous batching of ``generate_tokens`` requests: concurrent single-prompt requests share forward
passes.

Callers queue a :class:`TokenRequest` and await a future of their own event loop; results reach it
through ``loop.call_soon_threadsafe`` (those of one step and one loop in one call), so callers may be in
any number of event loops and threads. One worker thread (started when requests are queued, gone when
none are left) keeps a :class:`RunningBatch`: at every step boundary it admits the queued requests whose
sampling settings match the batch's (prefilled together, their KV cache merged into the batch's),
samples one token for every row (the seeded rows from their own streams, in one batched draw: see
:mod:`rlplat_rollout_hf.sampling`), hands finished rows their result and drops them, and runs the next
decoding step for the others.

Rows are left padded: each row's real tokens end at the last cache column, positions count real tokens
from 0, and the attention mask hides the padding, so a row's tokens do not depend on what else is in
the batch (up to float rounding of differently shaped matrix products); a seeded row's random numbers
depend on its seed and the index of the token it draws only, so its tokens do not either.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import threading
from typing import TYPE_CHECKING, Optional, Union

import torch

from rlplat.contracts.rollout import SamplingParams, TokenOutput
from rlplat.controller.host import follow_threads
from rlplat_rollout_hf.sampling import choose_per_row, stream_keys

if TYPE_CHECKING:
    from rlplat_rollout_hf.rollout import HFRollout


def sampling_key(sampling: SamplingParams) -> tuple:
    """What rows decoding together must share: the filters and temperature (greedy ignores them).
    The seed, ``max_new_tokens`` and stop tokens are per row."""
    if sampling.greedy:
        return ("greedy",)
    return ("sample", sampling.temperature, sampling.top_p, sampling.top_k)


@dataclasses.dataclass(eq=False)
class TokenRequest:
    """One queued ``generate_tokens`` call and, once admitted, its row's progress."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    waiter: Optional[asyncio.Future] = None
    """The caller's future, of ``loop``; None for a row driven directly (:class:`RunningBatch` alone)."""
    loop: Optional[asyncio.AbstractEventLoop] = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    """Per sampled token: the weights version (``HFRollout.weights_version``) whose logits it was drawn from."""
    logits_version: int = 0
    """The weights version of the row's next-token logits."""
    stream_key: Optional[int] = dataclasses.field(init=False)
    """Key of the row's own random stream (row 0 of ``sampling.seed``, :func:`stream_keys`); None draws
    from the engine's generator."""

    def __post_init__(self) -> None:
        self.stream_key = None if self.sampling.seed is None else int(stream_keys(self.sampling.seed, [0])[0])

    @property
    def key(self) -> tuple:
        return sampling_key(self.sampling)

    def cached_length(self) -> int:
        """Real tokens of this row in the KV cache: the prompt and every sampled token but the last
        (fed at the next step)."""
        return len(self.prompt_ids) + max(len(self.token_ids) - 1, 0)

    def output(self, aborted: bool = False) -> TokenOutput:
        ended = bool(self.token_ids) and self.token_ids[-1] in self.stop_token_ids
        reason = "abort" if aborted else "stop" if ended else "length"
        return TokenOutput(list(self.token_ids), list(self.log_probs), reason, versions=list(self.versions))

    def last_fed(self) -> int:
        """The token whose forward pass made the row's next-token logits: its last sampled token, else the
        last token of its prompt."""
        return self.token_ids[-1] if self.token_ids else self.prompt_ids[-1]


def padded_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` [rows, heads, length, head_dim] of every layer of a full-attention DynamicCache."""
    from transformers.cache_utils import DynamicLayer

    layers = list(cache.layers)
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if other:
        raise RuntimeError(
            f"hf rollout: batching generate_tokens merges and trims full-attention KV caches (DynamicLayer); "
            f"this model's cache has {other} layers"
        )
    return [(layer.keys, layer.values) for layer in layers]


def replace_cache_tensors(cache, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make every layer of ``cache`` (checked by :func:`cache_tensors`) hold these keys and values:
    merging and trimming a cache this way copies each tensor once."""
    for layer, (keys, values) in zip(cache.layers, tensors):
        layer.keys, layer.values = keys, values


class RunningBatch:
    """Rows decoding together with one sampling setting: their KV cache, attention mask [rows, length],
    positions of their last cached token [rows, 1] and next-token logits [rows, vocab]."""

    def __init__(self, model, device: torch.device, pad_token_id: int, key: tuple, version: int = 0):
        self.model, self.device, self.pad_token_id, self.key = model, device, pad_token_id, key
        self.version = version
        """The weights version the batch's next-token logits and cache were computed with."""
        self.logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.rows: list[TokenRequest] = []
        self.cache = None
        self.attention_mask: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    @torch.no_grad()
    def admit(self, requests: list[TokenRequest]) -> None:
        """Prefill ``requests`` together and add them as rows (all or none: on an error the batch is
        as it was)."""
        from transformers import DynamicCache

        width = max(len(request.prompt_ids) for request in requests)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in requests],
                                 dtype=torch.long, device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in requests],
                                      dtype=torch.long, device=self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        extra = {"logits_to_keep": 1} if self.logits_to_keep else {}
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True, **extra)
        logits, positions = output.logits[:, -1, :], position_ids[:, -1:]
        if self.rows:
            length = max(width, self.attention_mask.shape[1])
            replace_cache_tensors(cache, [
                (torch.cat([padded_left(old_keys, length, 2), padded_left(keys, length, 2)]),
                 torch.cat([padded_left(old_values, length, 2), padded_left(values, length, 2)]))
                for (old_keys, old_values), (keys, values) in zip(cache_tensors(self.cache), cache_tensors(cache))
            ])
            attention_mask = torch.cat([padded_left(self.attention_mask, length, 1), padded_left(attention_mask, length, 1)])
            positions = torch.cat([self.positions, positions])
            logits = torch.cat([self.logits, logits])
        for request in requests:
            request.logits_version = self.version
        self.rows = self.rows + requests
        self.cache, self.attention_mask, self.positions, self.logits = cache, attention_mask, positions, logits

    @torch.no_grad()
    def step(self, shared_generator: torch.Generator) -> list[TokenRequest]:
        """Sample one token per row, drop the rows that ended (returned, in row order) and run the
        decoding step of the others."""
        sampling = self.rows[0].sampling
        tokens, log_probs = choose_per_row(self.logits, sampling, [row.stream_key for row in self.rows],
                                           [len(row.token_ids) for row in self.rows], shared_generator)
        kept, finished = [], []
        for index, (row, token, log_prob) in enumerate(zip(self.rows, tokens.tolist(), log_probs.tolist())):
            row.token_ids.append(token)
            row.log_probs.append(log_prob)
            row.versions.append(row.logits_version)
            if token in row.stop_token_ids or len(row.token_ids) >= row.sampling.max_new_tokens:
                finished.append(row)
            else:
                kept.append(index)
        if finished:
            self.keep(kept)
            tokens = tokens[kept] if kept else tokens[:0]
        if self.rows:
            self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(self.rows), 1)], dim=1)
            self.positions = self.positions + 1
            output = self.model(input_ids=tokens[:, None], attention_mask=self.attention_mask, position_ids=self.positions,
                                past_key_values=self.cache, use_cache=True)
            self.logits = output.logits[:, -1, :]
            for row in self.rows:
                row.logits_version = self.version
        return finished

    @torch.no_grad()
    def continue_with(self, version: int, mode: str) -> None:
        """Go on with new weights (``version``) at this token boundary. ``keep``: the cache stays (the tokens
        so far were fed to the old weights); only the last fed token goes through the new weights again, so
        every token sampled from now on comes from them. ``recompute``: the cache is rebuilt from each row's
        prompt and its tokens so far with the new weights, as a fresh generation from that prefix would
        build it."""
        if mode not in ("keep", "recompute"):
            raise ValueError(f"continue mode must be keep or recompute, got {mode!r}")
        self.version = version
        if not self.rows:
            return
        if mode == "recompute":
            rows, self.rows = self.rows, []
            self.cache = self.attention_mask = self.positions = self.logits = None
            prefixes = [TokenRequest(row.prompt_ids + row.token_ids, row.sampling, row.stop_token_ids) for row in rows]
            self.admit(prefixes)
            self.rows = rows
        else:
            last = torch.tensor([[row.last_fed()] for row in self.rows], dtype=torch.long, device=self.device)
            replace_cache_tensors(self.cache, [(keys[:, :, :-1], values[:, :, :-1]) for keys, values in cache_tensors(self.cache)])
            output = self.model(input_ids=last, attention_mask=self.attention_mask, position_ids=self.positions,
                                past_key_values=self.cache, use_cache=True)
            self.logits = output.logits[:, -1, :]
        for row in self.rows:
            row.logits_version = version

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows, and drop the cache columns that are padding in all of them."""
        self.rows = [self.rows[index] for index in indices]
        if not self.rows:
            self.cache = self.attention_mask = self.positions = self.logits = None
            return
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        start = self.attention_mask.shape[1] - max(row.cached_length() for row in self.rows)
        replace_cache_tensors(self.cache, [(keys[index, :, start:], values[index, :, start:])
                                           for keys, values in cache_tensors(self.cache)])
        self.attention_mask = self.attention_mask[index, start:]
        self.positions, self.logits = self.positions[index], self.logits[index]


class TokenBatcher:
    """The queue of ``generate_tokens`` requests and the worker thread that serves them for one engine.

    :meth:`submit` queues a request; :meth:`start` makes sure a worker runs (an asyncio caller schedules
    it with ``loop.call_soon``, so the requests queued in the same event-loop iteration start together).
    The worker admits queued requests at every step boundary, up to ``max_rows`` rows, those with the
    running batch's sampling settings, first come first served; once a request with other settings is
    the oldest waiting, nothing more joins until the batch has drained, so no setting waits forever.
    Every model call holds ``engine.model_lock`` and checks ``engine.check_ready()`` first; an error in a
    prefill fails the requests being admitted, an error in a decoding step fails every row of the batch.
    """

    def __init__(self, engine: "HFRollout", max_rows: int):
        self.engine, self.max_rows = engine, max_rows
        self.lock = threading.Lock()
        self.pending: collections.deque[TokenRequest] = collections.deque()
        self.worker: threading.Thread | None = None
        self.boundary = threading.Condition(self.lock)
        self.held = False
        """While True (:meth:`hold`), the worker waits at its next token boundary."""
        self.waiting = False
        """Whether the worker waits at a boundary now."""
        self.aborting = False
        """Set by :meth:`abort`: at its next boundary the worker ends every request with what it has."""

    def hold(self) -> None:
        """Stop at the next token boundary: returns once no model call of the batcher runs and none will
        start until :meth:`release` (sequences in flight keep their state)."""
        with self.lock:
            self.held = True
            while self.worker is not None and not self.waiting:
                self.boundary.wait()

    def abort(self) -> None:
        """End every request queued or in flight at the next token boundary: each gets the tokens it has,
        ``finish_reason="abort"``. Requests submitted afterwards are served as usual."""
        with self.lock:
            if self.worker is None:  # nothing decoding: only requests not yet started
                waiting = list(self.pending)
                self.pending.clear()
            else:
                self.aborting, waiting = True, []
        deliver([(request, request.output(aborted=True)) for request in waiting])

    def release(self) -> None:
        with self.lock:
            self.held = False
            self.boundary.notify_all()

    def submit(self, request: TokenRequest) -> None:
        with self.lock:
            self.pending.append(request)

    def start(self) -> None:
        with self.lock:
            if self.worker is None and self.pending:
                threads = torch.get_num_threads()  # the starting thread's: OpenMP counts threads per thread
                self.worker = threading.Thread(target=self.serve, args=(threads,), name="hf-rollout-token-batcher", daemon=True)
                self.worker.start()

    def take(self, batch: RunningBatch | None) -> list[TokenRequest]:
        """Under ``lock``: the queued requests to admit now (cancelled ones are dropped)."""
        running = batch is not None and bool(batch.rows)
        room = self.max_rows - (len(batch.rows) if running else 0)
        taken: list[TokenRequest] = []
        key = batch.key if running else None
        while self.pending and len(taken) < room:
            request = self.pending[0]
            if request.waiter is not None and request.waiter.cancelled():
                self.pending.popleft()
                continue
            if key is None:
                key = request.key
            if request.key != key:
                break
            taken.append(self.pending.popleft())
        return taken

    def serve(self, threads: int | None = None) -> None:
        if threads is not None:
            follow_threads(threads)
        batch: RunningBatch | None = None
        try:
            while True:
                with self.lock:
                    while self.held:
                        self.waiting = True
                        self.boundary.notify_all()
                        self.boundary.wait()
                    self.waiting = False
                    if self.aborting:
                        ended = list(self.pending) + (batch.rows if batch is not None else [])
                        self.pending.clear()
                        self.aborting, batch = False, None
                        deliver([(request, request.output(aborted=True)) for request in ended])
                    admitted = self.take(batch)
                    if not admitted and (batch is None or not batch.rows):
                        self.worker = None
                        return
                batch = self.serve_step(batch, admitted)
        except BaseException as error:  # a fault of the batcher itself: every caller gets it, none waits forever
            with self.lock:
                waiting = list(self.pending)
                self.pending.clear()
                self.worker = None
            fail(waiting + (batch.rows if batch is not None else []), error)

    def serve_step(self, batch: RunningBatch | None, admitted: list[TokenRequest]) -> RunningBatch | None:
        """Admit ``admitted`` into ``batch`` (a new one when it has no rows), then one decoding step."""
        engine = self.engine
        if batch is not None and batch.rows and batch.version != engine.weights_version:
            try:  # new weights since the last step: the sequences in flight go on per the engine's mode
                with engine.model_lock:
                    engine.check_ready()
                    batch.continue_with(engine.weights_version, engine.continue_mode)
            except BaseException as error:
                fail(batch.rows, error)
                batch = None
        if admitted:
            if batch is None or not batch.rows:
                batch = RunningBatch(engine.model, engine.device, engine.pad_token_id, admitted[0].key,
                                     engine.weights_version)
            try:
                with engine.model_lock:
                    engine.check_ready()
                    batch.admit(admitted)
            except BaseException as error:
                fail(admitted, error)
        if batch is None or not batch.rows:
            return batch
        try:
            with engine.model_lock:
                engine.check_ready()
                finished = batch.step(engine.generator)
        except BaseException as error:
            fail(batch.rows, error)
            return None
        deliver([(row, row.output()) for row in finished])
        return batch


def fail(requests: list[TokenRequest], error: BaseException) -> None:
    deliver([(request, error) for request in requests])


def deliver(outcomes: list[tuple[TokenRequest, Union[TokenOutput, BaseException]]]) -> None:
    """Hand each request its result or error: one ``call_soon_threadsafe`` per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for request, outcome in outcomes:
        if request.waiter is not None:
            by_loop.setdefault(request.loop, []).append((request.waiter, outcome))
    for loop, settled in by_loop.items():
        try:
            loop.call_soon_threadsafe(settle, settled)
        except RuntimeError:  # the loop is closed: nobody waits there any more
            pass


def settle(settled: list[tuple[asyncio.Future, Union[TokenOutput, BaseException]]]) -> None:
    """In the callers' event loop: set every future still waiting (a cancelled caller's is done)."""
    for waiter, outcome in settled:
        if waiter.done():
            continue
        if isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)
