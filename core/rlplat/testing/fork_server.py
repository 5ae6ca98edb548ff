"""Processes forked from one interpreter that imported the heavy modules once: :class:`ForkServer`.

A test that starts the same kind of process many times (a run killed and resumed again and again) pays an
interpreter start and ``import torch`` for each one. A fork server imports them once, in a process of
its own, and forks each child from it; the child runs a plain function of an importable module.

The server is the one child of the test process, and every process it forked is its child, never the
test's: :meth:`ForkServer.close` (or leaving the ``with`` block) kills whatever still runs, reaps it,
and stops the server, so nothing is left behind. The protocol is one JSON object a line over the
server's stdin and stdout; what the server and its children print goes to ``log``.

Run as ``python -m rlplat.testing.fork_server MODULE...`` by :class:`ForkServer` only.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence


class ForkServer:
    """``with ForkServer(["torch", "rlplat.trainer.loop"], log=path) as server: pid = server.start("pkg.mod:function", arg)``.

    ``start`` forks a child that calls ``function(*args)`` (JSON-able arguments) and exits 0 when it
    returns, 1 when it raises (the traceback goes to ``log``). ``poll(pid)`` is its exit code or
    ``None`` while it runs, ``wait(pid)`` waits for it; an exit code is negative for a signal
    (``-9`` after SIGKILL), as with :class:`subprocess.Popen`. Kill a child with ``os.kill(pid, ...)``.
    """

    def __init__(self, preload: Sequence[str], *, log: Path, timeout_s: float = 300) -> None:
        self.log_path = Path(log)
        self._log = open(self.log_path, "ab")
        self._server = subprocess.Popen([sys.executable, "-m", "rlplat.testing.fork_server", *preload],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                        start_new_session=True)
        try:
            self._expect_ready(timeout_s)
        except BaseException:
            self.close()
            raise

    def _expect_ready(self, timeout_s: float) -> None:
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self._server.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                raise RuntimeError(f"the fork server did not import its modules within {timeout_s:.0f} s (see {self.log_path})")
        reply = self._server.stdout.readline()
        if reply.strip() != '{"ready": true}':
            raise RuntimeError(f"the fork server failed to start: {reply!r} (see {self.log_path})")

    def _ask(self, **request: Any) -> dict:
        if self._server.poll() is not None:
            raise RuntimeError(f"the fork server exited with {self._server.returncode} (see {self.log_path})")
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server exited while answering {request} (see {self.log_path})")
        answer = json.loads(reply)
        if "error" in answer:
            raise RuntimeError(f"the fork server refused {request}: {answer['error']}")
        return answer

    def start(self, target: str, *args: Any) -> int:
        """Fork a child that runs ``target`` (``"module:function"``) with ``args``; its pid."""
        module, _, function = target.partition(":")
        if not module or not function:
            raise ValueError(f"target {target!r}: expected 'module:function'")
        return self._ask(op="start", module=module, function=function, args=list(args))["pid"]

    def poll(self, pid: int) -> int | None:
        return self._ask(op="poll", pid=pid)["exit_code"]

    def wait(self, pid: int) -> int:
        return self._ask(op="wait", pid=pid)["exit_code"]

    def log_tail(self, characters: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-characters:]

    def close(self) -> None:
        """Kill every child still running, reap them and stop the server (closing its stdin asks it to)."""
        if self._server.stdin is not None and not self._server.stdin.closed:
            try:
                self._server.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a server that hangs: it and its children, one process group
            try:
                os.killpg(self._server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        self._log.close()

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# -- inside the server ---------------------------------------------------------------------------------------


def _child(request: dict, replies: int) -> None:
    """In a forked child: leave the protocol alone, run the function, exit with its outcome."""
    code = 1
    try:
        os.close(replies)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        function = getattr(importlib.import_module(request["module"]), request["function"])
        function(*request["args"])
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(pid: int, blocking: bool, children: set[int]) -> int | None:
    done, status = os.waitpid(pid, 0 if blocking else os.WNOHANG)
    if done == 0:
        return None
    children.discard(pid)
    return os.waitstatus_to_exitcode(status)


def serve(preload: Sequence[str]) -> None:
    replies = os.dup(1)
    os.dup2(2, 1)  # what the modules or children print goes to the log, never into the replies
    for name in preload:
        importlib.import_module(name)
    children: set[int] = set()

    def reply(**answer: Any) -> None:
        os.write(replies, (json.dumps(answer) + "\n").encode())

    reply(ready=True)
    try:
        for line in sys.stdin:
            request = json.loads(line)
            op = request.get("op")
            if op == "start":
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, replies)
                children.add(pid)
                reply(pid=pid)
            elif op in ("poll", "wait") and request.get("pid") in children:
                reply(exit_code=_exit_code(request["pid"], op == "wait", children))
            else:
                reply(error=f"unknown request or not a running child of this server: {request}")
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)


if __name__ == "__main__":
    serve(sys.argv[1:])
