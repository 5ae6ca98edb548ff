"""A rollout engine's HTTP server: started as a child process (or attached to by URL), waited for, asked
with JSON, and stopped with the engine that owns it.

Shared by the server modes of the vLLM and SGLang rollouts. Only the standard library is used, so the
client side imports nothing the backend's environment might lack. :func:`is_loopback` is the rule every server
rlplat binds follows (the agents' gateway, ``rlplat serve``): beyond loopback only with an API key.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rlplat.contracts.rollout import RolloutBuildConfig


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (127.0.0.0/8, ``::1``, ``localhost``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerError(RuntimeError):
    """The server could not be started, died, or answered a request with an error."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def request_json(url: str, payload: Any = None, *, method: str | None = None, timeout: float = 600.0) -> Any:
    """POST ``payload`` as JSON (GET when it is None and no method is given); the decoded JSON answer,
    None for an empty body. A non-2xx answer raises :class:`ServerError` with the server's message."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:2000]
        raise ServerError(f"{request.get_method()} {url} answered {error.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as error:
        raise ServerError(f"{request.get_method()} {url} failed: {error}") from None
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body.decode(errors="replace")


class ServerProcess:
    """A server started from ``argv``, its output in ``log_path``; ``wait_ready`` polls ``health_url``.

    The child gets its own process group, so :meth:`stop` (also run at interpreter exit) ends the
    server's own workers with it. It runs under :func:`guard`, which ends that group when this process dies
    without stopping it (SIGKILL, a crash): no server is left holding its memory after its owner is gone.
    """

    def __init__(self, argv: Sequence[str], *, base_url: str, health_path: str, env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike | None = None, name: str = "rollout server"):
        self.argv, self.base_url, self.health_path, self.name = list(argv), base_url.rstrip("/"), health_path, name
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="rlplat-rollout-server-", suffix=".log")
            os.close(handle)
        self.log_path = Path(log_path)
        self.log_file = open(self.log_path, "ab")
        guarded = [sys.executable, "-c", GUARD_COMMAND, str(os.getpid()), *self.argv]
        self.process = subprocess.Popen(
            guarded, stdout=self.log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
        atexit.register(self.stop)

    def log_tail(self, characters: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-characters:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``GET health_url`` answers 200; raise with the server's log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"{self.name} exited with code {code} before it was ready; its log ({self.log_path}) ends with:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + self.health_path, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.name} was not ready after {timeout_s:.0f} s; its log ({self.log_path}) ends with:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        if not self.log_file.closed:
            self.log_file.close()


GUARD_COMMAND = "import sys; from rlplat.kits.rollout_server import guard; sys.exit(guard(int(sys.argv[1]), sys.argv[2:]))"


def guard(owner: int, argv: Sequence[str], poll_s: float = 0.5, grace_s: float = 30.0) -> int:
    """Run ``argv`` as a child in this process's group (a new session, :class:`ServerProcess`) and return its
    exit code; if process ``owner`` (the one that started this) dies first, end the whole group: SIGTERM,
    then SIGKILL after ``grace_s``. A SIGTERM to the group (:meth:`ServerProcess.stop`) reaches the child
    too; the guard then waits for it, so its exit is the server's."""
    child = subprocess.Popen(list(argv))
    signal.signal(signal.SIGTERM, lambda *_: None)  # the child got it as well: wait for it below
    while True:
        try:
            return child.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != owner:  # orphaned: the owner died without stopping the server
            os.killpg(0, signal.SIGTERM)
            try:
                return child.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(0, signal.SIGKILL)
                return -signal.SIGKILL


def python_module_argv(module: str, arguments: Sequence[str]) -> list[str]:
    """``python -m module arguments`` with this interpreter (the backend lives in this environment)."""
    return [sys.executable, "-m", module, *arguments]


def cli_flags(values: Mapping[str, Any], boolean_style: str = "negatable", list_style: str = "json") -> list[str]:
    """``{"max_model_len": 512, "enforce_eager": True}`` -> ``["--max-model-len", "512", "--enforce-eager"]``.

    ``boolean_style`` ``"negatable"`` writes False as ``--no-NAME`` (argparse ``BooleanOptionalAction``);
    ``"store_true"`` leaves a False flag out. Lists are one JSON argument (``list_style="json"``) or one
    argument per item (``"separate"``, argparse ``nargs="+"``); mappings are JSON; None is left out.
    """
    flags: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif boolean_style == "negatable":
                flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)) and list_style == "separate":
            flags += [flag, *(str(item) for item in value)]
        elif isinstance(value, (dict, list, tuple)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


@dataclasses.dataclass
class ServerSettings(RolloutBuildConfig):
    """The server-mode keys of a rollout config (a backend's config dataclass inherits them, with the
    keys every rollout receives)."""

    server_url: str | None = None
    """Server mode: the base URL of a server that is already running on this node (nothing is started
    then; the backend's README says which flags it must have been started with)."""

    server_host: str = "127.0.0.1"
    """Server mode: address the started server listens on."""

    server_port: int = 0
    """Server mode: port of the started server (0: a free one)."""

    server_startup_timeout_s: float = 900.0
    """Server mode: how long to wait for the started server to answer its health check."""

    request_timeout_s: float = 1800.0
    """Server mode: the longest one HTTP request (a whole generation batch) may take."""

    def start_or_attach(self, module: str, arguments: Callable[[str, int], Sequence[str]], *, health_path: str,
                        env: Mapping[str, str] | None = None, name: str) -> tuple[str, ServerProcess | None]:
        """The server's base URL, and the process when one was started: ``server_url`` as it is, else
        ``python -m module arguments(host, port)`` on ``server_host`` (a free port unless
        ``server_port``), waited for until its ``health_path`` answers."""
        if self.server_url is not None:
            return self.server_url.rstrip("/"), None
        port = self.server_port or free_port(self.server_host)
        base_url = f"http://{self.server_host}:{port}"
        server = ServerProcess(python_module_argv(module, arguments(self.server_host, port)), base_url=base_url,
                               health_path=health_path, env=env, name=name)
        server.wait_ready(self.server_startup_timeout_s)
        return base_url, server

    def server_problems(self, mode: str, model_path: str | None) -> list[str]:
        """What is wrong with these keys for ``mode`` (``hybrid`` or ``server``), as sentences."""
        problems = []
        if model_path is None and self.server_url is None:
            problems.append("model_path is required (a local Hugging Face directory)")
        if mode != "server" and self.server_url is not None:
            problems.append("server_url is a server-mode key; set mode=server to use it")
        if self.server_port < 0 or self.server_port > 65535:
            problems.append(f"server_port must be in 0..65535, got {self.server_port}")
        return problems
