"""The ``python`` tool's sandbox: normal runs, limits, hostile code, and nothing left behind.

Every run uses short limits (CPU 1 s, wall 2 s, or 6 s where CPU time must run out first) and must come
back within the wall timeout plus :data:`MARGIN`; after every test no process of its runs and no child
of this process is alive, no run directory is left and no file descriptor leaked (``machine_is_clean``).
Runs that must wait for one another meet on an abstract unix socket the test listens on (``Meeting``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from rlplat_python_tool import sandbox
from rlplat_python_tool.sandbox import SandboxError, SandboxLimits, SandboxResult, run_python, run_python_async

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=2, memory_bytes=256 * 1024**2, max_processes=16)
# On a loaded machine a busy loop may get less than a CPU second in two wall seconds, and filling 256 MiB
# takes a second: tests that need CPU time to reach their limit leave the wall timeout room.
CPU_LIMITS = dataclasses.replace(LIMITS, wall_seconds=6)
# Seconds past the wall timeout a hostile run may take to come back (start-up and clean-up). make test runs
# the suite on two workers, so another test file's processes share the two cores with a fork bomb's 16
# spinning processes while they are killed: seen 2.5 s past the timeout (make test-matrix, 1 thread).
MARGIN = 3.0
ROOT = os.geteuid() == 0


@pytest.fixture(scope="session")
def namespaces_available() -> bool:
    """Whether the kernel grants the sandbox a PID namespace here (an unprivileged container may not)."""
    try:
        run_python("pass", LIMITS, pid_namespace=True)
    except SandboxError:
        return False
    return True


@pytest.fixture(scope="session")
def mount_namespaces_available() -> bool:
    """Whether the kernel grants the sandbox a mount namespace here (a container without CAP_SYS_ADMIN, or
    one whose security profile forbids mount, may not)."""
    try:
        run_python("pass", LIMITS, mount_namespace=True)
    except SandboxError:
        return False
    return True


def living_processes(predicate) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as file:
                status = dict(line.split(":", 1) for line in file.read().splitlines() if ":" in line)
            if status["State"].split()[0] not in ("Z", "X") and predicate(int(name), status):
                found.append(int(name))
        except OSError:
            continue
    return found


def processes_of_runs_under(directory: str) -> list[int]:
    """Living processes working in, or with HOME in, a run directory under ``directory``."""

    def of_a_run(pid: int, status: dict) -> bool:
        if os.readlink(f"/proc/{pid}/cwd").startswith(directory):
            return True
        with open(f"/proc/{pid}/environ", "rb") as file:
            return f"HOME={directory}".encode() in file.read()

    return living_processes(of_a_run)


def children_of_this_process() -> list[int]:
    me = str(os.getpid())
    return living_processes(lambda pid, status: status["PPid"].strip() == me)


@pytest.fixture(scope="module")
def runs_directory():
    """This module's runs make their directories here, apart from any other test's sandbox runs."""
    directory = tempfile.mkdtemp(prefix="rlplat-sandbox-tests-")
    os.chmod(directory, 0o711)  # the sandbox user must reach the runs' working directories
    yield directory
    shutil.rmtree(directory)


@pytest.fixture(autouse=True)
def machine_is_clean(runs_directory, monkeypatch):
    """After each test: no process of its runs alive, no child of this process alive, no run directory
    left, no file descriptor of this process leaked."""
    monkeypatch.setattr(tempfile, "tempdir", runs_directory)
    descriptors = len(os.listdir("/proc/self/fd"))
    yield
    assert processes_of_runs_under(runs_directory) == []
    assert children_of_this_process() == []
    assert os.listdir(runs_directory) == []
    assert len(os.listdir("/proc/self/fd")) == descriptors


@pytest.fixture(params=[True, False], ids=["pid-namespace", "subreaper-only"])
def pid_namespace(request, namespaces_available) -> bool:
    if request.param and not namespaces_available:
        pytest.skip("the kernel refuses PID namespaces here")
    return request.param


@pytest.fixture(params=[True, False], ids=["mount-namespace", "removed-afterwards"])
def mount_namespace(request, mount_namespaces_available) -> bool:
    if request.param and not mount_namespaces_available:
        pytest.skip("the kernel refuses mount namespaces here")
    if not request.param and not ROOT:
        pytest.skip("without root and a mount namespace the code's files are the caller's own and stay (module docstring)")
    return request.param


@pytest.fixture
def name():
    """A file name no one else uses; whatever a failing test left under it in the shared directories goes."""
    chosen = f"rlplat-sandbox-test-{uuid.uuid4().hex}"
    yield chosen
    for path in left_in_the_shared_directories(chosen):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def left_in_the_shared_directories(name: str) -> list[str]:
    """The entries of the machine's shared directories whose names start with ``name``."""
    return [
        os.path.join(directory, entry)
        for directory in sandbox.SHARED_DIRECTORIES
        if os.path.isdir(directory)
        for entry in os.listdir(directory)
        if entry.startswith(name)
    ]


def world_writable_shared_directories() -> list[str]:
    return [d for d in sandbox.SHARED_DIRECTORIES if os.path.isdir(d) and os.stat(d).st_mode & 0o002]


class Meeting:
    """An abstract unix socket the test listens on: runs connect, say they are ready, and go on when told."""

    def __init__(self):
        self.address = f"rlplat-sandbox-test-{uuid.uuid4().hex}"
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind("\0" + self.address)
        self.server.listen(8)
        self.server.setblocking(False)
        self.waiting: list[socket.socket] = []

    async def arrival(self, *runs: asyncio.Task) -> None:
        """Wait (at most a wall timeout and a margin) until one more of ``runs`` has connected and said it is
        ready; else fail with what the runs returned."""
        loop = asyncio.get_running_loop()
        try:
            connection, _ = await asyncio.wait_for(loop.sock_accept(self.server), LIMITS.wall_seconds + MARGIN)
            self.waiting.append(connection)
            said = await asyncio.wait_for(loop.sock_recv(connection, 5), LIMITS.wall_seconds + MARGIN)
        except asyncio.TimeoutError:
            self.release()
            raise AssertionError(f"no run came: {await asyncio.gather(*runs, return_exceptions=True)}") from None
        assert said == b"ready"

    def release(self) -> None:
        for connection in self.waiting:
            try:
                connection.sendall(b"go")
            except OSError:  # that run is over already; its result tells why
                pass
            connection.close()
        self.waiting.clear()

    def close(self) -> None:
        self.release()
        self.server.close()


# The code's side of a Meeting, at the address in the variable ``address``.
WAIT_FOR_THE_TEST = """
with socket.socket(socket.AF_UNIX) as meeting:
    meeting.connect("\\0" + address)
    meeting.sendall(b"ready")
    meeting.recv(2)
"""


def run(code: str, limits: SandboxLimits = LIMITS, **kwargs) -> SandboxResult:
    start = time.monotonic()
    result = run_python(textwrap.dedent(code), limits, **kwargs)
    elapsed = time.monotonic() - start
    assert elapsed <= limits.wall_seconds + MARGIN, f"took {elapsed:.2f} s: {result}"
    assert result.duration_s <= elapsed
    return result


# --- limits and results ----------------------------------------------------------------------------


def test_limit_defaults():
    limits = SandboxLimits()
    assert (limits.cpu_seconds, limits.wall_seconds) == (5, 10)
    assert limits.memory_bytes == 512 * 1024**2
    assert (limits.max_processes, limits.output_bytes, limits.file_size_bytes) == (32, 16 * 1024, 1024**2)
    assert limits.python is None


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("cpu_seconds", 0, "cpu_seconds must be positive, got 0"),
        ("wall_seconds", -1.5, "wall_seconds must be positive, got -1.5"),
        ("wall_seconds", float("inf"), "wall_seconds must be positive, got inf"),
        ("memory_bytes", 1.5, "memory_bytes must be an integer, got 1.5"),
        ("max_processes", True, "max_processes must be an integer, got True"),
        ("output_bytes", "16k", "output_bytes must be an integer, got '16k'"),
        ("file_size_bytes", 0, "file_size_bytes must be positive, got 0"),
        ("python", "", "python must be a path to an interpreter or None, got ''"),
    ],
)
def test_invalid_limits_are_refused_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match="invalid SandboxLimits: .*" + re.escape(message)):
        SandboxLimits(**{field: value})


def test_an_interpreter_that_does_not_exist_is_a_sandbox_error():
    with pytest.raises(SandboxError, match="SandboxLimits.python: no interpreter at '/nonexistent/python'"):
        run_python("print(1)", SandboxLimits(python="/nonexistent/python"))


def test_no_usable_interpreter_is_a_sandbox_error_that_says_what_to_do(monkeypatch):
    monkeypatch.setattr(sandbox.sys, "executable", "/nonexistent/python3")
    monkeypatch.setattr(sandbox.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(SandboxError) as caught:
        run_python("print(1)", LIMITS)
    message = str(caught.value)
    assert message.startswith("no interpreter that the sandbox's user (uid ")
    assert "there is no python3 on /usr/local/bin:/usr/bin:/bin; /nonexistent/python3 cannot be started as uid" in message
    assert message.endswith("or name one with SandboxLimits.python (the python tool's config key python).")


@pytest.mark.skipif(not ROOT, reason="only a root caller's code runs as another user")
def test_an_interpreter_the_sandbox_user_cannot_reach_is_refused_with_the_directory_in_the_way_named():
    private = tempfile.mkdtemp()  # mode 0700, in this module's runs directory
    try:
        python = os.path.join(private, "python3")
        os.symlink(sandbox.sandbox_python(), python)
        expected = f"SandboxLimits.python: {python} cannot be started as uid 65534: [Errno 13] Permission denied"
        with pytest.raises(SandboxError, match=re.escape(expected) + ".*" + re.escape(
            f" (the directory {private} (mode 0700) is not searchable by that user)"
        )):  # fmt: skip
            run_python("print(1)", SandboxLimits(python=python))
    finally:
        shutil.rmtree(private)


def test_to_text_gives_stdout_then_stderr_then_the_error():
    result = SandboxResult("4\n", "warning\n", 1, None, False, False, 0.1, "exited with code 1")
    assert result.to_text() == "4\nstderr:\nwarning\nerror: exited with code 1"
    assert SandboxResult("", "", 0, None, False, False, 0.1, None).to_text() == "(no output)"


# --- normal runs -------------------------------------------------------------------------------------


def test_printing():
    result = run("print(6 * 7)\nprint('done')")
    assert (result.stdout, result.stderr, result.exit_code, result.signal) == ("42\ndone\n", "", 0, None)
    assert (result.error, result.timed_out, result.truncated) == (None, False, False)
    assert result.to_text() == "42\ndone"


def test_an_exception_gives_its_traceback_and_exit_code_1():
    result = run("def f():\n    raise ValueError('bad value')\nf()")
    assert result.exit_code == 1
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert "ValueError: bad value" in result.stderr
    assert result.error == "exited with code 1"


def test_an_exit_code_is_reported():
    result = run("import sys; print('before'); sys.exit(3)")
    assert (result.stdout, result.exit_code, result.error) == ("before\n", 3, "exited with code 3")


def test_stdin_is_the_given_text():
    result = run("import sys\nlines = sys.stdin.read().splitlines()\nprint(sum(map(int, lines)))", stdin="1\n2\n39\n")
    assert result.stdout == "42\n"


def test_no_stdin_reads_as_end_of_file():
    result = run("import sys; print(repr(sys.stdin.read()))")
    assert result.stdout == "''\n"


def test_the_working_directory_is_empty_writable_and_removed_afterwards():
    result = run(
        """
        import os
        print(os.listdir("."))
        with open("notes.txt", "w") as file:
            file.write("kept for this run only")
        print(open("notes.txt").read())
        print(os.getcwd())
        """
    )
    listing, content, work = result.stdout.splitlines()
    assert (listing, content) == ("[]", "kept for this run only")
    assert not os.path.exists(work)


def test_the_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("RLPLAT_TEST_SECRET_TOKEN", "hunter2")
    result = run("import os, json; print(json.dumps(dict(os.environ)))")
    environment = json.loads(result.stdout)
    assert "hunter2" not in result.stdout
    assert set(environment) == {
        "PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
        "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
    }  # fmt: skip
    assert environment["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert environment["HOME"] == environment["TMPDIR"]
    assert environment["HOME"].endswith("/work")


def test_the_interpreter_runs_isolated_with_the_limits_set():
    result = run(
        """
        import resource, sys
        print(sys.flags.isolated, sys.flags.ignore_environment, sys.flags.no_user_site, sys.flags.dont_write_bytecode)
        for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CORE"):
            print(name, *resource.getrlimit(getattr(resource, name)))
        """
    )
    assert result.stdout.splitlines() == [
        "1 1 1 1",
        "RLIMIT_CPU 1 2",
        f"RLIMIT_AS {256 * 1024**2} {256 * 1024**2}",
        "RLIMIT_NPROC 16 16",
        f"RLIMIT_FSIZE {1024**2} {1024**2}",
        "RLIMIT_CORE 0 0",
    ]


@pytest.mark.skipif(not ROOT, reason="the code runs as the caller's user when the caller is not root")
def test_as_root_the_code_runs_as_nobody_without_groups():
    result = run("import os; print(os.getresuid(), os.getresgid(), os.getgroups())")
    assert result.stdout == "(65534, 65534, 65534) (65534, 65534, 65534) []\n"


def test_writing_a_file_past_the_size_limit_fails():
    result = run("open('big', 'wb').write(b'x' * 2 * 1024**2)")
    assert "File too large" in result.stderr
    assert result.error == f"file size limit exceeded ({1024**2} bytes)"


# --- hostile code --------------------------------------------------------------------------------------


def test_an_infinite_loop_is_killed_at_the_cpu_limit():
    result = run("while True: pass", CPU_LIMITS)
    assert result.signal == signal.SIGXCPU
    assert result.error == "killed: CPU time limit (1 s)"
    assert not result.timed_out


def test_output_before_the_kill_reaches_the_model():
    result = run("print('started', flush=False)\nwhile True: pass", CPU_LIMITS)
    assert result.stdout == "started\n"
    assert result.to_text() == "started\nerror: killed: CPU time limit (1 s)"


def test_sleeping_forever_hits_the_wall_timeout():
    result = run("import time; time.sleep(1e6)")
    assert result.timed_out
    assert (result.exit_code, result.signal, result.error) == (None, signal.SIGKILL, "timed out after 2 s")
    assert result.duration_s >= LIMITS.wall_seconds


def test_a_huge_allocation_is_a_memory_error():
    result = run("x = bytearray(10**11)")
    assert "MemoryError" in result.stderr
    assert result.error == "memory limit exceeded (MemoryError)"


def test_a_growing_list_hits_the_memory_limit():
    limits = dataclasses.replace(CPU_LIMITS, memory_bytes=128 * 1024**2)
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))", limits)
    assert result.error == "memory limit exceeded (MemoryError)"


def test_a_fork_bomb_hits_the_process_limit():
    result = run("import os\nwhile True:\n    os.fork()")
    assert "BlockingIOError" in result.stderr
    assert result.error == "process limit reached (16 processes and threads)"


def test_a_multiprocessing_bomb_hits_the_process_limit():
    result = run(
        """
        import multiprocessing, time
        def spin():
            while True:
                pass
        if __name__ == "__main__":
            workers = [multiprocessing.Process(target=spin) for _ in range(100)]
            for worker in workers:
                worker.start()
        """
    )
    assert result.error is not None
    assert result.error.startswith(("process limit reached", "killed: CPU time limit", "timed out"))


def test_one_huge_print_is_truncated_and_stops_the_run():
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run("print('x' * 10**8)\nprint('never reached')")
    assert result.truncated and not result.timed_out
    assert result.stdout == "x" * LIMITS.output_bytes
    assert result.error == f"output truncated at {LIMITS.output_bytes} bytes (stdout); the run was stopped"
    # The caller never holds the flood: its peak memory (KiB) grows by far less than 100 MB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 20 * 1024


def test_an_endless_print_loop_is_truncated_promptly():
    result = run("import sys\nwhile True:\n    print('spam', file=sys.stderr)", CPU_LIMITS)
    assert result.truncated and not result.timed_out  # stopped by the flood, not by a limit
    assert len(result.stderr.encode()) == LIMITS.output_bytes
    assert result.error.endswith("(stderr); the run was stopped")


@pytest.mark.skipif(not ROOT, reason="without root the code runs as the caller's user (see the module docstring)")
def test_the_code_cannot_signal_the_caller_its_parent_or_init(pid_namespace):
    result = run(
        f"""
        import os, signal
        outcomes = []
        # -1 is every process it may signal but itself: only tried in a namespace, since without one it
        # reaches every process of the sandbox user on this machine (other tests' runs included).
        for target in ({os.getpid()}, os.getppid(), 1{", -1" if pid_namespace else ""}):
            try:
                os.kill(target, signal.SIGKILL)
                outcomes.append("sent")
            except OSError as error:
                outcomes.append(type(error).__name__)
        print(*outcomes, flush=True)
        os.kill(0, signal.SIGKILL)  # its own process group, itself included
        """,
        pid_namespace=pid_namespace,
    )
    outcomes = result.stdout.split()
    assert len(outcomes) == (4 if pid_namespace else 3) and "sent" not in outcomes, outcomes
    assert result.signal == signal.SIGKILL
    assert result.error == "killed by signal SIGKILL"


ESCAPE = """
    import os, subprocess, sys
    # A double fork into a session of its own: the sleeper is no child of the code and in no group of it.
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(write_end, os.readlink("/proc/self").encode())  # its pid as this machine's /proc numbers it
            os.execv("/bin/sleep", ["sleep", "1000"])
        os._exit(0)
    os.wait()
    print(os.read(read_end, 100).decode(), flush=True)
    # And a subprocess in a new session that ignores SIGTERM.
    sleeper = subprocess.Popen([sys.executable, "-c",
        "import os, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.readlink('/proc/self'), flush=True);"
        " os.execv('/bin/sleep', ['sleep', '1000'])"], start_new_session=True, stdout=subprocess.PIPE)
    print(sleeper.stdout.readline().decode().strip(), flush=True)
"""


@pytest.mark.parametrize("ending", ["exits", "times-out"])
def test_no_process_outlives_the_call_even_in_a_new_session(pid_namespace, ending):
    code = ESCAPE + ("" if ending == "exits" else "    import time; time.sleep(1e6)\n")
    result = run(code, pid_namespace=pid_namespace)
    pids = [int(line) for line in result.stdout.split()]
    assert len(pids) == 2, result
    assert result.timed_out == (ending == "times-out")
    assert result.exit_code == (0 if ending == "exits" else None)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} survived the call"


def test_a_background_child_does_not_hold_the_call():
    result = run(
        """
        import subprocess
        subprocess.Popen(["sleep", "1000"], stdout=None)  # inherits stdout, so the pipe stays open
        print("main is done")
        """
    )
    assert (result.stdout, result.exit_code, result.timed_out) == ("main is done\n", 0, False)
    assert result.duration_s < 1.5


def test_the_caller_goes_on_after_hostile_runs():
    assert run("while True: pass", CPU_LIMITS).error is not None
    assert run("x = bytearray(10**11)", CPU_LIMITS).error is not None
    # Refused, or the supervisor killed (a caller that is not root, without a PID namespace), or ignored by
    # the namespace's init: whichever, the caller goes on.
    run("import os, signal; os.kill(os.getppid(), signal.SIGKILL)", CPU_LIMITS)
    assert run("print('still fine')").stdout == "still fine\n"


# --- concurrency -------------------------------------------------------------------------------------


def test_eight_runs_at_once_are_independent():
    code = """
        import os, sys
        index = int(sys.stdin.read())
        with open("mine.txt", "w") as file:
            file.write(str(index))
        print(index, os.listdir("."), open("mine.txt").read(), os.getcwd())
    """

    async def main():
        return await asyncio.gather(*(run_python_async(textwrap.dedent(code), LIMITS, stdin=str(i)) for i in range(8)))

    start = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - start < LIMITS.wall_seconds + MARGIN
    directories = set()
    for index, result in enumerate(results):
        number, listing, content, work = result.stdout.split()
        assert (number, listing, content) == (str(index), "['mine.txt']", str(index))
        directories.add(work)
    assert len(directories) == 8


def test_the_event_loop_keeps_running_during_a_run():
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.create_task(ticker())
        result = await run_python_async("import time; time.sleep(1); print('slept')", LIMITS)
        task.cancel()
        return result, ticks

    result, ticks = asyncio.run(main())
    assert result.stdout == "slept\n"
    assert ticks >= 10  # 1 s of sleeping code at 20 ticks per second, with room for a loaded machine


ESCAPE_AND_SLEEP = textwrap.dedent(ESCAPE) + "import time; time.sleep(1e6)\n"


def test_cancelling_an_async_run_kills_its_processes():
    async def main():
        task = asyncio.create_task(run_python_async(ESCAPE_AND_SLEEP, LIMITS))
        await asyncio.sleep(0.8)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < LIMITS.wall_seconds  # the cancellation, not the timeout, ended it
    # machine_is_clean checks that no process of the run is left.


def test_the_async_form_reports_like_the_blocking_one():
    result = asyncio.run(run_python_async("while True: pass", CPU_LIMITS))
    assert result.error == "killed: CPU time limit (1 s)"
    assert result.duration_s < CPU_LIMITS.wall_seconds + MARGIN


def test_a_required_namespace_is_used(namespaces_available):
    if not namespaces_available:
        with pytest.raises(SandboxError, match="a PID namespace was required"):
            run_python("pass", LIMITS, pid_namespace=True)
        return
    result = run("import os; print(os.getpid())", pid_namespace=True)
    assert result.stdout == "2\n"  # the namespace's init is 1, the code is the next process


# --- the shared directories ------------------------------------------------------------------------

WRITE_IN_THE_SHARED_DIRECTORIES = """
import os, sys
name = sys.stdin.read()
for directory in {directories!r}:
    with open(os.path.join(directory, name), "w") as file:
        file.write("left behind")
    os.mkdir(os.path.join(directory, name + ".d"))
    open(os.path.join(directory, name + ".d", "inside"), "w").close()
print("written")
"""


def test_files_written_in_the_shared_directories_do_not_survive_the_call(mount_namespace, name):
    directories = world_writable_shared_directories()
    assert "/tmp" in directories
    code = WRITE_IN_THE_SHARED_DIRECTORIES.format(directories=directories)
    result = run(code, stdin=name, mount_namespace=mount_namespace)
    assert result.stdout == "written\n", result
    assert left_in_the_shared_directories(name) == []


SAME_NAMES_IN_THE_SHARED_DIRECTORIES = """
import os, socket, sys
who, name, address = sys.stdin.read().split()
paths = [os.path.join(directory, name) for directory in {directories!r}]
for path in paths:
    with open(path, "x") as file:  # FileExistsError if the other run's file were in sight
        file.write(who)
""" + WAIT_FOR_THE_TEST + """
print(*(open(path).read() for path in paths))
"""


def test_a_concurrent_call_does_not_see_the_files_of_another(mount_namespaces_available, name):
    if not mount_namespaces_available:
        pytest.skip("the kernel refuses mount namespaces here: runs share the machine's /tmp (module docstring)")
    directories = world_writable_shared_directories()
    code = SAME_NAMES_IN_THE_SHARED_DIRECTORIES.format(directories=directories)
    meeting = Meeting()

    async def main():
        runs = [
            asyncio.create_task(run_python_async(code, LIMITS, stdin=f"{who} {name} {meeting.address}", mount_namespace=True))
            for who in ("first", "second")
        ]
        await meeting.arrival(*runs)
        await meeting.arrival(*runs)
        on_the_machine = left_in_the_shared_directories(name)  # both runs have written, and wait
        meeting.release()
        return on_the_machine, await asyncio.gather(*runs)

    try:
        on_the_machine, results = asyncio.run(main())
    finally:
        meeting.close()
    assert on_the_machine == []
    assert [result.stdout.split() for result in results] == [["first"] * len(directories), ["second"] * len(directories)]


@pytest.mark.skipif(not ROOT, reason="without root nothing is removed when there is no mount namespace (module docstring)")
def test_without_a_mount_namespace_only_what_the_sandbox_user_made_during_the_call_is_removed(monkeypatch, name):
    there_before = os.path.join("/tmp", f"{name}-before")  # nobody's, made before the call
    made_by_root = os.path.join("/tmp", f"{name}-root")  # made during the call by another user
    with open(there_before, "w") as file:
        file.write("before")
    os.chown(there_before, sandbox.SANDBOX_UID, sandbox.SANDBOX_UID)
    run_started = sandbox._LEFTOVERS.run_started

    def and_root_makes_a_file():
        run_started()
        open(made_by_root, "w").close()

    monkeypatch.setattr(sandbox._LEFTOVERS, "run_started", and_root_makes_a_file)
    code = """
        import sys
        name = sys.stdin.read()
        open(f"/tmp/{name}-before", "a").write(", during")
        open(f"/tmp/{name}-code", "w").close()
    """
    result = run(code, stdin=name, mount_namespace=False)
    assert result.error is None, result
    assert sorted(left_in_the_shared_directories(name)) == [there_before, made_by_root]
    with open(there_before) as file:
        assert file.read() == "before, during"  # changed, and kept: it was not made during the call


LONG_CALL = """
import os, socket, sys
name, address = sys.stdin.read().split()
open(f"/tmp/{name}-long", "w").close()
""" + WAIT_FOR_THE_TEST + """
print(os.path.exists(f"/tmp/{name}-long"), os.path.exists(f"/tmp/{name}-short"))
"""


@pytest.mark.skipif(not ROOT, reason="without root nothing is removed when there is no mount namespace (module docstring)")
def test_without_a_mount_namespace_a_calls_files_stay_until_the_callers_last_call_ends(name):
    meeting = Meeting()

    async def main():
        long = asyncio.create_task(run_python_async(LONG_CALL, LIMITS, stdin=f"{name} {meeting.address}", mount_namespace=False))
        await meeting.arrival(long)  # the long call has made its file and waits
        short = await run_python_async(f"open('/tmp/{name}-short', 'w').close()", LIMITS, mount_namespace=False)
        meeting.release()
        return short, await long

    try:
        short, long = asyncio.run(main())
    finally:
        meeting.close()
    assert short.error is None, short
    # Neither call's file went when the short call ended, and both went when the long one did.
    assert long.stdout == "True True\n", long
    assert left_in_the_shared_directories(name) == []


def test_a_required_mount_namespace_is_used(mount_namespaces_available, runs_directory):
    if not mount_namespaces_available:
        with pytest.raises(SandboxError, match="a mount namespace was required"):
            run_python("pass", LIMITS, mount_namespace=True)
        return
    result = run("import os; print(sorted(os.listdir('/tmp')))", mount_namespace=True)
    # The run's /tmp holds only the ways to its own directory and to its interpreter's, those under /tmp.
    kept = [runs_directory, *sandbox._python_directories(sandbox.sandbox_python(LIMITS))]
    ways = [os.path.relpath(os.path.realpath(path), os.path.realpath("/tmp")) for path in kept]
    assert result.stdout == f"{sorted({way.split(os.sep)[0] for way in ways if not way.startswith('..')})}\n"


def test_an_interpreter_installed_under_tmp_serves_in_the_mount_namespace(mount_namespaces_available):
    if not mount_namespaces_available:
        pytest.skip("the kernel refuses mount namespaces here, so the machine's /tmp is the code's")
    environment = tempfile.mkdtemp()  # in this module's runs directory, under /tmp unless TMPDIR says otherwise
    try:
        os.chmod(environment, 0o755)
        subprocess.run([sandbox.sandbox_python(LIMITS), "-m", "venv", "--without-pip", environment], check=True)
        python = os.path.join(environment, "bin", "python")
        result = run("import sys; print(sys.prefix)", dataclasses.replace(LIMITS, python=python), mount_namespace=True)
    finally:
        shutil.rmtree(environment)
    assert result.stdout == f"{environment}\n", result


def test_a_run_directory_whose_path_has_a_space(runs_directory, monkeypatch):
    spaced = os.path.join(runs_directory, "with a space")
    os.mkdir(spaced, 0o711)
    monkeypatch.setattr(tempfile, "tempdir", spaced)
    try:
        result = run("import os; print(os.getcwd()); print(os.listdir('.'))")
    finally:
        os.rmdir(spaced)
    work, listing = result.stdout.splitlines()
    assert work.startswith(spaced + "/rlplat-sandbox-") and work.endswith("/work")
    assert listing == "[]"


def test_the_supervisor_opens_no_file_of_the_installation(monkeypatch):
    # A copy of this module in a directory the sandbox user may not enter, then gone altogether.
    installation = tempfile.mkdtemp()  # mode 0700, in this module's runs directory
    copy = os.path.join(installation, "sandbox.py")
    shutil.copy(sandbox.__file__, copy)
    shutil.copy(sandbox.supervisor.__file__, os.path.join(installation, "supervisor.py"))
    spec = importlib.util.spec_from_file_location("rlplat_sandbox_copy", copy)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    limits = module.SandboxLimits(cpu_seconds=1, wall_seconds=2)
    assert module.run_python("print('from a directory nobody may enter')", limits).stdout == "from a directory nobody may enter\n"
    shutil.rmtree(installation)
    assert module.run_python("print('with the file gone')", limits).stdout == "with the file gone\n"


HANGING_SUPERVISOR = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(1000)
open(sys.argv[1], "w").write(str(child))
time.sleep(1000)
"""


def test_a_supervisor_that_hangs_is_killed_with_its_children(monkeypatch):
    # Stands in for a supervisor bug: a process that never answers and has a child of its own.
    monkeypatch.setattr(sandbox, "SUPERVISOR_GRACE_SECONDS", 0.5)
    prepare = sandbox._Launch.prepare
    pid_file = os.path.join("/tmp", f"rlplat-sandbox-test-{os.getpid()}.pid")

    def hanging(*args):
        launch = prepare(*args)
        launch.argv = [sys.executable, "-c", HANGING_SUPERVISOR, pid_file]
        return launch

    monkeypatch.setattr(sandbox._Launch, "prepare", hanging)
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=1)
    try:
        result = run("print(1)", limits)
        child = int(open(pid_file).read())
    finally:
        os.unlink(pid_file)
    assert result.timed_out and result.error == "timed out after 1 s"
    assert result.duration_s >= limits.wall_seconds + 0.5
    # Killed; the machine's init reaps it once its parent, killed too, is gone.
    assert living_processes(lambda pid, status: pid == child) == []


AS_ANOTHER_USER = """
import importlib.util, json, os, sys
module_file, code, namespaces = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spec = importlib.util.spec_from_file_location("sandbox_of_a_plain_user", module_file)
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
try:
    result = sandbox.run_python(code, sandbox.SandboxLimits(cpu_seconds=1, wall_seconds=2), stdin=str(os.getpid()), **namespaces)
except sandbox.SandboxError as error:
    print(json.dumps({"refused": str(error)}))
else:
    print(json.dumps({"caller": os.getpid(), "result": result.__dict__}))
"""


def run_as_a_caller_that_is_not_root(code: str, **namespaces) -> tuple[dict, str]:
    """Run ``code`` from a caller that is ``nobody``, as a plain user would: with its own copy of the
    sandbox and its runs' directories in its home, a directory of mode 0700 whose path has a space, and the
    interpreter the sandbox runs code with. Returns the caller's answer and its home."""
    home = tempfile.mkdtemp(prefix="home of nobody ")  # in this module's runs directory
    try:
        os.mkdir(os.path.join(home, "tmp"))
        module_file = os.path.join(home, "sandbox.py")
        shutil.copy(sandbox.__file__, module_file)
        shutil.copy(sandbox.supervisor.__file__, os.path.join(home, "supervisor.py"))
        for path in (home, os.path.join(home, "tmp"), module_file, os.path.join(home, "supervisor.py")):
            os.chown(path, sandbox.SANDBOX_UID, sandbox.SANDBOX_UID)
        completed = subprocess.run(
            [sandbox.sandbox_python(), "-I", "-B", "-c", AS_ANOTHER_USER, module_file, code, json.dumps(namespaces)],
            user=sandbox.SANDBOX_UID, group=sandbox.SANDBOX_UID, extra_groups=[], cwd="/",
            env={"PATH": "/usr/bin:/bin", "TMPDIR": os.path.join(home, "tmp")}, capture_output=True,
            timeout=LIMITS.wall_seconds + 10,
        )  # fmt: skip
        assert completed.returncode == 0, completed.stderr.decode()
        assert os.listdir(os.path.join(home, "tmp")) == []  # the caller removed its runs' directories
        return json.loads(completed.stdout), home
    finally:
        shutil.rmtree(home)


@pytest.mark.skipif(not ROOT, reason="needs root to start a caller as another user")
def test_a_caller_that_is_not_root_keeps_the_namespace_protections(name):
    # A user namespace gives it the PID and mount namespaces; the code runs as that user, yet cannot signal
    # its caller, what it starts in a new session does not survive the call, nor does its file in /tmp.
    code = textwrap.dedent(ESCAPE) + textwrap.dedent(
        f"""
        import signal
        open({os.path.join("/tmp", name)!r}, "w").close()
        for target in (int(input()), os.getppid()):
            try:
                os.kill(target, signal.SIGKILL)
                print("sent")
            except OSError as error:
                print(type(error).__name__)
        """
    )
    answer, _ = run_as_a_caller_that_is_not_root(code, pid_namespace=True, mount_namespace=True)
    if "refused" in answer:
        pytest.skip(f"no user namespace for an unprivileged user here: {answer['refused']}")
    result = answer["result"]
    first_sleeper, second_sleeper, kill_caller, kill_parent = result["stdout"].split()
    assert (kill_caller, kill_parent, result["exit_code"]) == ("ProcessLookupError", "sent", 0), result
    assert result["duration_s"] <= LIMITS.wall_seconds + MARGIN
    # "sent": its parent is the namespace's init, which ignores signals from inside the namespace.
    for pid in (first_sleeper, second_sleeper):
        assert not os.path.exists(f"/proc/{pid}")
    assert left_in_the_shared_directories(name) == []


@pytest.mark.skipif(not ROOT, reason="needs root to start a caller as another user")
def test_a_caller_that_is_not_root_runs_code_without_namespaces_too():
    answer, home = run_as_a_caller_that_is_not_root(
        "import os; print(os.getuid()); print(os.getcwd())", pid_namespace=False, mount_namespace=False
    )
    uid, work = answer["result"]["stdout"].splitlines()
    assert uid == str(sandbox.SANDBOX_UID)
    assert work.startswith(os.path.join(home, "tmp", "rlplat-sandbox-")) and work.endswith("/work")
