"""An OpenEnv environment server on 127.0.0.1, in this process: what ``uvicorn server.app:app`` does in an
environment's container, without the container.

:func:`serve` starts the ASGI app a ``"module:attribute"`` names (an OpenEnv ``create_app(...)`` result)
with uvicorn on a free loopback port, on a thread and event loop of its own, once per process; later calls
return the same address. The servers stop when the process exits.
"""

from __future__ import annotations

import atexit
import importlib
import socket
import threading
import time
from typing import Any

_servers: dict[str, "LocalServer"] = {}
_starting = threading.Lock()


class LocalServer:
    """One ASGI app served by uvicorn on ``127.0.0.1`` (a port the OS picked) on a daemon thread."""

    def __init__(self, app: Any, name: str):
        import uvicorn

        self.name = name
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        # uvicorn installs no signal handlers off the main thread, so the worker's own stay.
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name=f"openenv-server-{name}", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the OpenEnv server of {self.name} stopped while starting (see its log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server of {self.name} did not start within {timeout_s:g} s")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


def load_app(path: str) -> Any:
    """The ASGI app at ``"module:attribute"``; :class:`ValueError` naming what is missing."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"agent_kwargs.app must be \"module:attribute\" (an OpenEnv create_app(...) result), got {path!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"agent_kwargs.app={path!r}: cannot import {module_name!r}: {error}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"agent_kwargs.app={path!r}: {module_name} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"agent_kwargs.app={path!r} is a {type(target).__name__}, not an ASGI app")
    return target


def serve(path: str) -> str:
    """The base URL (``http://127.0.0.1:<port>``) of the app at ``path``, served from the first call on."""
    with _starting:
        server = _servers.get(path)
        if server is None or not server.thread.is_alive():
            server = LocalServer(load_app(path), path)
            server.start()
            _servers[path] = server
        return server.base_url


@atexit.register
def _stop_all() -> None:
    for server in list(_servers.values()):
        server.stop()
    _servers.clear()
