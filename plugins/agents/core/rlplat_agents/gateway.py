"""An OpenAI-compatible gateway over a rollout worker's replicas that records every sampled token.

Black-box agents (programs written against the ``openai`` client, an environment hub's rollout code) are
pointed at ``base_url``; each request is rendered with the policy's chat template, sampled through the
worker's :class:`~rlplat.contracts.agent.TokenClient` (``RolloutEngine.generate_tokens``: hf, vllm, sglang),
and recorded token by token. The recorded tokens, not the text the agent saw, become the training row, so
the row holds exactly what was sampled:

* ``POST /v1/chat/completions`` (``tools`` offered through the chat template, the model's calls parsed
  with ``agent.tool_parser`` into ``tool_calls``; no streaming, ``n`` = 1) and ``POST /v1/completions``
  (a text prompt, or token ids), ``GET /v1/models``. Served on ``agent.gateway.host``/``port``
  (127.0.0.1, a free port), on a thread and event loop of its own in the worker process.
* **Sessions.** One session per trajectory. A request names its session in the path
  (``/s/<session>/v1/...``, the ``base_url`` the ``blackbox`` loop hands each agent) or the
  ``X-Session-Id`` header; without either it goes to the open session whose history is the longest prefix
  of the request's messages (a session not yet called matches on its task's prompt). A session id never
  seen starts a new session, whose tokens train nothing (``unattributed``); a closed one gets 410.
* **What is recorded.** A session is a list of segments; each is a prompt (the first request's rendering)
  and a response of the model's sampled tokens (mask 1, their log-probs, the policy version that sampled
  them) and, between calls, the tokens the template adds for the new messages (mask 0;
  :meth:`~rlplat_agents.chat.ChatRenderer.delta_ids`, the same tokens as the ``tool`` loop's).
* **Prefix safety.** A request continues its segment only when the history it sends equals, message by
  message, what the gateway knows (the earlier requests' messages and the turns it returned: content, and
  each tool call's name and argument string, exactly as returned), followed by new non-assistant messages,
  with the same tools. Anything else (a tool call re-serialised, ``false`` turned into ``False``, an
  assistant turn edited or inserted) is a prefix break, never merged: ``agent.gateway.on_prefix_break``
  ``split`` starts a new segment from the request's rendering, ``error`` answers 400.
* **Errors** have OpenAI's body (``{"error": {"message", "type", "param", "code"}}``): 400 for a malformed
  request or one over the token budget (``context_length_exceeded``), 401 without the key
  (``agent.gateway.api_key``), 404 for an unknown path, 410 for a closed session.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Optional, Sequence

from rlplat.kits.agent import TrajectoryBuilder
from rlplat.contracts.rollout import SamplingParams

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_KEYS = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "seed", "stop", "n", "stream", "logprobs", "top_logprobs", "user", "metadata",
    "frequency_penalty", "presence_penalty", "response_format", "store", "stream_options", "extra_body",
})
COMPLETION_KEYS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "logprobs", "echo",
    "user", "frequency_penalty", "presence_penalty", "best_of", "suffix", "stream_options",
})


class RequestError(Exception):
    """A request the gateway answers with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class PrefixBreak(RequestError):
    def __init__(self, message: str):
        super().__init__(400, message, "messages", "prefix_break")


# -- messages ---------------------------------------------------------------------------------------------

def content_text(content: Any, where: str) -> str:
    """A message's ``content`` as text: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"{where}.content[{number}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                        f"are supported, got {part!r:.80}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"{where}.content must be a string, null or a list of text parts, got "
                            f"{type(content).__name__}", "messages")


@dataclasses.dataclass(frozen=True)
class Message:
    """A chat message as the gateway compares it: what reaches the tokens, exactly as sent."""

    role: str
    content: str
    calls: tuple[tuple[str, str], ...] = ()
    """Tool calls: (name, the arguments string as sent)."""
    name: Optional[str] = None

    def for_template(self) -> dict:
        """The message as chat templates take it (tool-call arguments as objects)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": arguments_object(arguments)}}
                                     for name, arguments in self.calls]
        if self.name is not None:
            message["name"] = self.name
        return message


def arguments_object(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def read_messages(value: Any) -> list[Message]:
    """The request's ``messages``, checked; :class:`RequestError` naming the first bad one."""
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty list of chat messages", "messages")
    messages = []
    for index, raw in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(raw, Mapping):
            raise RequestError(400, f"{where} must be an object, got {type(raw).__name__}", "messages")
        role = raw.get("role")
        if role not in ROLES:
            raise RequestError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        calls = []
        for number, call in enumerate(raw.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, Mapping) else None
            if role != "assistant" or not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise RequestError(400, f"{where}.tool_calls[{number}] must be {{'type': 'function', 'function': "
                                        f"{{'name': ..., 'arguments': '...'}}}} on an assistant message", "messages")
            arguments = function.get("arguments", "")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            calls.append((function["name"], arguments))
        name = raw.get("name")
        messages.append(Message("system" if role == "developer" else role, content_text(raw.get("content"), where),
                                tuple(calls), name if isinstance(name, str) else None))
    return messages


def read_tools(value: Any) -> Optional[list[dict]]:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError(400, "'tools' must be a list of function schemas", "tools")
    from rlplat.contracts.agent import check_tool_schema

    for index, tool in enumerate(value):
        try:
            check_tool_schema(tool, f"tools[{index}]")
        except ValueError as error:
            raise RequestError(400, str(error), "tools") from None
    return [dict(tool) for tool in value] or None


# -- sessions ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Segment:
    """One trajectory segment: a prompt and the tokens after it (see the module docstring)."""

    builder: TrajectoryBuilder
    versions: list[int]
    """Per response token: the policy version that sampled it (-1 on tokens not sampled)."""
    history: Optional[tuple[Message, ...]] = None
    """Chat: every message so far, the returned turns included; None for a completion segment."""
    tools_key: Optional[str] = None
    text: str = ""
    """Completion: the prompt text and every returned completion."""
    last_ids: tuple[int, ...] = ()
    """The last model turn's tokens (its end-of-turn decides what closes it)."""
    calls: int = 0
    tool_calls: int = 0


class Session:
    """The calls of one trajectory. ``client`` samples (a conversation keeps its replica); ``sampling`` is
    the run's, with the session's seed; ``response_length`` the budget of each segment's response."""

    def __init__(self, session_id: str, client: Any, sampling: SamplingParams, response_length: int,
                 prompt_length: int, task_messages: Optional[Sequence[Message]] = None, attributed: bool = True):
        self.id, self.client, self.sampling = session_id, client, sampling
        self.response_length, self.prompt_length = response_length, prompt_length
        self.task_messages = tuple(task_messages or ())
        self.attributed = attributed
        self.renderer: Any = None
        """The chat renderer of this trajectory (the template check's recording one); None: the gateway's."""
        self.segments: list[Segment] = []
        self.prefix_breaks = 0
        self.parse_errors = 0
        self.rejected = 0
        self.closed = False
        self.lock: Optional[asyncio.Lock] = None

    @property
    def calls(self) -> int:
        return sum(segment.calls for segment in self.segments)

    def history_key(self) -> Optional[tuple]:
        segment = self.segments[-1] if self.segments else None
        if segment is None or segment.history is None:
            return None
        return (segment.tools_key, segment.history)


class Gateway:
    """The gateway of one rollout worker. ``renderer``, ``parser`` and ``stop_token_ids`` are the agent
    manager's; ``default_client`` answers requests of unattributed sessions; ``policy_version()`` is the
    version the rollout samples from now (None: -1 is recorded)."""

    def __init__(self, config: Any, tokenizer: Any, renderer: Any, parser: Any, stop_token_ids: Sequence[int],
                 default_client: Callable[[], Any], sampling: SamplingParams, response_length: int, prompt_length: int,
                 policy_version: Optional[Callable[[], int]] = None):
        self.config, self.tokenizer, self.renderer, self.parser = config, tokenizer, renderer, parser
        self.stop_token_ids = tuple(stop_token_ids)
        self.default_client, self.default_sampling = default_client, sampling
        self.response_length, self.prompt_length = response_length, prompt_length
        self.policy_version = policy_version
        self.sessions: dict[str, Session] = {}
        self.closed_ids: set[str] = set()
        self.lock = threading.Lock()
        self.counter = itertools.count()
        self.unattributed_calls = 0
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.thread: Optional[threading.Thread] = None
        self.runner: Any = None
        self.port: Optional[int] = None
        self.window: Optional[asyncio.Future] = None

    # -- life -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind and serve (idempotent); :class:`OSError` naming the keys when the address cannot be bound."""
        if self.thread is not None:
            return
        ready: dict[str, Any] = {}
        started = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._bind())
                ready["ok"] = True
            except BaseException as error:  # reported to start()'s caller
                ready["error"] = error
                started.set()
                loop.close()
                return
            self.loop = loop
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.runner.cleanup())
                loop.close()

        self.thread = threading.Thread(target=serve, name="rlplat-gateway", daemon=True)
        self.thread.start()
        started.wait()
        if "error" in ready:
            self.thread = None
            error = ready["error"]
            raise OSError(f"agent.gateway: cannot serve on {self.config.host}:{self.config.port} "
                          f"({type(error).__name__}: {error}); choose another agent.gateway.port (0: a free one) "
                          f"or agent.gateway.host") from error

    async def _bind(self) -> None:
        from aiohttp import web

        @web.middleware
        async def errors(request: Any, handler: Any) -> Any:
            return await self._errors(request, handler)

        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[errors])
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self.chat_completions)
            app.router.add_post(prefix + "/v1/completions", self.completions)
            app.router.add_get(prefix + "/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Stop serving; open sessions are closed (their agents' next calls fail)."""
        if self.thread is None:
            return
        loop, thread = self.loop, self.thread
        self.thread = self.loop = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)

    @property
    def address(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def base_url(self, session_id: Optional[str] = None) -> str:
        """The OpenAI ``base_url`` of a session (or of the longest-prefix matching without one)."""
        if self.thread is None:
            self.start()
        return f"{self.address}/s/{session_id}/v1" if session_id else f"{self.address}/v1"

    # -- sessions -------------------------------------------------------------------------------------------

    def open(self, client: Any, sampling: SamplingParams, task_messages: Optional[Sequence[Mapping[str, Any]]] = None,
             response_length: Optional[int] = None, renderer: Any = None) -> Session:
        """A new session for one trajectory; ``task_messages`` (the task's prompt) let requests without a
        session id find it."""
        messages = None
        if task_messages:
            try:
                messages = read_messages(list(task_messages))
            except RequestError:
                messages = None
        session_id = f"{uuid.uuid4().hex[:16]}"
        session = Session(session_id, client, sampling, response_length or self.response_length, self.prompt_length,
                          messages)
        session.renderer = renderer
        with self.lock:
            self.sessions[session_id] = session
        return session

    def close(self, session_id: str) -> Session:
        """End a session; later requests naming it get 410."""
        with self.lock:
            session = self.sessions.pop(session_id)
            self.closed_ids.add(session_id)
        session.closed = True
        return session

    def sweep(self) -> int:
        """After a batch: drop the unattributed sessions (their calls trained nothing) and forget old closed
        ids; returns the unattributed calls since the last sweep, logged as a warning when there were any."""
        with self.lock:
            for session_id in [key for key, session in self.sessions.items() if not session.attributed]:
                del self.sessions[session_id]
            if len(self.closed_ids) > 100_000:
                self.closed_ids.clear()
            calls, self.unattributed_calls = self.unattributed_calls, 0
        if calls:
            log.warning("gateway: %d calls named no open session (a base_url without the session, or a session id "
                        "rlplat did not hand out) and matched none by prefix; they were answered and train nothing",
                        calls)
        return calls

    def find(self, session_id: Optional[str], messages: Optional[Sequence[Message]], tools_key: Optional[str],
             text: Optional[str] = None) -> Session:
        """The session of a request (see the module docstring)."""
        with self.lock:
            if session_id is not None:
                if session_id in self.sessions:
                    return self.sessions[session_id]
                if session_id in self.closed_ids:
                    raise RequestError(410, f"session {session_id!r} is closed: its trajectory was collected", None,
                                       "session_closed")
                return self._unattributed(session_id)
            best, best_length = None, -1
            for session in self.sessions.values():
                if not session.attributed or session.closed:
                    continue
                length = self._match(session, messages, tools_key, text)
                if length > best_length:
                    best, best_length = session, length
            if best is not None and best_length >= 0:
                return best
            return self._unattributed(f"anon-{next(self.counter)}")

    @staticmethod
    def _match(session: Session, messages: Optional[Sequence[Message]], tools_key: Optional[str], text: Optional[str]) -> int:
        """How much of the request ``session`` already holds (-1: none of it). A session not yet called
        matches on its task's prompt at length 0."""
        if session.segments:
            segment = session.segments[-1]
            if messages is not None and segment.history is not None:
                history = segment.history
                if (segment.tools_key == tools_key and len(history) <= len(messages)
                        and tuple(messages[:len(history)]) == history):
                    return 1 + len(history)
            elif text is not None and segment.history is None and segment.text and text.startswith(segment.text):
                return 1 + len(segment.text)
            return -1
        if messages is not None and session.task_messages:
            task = session.task_messages
            if len(task) <= len(messages) and tuple(messages[:len(task)]) == task:
                return 0
        return -1

    def _unattributed(self, session_id: str) -> Session:
        session = Session(session_id, self.default_client(), self.default_sampling, self.response_length,
                          self.prompt_length, attributed=False)
        self.sessions[session_id] = session
        return session

    # -- HTTP -----------------------------------------------------------------------------------------------

    from_header = "X-Session-Id"

    def _authorise(self, request: Any) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("Authorization", "")
        if header != f"Bearer {key}":
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <agent.gateway.api_key>'",
                               None, "invalid_api_key", "authentication_error")

    async def _errors(self, request: Any, handler: Any) -> Any:
        """Every answer: the key checked, and every error as an OpenAI error body."""
        from aiohttp import web

        try:
            self._authorise(request)
            return await handler(request)
        except RequestError as error:
            return web.json_response(error.body(), status=error.status)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            body = RequestError(error.status, f"{request.method} {request.path}: {error.reason}", None,
                                None if error.status != 404 else "not_found").body()
            return web.json_response(body, status=error.status)
        except Exception as error:  # the agent sees a 500 with the reason; the gateway serves on
            log.exception("gateway: %s %s failed", request.method, request.path)
            body = RequestError(500, f"{type(error).__name__}: {error}", None, None, "server_error").body()
            return web.json_response(body, status=500)

    async def _body(self, request: Any, known: frozenset) -> dict:
        try:
            body = await request.json()
        except Exception as error:
            raise RequestError(400, f"the request body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - known)
        if unknown:
            raise RequestError(400, f"unsupported parameter(s): {', '.join(unknown)}", unknown[0], "unsupported_parameter")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported: the gateway answers whole responses", "stream")
        if body.get("n", 1) not in (1, None):
            raise RequestError(400, f"n={body.get('n')!r}: the gateway samples one choice per request (one "
                                    f"trajectory per session); send n requests", "n")
        if body.get("top_logprobs"):
            raise RequestError(400, "top_logprobs is not supported: the log-prob of each sampled token is "
                                    "(logprobs=true)", "top_logprobs")
        return body

    def _session_id(self, request: Any) -> Optional[str]:
        return request.match_info.get("session") or request.headers.get(self.from_header) or None

    async def models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rlplat"}]})

    # -- sampling -------------------------------------------------------------------------------------------

    def _sampling(self, session: Session, body: Mapping[str, Any], budget: int) -> SamplingParams:
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RequestError(400, f"max_tokens must be an integer >= 1, got {limit!r}", "max_tokens")
        if budget <= 0:
            raise RequestError(400, f"maximum context length exceeded: the trajectory's response budget of "
                                    f"{session.response_length} tokens (rollout.response_length) is spent", "messages",
                               "context_length_exceeded")
        sampling = session.sampling
        changes: dict[str, Any] = {"n": 1, "max_new_tokens": min(budget, limit or budget)}
        stops = set(sampling.stop_token_ids) | set(self.stop_token_ids) | set(self._stop_ids(body.get("stop")))
        changes["stop_token_ids"] = tuple(sorted(stops))
        segment_calls = session.calls
        if sampling.seed is not None:
            changes["seed"] = int(sampling.seed) + 7_919 * segment_calls
        if self.config.request_sampling:
            for key, field in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
                value = body.get(key)
                if value is not None:
                    if not isinstance(value, (int, float)) or isinstance(value, bool):
                        raise RequestError(400, f"{key} must be a number, got {value!r}", key)
                    changes[field] = int(value) if field == "seed" else float(value)
            if changes.get("temperature") == 0:
                changes.pop("temperature")
                changes["greedy"] = True
        try:
            return dataclasses.replace(sampling, **changes)
        except ValueError as error:
            raise RequestError(400, str(error)) from None

    def _stop_ids(self, stop: Any) -> list[int]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(item, str) for item in stops):
            raise RequestError(400, "stop must be a string or a list of strings", "stop")
        ids = []
        for item in stops:
            encoded = self.tokenizer(item, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise RequestError(400, f"stop {item!r} is {len(encoded)} tokens: the gateway stops on single-token "
                                        f"stop strings only (the tokens trained on must be the tokens sampled)", "stop")
            ids.append(int(encoded[0]))
        return ids

    async def _admission(self) -> None:
        """Wait for the current admission window to close (``agent.gateway.batch_window_ms``): every request
        that waited then reaches the rollout in one event-loop iteration, so the rollout admits them together."""
        window = self.config.batch_window_ms / 1000.0
        if window <= 0:
            return
        if self.window is None:
            loop = asyncio.get_running_loop()
            self.window = loop.create_future()
            loop.call_later(window, self._close_window)
        await asyncio.shield(self.window)

    def _close_window(self) -> None:
        window, self.window = self.window, None
        if window is not None and not window.done():
            window.set_result(None)

    async def _generate(self, session: Session, segment: Segment, body: Mapping[str, Any]) -> Any:
        sampling = self._sampling(session, body, segment.builder.remaining)
        await self._admission()
        version = self.policy_version() if self.policy_version is not None else -1
        output = await session.client.generate(segment.builder.ids, sampling)
        segment.builder.add_model(output)
        segment.versions += [int(version)] * len(output.token_ids)
        segment.last_ids = tuple(output.token_ids)
        segment.calls += 1
        if not session.attributed:
            self.unattributed_calls += 1
        return output

    def _new_segment(self, session: Session, prompt_ids: list[int]) -> Segment:
        if len(prompt_ids) > session.prompt_length:
            raise RequestError(400, f"maximum context length exceeded: the prompt is {len(prompt_ids)} tokens, more "
                                    f"than agent.max_prompt_length={session.prompt_length}", "messages",
                               "context_length_exceeded")
        segment = Segment(TrajectoryBuilder(prompt_ids, session.response_length), [])
        return segment

    def _context(self, segment: Segment, delta: Sequence[int]) -> None:
        if not segment.builder.add_context(delta):
            raise RequestError(400, f"maximum context length exceeded: the new messages ({len(delta)} tokens) do not "
                                    f"fit in what is left of the "
                                    f"trajectory's response budget ({segment.builder.remaining} of "
                                    f"rollout.response_length)", "messages", "context_length_exceeded")
        segment.versions += [-1] * len(delta)

    def _break(self, session: Session, reason: str) -> None:
        session.prefix_breaks += 1
        if self.config.on_prefix_break == "error":
            raise PrefixBreak(f"the history sent is not the conversation the gateway returned ({reason}); "
                              f"agent.gateway.on_prefix_break=error")

    def _text(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        while ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprobs(self, output: Any) -> dict:
        content = []
        for token, value in zip(output.token_ids, output.log_probs):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            content.append({"token": text, "logprob": float(value), "bytes": list(text.encode("utf-8")),
                            "top_logprobs": [], "token_id": int(token)})
        return {"content": content}

    def _usage(self, prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- /v1/chat/completions -------------------------------------------------------------------------------

    async def chat_completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request, CHAT_KEYS)
        messages = read_messages(body.get("messages"))
        tools = read_tools(body.get("tools"))
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise RequestError(400, f"tool_choice={body.get('tool_choice')!r}: only 'auto' and 'none' are supported "
                                    f"(the model's own calls are what is trained)", "tool_choice")
        if body.get("tool_choice") == "none":
            tools = None
        from rlplat_agents.chat import tools_key as key_of

        tools_key = key_of(tools)
        session = self.find(self._session_id(request), messages, tools_key)
        async with self._serving(session):
            segment = self._chat_segment(session, messages, tools, tools_key)
            output = await self._generate(session, segment, body)
            text = self._text(output.token_ids)
            calls, content = [], text
            if tools and self.parser is not None:
                parsed = self.parser.parse(text)
                if parsed.calls:
                    content = parsed.content
                    calls = [(call.name, json.dumps(dict(call.arguments), ensure_ascii=False)) for call in parsed.calls]
                session.parse_errors += len(parsed.errors)
            segment.tool_calls += len(calls)
            segment.history = (*messages, Message("assistant", content, tuple(calls)))
            ended = output.finish_reason == "stop" and output.token_ids and output.token_ids[-1] in self.stop_token_ids
            finish = "tool_calls" if calls else ("stop" if ended else "length")
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                          "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                                      "logprobs": self._logprobs(output) if body.get("logprobs") else None}
            prompt_tokens = len(segment.builder.ids) - len(output.token_ids)
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": str(body.get("model") or "policy"), "choices": [choice],
            "usage": self._usage(prompt_tokens, len(output.token_ids)), "session_id": session.id,
        })

    def _chat_segment(self, session: Session, messages: list[Message], tools: Optional[list], tools_key: Optional[str]) -> Segment:
        """The segment this request continues (its new messages appended as context), or a new one."""
        current = session.segments[-1] if session.segments else None
        if current is not None and current.history is not None:
            history = current.history
            reason = None
            if current.tools_key != tools_key:
                reason = "the tools offered changed"
            elif len(messages) <= len(history) or tuple(messages[:len(history)]) != history:
                position = next((index for index, (sent, known) in enumerate(zip(messages, history)) if sent != known),
                                min(len(messages), len(history)))
                reason = (f"message {position} differs from what the gateway returned" if position < len(history)
                          and position < len(messages) else "the history is shorter than the conversation so far")
            else:
                new = messages[len(history):]
                if any(message.role == "assistant" for message in new):
                    reason = "an assistant message the model did not write was added"
                else:
                    from rlplat_agents.chat import TemplateError

                    try:
                        renderer = session.renderer or self.renderer
                        delta = list(renderer.closing_ids(current.last_ids)) + renderer.delta_ids(
                            [message.for_template() for message in new], tools=tools)
                    except TemplateError as error:
                        raise RequestError(400, f"the new messages cannot be appended through the chat template: {error}",
                                           "messages") from None
                    self._context(current, delta)
                    return current
            self._break(session, reason)
        elif current is not None:
            self._break(session, "a chat request in a completions session")
        from rlplat_agents.chat import TemplateError

        try:
            prompt_ids = (session.renderer or self.renderer).prompt_ids([message.for_template() for message in messages],
                                                                        tools=tools)
        except TemplateError as error:
            raise RequestError(400, f"the chat template cannot render these messages: {error}", "messages") from None
        segment = self._new_segment(session, prompt_ids)
        segment.tools_key = tools_key
        session.segments.append(segment)
        return segment

    @contextlib.asynccontextmanager
    async def _serving(self, session: Session) -> AsyncIterator[None]:
        """One request of ``session`` at a time, never on a closed session, undone if it fails."""
        if session.lock is None:
            session.lock = asyncio.Lock()
        async with session.lock:
            if session.closed:
                raise RequestError(410, f"session {session.id!r} is closed", None, "session_closed")
            with self._undone_on_error(session):
                yield

    @contextlib.contextmanager
    def _undone_on_error(self, session: Session) -> Iterator[None]:
        """A request that fails (refused, or its generation raised) leaves its session as it found it: the
        context tokens it appended and the segment it started go (a prefix break it found stays counted)."""
        segments = len(session.segments)
        current = session.segments[-1] if session.segments else None
        length = len(current.builder.response_ids) if current is not None else 0
        try:
            yield
        except BaseException:
            del session.segments[segments:]
            if current is not None:
                builder = current.builder
                del builder.response_ids[length:], builder.response_mask[length:], builder.rollout_log_probs[length:]
                del current.versions[length:]
            raise

    def _completion_segment(self, session: Session, prompt: Any, text: str) -> Segment:
        current = session.segments[-1] if session.segments else None
        if current is not None and current.history is None and text.startswith(current.text) and len(text) > len(current.text):
            self._context(current, self.tokenizer(text[len(current.text):], add_special_tokens=False)["input_ids"])
            return current
        if current is not None:
            self._break(session, "the prompt does not extend the session's text" if current.history is None
                        else "a completions request in a chat session")
        ids = list(prompt) if isinstance(prompt, list) else list((session.renderer or self.renderer).encode(text))
        segment = self._new_segment(session, ids)
        session.segments.append(segment)
        return segment

    # -- /v1/completions ------------------------------------------------------------------------------------

    async def completions(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request, COMPLETION_KEYS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
                raise RequestError(400, "'prompt' must be a string, or a non-empty list of token ids", "prompt")
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        elif isinstance(prompt, str) and prompt:
            text = prompt
        else:
            raise RequestError(400, "'prompt' must be a non-empty string, or a list of token ids", "prompt")
        if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
            raise RequestError(400, "echo, suffix and best_of are not supported")
        session = self.find(self._session_id(request), None, None, text)
        async with self._serving(session):
            segment = self._completion_segment(session, prompt, text)
            output = await self._generate(session, segment, body)
            completion = self._text(output.token_ids)
            segment.text = text + completion
            ended = output.finish_reason == "stop"
            choice = {"index": 0, "text": completion, "finish_reason": "stop" if ended else "length",
                      "logprobs": None}
            if body.get("logprobs"):
                tokens = [self.tokenizer.decode([token], skip_special_tokens=False) for token in output.token_ids]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": [float(v) for v in output.log_probs],
                                      "top_logprobs": None, "text_offset": None,
                                      "token_ids": [int(token) for token in output.token_ids]}
            prompt_tokens = len(segment.builder.ids) - len(output.token_ids)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
            "model": str(body.get("model") or "policy"), "choices": [choice],
            "usage": self._usage(prompt_tokens, len(output.token_ids)), "session_id": session.id,
        })
