"""The thread that drives a ``vllm.LLM``'s engine for ``generate_tokens`` requests one engine step at a time
(``LLMEngine.add_request`` / ``LLMEngine.step``, outputs as deltas), so that generations in flight can stop at a
token boundary for a weight update, go on with the new weights, record the weights version of every token, and
be aborted with the tokens they have.

Two engine layouts, told apart by ``in_process``:

- vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, async scheduling off): a step is one
  forward pass and returns its tokens; between steps nothing runs, so a pause is the loop not stepping. Each
  token is numbered with the version in effect when its step began; an abort takes what each request has and
  drops the requests (``LLMEngine.abort_request``).
- vLLM's engine core in a process of its own: it steps by itself, ahead of the outputs read here. A pause is
  vLLM's scheduler pause that keeps requests and their KV cache (``LLM.sleep(level=0, mode="keep")``, undone by
  ``LLM.wake_up(tags=["scheduling"])``); versions are vLLM's own labels (``set_weight_version``), which it
  records per token as the ``weight_versions`` spans of each final output; an abort is vLLM's pause in
  ``abort`` mode, which ends every request with a final output of the tokens it has.

Carrying requests over new weights: ``keep`` does nothing to them (their KV cache stays, every token sampled
from then on comes from the new weights); ``recompute`` preempts them with
``reset_prefix_cache(reset_running_requests=True)``, and vLLM rebuilds a preempted request's KV cache from its
prompt and its tokens so far, with the new weights, before it samples again (a seeded request keeps its random
stream: with unchanged weights the tokens are those of an uninterrupted generation).

A batch ``LLM.generate`` runs the engine until no request is left in it, those of this loop included, so it
gets the engine to itself (:meth:`TokenLoop.engine_to_itself`): the loop admits nothing while one waits, and it
starts once the loop's requests in flight have ended.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Iterator, Sequence

import torch

from rlplat.contracts.rollout import TokenOutput
from rlplat.controller.host import follow_threads
from rlplat_rollout_vllm.translate import token_finish_reason, versions_from_spans


@dataclasses.dataclass
class TokenRequest:
    """One ``generate_tokens`` call: what vLLM is given, and what it has returned so far."""

    request_id: str
    prompt: Any
    """vLLM's engine input (token ids, cache salt)."""
    params: Any
    """``vllm.SamplingParams`` with ``output_kind`` DELTA."""
    stop_token_ids: frozenset[int]
    max_new_tokens: int
    adapter: Any
    """The ``LoRARequest`` served with this request, or None."""
    future: Future = dataclasses.field(default_factory=Future)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)

    def output(self, reported: str | None, spans: Any = None, from_spans: bool = False) -> TokenOutput:
        """The call's answer: its tokens, their log-probs, their versions (vLLM's spans when ``from_spans``, else
        those numbered here) and the finish reason, ``"abort"`` included."""
        versions = versions_from_spans(spans, len(self.token_ids)) if from_spans else list(self.versions)
        reason = token_finish_reason(self.token_ids, self.stop_token_ids, self.max_new_tokens, reported)
        return TokenOutput(list(self.token_ids), list(self.log_probs), reason, versions=versions)


def settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Hand a caller its answer, unless it gave up waiting (a call cancelled, also while this runs)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class TokenLoop:
    """The queue of ``generate_tokens`` requests of one ``vllm.LLM`` and the thread that steps the engine for
    them (see the module docstring). ``lock`` serialises every call into the ``LLM`` (it is not thread safe);
    the loop holds it for one admission and one step at a time."""

    def __init__(self, llm: Any, lock: threading.Lock, in_process: bool):
        self.llm, self.lock, self.in_process = llm, lock, in_process
        self.condition = threading.Condition()
        self.pending: collections.deque[TokenRequest] = collections.deque()
        self.running: dict[str, TokenRequest] = {}
        self.worker: threading.Thread | None = None
        self.version = 0
        """The weights version numbered on tokens of the steps that start from now (in-process layout)."""
        self.stepping = False
        """Whether a step (with its admissions) runs now."""
        self.held = False
        """:meth:`pause`: no step starts, nothing is admitted, until :meth:`resume`."""
        self.closed = False
        """:meth:`drain`: nothing is admitted until :meth:`resume`; requests in flight go on to their end."""
        self.barriers = 0
        """Callers that need the loop between steps for a moment (:meth:`between_steps`)."""
        self.exclusive_waiting = 0
        self.exclusive_running = 0
        self.engine_paused = False
        """Whether vLLM's own scheduler is paused (engine core in its own process)."""

    # -- requests --------------------------------------------------------------------------------------------

    def submit(self, request: TokenRequest) -> Future:
        """Queue a request; it is admitted at the next step boundary the loop may admit at."""
        with self.condition:
            self.pending.append(request)
            if self.worker is None:
                threads = torch.get_num_threads()  # the submitting thread's: the loop's kernels use as many
                self.worker = threading.Thread(target=self.serve, args=(threads,), name="vllm-rollout-token-loop", daemon=True)
                self.worker.start()
            self.condition.notify_all()
        return request.future

    def may_admit(self) -> bool:
        return not (self.held or self.closed or self.exclusive_waiting or self.exclusive_running or self.barriers)

    def may_step(self) -> bool:
        if self.held or self.barriers or self.exclusive_running:
            return False
        return bool(self.running) or (bool(self.pending) and self.may_admit())

    def serve(self, threads: int | None = None) -> None:
        if threads is not None:
            follow_threads(threads)  # OpenMP counts threads per thread: a new one starts from the default
        while True:
            with self.condition:
                while not self.may_step():
                    if not self.running and not self.pending:
                        self.worker = None
                        self.condition.notify_all()
                        return
                    self.condition.wait()
                admitted = []
                if self.may_admit():
                    while self.pending:
                        request = self.pending.popleft()
                        if not request.future.cancelled():
                            admitted.append(request)
                self.stepping = True
                version = self.version
            outputs, failure = [], None
            try:
                with self.lock:
                    for request in admitted:
                        try:
                            self.llm.llm_engine.add_request(request.request_id, request.prompt, request.params,
                                                            lora_request=request.adapter)
                        except Exception as error:  # vLLM refused this request (a prompt too long, say): its caller is told
                            settle(request.future, error=error)
                            continue
                        with self.condition:
                            self.running[request.request_id] = request
                    if self.running:
                        outputs = self.llm.llm_engine.step()
            except BaseException as error:  # the engine failed: every caller gets the error, none waits forever
                failure = error
            with self.condition:
                self.stepping = False
                if failure is not None:
                    failed = list(self.running.values())
                    self.running.clear()
                    for request in failed:
                        settle(request.future, error=failure)
                else:
                    self.dispatch(outputs, version)
                self.condition.notify_all()

    def dispatch(self, outputs: Sequence[Any], version: int) -> None:
        """Under ``condition``: add one step's delta outputs to their requests, numbered ``version``, and answer
        the requests that ended."""
        for output in outputs:
            request = self.running.get(output.request_id)
            if request is None:
                continue
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = completion.logprobs
            if tokens and (logprobs is None or len(logprobs) != len(tokens)):
                error = RuntimeError(f"vllm returned {0 if logprobs is None else len(logprobs)} log-prob entries for "
                                     f"{len(tokens)} tokens; the rollout asks for logprobs=0 on every request")
                del self.running[request.request_id]
                settle(request.future, error=error)
                continue
            request.token_ids += tokens
            request.log_probs += [float(position[token].logprob) for token, position in zip(tokens, logprobs or ())]
            request.versions += [version] * len(tokens)
            if output.finished:
                del self.running[request.request_id]
                try:
                    answer = request.output(completion.finish_reason, completion.weight_versions, from_spans=not self.in_process)
                except BaseException as error:
                    settle(request.future, error=error)
                else:
                    settle(request.future, answer)

    # -- the engine between steps -------------------------------------------------------------------------

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """The block runs with no step of the loop running or starting (it waits for the current one to end)."""
        with self.condition:
            self.barriers += 1
            while self.stepping:
                self.condition.wait()
        try:
            yield
        finally:
            with self.condition:
                self.barriers -= 1
                self.condition.notify_all()

    @contextlib.contextmanager
    def engine_to_itself(self) -> Iterator[None]:
        """For a batch ``LLM.generate``: waits while the loop is paused or drained for a weight update and until
        its requests in flight have ended (admitting none meanwhile), then keeps the loop from stepping while the
        block runs."""
        with self.condition:
            self.exclusive_waiting += 1
            try:
                while self.held or self.closed or self.running or self.stepping:
                    self.condition.wait()
            finally:
                self.exclusive_waiting -= 1
            self.exclusive_running += 1
        try:
            yield
        finally:
            with self.condition:
                self.exclusive_running -= 1
                self.condition.notify_all()

    def pause(self) -> None:
        """Stop at the next token boundary: returns once no step runs (no batch ``LLM.generate`` either) and none
        will start until :meth:`resume`; requests in flight keep their state."""
        with self.condition:
            self.held = True
            while self.stepping or self.exclusive_running:
                self.condition.wait()
            pause_engine = bool(self.running) and not self.in_process and not self.engine_paused
        if pause_engine:
            with self.lock:
                self.llm.sleep(level=0, mode="keep")
            self.engine_paused = True

    def drain(self) -> None:
        """Admit nothing more and wait for the requests in flight (and any batch generation) to end: the engine
        is then idle until :meth:`resume`."""
        with self.condition:
            self.closed = True
            while self.running or self.stepping or self.exclusive_running:
                self.condition.wait()

    def resume(self, carry: str | None = None) -> None:
        """Go on after :meth:`pause` or :meth:`drain`. ``carry``: the weights changed meanwhile, and requests in
        flight go on ``"keep"`` or ``"recompute"`` (see the module docstring); the prefix cache is reset too
        where nothing in flight holds it (new requests never meet stale entries anyway: their cache salt names
        the weights)."""
        with self.condition:
            in_flight = bool(self.running)
        with self.lock:
            if carry == "recompute" or (carry == "keep" and not in_flight):
                self.llm.reset_prefix_cache(reset_running_requests=carry == "recompute")
            if self.engine_paused:
                self.llm.wake_up(tags=["scheduling"])
                self.engine_paused = False
        with self.condition:
            self.held = self.closed = False
            self.condition.notify_all()

    def set_version(self, version: int) -> None:
        """Number the tokens of the steps that start from now ``version`` (vLLM's own label is set by the
        caller, for the other layout)."""
        with self.condition:
            self.version = int(version)

    def abort(self) -> None:
        """End every request queued or in flight now: each caller gets the tokens it has, with
        ``finish_reason="abort"``. Requests submitted afterwards are served as usual."""
        with self.between_steps():
            with self.condition:
                queued, self.pending = list(self.pending), collections.deque()
                in_flight = list(self.running.values())
            for request in queued:
                settle(request.future, request.output("abort"))
            if not in_flight:
                return
            with self.lock:
                if self.in_process:
                    self.llm.llm_engine.abort_request([request.request_id for request in in_flight])
                    with self.condition:
                        for request in in_flight:
                            self.running.pop(request.request_id, None)
                            settle(request.future, request.output("abort"))
                    return
                # vLLM ends every request with a final output (its tokens and their version spans); the outputs
                # still on their way come first
                self.llm.sleep(level=0, mode="abort")
                while any(request.request_id in self.running for request in in_flight):
                    outputs = self.llm.llm_engine.step()
                    with self.condition:
                        self.dispatch(outputs, self.version)
                if not self.held:
                    self.llm.wake_up(tags=["scheduling"])
                else:
                    self.engine_paused = True
