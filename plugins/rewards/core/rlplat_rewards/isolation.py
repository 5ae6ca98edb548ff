"""Scoring in processes that can be killed: a scorer stuck in C code (a regular expression backtracking
catastrophically, a huge big-integer power) holds the GIL, so no thread of the process it runs in can stop
it, or even run; only killing its process can.

:func:`scorer_pool` decides, from ``reward.config.isolation`` and ``timeout_s``, whether a manager scores in
its own process (None) or through a :class:`ScorerPool`:

* ``thread``: never a pool (each manager's own timeout on a thread: it cannot stop a C-level loop);
* ``process``: always a pool; a scorer that cannot be rebuilt in another process is an error;
* ``auto``: a pool when ``timeout_s`` is set (without a deadline there is nothing to kill) and the scorer
  is not known safe (:func:`known_safe`); a scorer that cannot be rebuilt elsewhere (a closure, a lambda)
  stays on a thread, with a warning.

A :class:`ScorerPool` holds up to ``processes`` long-lived scorer processes, each started as
``python -m rlplat_rewards.isolation`` (an exec, never a fork of the caller, which may hold threads, CUDA
or torch; and unlike multiprocessing's ``spawn``, without re-running the caller's ``__main__``: the rlplat
command line, a Ray worker, or a user's script without a ``__main__`` guard). A process imports only what
its scorer imports, rebuilt from a :class:`ScorerDescription` (a registered scorer by its name, a user's
function by its file and name, the default :class:`~rlplat.scorers.DataSourceScorer`, a module-level
function by its module and name), never a pickled closure. A dispatcher thread sends queued samples in
chunks (one message per chunk; each result streams back as it is ready) and keeps each process's deadline:
``timeout_s`` from the moment its current sample started. When a sample overruns it, the process is
SIGKILLed, the sample fails with :class:`ScorerTimeout` (``killed`` True), the rest of its chunk goes back
to the queue and a fresh process is started when one is needed. A process that dies by itself (a
segfault, ``os._exit``) fails its current sample with :class:`ScorerCrashed`; an exception of the scorer
comes back as :class:`ScorerError` with the traceback text. ``async def`` scorers are awaited in the
process's own event loop.

Processes stop when the pool is closed or garbage-collected, at interpreter exit, and, on Linux, when the
dispatcher thread (so the caller's process) dies, even by SIGKILL (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import inspect
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Mapping, Optional, Sequence

logger = logging.getLogger("rlplat_rewards.isolation")

STARTUP_TIMEOUT_S = 120.0
"""Seconds a new scorer process may take to import its scorer and report ready (sympy on a busy
machine takes several) before :class:`ScorerStartError`."""

CHUNK_SIZE = 32
"""The most samples sent to one process in one message: fewer messages than one per sample, and small
enough that a second process shares a batch."""

STOP_GRACE_S = 2.0
"""Seconds a process asked to stop may take before it is killed."""


class ScorerTimeout(TimeoutError):
    """A sample overran ``timeout_s``; ``killed``: its scorer process was killed (always, in a pool)."""

    def __init__(self, message: str, *, killed: bool = False, pid: int | None = None):
        super().__init__(message)
        self.killed, self.pid = killed, pid


class ScorerError(RuntimeError):
    """The scorer raised in its process; the message holds the exception and its traceback there."""


class ScorerCrashed(RuntimeError):
    """The scorer process died by itself (a signal, ``os._exit``) while scoring a sample."""


class ScorerStartError(RuntimeError):
    """A scorer process could not be started or could not rebuild its scorer; not a sample's fault, so the
    managers raise it instead of giving fallback scores."""


# -- what a scorer is ----------------------------------------------------------------------------------

def _target_of(factory: str) -> str:
    """A registry factory path (``pkg.mod:attr`` or ``pkg.mod.attr``) as ``pkg.mod:attr``."""
    if ":" in factory:
        return factory
    module, _, attribute = factory.rpartition(".")
    return f"{module}:{attribute}"


def registered_entry(scorer: Any) -> Any:
    """The process-wide registry's ``reward_scorer`` entry whose factory is ``scorer``, or None. Compares
    dotted paths first, so no scorer module is imported to answer."""
    from rlplat import registry

    module, qualname = getattr(scorer, "__module__", None), getattr(scorer, "__qualname__", None)
    path = f"{module}:{qualname}" if module and qualname else None
    for entry in registry.entries("reward_scorer"):
        factory = entry.factory
        if not isinstance(factory, str):
            if factory is scorer:
                return entry
        elif path is not None and _target_of(factory) == path:
            return entry
    return None


def known_safe(scorer: Any) -> bool:
    """Whether ``scorer`` is known to return promptly on any input, so it needs no process of its own: a
    registered scorer whose entry's metadata says ``"safe": True``, or the default ``DataSourceScorer``
    when ``exact_match`` and every scorer that claims a data source are. Anything else (a user's function,
    a registered scorer without the mark) is not."""
    from rlplat.scorers import DataSourceScorer, exact_match

    if isinstance(scorer, DataSourceScorer):
        from rlplat import registry

        routed = [registry.entry("reward_scorer", name) for name in set(scorer.claims().values())]
        return all(entry is not None and entry.metadata.get("safe") is True
                   for entry in [registered_entry(exact_match), *routed])
    entry = registered_entry(scorer)
    return entry is not None and entry.metadata.get("safe") is True


def _importable(module: str) -> bool:
    """Whether another process with this ``sys.path`` can import ``module`` by name (not, say, a user's
    reward file that :func:`rlplat.scorers.load_function` imported under a made-up name)."""
    from importlib.machinery import PathFinder

    top = module.partition(".")[0]
    return top in sys.builtin_module_names or PathFinder.find_spec(top, sys.path) is not None


@dataclasses.dataclass(frozen=True)
class ScorerDescription:
    """How a scorer process rebuilds the scorer: picklable, and what a message says the scorer is."""

    kind: str
    """``registered`` (``name`` in the registry), ``custom`` (function ``name`` in the file ``path``),
    ``data_source`` (the default scorer) or ``function`` (attribute ``name`` of module ``path``)."""
    name: str = ""
    path: str = ""

    @classmethod
    def of(cls, scorer: Any) -> Optional["ScorerDescription"]:
        """The description of ``scorer``, or None when another process cannot rebuild it (a lambda, a
        closure, a function of ``__main__``, a callable object of no registered name)."""
        from rlplat.scorers import CustomScorer, DataSourceScorer

        if isinstance(scorer, CustomScorer):
            return cls("custom", scorer.name, os.path.abspath(scorer.path))
        if isinstance(scorer, DataSourceScorer):
            return cls("data_source")
        entry = registered_entry(scorer)
        if entry is not None:
            return cls("registered", entry.name)
        module, qualname = getattr(scorer, "__module__", None), getattr(scorer, "__qualname__", "")
        if inspect.isroutine(scorer) and module and module != "__main__" and "<" not in qualname and _importable(module):
            target = sys.modules.get(module)
            for part in qualname.split("."):
                target = getattr(target, part, None)
            if target is scorer:
                return cls("function", qualname, module)
        return None

    def build(self) -> Callable[..., Any]:
        """The scorer, as :func:`rlplat.scorers.scorer_for` would give it (run in the scorer process)."""
        from rlplat import registry
        from rlplat.scorers import CustomScorer, DataSourceScorer

        if self.kind == "registered":
            return registry.get("reward_scorer", self.name)
        if self.kind == "custom":
            return CustomScorer(self.path, self.name)
        if self.kind == "data_source":
            return DataSourceScorer()
        if self.kind == "function":
            return registry.resolve_dotted_path(f"{self.path}:{self.name}")
        raise ValueError(f"unknown scorer description kind {self.kind!r}")

    def __str__(self) -> str:
        return {"registered": f"registered scorer {self.name!r}", "custom": f"reward function {self.name!r} from {self.path}",
                "data_source": "the default scorer (by data_source)", "function": f"{self.path}.{self.name}"}[self.kind]


def scorer_pool(scorer: Any, isolation: str, timeout_s: Optional[float], processes: int,
                name: str) -> Optional["ScorerPool"]:
    """The pool ``scorer`` is to run in under ``reward.config.isolation`` (see the module docstring), or
    None to score in this process. ``name`` is the scorer as the manager's messages call it."""
    if isolation == "thread" or (isolation == "auto" and (timeout_s is None or known_safe(scorer))):
        return None
    description = ScorerDescription.of(scorer)
    if description is None:
        if isolation == "process":
            raise ValueError(
                f"reward.config.isolation=process: the scorer {name} cannot be rebuilt in a scorer process (it "
                "is a lambda, a closure or an object of no registered name); register it, give it as "
                "reward.custom_function.path/.name, or set reward.config.isolation=thread")
        logger.warning(
            "reward scorer %s cannot be rebuilt in a scorer process (a lambda, a closure or an object of no "
            "registered name), so it runs on a thread: reward.config.timeout_s=%s cannot stop it if it loops in "
            "C code holding the GIL (a regular expression, a big-integer operation)", name, timeout_s)
        return None
    return ScorerPool(description, processes)


def killed_event(scorer: str, timeout_s: Optional[float], rows: Sequence[int], killed: int) -> dict[str, Any]:
    """The ``meta_info["health_events"]`` record of a manager call that killed ``killed`` scorer processes
    scoring ``rows`` (a :class:`rlplat.contracts.health.HealthEvent`, check ``scorer``, as a dict)."""
    from rlplat.contracts.health import HealthEvent

    rows = [int(row) for row in rows]
    shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
    message = (f"reward scorer {scorer} overran reward.config.timeout_s={timeout_s}: {killed} scorer process(es) "
               f"killed, rows {shown} got the fallback score")
    return HealthEvent(check="scorer", message=message, role="reward",
                       figures={"killed": killed, "timeout_s": timeout_s, "scorer": scorer, "rows": rows}).as_dict()


# -- the pool (caller's side) --------------------------------------------------------------------------

class ScorerPool:
    """Up to ``processes`` scorer processes running the scorer ``description`` rebuilds; see the module
    docstring. Thread-safe; processes start on first use. Pickles as its description and size (a new pool)."""

    def __init__(self, description: ScorerDescription, processes: int = 1):
        self.description, self.processes = description, processes
        self._dispatcher = _Dispatcher(description, processes)
        self._finalizer = weakref.finalize(self, self._dispatcher.stop)

    def __reduce__(self):
        return (ScorerPool, (self.description, self.processes))

    def submit(self, kwargs: Mapping[str, Any], timeout_s: Optional[float]) -> "concurrent.futures.Future[Any]":
        """A future of ``scorer(**kwargs)``'s raw result, or of the :class:`ScorerTimeout`,
        :class:`ScorerError`, :class:`ScorerCrashed` or :class:`ScorerStartError` it failed with."""
        return self._dispatcher.submit([dict(kwargs)], timeout_s)[0]

    def score_all(self, calls: Sequence[Mapping[str, Any]], timeout_s: Optional[float]) -> list[Any]:
        """Each call's raw result, or the exception it failed with (in order); raises
        :class:`ScorerStartError` when the scorer could not be started."""
        futures = self._dispatcher.submit([dict(kwargs) for kwargs in calls], timeout_s)
        try:
            outcomes = [future.exception() or future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        for outcome in outcomes:
            if isinstance(outcome, ScorerStartError):
                raise outcome
        return outcomes

    def pids(self) -> list[int]:
        """The process ids of the pool's scorer processes now (for tests and diagnostics)."""
        return [worker.process.pid for worker in list(self._dispatcher.workers)]

    def close(self) -> None:
        """Stop the scorer processes (killing any still scoring) and the dispatcher; idempotent."""
        self._finalizer()


@dataclasses.dataclass
class _Request:
    kwargs: dict[str, Any]
    timeout_s: Optional[float]
    future: "concurrent.futures.Future[Any]"
    identifier: int
    running: bool = False


class _Worker:
    """One scorer process and what the dispatcher knows of it."""

    def __init__(self, description: ScorerDescription):
        parent_end, child_end = socket.socketpair()
        self.connection = Connection(parent_end.detach())
        child_fd = child_end.detach()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rlplat_rewards.isolation", str(child_fd), str(os.getpid())],
                pass_fds=(child_fd,), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            self.connection.close()
            raise
        finally:
            os.close(child_fd)
        try:
            self.connection.send((description, list(sys.path)))
        except BaseException:
            self.stop(0)
            raise
        self.state = "starting"
        """``starting`` (until it reports ready), ``idle`` or ``busy``."""
        self.since = time.monotonic()
        """When it started, or when its current sample did."""
        self.chunk: collections.deque[_Request] = collections.deque()

    def deadline(self) -> Optional[float]:
        if self.state == "starting":
            return self.since + STARTUP_TIMEOUT_S
        if self.state == "busy" and self.chunk[0].timeout_s is not None:
            return self.since + self.chunk[0].timeout_s
        return None

    def stop(self, grace: float) -> None:
        """Ask the process to exit, kill it after ``grace`` seconds (at once with 0), reap it."""
        if grace > 0:
            try:
                self.connection.send(None)
                self.process.wait(grace)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:  # stuck in the kernel; the SIGKILL takes it when it returns
            logger.warning("scorer process %s did not exit 10 s after SIGKILL", self.process.pid)
        self.connection.close()

    def exit_status(self) -> str:
        try:
            code = self.process.wait(5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        if code < 0:
            return f"was killed by signal {code} ({signal.Signals(-code).name})"
        return f"exited with code {code}"


class _Dispatcher:
    """The pool's state and its thread: the queue of requests, the workers, the deadlines."""

    def __init__(self, description: ScorerDescription, processes: int):
        self.description, self.processes = description, processes
        self.lock = threading.Lock()
        self.queue: collections.deque[_Request] = collections.deque()
        self.workers: list[_Worker] = []
        self.thread: Optional[threading.Thread] = None
        self.stopping = False
        self.wake_reader, self.wake_writer = socket.socketpair()
        self.wake_writer.setblocking(False)  # a full buffer already means "wake up"
        self.identifiers = itertools.count()

    def submit(self, calls: Sequence[dict[str, Any]], timeout_s: Optional[float]) -> list["concurrent.futures.Future[Any]"]:
        requests = [_Request(kwargs, timeout_s, concurrent.futures.Future(), next(self.identifiers)) for kwargs in calls]
        with self.lock:
            if self.stopping:
                raise RuntimeError(f"the scorer pool of {self.description} is closed")
            self.queue.extend(requests)
            if self.thread is None:
                # the thread that starts the processes: PR_SET_PDEATHSIG ends them when it ends
                self.thread = threading.Thread(target=self.run, daemon=True, name="rlplat-scorer-pool")
                self.thread.start()
        self.wake()
        return [request.future for request in requests]

    def wake(self) -> None:
        try:
            self.wake_writer.send(b"\0")
        except OSError:  # closed: the dispatcher has finished
            pass

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            thread = self.thread
        self.wake()
        if thread is None:
            self.close_wake_sockets()
        elif thread is not threading.current_thread():
            thread.join()

    def close_wake_sockets(self) -> None:
        self.wake_reader.close()
        self.wake_writer.close()

    # -- the dispatcher thread ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self.stopping:
                self.assign()
                self.wait_for_news()
                self.enforce_deadlines()
        except BaseException:
            logger.exception("the scorer pool of %s stopped on an error", self.description)
            raise
        finally:
            with self.lock:
                self.stopping = True
                pending, self.queue = list(self.queue), collections.deque()
            for worker in self.workers:
                pending.extend(worker.chunk)
                worker.stop(STOP_GRACE_S if worker.state != "busy" else 0)
            self.workers = []
            for request in pending:
                self.fail(request, RuntimeError(f"the scorer pool of {self.description} was closed"))
            self.close_wake_sockets()

    def next_requests(self, count: int) -> list[_Request]:
        """Up to ``count`` requests from the queue's front, skipping cancelled ones."""
        taken: list[_Request] = []
        with self.lock:
            while self.queue and len(taken) < count:
                request = self.queue.popleft()
                if request.running or request.future.set_running_or_notify_cancel():
                    request.running = True
                    taken.append(request)
        return taken

    def assign(self) -> None:
        with self.lock:
            waiting = len(self.queue)
        free = sum(worker.state != "busy" for worker in self.workers)
        while waiting > free and len(self.workers) < self.processes:
            try:
                self.workers.append(_Worker(self.description))
            except OSError as error:
                self.fail_queue(ScorerStartError(f"could not start a scorer process for {self.description}: {error}"))
                return
            free += 1
        for worker in self.workers:
            if worker.state != "idle":
                continue
            with self.lock:
                waiting = len(self.queue)
            size = min(CHUNK_SIZE, max(1, -(-waiting // self.processes)))
            chunk = self.next_requests(size)
            if not chunk:
                return
            try:
                worker.connection.send([(request.identifier, request.kwargs) for request in chunk])
            except OSError:  # it died while idle; its EOF is read in wait_for_news
                self.requeue(chunk)
                continue
            worker.chunk.extend(chunk)
            worker.state, worker.since = "busy", time.monotonic()

    def wait_for_news(self) -> None:
        deadlines = [deadline for deadline in (worker.deadline() for worker in self.workers) if deadline is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = wait([self.wake_reader, *(worker.connection for worker in self.workers)], timeout)
        for source in ready:
            if source is self.wake_reader:
                self.wake_reader.recv(4096)
        for worker in list(self.workers):
            if worker.connection in ready:
                self.read(worker)

    def read(self, worker: _Worker) -> None:
        """Every message ``worker`` has sent; a closed connection means the process died."""
        try:
            while worker in self.workers and worker.connection.poll():
                self.handle(worker, worker.connection.recv())
        except (EOFError, OSError):
            self.died(worker)

    def handle(self, worker: _Worker, message: tuple) -> None:
        if message[0] == "ready":
            worker.state = "idle"
        elif message[0] == "failed":
            self.retire(worker, 0)
            self.fail_queue(ScorerStartError(f"the scorer process could not rebuild {self.description}:\n{message[1]}"))
        else:
            _, identifier, succeeded, payload = message
            request = worker.chunk.popleft()
            assert request.identifier == identifier, (request.identifier, identifier)
            worker.since = time.monotonic()
            if not worker.chunk:
                worker.state = "idle"
            if succeeded:
                if not request.future.done():
                    request.future.set_result(payload)
            else:
                summary, details = payload
                self.fail(request, ScorerError(f"{summary}\nTraceback in the scorer process "
                                               f"(pid {worker.process.pid}):\n{details}"))

    def died(self, worker: _Worker) -> None:
        status = worker.exit_status()
        state, chunk = worker.state, list(worker.chunk)
        self.retire(worker, 0)
        if state == "starting":
            self.fail_queue(ScorerStartError(f"the scorer process for {self.description} {status} while starting"))
        elif chunk:
            self.fail(chunk[0], ScorerCrashed(f"the scorer process (pid {worker.process.pid}) {status} while "
                                              f"scoring this sample"))
            self.requeue(chunk[1:])
        else:
            logger.warning("an idle scorer process (pid %s) %s; a new one starts when needed",
                           worker.process.pid, status)

    def enforce_deadlines(self) -> None:
        for worker in list(self.workers):
            deadline = worker.deadline()
            if deadline is None or time.monotonic() < deadline:
                continue
            self.read(worker)  # a result that came in since the wait ended
            deadline = worker.deadline() if worker in self.workers else None
            if deadline is None or time.monotonic() < deadline:
                continue
            state, chunk = worker.state, list(worker.chunk)
            self.retire(worker, 0)
            if state == "starting":
                self.fail_queue(ScorerStartError(f"the scorer process for {self.description} was not ready after "
                                                 f"{STARTUP_TIMEOUT_S} s and was killed"))
                continue
            self.fail(chunk[0], ScorerTimeout(
                f"the scorer took longer than reward.config.timeout_s={chunk[0].timeout_s}; its scorer process "
                f"(pid {worker.process.pid}) was killed", killed=True, pid=worker.process.pid))
            self.requeue(chunk[1:])

    def retire(self, worker: _Worker, grace: float) -> None:
        self.workers.remove(worker)
        worker.chunk.clear()
        worker.stop(grace)

    def requeue(self, requests: Sequence[_Request]) -> None:
        with self.lock:
            self.queue.extendleft(reversed(requests))

    def fail_queue(self, error: BaseException) -> None:
        for request in self.next_requests(sys.maxsize):
            self.fail(request, error)

    @staticmethod
    def fail(request: _Request, error: BaseException) -> None:
        if not request.future.done():
            request.future.set_exception(error)


# -- the scorer process --------------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends (PR_SET_PDEATHSIG), then
    make sure its parent ``parent`` had not already died before that."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (AttributeError, OSError):
            pass
    if os.getppid() != parent:
        os._exit(0)


def serve(fd: int, parent: int) -> None:
    """The scorer process: rebuild the scorer, then score each chunk received, one result message per
    sample, until told to stop (None) or the caller's side closes."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the caller decides
    connection = Connection(fd)
    try:
        description, path = connection.recv()
        sys.path[:] = path
        scorer = description.build()
    except BaseException:
        connection.send(("failed", traceback.format_exc()))
        return
    connection.send(("ready",))
    event_loop: Optional[asyncio.AbstractEventLoop] = None
    while True:
        try:
            chunk = connection.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for identifier, kwargs in chunk:
            try:
                result = scorer(**kwargs)
                if inspect.isawaitable(result):
                    event_loop = event_loop or asyncio.new_event_loop()
                    result = event_loop.run_until_complete(_awaited(result))
                message = ForkingPickler.dumps(("result", identifier, True, result))
            except Exception as error:  # the scorer's, or a result that does not pickle
                summary = "".join(traceback.format_exception_only(type(error), error)).strip()
                message = ForkingPickler.dumps(("result", identifier, False, (summary, traceback.format_exc())))
            try:
                connection.send_bytes(message)
            except OSError:  # the caller's side has gone
                return


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


if __name__ == "__main__":
    from rlplat_rewards.isolation import serve as _serve  # the module by its name, so pickles resolve to it

    _serve(int(sys.argv[1]), int(sys.argv[2]))
