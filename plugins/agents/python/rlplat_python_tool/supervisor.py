"""The sandbox's supervisor (see :mod:`rlplat_python_tool.sandbox` for how a run is contained): the code
the caller hands a fresh interpreter on stdin, run as ``__main__``. It imports only the standard library's
built-in modules and needs nothing of the caller's module."""


from __future__ import annotations

# Only what the supervisor needs is imported here: it runs this file's code as ``__main__`` and stops
# before the public part below (see the end of the supervisor's section). One file for both, since the
# supervisor imports nothing of rlplat's installation.
import ctypes
import marshal
import math
import os
import resource
import select
import signal
import sys
import time

SUPERVISOR_GRACE_SECONDS = 5.0
"""How long past the wall timeout the caller waits for the supervisor before killing it."""

SANDBOX_UID = 65534
"""The user (``nobody``) and group (``nogroup``) the code runs as when the caller is root."""

SHARED_DIRECTORIES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""The machine's directories every user may write in. Each run gets private ones in their place when the
kernel gives it a mount namespace; else what the code leaves there is removed (see the module docstring)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_MNT_DETACH = 2
_READ_CHUNK = 65536
_ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    # Numerical libraries start a thread per core otherwise, each counted by RLIMIT_NPROC.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


# ---------------------------------------------------------------------------------------------------
# Processes: finding and killing a tree. Used by the caller (backstop) and by the supervisor.


def _parents() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process in /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                fields = file.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def _descendants(root: int, *, zombies: bool) -> list[int]:
    """Processes whose parent chain leads to ``root``, parents before children; zombies only when asked."""
    children: dict[int, list[int]] = {}
    states = {}
    for pid, (parent, state) in _parents().items():
        children.setdefault(parent, []).append(pid)
        states[pid] = state
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, ()):
            found.append(child)
            frontier.append(child)
    return [pid for pid in found if zombies or states.get(pid) not in ("Z", "X")]


def _signal_pid(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_any() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_tree(root: int, *, include_root: bool, reap: bool, patience: float = 10.0) -> None:
    """SIGKILL every descendant of ``root`` until none remains (then ``root`` itself when asked).

    Processes are stopped first so that a fork bomb cannot outrun the sweep. With ``reap`` (the
    supervisor, their subreaper) the sweep goes on until the zombies are collected too."""
    deadline = time.monotonic() + patience
    while True:
        if reap:
            _reap_any()
        remaining = _descendants(root, zombies=reap)
        if not remaining:
            break
        for pid in remaining:
            _signal_pid(pid, signal.SIGSTOP)
        for pid in remaining:
            _signal_pid(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.001)
    if include_root:
        _signal_pid(root, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------
# The supervisor: this file's code run as ``__main__`` by ``python -I -S -B -c _SUPERVISOR_LOADER``,
# with its instructions on stdin after that code.


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"prctl({option}, {value}): {os.strerror(number)}")


def _unshare(flags: int, names: str) -> str | None:
    """Enter the new namespaces ``flags`` names; None on success, else why not."""
    if _libc().unshare(flags) != 0:
        return f"unshare({names}): {os.strerror(ctypes.get_errno())}"
    return None


def _enter_user_namespace() -> str | None:
    """Enter a new user namespace that maps only this process's user and group to themselves, which gives a
    caller that is not root the right to make the other namespaces; None on success, else why not."""
    uid, gid = os.geteuid(), os.getegid()
    refusal = _unshare(_CLONE_NEWUSER, "CLONE_NEWUSER")
    if refusal is None:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    return refusal


def _mount(source: str | None, target: str, flags: int) -> str | None:
    """mount(2) without a file system type or data (a bind, or a change of propagation); None on success,
    else why not."""
    if _libc().mount(None if source is None else os.fsencode(source), os.fsencode(target), None, flags, None) != 0:
        return f"mount({source or 'none'}, {target}): {os.strerror(ctypes.get_errno())}"
    return None


def _make_shared_directories_private(directory: str, shared: list[str], keep: list[str]) -> str | None:
    """Enter a new mount namespace in which a directory of the run's own lies over each of the machine's
    ``shared`` directories, and ``T`` and the ``keep`` directories stay where they were (see
    :func:`_bind_private_directories`); None on success, else why not (with the mounts made undone)."""
    refusal = _unshare(_CLONE_NEWNS, "CLONE_NEWNS")
    if refusal is None:
        # Nothing mounted here may reach the machine's namespace (where "/" is usually a shared mount).
        refusal = _mount(None, "/", _MS_REC | _MS_PRIVATE)
    if refusal is not None:
        return refusal
    mounted: list[str] = []
    try:
        refusal = _bind_private_directories(directory, shared, keep, mounted)
    except OSError as error:
        refusal = str(error)
    if refusal is not None:
        for target in reversed(mounted):
            if _libc().umount2(os.fsencode(target), _MNT_DETACH) != 0:
                number = ctypes.get_errno()
                raise OSError(number, f"umount({target}): {os.strerror(number)}, undoing the mounts after: {refusal}")
    return refusal


def _bind_private_directories(directory: str, shared: list[str], keep: list[str], mounted: list[str]) -> str | None:
    """Bind ``T/shared/0``, ``1``, ... (mode 1777) over the ``shared`` directories that exist, then ``T``
    and each ``keep`` directory (the interpreter's) that lay under one of them back at its path; each
    mount goes into ``mounted`` once made. None on success, else why not."""
    existing = [path for path in shared if os.path.isdir(path)]
    targets = list(dict.fromkeys(os.path.realpath(path) for path in existing))
    names = {form for path in existing for form in (os.path.abspath(path), os.path.realpath(path))}

    def under_a_shared_directory(path: str) -> bool:
        forms = (os.path.abspath(path), os.path.realpath(path))
        return any(form.startswith(name + os.sep) for form in forms for name in names)

    def held(path: str) -> int:
        return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    # Held by descriptor: once /tmp is covered, their paths lead into the run's own directory.
    descriptors: dict[str, int] = {}
    try:
        covered = {os.path.abspath(path) for path in [directory, *keep] if under_a_shared_directory(path)}
        for path in sorted(covered, key=len):
            try:
                descriptors[path] = held(path)
            except FileNotFoundError:
                continue
        run_directory = descriptors.get(directory)
        if run_directory is None:
            run_directory = descriptors[directory] = held(directory)
        os.mkdir(os.path.join(directory, "shared"), 0o711)
        for index in range(len(targets)):
            private = os.path.join(directory, "shared", str(index))
            os.mkdir(private)
            os.chmod(private, 0o1777)  # like /tmp: anyone may write, only a file's owner removes it
        for index, target in enumerate(targets):
            refusal = _mount(f"/proc/self/fd/{run_directory}/shared/{index}", target, _MS_BIND)
            if refusal is not None:
                return refusal
            mounted.append(target)
        for path, descriptor in descriptors.items():  # shortest first: one bound back brings those below it
            try:
                if os.path.samestat(os.stat(path), os.fstat(descriptor)):
                    continue
            except FileNotFoundError:
                pass
            way = ""
            for part in path.strip(os.sep).split(os.sep):
                way += os.sep + part
                if not os.path.isdir(way):
                    os.mkdir(way, 0o711)
            refusal = _mount(f"/proc/self/fd/{descriptor}", path, _MS_BIND)
            if refusal is not None:
                return refusal
            mounted.append(path)
        return None
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)


def _isolate(plan: dict[str, object]) -> tuple[bool, bool, str | None]:
    """Enter the namespaces the plan asks for, as far as the kernel allows: (in a PID namespace, shared
    directories private, why a namespace the plan requires was refused or None)."""
    wanted = {"PID": plan["pid_namespace"], "mount": plan["mount_namespace"]}
    refusals: dict[str, str] = {}
    if os.geteuid() != 0 and any(choice is not False for choice in wanted.values()):
        refusal = _enter_user_namespace()
        if refusal is not None:
            refusals = dict.fromkeys(wanted, refusal)
    if wanted["mount"] is not False and "mount" not in refusals:
        refusal = _make_shared_directories_private(plan["directory"], plan["shared_directories"], plan["keep"])
        if refusal is not None:
            refusals["mount"] = refusal
    if wanted["PID"] is not False and "PID" not in refusals:
        refusal = _unshare(_CLONE_NEWPID, "CLONE_NEWPID")
        if refusal is not None:
            refusals["PID"] = refusal
    for kind, choice in wanted.items():
        if choice and kind in refusals:
            return False, False, f"a {kind} namespace was required but the kernel refused it: {refusals[kind]}"
    entered = {kind: choice is not False and kind not in refusals for kind, choice in wanted.items()}
    return entered["PID"], entered["mount"], None


class _Capture:
    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.overflowed = False

    def add(self, chunk: bytes) -> bool:
        """Keep what fits; True when the stream has gone past the limit."""
        room = self.limit - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.overflowed = self.overflowed or len(chunk) > room
        return self.overflowed


def _exec_code(plan: dict[str, object], stdin_fd: int, stdout_fd: int, stderr_fd: int, status_fd: int) -> None:
    """In the forked child: become the code's process and exec the interpreter; never returns."""
    try:
        limits = plan["limits"]
        directory = plan["directory"]
        work = os.path.join(directory, "work")
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        os.setsid()
        os.chdir(work)
        os.umask(0o022)
        for number in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        cpu = math.ceil(limits["cpu_seconds"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if plan["identity"] is not None:
            uid, gid = plan["identity"]
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        # After the change of user (which clears the parent-death signal) and so after the kernel's check
        # of RLIMIT_NPROC at setuid: other runs' processes cannot make this exec fail.
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        environment = dict(_ENVIRONMENT, HOME=work, TMPDIR=work)
        python = plan["python"]
        os.execve(python, [python, "-I", "-u", "-B", os.path.join(directory, "main.py")], environment)
    except BaseException as exc:
        try:
            os.write(status_fd, f"E could not start the code: {type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(127)


def _namespace_init(plan: dict[str, object], stdin_fd: int, stdout_fd: int, stderr_fd: int, status_fd: int) -> None:
    """PID 1 of the run's namespace: start the code, reap orphans until the code exits, kill the rest,
    report the code's status on ``status_fd``; never returns."""
    try:
        os.setsid()
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        code_pid = os.fork()
        if code_pid == 0:
            _exec_code(plan, stdin_fd, stdout_fd, stderr_fd, status_fd)
        for fd in (stdin_fd, stdout_fd, stderr_fd):
            os.close(fd)
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid == code_pid:
                break
        _signal_pid(-1, signal.SIGKILL)  # every process of the namespace but this one
        while True:
            try:
                os.wait4(-1, 0)
            except ChildProcessError:
                break
        exit_code = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime
        os.write(status_fd, f"X {exit_code} {cpu}".encode())
    except BaseException as exc:
        os.write(status_fd, f"E the sandbox's namespace init failed: {type(exc).__name__}: {exc}".encode())
    finally:
        os._exit(0)


def _supervise(plan: dict[str, object]) -> dict[str, object]:
    limits = plan["limits"]
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != plan["caller_pid"]:
        return {"setup_error": "the caller exited before the sandbox started"}
    in_namespace, private_directories, refusal = _isolate(plan)
    if refusal is not None:
        return {"setup_error": refusal}
    stdin_fd = os.open(os.path.join(plan["directory"], "stdin"), os.O_RDONLY | os.O_CLOEXEC)
    stdout_read, stdout_write = os.pipe()
    stderr_read, stderr_write = os.pipe()
    status_read, status_write = os.pipe()
    start = time.monotonic()
    child = os.fork()
    if child == 0:
        for fd in (stdout_read, stderr_read, status_read):
            os.close(fd)
        run = _namespace_init if in_namespace else _exec_code
        run(plan, stdin_fd, stdout_write, stderr_write, status_write)
    for fd in (stdin_fd, stdout_write, stderr_write, status_write):
        os.close(fd)

    captures = {stdout_read: _Capture(limits["output_bytes"]), stderr_read: _Capture(limits["output_bytes"])}
    names = {stdout_read: "stdout", stderr_read: "stderr"}
    status = bytearray()
    open_fds = {stdout_read, stderr_read, status_read}
    try:
        child_fd: int | None = os.pidfd_open(child)
    except (AttributeError, OSError):
        child_fd = None
    deadline = start + limits["wall_seconds"]
    stopped = truncated_stream = None
    wait_status = None

    def read(fd: int) -> None:
        nonlocal stopped, truncated_stream
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            open_fds.discard(fd)
            os.close(fd)
        elif fd == status_read:
            status.extend(chunk[:4096])
        elif captures[fd].add(chunk) and stopped is None:
            stopped, truncated_stream = "output", names[fd]

    while stopped is None and wait_status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stopped = "timeout"
            break
        watched = list(open_fds) + ([child_fd] if child_fd is not None else [])
        ready, _, _ = select.select(watched, [], [], remaining if child_fd is not None else min(remaining, 0.02))
        for fd in ready:
            if fd != child_fd:
                read(fd)
        if child_fd is None or child_fd in ready:
            pid, raw_status, usage = os.wait4(child, os.WNOHANG)
            if pid == child:
                wait_status = (raw_status, usage)
    if wait_status is None:
        _signal_pid(child, signal.SIGKILL)
        _, raw_status, usage = os.wait4(child, 0)
        wait_status = (raw_status, usage)
    _kill_tree(os.getpid(), include_root=False, reap=True)
    drain_deadline = time.monotonic() + 5.0
    while open_fds and time.monotonic() < drain_deadline:
        ready, _, _ = select.select(list(open_fds), [], [], max(drain_deadline - time.monotonic(), 0))
        for fd in ready:
            read(fd)
    if child_fd is not None:
        os.close(child_fd)

    text = status.decode(errors="replace")
    if text.startswith("E "):
        return {"setup_error": text[2:]}
    exit_code = signal_number = None
    cpu_seconds = 0.0
    if stopped is not None:
        signal_number = int(signal.SIGKILL)
    elif in_namespace:
        if not text.startswith("X "):
            return {"setup_error": f"the sandbox's namespace init ended without a report ({wait_status[0]:#x})"}
        _, exit_text, cpu_text = text.split()
        exit_code, cpu_seconds = int(exit_text), float(cpu_text)
    else:
        exit_code = os.waitstatus_to_exitcode(wait_status[0])
        cpu_seconds = wait_status[1].ru_utime + wait_status[1].ru_stime
    if exit_code is not None and exit_code < 0:
        exit_code, signal_number = None, -exit_code
    return {
        "stdout": bytes(captures[stdout_read].data).decode(errors="replace"),
        "stderr": bytes(captures[stderr_read].data).decode(errors="replace"),
        "exit_code": exit_code,
        "signal": signal_number,
        "cpu_seconds": cpu_seconds,
        "stopped": stopped,
        "truncated_stream": truncated_stream,
        "pid_namespace": in_namespace,
        "private_directories": private_directories,
    }


def _supervisor_main() -> None:
    # marshal, not json: built in, so it costs the supervisor no import; both ends are this file run by
    # the same interpreter, and the data is never anyone else's. This file's code came first on stdin.
    plan = marshal.load(sys.stdin.buffer)
    try:
        report = _supervise(plan)
    except BaseException as exc:
        _kill_tree(os.getpid(), include_root=False, reap=True)
        report = {"setup_error": f"sandbox supervisor failed: {type(exc).__name__}: {exc}"}
    sys.stdout.buffer.write(marshal.dumps(report))
    sys.stdout.flush()


# The supervisor's entry point.
if __name__ == "__main__":
    _supervisor_main()
    sys.exit(0)
