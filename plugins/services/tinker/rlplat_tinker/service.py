"""The service's state and calls, apart from HTTP: sessions, training clients (models), sampler snapshots and
sampling sessions, each owned by the API key that made it; futures for every long call.

Every call that touches the workers runs on one thread, in the order the requests arrived: the SDK submits a
client's training calls one at a time in ``seq_id`` order, so each client's calls run in its program order
and clients interleave call by call (each call puts its client's state in place: :mod:`rlplat_tinker.worker`).
A future's result is JSON (a dict) or protobuf bytes; a refused call's result is an error with its category.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rlplat.contracts.rollout import SamplingParams
from rlplat_tinker import datums as datum_rows
from rlplat_tinker import wire
from rlplat_tinker.losses import LOSSES, RequestError, TinkerLoss

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
#: The most samples one request asks for (``num_samples``).
MAX_SAMPLES = 1024


def sequence_number(body: dict, key: str) -> int:
    """The request's ``key`` (``model_seq_id``, ``sampling_session_seq_id``): an integer >= 0, 0 when absent. It
    becomes part of ids and of the saved states' folder names, so nothing else is taken."""
    value = body.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"{key} must be an integer >= 0, got {value!r}")
    return value
GATHER_QUIET_S, GATHER_MAX_S = 0.003, 0.05
LORA_ALPHA = 32.0  # the adapter scale Tinker's LoRA clients get
ATTENTION, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass
class Model:
    owner: str
    session: str
    lora: dict[str, Any]
    rank: int
    info: dict[str, Any]


def lora_of(config: Any) -> tuple[dict[str, Any], int]:
    """rlplat's ``lora`` node for a Tinker ``lora_config`` (rank, train_attn, train_mlp; the output layer is never
    adapted: train_unembed has no effect here)."""
    config = dict(config or {})
    rank = config.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise RequestError(f"lora_config.rank must be an integer >= 1, got {rank!r}")
    attention, mlp = bool(config.get("train_attn", True)), bool(config.get("train_mlp", True))
    if not (attention or mlp):
        raise RequestError("lora_config: train_attn and train_mlp are both false: no layer would be trained")
    targets = ["all-linear"] if attention and mlp else (ATTENTION if attention else MLP)
    return {"rank": rank, "alpha": LORA_ALPHA, "target_modules": targets}, rank


def adam_settings(params: Any) -> dict[str, Any]:
    """An ``optim_step``'s ``adam_params`` as the engine's step settings (``grad_clip_norm`` 0: no clipping)."""
    if not isinstance(params, dict):
        raise RequestError("optim_step needs adam_params (this service runs AdamW only)")
    known = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"}
    unknown = sorted(set(params) - known - {"type"})
    if unknown:
        raise RequestError(f"adam_params: unknown key(s) {', '.join(unknown)}")
    clip = params.get("grad_clip_norm", 0.0)
    settings = {"lr": params.get("learning_rate", 1e-4), "betas": [params.get("beta1", 0.9), params.get("beta2", 0.95)],
                "eps": params.get("eps", 1e-12), "weight_decay": params.get("weight_decay", 0.0), "grad_clip": clip or None}
    from rlplat.kits.engine import check_optimizer_settings

    try:
        return check_optimizer_settings(settings)
    except ValueError as error:
        raise RequestError(f"adam_params: {error}") from None


@dataclasses.dataclass
class PendingSample:
    snapshot: str
    prompt: list[int]
    sampling: SamplingParams
    prompt_logprobs: bool
    future: concurrent.futures.Future


class Futures:
    """Request ids and their results; every call runs on one thread in arrival order. The newest ``KEPT`` finished
    results are kept for polls that come again (a client's retry); older finished ones are dropped."""

    KEPT = 512  # a forward_backward result holds every datum's log-probs: bounded memory

    def __init__(self):
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlplat-serve")
        self.results: dict[str, tuple[str, concurrent.futures.Future]] = {}
        self.ids = itertools.count(1)
        self.lock = threading.Lock()

    def submit(self, owner: str, call: Callable[[], Any]) -> str:
        return self.add(owner, self.executor.submit(call))

    def get(self, owner: str, request_id: str) -> concurrent.futures.Future:
        entry = self.results.get(request_id)
        if entry is None or entry[0] != owner:
            raise RequestError(f"no request {request_id!r}", status=404)
        return entry[1]

    def add(self, owner: str, future: concurrent.futures.Future) -> str:
        """A request id for a future resolved elsewhere."""
        with self.lock:
            request_id = f"req-{next(self.ids)}"
            self.results[request_id] = (owner, future)
            if len(self.results) > self.KEPT:
                finished = [key for key, (_, held) in self.results.items() if held.done()]
                for key in finished[: len(self.results) - self.KEPT]:
                    del self.results[key]
        return request_id

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


class TinkerService:
    """See the module docstring. ``group``: a worker group of :class:`~rlplat_tinker.worker.TinkerWorker`."""

    def __init__(self, group: Any, base_model: str, state_dir: Path, tokenizer_dir: Optional[str], pad_token_id: int,
                 eos_token_ids: tuple[int, ...] = (), max_snapshots: int = 8):
        self.group, self.base_model, self.state_dir = group, base_model, Path(state_dir)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context: Optional[int] = None  # the model's max_position_embeddings, once the first client is built
        self.vocab_size: Optional[int] = None  # likewise its vocabulary
        self.tokenizer_dir, self.pad_token_id, self.max_snapshots = tokenizer_dir, pad_token_id, max_snapshots
        self.futures = Futures()
        self.sessions: dict[str, str] = {}  # session -> owner
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, tuple[str, str]] = {}  # sampling session -> (owner, snapshot)
        self.snapshots: dict[str, str] = {}  # snapshot -> owner, oldest first
        self.counter = itertools.count(1)
        self.lock = threading.Lock()
        self.pending: list[PendingSample] = []  # sample requests not yet drained (drain_samples)

    # -- sessions and models ----------------------------------------------------------------------------------

    def create_session(self, owner: str) -> str:
        with self.lock:  # unique across restarts: saved states outlive the service under --state-dir
            session = f"session-{next(self.counter)}-{uuid.uuid4().hex[:8]}"
            self.sessions[session] = owner
        return session

    def check_session(self, owner: str, session: Any) -> str:
        if self.sessions.get(session) != owner:
            raise RequestError(f"no session {session!r}", status=404)
        return session

    def model(self, owner: str, model_id: Any) -> Model:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise RequestError(f"no training client {model_id!r}", status=404)
        return model

    def create_model(self, owner: str, body: dict) -> str:
        session = self.check_session(owner, body.get("session_id"))
        base = body.get("base_model")
        if base is not None and base != self.base_model:
            raise RequestError(f"base_model {base!r} is not served here; this service trains {self.base_model!r}")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise RequestError(f"optimizer_config type {optimizer!r}: this service runs adamw only")
        lora, rank = lora_of(body.get("lora_config") or {"rank": 32})
        return self.futures.submit(owner, self.creation(owner, session, sequence_number(body, "model_seq_id"), lora, rank))

    def creation(self, owner: str, session: str, sequence: int, lora: dict, rank: int) -> Callable[[], dict]:
        """The call that builds client ``<session>:train:<sequence>`` in the workers and registers it."""
        model_id = f"{session}:train:{sequence}"
        if model_id in self.models:
            raise RequestError(f"training client {model_id!r} exists already")  # 400: the SDK retries a 409 for minutes

        def create() -> dict:
            info = self.group.create(model_id, lora)[0]
            self.models[model_id] = Model(owner, session, lora, rank, info)
            self.max_context = info.get("max_position_embeddings")
            self.vocab_size = int(info.get("vocab_size") or 0) or None
            return {"model_id": model_id, "type": "create_model"}

        return create

    def get_info(self, owner: str, model_id: Any) -> dict:
        model = self.model(owner, model_id)
        return {"model_id": model_id, "is_lora": True, "lora_rank": model.rank, "optimizer_config": {"type": "adamw"},
                "model_data": {"model_name": self.base_model, "arch": model.info.get("model_type"), "tokenizer_id": self.tokenizer_dir},
                "type": "get_info"}

    def unload(self, owner: str, model_id: Any) -> str:
        self.model(owner, model_id)

        def unload() -> dict:
            self.group.unload(model_id)
            self.models.pop(model_id, None)
            return {"model_id": model_id, "type": "unload_model"}

        return self.futures.submit(owner, unload)

    # -- training --------------------------------------------------------------------------------------------

    def forward_backward(self, owner: str, request: dict) -> str:
        model = self.model(owner, request["model_id"])
        loss_name, forward_only, data = request["loss_fn"], request["forward_only"], request["data"]
        loss = TinkerLoss(loss_name, {key: value for key, value in request["loss_fn_config"].items()}) if not forward_only else None
        if forward_only and loss_name and loss_name not in LOSSES:
            raise RequestError(f"unknown loss_fn {loss_name!r}; this service has {', '.join(LOSSES)}")
        datum_rows.check_datums(data, None if forward_only else loss_name, model.info["vocab_size"], model.info.get("max_position_embeddings"))
        if forward_only and not datum_rows.shifted(data):
            raise RequestError("forward: each datum's target_tokens must be its next input tokens (target_tokens[i] = "
                               "model_input[i + 1]); forward_backward takes any targets")
        batch = datum_rows.rows_of(data, self.pad_token_id)
        model_id = request["model_id"]

        def run() -> bytes:
            if forward_only:
                log_probs = self.group.forward(model_id, batch).batch["log_probs"]
                return wire.forward_backward_output(datum_rows.logprobs_of(log_probs, data), {})
            output = self.group.forward_backward(model_id, batch, loss)
            metrics = {key: first(value) for key, value in output.meta_info["metrics"].items()}
            return wire.forward_backward_output(datum_rows.logprobs_of(output.batch["gathered_log_probs"][..., 0], data),
                                                {key: metrics[key] for key in ("loss:sum", "num_tokens:sum") if key in metrics})

        return self.futures.submit(owner, run)

    def optim_step(self, owner: str, body: dict) -> str:
        model_id = body.get("model_id")
        self.model(owner, model_id)
        if body.get("optimizer_params") is not None:
            raise RequestError("optim_step: this service runs AdamW; send adam_params")
        settings = adam_settings(body.get("adam_params"))

        def run() -> dict:
            metrics = self.group.optimizer_step(model_id, settings)[0]
            return {"metrics": {"grad_norm:mean": metrics["grad_norm"], "lr:mean": metrics["lr"],
                                "skipped_step:sum": metrics["skipped_step"]}, "type": "optim_step"}

        return self.futures.submit(owner, run)

    # -- saved states ------------------------------------------------------------------------------------------

    def state_path(self, model_id: str, name: str) -> Path:
        """``<state dir>/<model id>/weights/<name>``; refused where it would lead out of the state dir."""
        if not isinstance(model_id, str) or not isinstance(name, str):
            raise RequestError(f"no saved state for {model_id!r}/{name!r}", status=404)
        root = self.state_dir.resolve()
        path = root / model_id.replace(":", "_") / "weights" / name
        if not path.resolve().is_relative_to(root) or ".." in Path(model_id).parts:
            raise RequestError(f"no saved state for {model_id!r}/{name!r}", status=404)
        return path

    def save_state(self, owner: str, body: dict) -> str:
        model_id, name = body.get("model_id"), body.get("path")
        self.model(owner, model_id)
        if not isinstance(name, str) or not NAME.match(name):
            raise RequestError(f"save_weights: path {name!r} must be a name of letters, digits, '_', '-' and '.'")
        target = self.state_path(model_id, name)
        if target.exists() and not body.get("overwrite", False):
            raise RequestError(f"a state named {name!r} exists for {model_id}; pass overwrite=True to replace it")

        def run() -> dict:
            partial = target.with_name(f".{name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.parent.mkdir(parents=True, exist_ok=True)
            self.group.save_state(model_id, str(partial))
            (partial / "OWNER").write_text(owner)
            (partial / "LORA.json").write_text(json.dumps({"rank": self.models[model_id].rank, "lora": self.models[model_id].lora}))
            if target.exists():
                shutil.rmtree(target)
            partial.rename(target)  # complete or absent: a failed save leaves the previous state as it was
            return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}

        return self.futures.submit(owner, run)

    def saved_state(self, owner: str, path: Any) -> Path:
        match = re.match(r"^tinker://([^/]+)/weights/([^/]+)$", path or "")
        if not match:
            raise RequestError(f"load_weights: path {path!r} is not tinker://<model_id>/weights/<name>")
        folder = self.state_path(match.group(1), match.group(2))
        if not (folder / "OWNER").is_file() or (folder / "OWNER").read_text() != owner:
            raise RequestError(f"no saved state {path}", status=404)
        return folder

    def load_state(self, owner: str, body: dict) -> str:
        folder = self.saved_state(owner, body.get("path"))
        with_optimizer = bool(body.get("optimizer", False))
        if body.get("model_id") is None:  # create_training_client_from_state: a new client, then the load
            session = self.check_session(owner, body.get("session_id"))
            saved = json.loads((folder / "LORA.json").read_text())  # the client is built in the saved one's shape
            sequence = sequence_number(body, "model_seq_id")
            model_id = f"{session}:train:{sequence}"
            self.futures.submit(owner, self.creation(owner, session, sequence, saved["lora"], saved["rank"]))
        else:
            model_id = body["model_id"]
            self.model(owner, model_id)

        def run() -> dict:
            self.group.load_state(model_id, str(folder), with_optimizer)
            return {"path": body.get("path"), "model_id": model_id, "type": "load_weights"}

        return self.futures.submit(owner, run)

    # -- sampling ----------------------------------------------------------------------------------------------

    def save_for_sampler(self, owner: str, body: dict) -> str:
        model_id = body.get("model_id")
        self.model(owner, model_id)
        name = body.get("path")
        if name is not None and (not isinstance(name, str) or not NAME.match(name)):
            raise RequestError(f"save_weights_for_sampler: path {name!r} must be a name of letters, digits, '_', '-' and '.'")
        if name is None:
            session = self.models[model_id].session
            sampler = f"{session}:sample:{sequence_number(body, 'sampling_session_seq_id')}"
            snapshot = f"tinker://{model_id}/sampler_weights/{sampler.replace(':', '_')}"
        else:
            sampler, snapshot = None, f"tinker://{model_id}/sampler_weights/{name}"

        def run() -> dict:
            self.group.snapshot(model_id, snapshot)
            with self.lock:
                self.snapshots.pop(snapshot, None)
                self.snapshots[snapshot] = owner
                if sampler is not None:
                    self.samplers[sampler] = (owner, snapshot)
                self.evict()
            return {"path": snapshot, "type": "save_weights_for_sampler"} if sampler is None else \
                {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}

        return self.futures.submit(owner, run)

    def evict(self) -> None:
        """Keep the newest ``max_snapshots`` sampler snapshots (the weights of each are held in memory)."""
        while len(self.snapshots) > self.max_snapshots:
            oldest = next(iter(self.snapshots))
            self.snapshots.pop(oldest)
            self.group.drop_snapshot(oldest)

    def create_sampling_session(self, owner: str, body: dict) -> dict:
        session = self.check_session(owner, body.get("session_id"))
        path = body.get("model_path")
        if self.snapshots.get(path) != owner:
            raise RequestError(f"no sampler weights {path!r} (saved with save_weights_for_sampler; the service keeps the newest "
                               f"{self.max_snapshots})", status=404)
        sampler = f"{session}:sample:{sequence_number(body, 'sampling_session_seq_id')}"
        self.samplers[sampler] = (owner, path)
        return {"sampling_session_id": sampler, "type": "create_sampling_session"}

    def sampler(self, owner: str, sampler_id: Any) -> dict:
        entry = self.samplers.get(sampler_id)
        if entry is None or entry[0] != owner:
            raise RequestError(f"no sampling session {sampler_id!r}", status=404)
        return {"sampler_id": sampler_id, "base_model": self.base_model, "model_path": entry[1]}

    def sample(self, owner: str, body: dict) -> tuple[str, list[str]]:
        entry = self.samplers.get(body.get("sampling_session_id"))
        if entry is None or entry[0] != owner:
            raise RequestError(f"no sampling session {body.get('sampling_session_id')!r}: sample from a client that "
                               "save_weights_and_get_sampling_client or create_sampling_client made", status=404)
        snapshot = entry[1]
        prompt = self.prompt_tokens(body.get("prompt"))
        count = body.get("num_samples", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SAMPLES:
            raise RequestError(f"num_samples must be an integer from 1 to {MAX_SAMPLES}, got {count!r}")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object")
        sampling = sampling_params(params, count)
        if self.max_context and len(prompt) + sampling.max_new_tokens > self.max_context:
            raise RequestError(f"the prompt's {len(prompt)} tokens and max_tokens {sampling.max_new_tokens} exceed the model's "
                               f"context of {self.max_context} positions")
        with_prompt_logprobs = bool(body.get("prompt_logprobs"))
        if body.get("topk_prompt_logprobs") or body.get("topk_sample_logprobs") or body.get("prompt_alt_tokens_k") or \
                body.get("target_prompt_logprobs") is not None:
            raise RequestError("top-k log-probs, target prompt log-probs and alternative tokens are not served")

        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.pending.append(PendingSample(snapshot, prompt, sampling, with_prompt_logprobs, future))
        self.futures.submit(owner, self.drain_samples)
        return self.futures.add(owner, future), [f"seq-{index}" for index in range(count)]

    def prompt_tokens(self, prompt: Any) -> list[int]:
        """A ``ModelInput``'s token ids: encoded_text chunks of integers within the vocabulary."""
        chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
        if not isinstance(chunks, list):
            raise RequestError("prompt must be a ModelInput: an object with a list of chunks")
        tokens: list[int] = []
        for chunk in chunks:
            if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
                raise RequestError(f"prompt: only encoded_text chunks are served, got {chunk.get('type') if isinstance(chunk, dict) else chunk!r}")
            given = chunk.get("tokens", [])
            if not isinstance(given, list) or any(isinstance(token, bool) or not isinstance(token, int) for token in given):
                raise RequestError("prompt: a chunk's tokens must be a list of integers")
            tokens.extend(given)
        if not tokens:
            raise RequestError("prompt has no tokens")
        outside = [token for token in tokens if token < 0 or (self.vocab_size and token >= self.vocab_size)]
        if outside:
            raise RequestError(f"prompt: token ids {outside[:5]} are outside the vocabulary (0 to {(self.vocab_size or 0) - 1})")
        return tokens

    def drain_samples(self) -> None:
        """Every sample request waiting, in batches: requests without a seed that share sampler weights and
        settings are one ``generate`` call (a seeded request is sampled alone, so its seed draws what the rollout
        draws for its prompt alone). A client sends a batch's requests one by one: the drain waits while more keep
        arriving (``GATHER_QUIET_S`` apart, ``GATHER_MAX_S`` at most)."""
        deadline = time.monotonic() + GATHER_MAX_S
        while time.monotonic() < deadline:
            waiting = len(self.pending)
            time.sleep(GATHER_QUIET_S)
            if len(self.pending) == waiting:
                break
        with self.lock:
            pending, self.pending = self.pending, []
        groups: dict[Any, list[PendingSample]] = {}
        for entry in pending:
            key = (entry.snapshot, entry.sampling) if entry.sampling.seed is None else id(entry)
            groups.setdefault(key, []).append(entry)
        for entries in groups.values():
            try:
                results = self.sample_batch(entries)
            except BaseException as error:
                for entry in entries:
                    entry.future.set_exception(error)
            else:
                for entry, result in zip(entries, results):
                    entry.future.set_result(result)

    def sample_batch(self, entries: list["PendingSample"]) -> list[bytes]:
        snapshot, sampling = entries[0].snapshot, entries[0].sampling
        if snapshot not in self.snapshots:
            raise RequestError(f"the sampler weights {snapshot} were dropped (the service keeps the newest {self.max_snapshots})")
        output = self.group.sample(snapshot, [entry.prompt for entry in entries], sampling)[0]
        stops = set(sampling.stop_token_ids) | set(self.eos_token_ids)
        results = []
        for index, entry in enumerate(entries):
            sequences = []
            for row in range(index * sampling.n, (index + 1) * sampling.n):
                length = int(output.batch["response_mask"][row].sum())
                tokens = output.batch["responses"][row, :length].tolist()
                logprobs = output.batch["rollout_log_probs"][row, :length].tolist()
                sequences.append((tokens, logprobs, "stop" if tokens and tokens[-1] in stops else "length"))
            prompt_logprobs = None
            if entry.prompt_logprobs:
                prompt_logprobs = [None, *self.group.score(snapshot, entry.prompt)[0]] if len(entry.prompt) > 1 else [None]
            results.append(wire.sample_response(sequences, prompt_logprobs))
        return results

    def shutdown(self) -> None:
        self.futures.shutdown()


def first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def sampling_params(params: dict, count: int) -> SamplingParams:
    """Tinker's ``SamplingParams`` as rlplat's: temperature 0 is greedy, top_k -1 none; ``stop`` token ids add to the
    model's end-of-sequence tokens (``stop`` strings are not served: pass token ids)."""
    stop = params.get("stop")
    if isinstance(stop, str) or (isinstance(stop, list) and any(not isinstance(item, int) for item in stop)):
        raise RequestError("sampling_params.stop: stop strings are not served; pass the stop sequences' token ids")
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        raise RequestError("sampling_params.max_tokens is required")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"sampling_params.max_tokens must be an integer >= 1, got {max_tokens!r}")
    try:
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1))
        return SamplingParams(n=count, temperature=temperature if temperature > 0 else 1.0, greedy=temperature <= 0,
                              top_p=float(params.get("top_p", 1.0)), top_k=0 if top_k < 0 else top_k, max_new_tokens=int(max_tokens),
                              stop_token_ids=tuple(stop or ()), seed=params.get("seed"))
    except (TypeError, ValueError) as error:
        raise RequestError(f"sampling_params: {error}") from None
