"""Running untrusted Python code for the built-in ``python`` tool: :func:`run_python` and
:func:`run_python_async` return a :class:`SandboxResult` whatever the code does.

How a run is contained
======================

The caller makes a fresh temporary directory ``T`` (``main.py`` holds the code, ``stdin`` its input,
``work/`` the empty working directory) and starts a **supervisor** in a new session: the caller's
interpreter as ``python -I -S -B -c <loader>``, reading on stdin first this file's code (compiled when the
caller imported it, so the supervisor opens no file of rlplat's installation and runs the caller's very
version of it), then its instructions, and writing its report on stdout. The supervisor

1. marks itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so every process the code
   starts stays its descendant even after ``setsid()`` or a double fork, and asks for SIGKILL when the
   caller dies (``PR_SET_PDEATHSIG``);
2. enters the namespaces the kernel allows (when not root, through a new **user namespace** that maps
   only the caller's user and group, ``CLONE_NEWUSER``):

   * a new **mount namespace** (``unshare(CLONE_NEWNS)``) where every mount is private and a directory of
     the run's own (``T/shared/0``, ``1``, ...; mode 1777) is bound over each of the machine's
     :data:`SHARED_DIRECTORIES` (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``); ``T`` and the
     interpreter's directories (its prefixes and module path, as it reports them) are bound back at their
     paths where they lay under one of them. What the code writes there is its own, unseen by other runs
     at their paths, and goes with ``T``;
   * a new **PID namespace** (``unshare(CLONE_NEWPID)``), whose init it forks: a small process that
     starts the code, reaps orphans and, once the code has exited, kills everything else in the
     namespace. When a namespace's init dies the kernel kills every process in it, so nothing started
     there can outlive the run, and the code cannot signal any process outside it (a pid names a process
     of its own namespace);
3. starts the code as ``python -I -u -B main.py`` in ``work/``, in a session of its own, with a scrubbed
   environment (``PATH``, ``HOME`` and ``TMPDIR`` = ``work/``, ``LANG``/``LC_ALL`` = ``C.UTF-8``,
   ``PYTHONDONTWRITEBYTECODE``, ``PYTHONUNBUFFERED``, one thread for BLAS/OpenMP; nothing from the
   caller), stdin from the given text, and the limits of :class:`SandboxLimits` (``RLIMIT_CPU``,
   ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_CORE`` = 0). When the caller is root the
   code runs as ``nobody`` (uid and gid 65534, no supplementary groups), so it cannot signal root's
   processes: the trainer's, the supervisor, the namespace's init. The interpreter is the caller's when
   that user can run it, else the system's ``python3`` (:func:`sandbox_python`);
4. reads the code's stdout and stderr, keeping ``output_bytes`` of each; a stream past that stops the
   run. At the wall timeout it stops the run too;
5. at the end (exit, timeout, too much output) kills what is left: the namespace's init (which takes the
   namespace with it), then, repeatedly until none remains, every process whose parent chain leads to the
   supervisor (found in ``/proc``), reaping them as it goes.

The caller waits for the supervisor's answer at most ``wall_seconds`` + :data:`SUPERVISOR_GRACE_SECONDS`;
past that, or when the call is cancelled, it kills the supervisor's descendants and the supervisor the
same way. It then removes ``T``. When the caller is root and a run had no mount namespace, the entries
``nobody`` made at the top of the shared directories while the caller's runs went on are removed once
none goes on (:class:`_Leftovers`; see below).

What remains shared
===================

* ``max_processes`` is Linux's ``RLIMIT_NPROC``: it counts every process and thread of the user, so all
  runs at once as ``nobody`` share it: one run's fork bomb can make another run's ``fork`` fail while it
  lasts (at most its wall timeout). ``memory_bytes`` bounds each process's address space, not the sum
  over a run's processes.
* Without a PID namespace (``pid_namespace=False``, or a kernel or container that refuses one) the
  subreaper and the ``/proc`` sweep still kill every descendant, but the code sees every process on the
  machine; as ``nobody`` it may signal other runs' code (e.g. ``kill(-1, SIGKILL)``).
* Without a mount namespace (``mount_namespace=False``, or refused) the code writes the machine's shared
  directories, where other runs and processes see its files while it runs. When the caller is root, what
  ``nobody`` made at their top during the caller's runs is removed once none of them goes on, so a file
  there outlives its run while another run of the caller goes on; a file made inside a directory that was
  already there, or a file that was there and is changed, stays; a file another process's run (as
  ``nobody``) made meanwhile is removed too. When the caller is not root nothing is removed: the code's
  files are the caller's user's, not to be told from the caller's own.
* When the caller is not root the code runs as the caller's user: it can read and write what the caller
  can (the machine's ``/tmp`` too, through ``/proc/PID/root`` of the caller's processes). In a PID
  namespace it still cannot signal the caller's processes; without one it can, and a process that kills
  the supervisor can escape the sweep.
* The code still reads the machine's ``/proc``: it sees other processes' command lines (not their
  environments when it runs as ``nobody``), and through ``/proc/PID/cwd`` and ``/proc/PID/root`` of
  another run's processes, which run as the same ``nobody``, it reaches that run's working directory and
  private shared directories while that run lasts.
* The rest of the file system is the machine's: ``RLIMIT_FSIZE`` bounds each file, not their number or
  their sum in ``T``. The network is not cut.
* The caller's interpreter serves only when ``nobody`` can read its installation: under a directory it
  cannot search (``/root``, mode 0700, holds pyenv's and many virtual environments) the code gets the
  system's ``python3`` and its standard library only. Such an installation is not made reachable in the
  mount namespace: its paths are fixed (a virtual environment's ``home``, the libraries' run paths), and
  reaching them there would mean putting a searchable directory in place of each one above them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import marshal
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time



def _load_supervisor():
    """The supervisor module beside this file: imported as this package's when this module is, else (a copy
    of the two files run on their own, standard library only) loaded from its path."""
    if __package__:
        import importlib

        return importlib.import_module(f"{__package__}.supervisor")
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")
    spec = importlib.util.spec_from_file_location(f"{__name__}_supervisor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


supervisor = _load_supervisor()
_ENVIRONMENT, SANDBOX_UID, SHARED_DIRECTORIES = supervisor._ENVIRONMENT, supervisor.SANDBOX_UID, supervisor.SHARED_DIRECTORIES
SUPERVISOR_GRACE_SECONDS, _kill_tree = supervisor.SUPERVISOR_GRACE_SECONDS, supervisor._kill_tree


def _marshalled_supervisor_code() -> bytes | str:
    """The supervisor module's code, marshalled, else why it could not be had. The caller hands it to the
    supervisor on stdin, after :data:`_SUPERVISOR_LOADER`, so the supervisor opens no file of the
    installation: it needs no right to read it, and runs the very code the caller imported even when that
    file has changed or gone since."""
    loader = getattr(supervisor, "__loader__", None)
    try:
        if hasattr(loader, "get_code"):
            code = loader.get_code(supervisor.__name__)
        else:  # e.g. pytest's assertion rewriter
            with open(supervisor.__file__, "rb") as file:
                code = compile(file.read(), supervisor.__file__, "exec", dont_inherit=True)
        if code is None:
            raise ImportError(f"its loader {loader!r} gave no code")
        return marshal.dumps(code)
    except Exception as error:  # a loader of any kind: nothing narrower is promised
        return (
            f"the sandbox's supervisor runs the code of {supervisor.__name__}, which could not be read "
            f"({type(error).__name__}: {error}); import it from a source or .pyc file"
        )


_SUPERVISOR_CODE = _marshalled_supervisor_code()
_SUPERVISOR_LOADER = "import marshal, sys; exec(marshal.load(sys.stdin.buffer))"
"""The supervisor's ``-c`` program: it runs the code that comes first on stdin, as ``__main__``."""


class SandboxError(RuntimeError):
    """The sandbox itself could not run (no usable interpreter, no PID namespace when one was required,
    a supervisor failure); never raised for what the code does."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Every number must be positive."""

    cpu_seconds: float = 5
    """CPU time of each process of the run (``RLIMIT_CPU``, rounded up to whole seconds): SIGXCPU at the
    limit, SIGKILL a second later."""
    wall_seconds: float = 10
    """Wall-clock time from the code's start; then every process of the run is killed."""
    memory_bytes: int = 512 * 1024**2
    """Address space of each process (``RLIMIT_AS``); Python raises MemoryError past it."""
    max_processes: int = 32
    """Processes and threads of the user the code runs as (``RLIMIT_NPROC``; see the module docstring)."""
    output_bytes: int = 16 * 1024
    """Bytes kept of stdout and of stderr, each; a stream that goes past it stops the run and the result
    is flagged ``truncated``."""
    file_size_bytes: int = 1024**2
    """Largest file the code may write (``RLIMIT_FSIZE``); writing past it fails with EFBIG."""
    python: str | None = None
    """Interpreter that runs the code. Default: the one running rlplat when the sandbox user can run it
    (when root, ``nobody`` must be able to read its installation), else the system's ``python3``."""

    def __post_init__(self) -> None:
        problems = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "python":
                if value is not None and (not isinstance(value, str) or not value):
                    problems.append(f"python must be a path to an interpreter or None, got {value!r}")
                continue
            integral = field.name not in ("cpu_seconds", "wall_seconds")
            kinds = (int,) if integral else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                kind = "an integer" if integral else "a number"
                problems.append(f"{field.name} must be {kind}, got {value!r}")
            elif not (value > 0 and math.isfinite(value)):
                problems.append(f"{field.name} must be positive, got {value!r}")
        if problems:
            raise ValueError("invalid SandboxLimits: " + "; ".join(problems))


@dataclasses.dataclass
class SandboxResult:
    """What a run did. ``error`` is None exactly when the code exited with code 0 on its own."""

    stdout: str
    """The code's standard output, at most ``output_bytes`` of it (decoded as UTF-8, bad bytes replaced)."""
    stderr: str
    """The code's standard error, at most ``output_bytes`` of it."""
    exit_code: int | None
    """The code's exit status; None when a signal ended it or the run was stopped."""
    signal: int | None
    """The signal that ended the code (SIGKILL when the run was stopped), else None."""
    timed_out: bool
    """The wall timeout stopped the run."""
    truncated: bool
    """A stream went past ``output_bytes``, which stopped the run."""
    duration_s: float
    """Seconds the call took, start to clean-up."""
    error: str | None
    """A short message for the model when the run did not finish normally, e.g. ``"timed out after 10 s"``,
    ``"killed: CPU time limit (5 s)"``, ``"memory limit exceeded (MemoryError)"``, ``"exited with code 1"``."""

    def to_text(self) -> str:
        """What the tool returns to the model: stdout, then stderr, then the error, or ``(no output)``."""
        parts = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        if self.error:
            parts.append(f"error: {self.error}")
        return "\n".join(parts) if parts else "(no output)"


def run_python(
    code: str,
    limits: SandboxLimits = SandboxLimits(),
    *,
    stdin: str = "",
    pid_namespace: bool | None = None,
    mount_namespace: bool | None = None,
) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module docstring) and return what it did; blocks until the
    run is over and every process it started is gone.

    ``pid_namespace``: None uses a PID namespace when the kernel allows one, True requires one
    (:class:`SandboxError` otherwise), False never uses one. ``mount_namespace``: the same for the mount
    namespace that gives the run private :data:`SHARED_DIRECTORIES`."""
    start = time.monotonic()
    launch = _Launch.prepare(code, limits, stdin, pid_namespace, mount_namespace)
    try:
        process = subprocess.Popen(
            launch.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=launch.environment,
            cwd="/",
            start_new_session=True,
        )
        try:
            answer, problems = process.communicate(launch.instructions, timeout=launch.backstop_seconds)
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid, include_root=True, reap=False)
            process.communicate()
            return launch.supervisor_timed_out(time.monotonic() - start)
        except BaseException:
            _kill_tree(process.pid, include_root=True, reap=False)
            process.wait()
            raise
        return launch.result(answer, problems, process.returncode, time.monotonic() - start)
    finally:
        launch.remove()


async def run_python_async(
    code: str,
    limits: SandboxLimits = SandboxLimits(),
    *,
    stdin: str = "",
    pid_namespace: bool | None = None,
    mount_namespace: bool | None = None,
) -> SandboxResult:
    """:func:`run_python` without blocking the event loop; many may run at once. Cancelling it kills
    the run's processes before the cancellation goes on."""
    start = time.monotonic()
    await asyncio.to_thread(sandbox_python, limits)  # the first use tries the interpreter: off the loop
    launch = _Launch.prepare(code, limits, stdin, pid_namespace, mount_namespace)  # a few small files: quick
    try:
        process = await asyncio.create_subprocess_exec(
            *launch.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=launch.environment,
            cwd="/",
            start_new_session=True,
        )
        try:
            answer, problems = await asyncio.wait_for(process.communicate(launch.instructions), launch.backstop_seconds)
        except asyncio.TimeoutError:
            _kill_tree(process.pid, include_root=True, reap=False)
            await process.wait()
            return launch.supervisor_timed_out(time.monotonic() - start)
        except BaseException:
            _kill_tree(process.pid, include_root=True, reap=False)
            await asyncio.shield(process.wait())
            raise
        return launch.result(answer, problems, process.returncode, time.monotonic() - start)
    finally:
        await asyncio.to_thread(launch.remove)


def sandbox_python(limits: SandboxLimits = SandboxLimits()) -> str:
    """The interpreter a run with ``limits`` uses (see :attr:`SandboxLimits.python`); raises
    :class:`SandboxError` when the sandbox user can run none."""
    if limits.python is not None:
        path = shutil.which(limits.python) if os.sep not in limits.python else limits.python
        if path is None or not os.path.isfile(path):
            raise SandboxError(f"SandboxLimits.python: no interpreter at {limits.python!r}")
        problem = _python_problem(os.path.abspath(path))
        if problem:
            raise SandboxError(f"SandboxLimits.python: {problem}")
        return os.path.abspath(path)
    system_python = shutil.which("python3", path=_ENVIRONMENT["PATH"])
    problems = [] if system_python else [f"there is no python3 on {_ENVIRONMENT['PATH']}"]
    for candidate in dict.fromkeys(c for c in (sys.executable, system_python) if c):
        problem = _python_problem(candidate)
        if problem is None:
            return candidate
        problems.append(problem)
    user = f"uid {SANDBOX_UID}" if os.geteuid() == 0 else f"uid {os.geteuid()}, this process's"
    raise SandboxError(
        f"no interpreter that the sandbox's user ({user}) can run: " + "; ".join(problems) + ". Install a "
        "python3 there, make an interpreter's installation readable by that user (and every directory above "
        "it searchable), or name one with SandboxLimits.python (the python tool's config key python)."
    )


# What the interpreter reports of itself: where its installation lies (its executable's directory, its
# prefixes) and its module search path, which is the code's too (the same -I): whatever of them lies under a
# shared directory is bound back into the run's mount namespace.
_PROBE = (
    "import sys; print(*(p for p in (sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix,"
    " sys.base_exec_prefix, *sys.path) if p), sep='\\0')"
)
_probed_pythons: dict[tuple[str, int], str | list[str]] = {}


def _python_problem(path: str) -> str | None:
    """None when the sandbox user can start ``path``; else why not. Tried once per path and user."""
    probed = _probe_python(path)
    return probed if isinstance(probed, str) else None


def _python_directories(path: str) -> list[str]:
    """The directories the interpreter at ``path``, which the sandbox user can start, uses."""
    probed = _probe_python(path)
    return [] if isinstance(probed, str) else probed


def _probe_python(path: str) -> str | list[str]:
    """Start ``path`` as the sandbox user: the directories it uses, else why it could not be started."""
    root = os.geteuid() == 0
    key = (path, SANDBOX_UID if root else os.geteuid())
    if key not in _probed_pythons:
        identity = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []} if root else {}
        try:
            probe = subprocess.run(
                [path, "-I", "-c", _PROBE],
                env=dict(_ENVIRONMENT, HOME="/"),
                cwd="/",
                capture_output=True,
                timeout=60,
                **identity,
            )
            if probe.returncode:
                failure = " ".join(probe.stderr.decode(errors="replace").strip().splitlines()[-1:])
                _probed_pythons[key] = f"{path} fails as uid {key[1]}: {failure}"
            else:
                reported = os.fsdecode(probe.stdout).rstrip("\n").split("\0")
                _probed_pythons[key] = list(dict.fromkeys(
                    entry if os.path.isdir(entry) else os.path.dirname(entry)
                    for entry in reported if os.path.isabs(entry) and os.path.exists(entry)
                ))  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            _probed_pythons[key] = f"{path} cannot be started as uid {key[1]}: {exc}"
        blocking = root and isinstance(_probed_pythons[key], str) and _unsearchable_directory(path)
        if blocking:
            _probed_pythons[key] += f" (the directory {blocking} is not searchable by that user)"
    return _probed_pythons[key]


def _unsearchable_directory(path: str) -> str | None:
    """The first directory on the way to ``path`` (as written, then with links resolved) that the sandbox
    user may not search by its mode bits, described with its mode; None if there is none."""
    for way in (os.path.abspath(path), os.path.realpath(path)):
        parts = way.split(os.sep)
        for end in range(2, len(parts)):
            directory = os.sep.join(parts[:end])
            try:
                status = os.stat(directory)
            except OSError:
                continue
            shift = 6 if status.st_uid == SANDBOX_UID else 3 if status.st_gid == SANDBOX_UID else 0
            if not status.st_mode >> shift & 1:
                return f"{directory} (mode {status.st_mode & 0o7777:04o})"
    return None


@dataclasses.dataclass
class _Launch:
    """One run's temporary directory, supervisor command line and instructions."""

    directory: str
    argv: list[str]
    environment: dict[str, str]
    instructions: bytes
    limits: SandboxLimits
    backstop_seconds: float
    leftovers_tracked: bool
    """Counted in :data:`_LEFTOVERS` (the caller is root) until :meth:`remove`."""
    private_directories: bool | None = None
    """Whether the run had private :data:`SHARED_DIRECTORIES`, once the supervisor has said."""

    @classmethod
    def prepare(
        cls, code: str, limits: SandboxLimits, stdin: str, pid_namespace: bool | None, mount_namespace: bool | None
    ) -> "_Launch":
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if not isinstance(stdin, str):
            raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
        for name, choice in (("pid_namespace", pid_namespace), ("mount_namespace", mount_namespace)):
            if choice not in (None, True, False):
                raise ValueError(f"{name} must be None, True or False, got {choice!r}")
        if isinstance(_SUPERVISOR_CODE, str):
            raise SandboxError(_SUPERVISOR_CODE)
        python = sandbox_python(limits)
        root = os.geteuid() == 0
        directory = tempfile.mkdtemp(prefix="rlplat-sandbox-")
        try:
            work = os.path.join(directory, "work")
            os.mkdir(work, 0o700)
            with open(os.path.join(directory, "main.py"), "w", encoding="utf-8", errors="replace") as file:
                file.write(code)
            with open(os.path.join(directory, "stdin"), "w", encoding="utf-8", errors="replace") as file:
                file.write(stdin)
            os.chmod(os.path.join(directory, "stdin"), 0o600)
            if root:
                # nobody may enter the directory (not list it), read main.py and own work/.
                os.chmod(directory, 0o711)
                os.chmod(os.path.join(directory, "main.py"), 0o644)
                os.chown(work, SANDBOX_UID, SANDBOX_UID)
        except BaseException:
            _remove_tree(directory)
            raise
        instructions = {
            "directory": directory,
            "python": python,
            "caller_pid": os.getpid(),
            "pid_namespace": pid_namespace,
            "mount_namespace": mount_namespace,
            "shared_directories": list(SHARED_DIRECTORIES),
            "keep": _python_directories(python),
            "identity": [SANDBOX_UID, SANDBOX_UID] if root else None,
            "limits": dataclasses.asdict(limits),
        }
        if root:
            _LEFTOVERS.run_started()
        return cls(
            directory=directory,
            argv=[sys.executable, "-I", "-S", "-B", "-c", _SUPERVISOR_LOADER],
            environment={"PATH": _ENVIRONMENT["PATH"], "LANG": "C.UTF-8"},
            instructions=_SUPERVISOR_CODE + marshal.dumps(instructions),
            limits=limits,
            backstop_seconds=limits.wall_seconds + SUPERVISOR_GRACE_SECONDS,
            leftovers_tracked=root,
        )

    def remove(self) -> None:
        _remove_tree(self.directory)
        if self.leftovers_tracked:
            self.leftovers_tracked = False
            _LEFTOVERS.run_ended(private=self.private_directories)

    def supervisor_timed_out(self, duration: float) -> SandboxResult:
        return SandboxResult(
            stdout="",
            stderr="",
            exit_code=None,
            signal=int(signal.SIGKILL),
            timed_out=True,
            truncated=False,
            duration_s=duration,
            error=f"timed out after {self.limits.wall_seconds:g} s",
        )

    def result(self, answer: bytes, problems: bytes, returncode: int, duration: float) -> SandboxResult:
        try:
            report = marshal.loads(answer)
        except (EOFError, ValueError, TypeError):
            if returncode < 0:
                # Only the code can have done this: when the caller is not root and there is no PID
                # namespace, the code runs as the supervisor's user and may signal it.
                return SandboxResult(
                    stdout="",
                    stderr="",
                    exit_code=None,
                    signal=-returncode,
                    timed_out=False,
                    truncated=False,
                    duration_s=duration,
                    error=f"the code killed its sandbox's supervisor (signal {-returncode}); its output is lost",
                )
            raise SandboxError(
                f"the sandbox supervisor exited with status {returncode} without a result; its stderr: "
                + problems.decode(errors="replace")[-2000:]
            ) from None
        if report.get("setup_error"):
            raise SandboxError(report["setup_error"])
        self.private_directories = report["private_directories"]
        return SandboxResult(
            stdout=report["stdout"],
            stderr=report["stderr"],
            exit_code=report["exit_code"],
            signal=report["signal"],
            timed_out=report["stopped"] == "timeout",
            truncated=report["stopped"] == "output",
            duration_s=duration,
            error=_describe_outcome(report, self.limits),
        )


def _describe_outcome(report: dict[str, object], limits: SandboxLimits) -> str | None:
    """The model's error message for a supervisor ``report`` (keys ``stopped``, ``exit_code``,
    ``signal``, ``cpu_seconds``, ``stderr``, ``truncated_stream``); None for a clean exit."""
    if report["stopped"] == "timeout":
        return f"timed out after {limits.wall_seconds:g} s"
    if report["stopped"] == "output":
        return f"output truncated at {limits.output_bytes} bytes ({report['truncated_stream']}); the run was stopped"
    code, number = report["exit_code"], report["signal"]
    if code == 0 and number is None:
        return None
    cpu_limit = math.ceil(limits.cpu_seconds)
    if number == signal.SIGXCPU or (number == signal.SIGKILL and report["cpu_seconds"] >= cpu_limit):
        return f"killed: CPU time limit ({cpu_limit} s)"
    stderr = report["stderr"]
    if "MemoryError" in stderr:
        return "memory limit exceeded (MemoryError)"
    if "BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr or "can't start new thread" in stderr:
        return f"process limit reached ({limits.max_processes} processes and threads)"
    if "File too large" in stderr:
        return f"file size limit exceeded ({limits.file_size_bytes} bytes)"
    if number is not None:
        return f"killed by signal {signal.Signals(number).name}" if number in signal.valid_signals() else f"killed by signal {number}"
    return f"exited with code {code}"


def _remove_tree(directory: str) -> None:
    def allow_and_retry(function, path, _exc_info):
        # A non-root caller cannot remove what the code made read-only; root ignores modes.
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        function(path)

    if os.path.exists(directory):
        shutil.rmtree(directory, onerror=allow_and_retry)


class _Leftovers:
    """The fallback for runs without private shared directories, when the caller is root: removes the
    entries that the sandbox user (uid :data:`SANDBOX_UID`) made at the top of :data:`SHARED_DIRECTORIES`
    while runs of this process went on, once none goes on, so that one run's clean-up never takes away
    the files of another run of this process that is still using them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._before: dict[str, set[tuple[str, int]]] = {}
        self._sweep = False

    def run_started(self) -> None:
        with self._lock:
            if self._running == 0:
                listings = {path: _entries(path) for path in SHARED_DIRECTORIES}
                self._before = {path: entries for path, entries in listings.items() if entries is not None}
                self._sweep = False
            self._running += 1

    def run_ended(self, *, private: bool | None) -> None:
        """``private``: whether the run had private shared directories (None: unknown, as after a timeout of
        the supervisor)."""
        with self._lock:  # held while removing: no run starts meanwhile, so none of its files is taken
            self._running -= 1
            self._sweep = self._sweep or not private
            if self._running or not self._sweep:
                return
            for path, before in self._before.items():
                for name, _ in (_entries(path) or set()) - before:
                    _remove_if_made_by_the_sandbox_user(os.path.join(path, name))


_LEFTOVERS = _Leftovers()


def _entries(directory: str) -> set[tuple[str, int]] | None:
    """(name, inode) of each entry of ``directory``; None when it cannot be listed."""
    try:
        with os.scandir(directory) as listing:
            return {(entry.name, entry.inode()) for entry in listing}
    except OSError:
        return None


def _remove_if_made_by_the_sandbox_user(path: str) -> None:
    try:
        if os.lstat(path).st_uid != SANDBOX_UID:
            return
        if os.path.isdir(path) and not os.path.islink(path):
            # Safe against a symbolic link swapped in meanwhile: rmtree works through descriptors on Linux.
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass
