"""Checkpoints of a run: one directory per saved step, put in place atomically, the last K kept.

**On disk** (``root`` is the run's checkpoint directory)::

    root/
      latest                         "global_step_40\\n": the directory of the most recent save
      global_step_30/
      global_step_40/
        actor/ ...                   what ``write(directory)`` put there (the workers' engine checkpoints)
        trainer_state.json           {"format": 1, "step": 40, "saved_at": "<UTC ISO 8601>", **trainer_state}
        COMPLETE                     written last and fsynced: everything above is whole
      .global_step_50.partial-<hex>  a save in progress, or one whose process died: never read
      .global_step_40.replaced-<hex> the old global_step_40 while a second save of step 40 moves in
      .global_step_20.pruned-<hex>   a checkpoint being deleted
      .lock                          flock'ed by the process that is saving

A ``global_step_N`` directory is only ever created by renaming a finished ``.partial`` directory, and only
ever removed by renaming it away first, so whoever reads ``root`` sees each ``global_step_N`` either whole
or not at all. What a crash at each point of :meth:`CheckpointManager.save` leaves:

* during ``write`` or before the rename: a ``.partial`` directory that readers ignore; the earlier
  checkpoints are untouched and the next save deletes it;
* re-saving step N, between moving the old ``global_step_N`` aside and moving the new one in: readers take
  the ``.replaced`` directory as step N and the next save moves it back;
* after the rename, before ``latest`` is updated: ``latest`` still names the previous checkpoint, which is
  what a resume picks (a consistent, slightly older state);
* while pruning: the pruned directory is already renamed away; the next save finishes deleting it.

"Newest" means most recently saved (``saved_at``, then step), which is the highest step in a run that only
moves forward; after resuming from an older checkpoint into the same root, the later checkpoints of the
abandoned run are the oldest saves and are pruned first. One process saves into a root at a time (the
``.lock``); the ``write`` callback may have other processes write into the directory it is given.

Also here: :func:`capture_rng_state` / :func:`restore_rng_state` for the driver's random streams, and
:func:`graceful_interrupt` so that Ctrl-C ends a run with a checkpoint.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import os
import random
import re
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

logger = logging.getLogger("rlplat.trainer.checkpoint")

FORMAT = 1
STATE_FILE = "trainer_state.json"
COMPLETE_MARKER = "COMPLETE"
LATEST_POINTER = "latest"
LOCK_FILE = ".lock"
RESERVED_KEYS = ("format", "step", "saved_at")

CHECKPOINT_NAME = re.compile(r"global_step_(\d+)")
HIDDEN_NAME = re.compile(r"\.global_step_(\d+)\.(partial|replaced|pruned)-[0-9a-f]+")
POINTER_TEMPORARY = re.compile(r"\.latest\.tmp-[0-9a-f]+")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, found or read; the message names the path, what is wrong and what to do."""


class Checkpoint(NamedTuple):
    """A complete checkpoint directory as found on disk."""

    path: Path
    step: int
    saved_at: str


def checkpoint_name(step: int) -> str:
    """The directory name of step ``step``: ``global_step_{step}``."""
    return f"global_step_{step}"


class CheckpointManager:
    """Saves, finds and prunes the checkpoints under ``root`` (see the module docstring for the layout).

    ``keep_last``: how many complete checkpoints to keep, the one just saved included (None: all).
    The directory is created at the first :meth:`save`; readers accept a root that does not exist yet.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int | None = 3):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep every checkpoint), got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last

    # -- saving ------------------------------------------------------------------------------------

    def save(
        self, step: int, write: Callable[[Path], None] | None, trainer_state: dict[str, Any] | None = None
    ) -> Path:
        """Save step ``step`` as ``root/global_step_{step}`` and return that path.

        ``write(directory)`` fills a fresh temporary directory (the trainer has its workers write their
        engine checkpoints there, possibly from other processes) and must return only once every file is
        written. Then ``trainer_state.json`` (``trainer_state`` plus ``format``, ``step`` and ``saved_at``)
        and the ``COMPLETE`` marker are written, every file and directory is fsynced, and the directory is
        renamed into place, replacing an earlier checkpoint of the same step. Finally ``latest`` names it
        and the oldest complete checkpoints beyond ``keep_last`` are deleted (never this one).

        ``trainer_state`` must be JSON-serialisable; it is checked before ``write`` runs. Raises
        :class:`CheckpointError` (the cause chained) when ``write`` or any step before the rename fails:
        the temporary directory is deleted and the earlier checkpoints are untouched. Stale temporary
        directories of a killed process are deleted first.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        state_text = self._state_text(step, trainer_state or {})
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / checkpoint_name(step)
        with self._lock():
            self._clean_stale()
            partial = self.root / f".{final.name}.partial-{uuid.uuid4().hex}"
            partial.mkdir()
            phase = "in write()"
            try:
                if write is not None:
                    write(partial)
                phase = "finishing the directory"
                (partial / STATE_FILE).write_text(state_text)
                fsync_tree(partial)
                write_durably(partial / COMPLETE_MARKER, f"{final.name}\n")
                fsync_directory(partial)
                phase = "moving it into place"
                replaced = self._move_into_place(partial, final)
            except BaseException as error:
                remove_tree(partial)
                if not isinstance(error, Exception):
                    raise
                newest = self.latest()
                raise CheckpointError(
                    f"saving checkpoint step {step} to {final} failed {phase}: {type(error).__name__}: {error}; "
                    f"the earlier checkpoints are untouched (newest: {newest or 'none'})"
                ) from error
            fsync_directory(self.root)
            if replaced is not None:
                remove_tree(replaced)
            self._point_latest_at(final)
            self._prune(keep=final)
        logger.info("saved checkpoint step %d to %s", step, final)
        return final

    def _state_text(self, step: int, trainer_state: dict[str, Any]) -> str:
        clashes = [key for key in ("format", "saved_at") if key in trainer_state]
        if "step" in trainer_state and trainer_state["step"] != step:
            clashes.append(f"step={trainer_state['step']!r} (saving step {step})")
        if clashes:
            raise ValueError(
                f"trainer_state must not set {clashes}: the checkpoint manager writes {list(RESERVED_KEYS)} itself"
            )
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")
        try:
            return json.dumps({**trainer_state, "format": FORMAT, "step": step, "saved_at": now}, indent=1)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"trainer_state of step {step} is not JSON-serialisable: {error}; store tensors and arrays as "
                "lists or via capture_rng_state(), and state objects through their state_dict()"
            ) from error

    def _move_into_place(self, partial: Path, final: Path) -> Path | None:
        """Rename ``partial`` to ``final``; an existing ``final`` is first moved aside, and that path is
        returned for the caller to delete once the rename is durable."""
        if not os.path.lexists(final):
            os.rename(partial, final)
            return None
        aside = self.root / f".{final.name}.replaced-{uuid.uuid4().hex}"
        os.rename(final, aside)
        try:
            os.rename(partial, final)
        except BaseException:
            os.rename(aside, final)
            raise
        return aside

    def _point_latest_at(self, final: Path) -> None:
        temporary = self.root / f".latest.tmp-{uuid.uuid4().hex}"
        try:
            write_durably(temporary, f"{final.name}\n")
            os.replace(temporary, self.root / LATEST_POINTER)
            fsync_directory(self.root)
        except OSError as error:
            remove_tree(temporary)
            raise CheckpointError(
                f"checkpoint {final} is saved and complete, but {self.root / LATEST_POINTER} could not be updated "
                f"({error}); trainer.resume=auto would pick the previous checkpoint: fix the directory's "
                f"permissions or space, or resume with trainer.resume={final}"
            ) from error

    def _prune(self, keep: Path) -> None:
        if self.keep_last is None:
            return
        others = [checkpoint for checkpoint in self.checkpoints() if checkpoint.path != keep]
        for checkpoint in others[: max(0, len(others) - (self.keep_last - 1))]:
            if checkpoint.path.name != checkpoint_name(checkpoint.step):
                continue  # a .replaced directory: the stale cleanup owns it
            doomed = self.root / f".{checkpoint.path.name}.pruned-{uuid.uuid4().hex}"
            try:
                os.rename(checkpoint.path, doomed)
            except OSError as error:
                logger.warning(
                    "could not delete old checkpoint %s (keep_last=%s): %s", checkpoint.path, self.keep_last, error
                )
                continue
            remove_tree(doomed)

    def _clean_stale(self) -> None:
        """Delete what killed saves left: partial, pruned and pointer temporaries; put a ``.replaced``
        checkpoint back when its replacement never arrived."""
        for entry in sorted(self.root.iterdir()):
            hidden = HIDDEN_NAME.fullmatch(entry.name)
            if hidden and hidden.group(2) == "replaced":
                final = self.root / checkpoint_name(int(hidden.group(1)))
                if not os.path.lexists(final) and checkpoint_problem(entry) is None:
                    logger.warning("restoring %s from %s (a save of that step was interrupted)", final, entry.name)
                    os.rename(entry, final)
                    fsync_directory(self.root)
                    continue
            if hidden or POINTER_TEMPORARY.fullmatch(entry.name):
                logger.info("removing %s left by an interrupted save", entry)
                remove_tree(entry)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        import fcntl

        with open(self.root / LOCK_FILE, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CheckpointError(
                    f"another process is saving checkpoints into {self.root} (it holds {self.root / LOCK_FILE}): "
                    "do two runs share trainer.output_dir? Give each run its own"
                ) from None
            except OSError as error:
                logger.warning("cannot lock %s (%s); saving without the lock", self.root / LOCK_FILE, error)
            yield

    # -- reading -----------------------------------------------------------------------------------

    def checkpoints(self) -> list[Checkpoint]:
        """The complete checkpoints under ``root``, oldest save first. A step whose ``global_step_N`` is
        missing or incomplete is represented by its ``.replaced`` directory when that one is complete."""
        if not self.root.is_dir():
            return []
        found: dict[int, Checkpoint] = {}
        for entry in sorted(self.root.iterdir()):
            name, hidden = CHECKPOINT_NAME.fullmatch(entry.name), HIDDEN_NAME.fullmatch(entry.name)
            if not name and not (hidden and hidden.group(2) == "replaced"):
                continue
            state = read_complete(entry)
            if state is None:
                continue
            step = int((name or hidden).group(1))
            if step not in found or name:
                found[step] = Checkpoint(entry, step, state["saved_at"])
        return sorted(found.values(), key=lambda checkpoint: (checkpoint.saved_at, checkpoint.step))

    def latest(self) -> Path | None:
        """The newest complete checkpoint: the one ``latest`` names when it is complete, else the most
        recently saved complete one found by scanning ``root``; None when there is none."""
        pointer = self.root / LATEST_POINTER
        try:
            name = pointer.read_text().strip()
        except OSError:
            name = ""
        if CHECKPOINT_NAME.fullmatch(name) and read_complete(self.root / name) is not None:
            return self.root / name
        if name:
            logger.warning("%s names %r, which is not a complete checkpoint; scanning %s", pointer, name, self.root)
        found = self.checkpoints()
        return found[-1].path if found else None

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint ``trainer.resume`` asks for: ``"disable"`` -> None; ``"auto"`` -> :meth:`latest`
        (None: a fresh run); anything else is a checkpoint directory (a path, or a name under ``root``)
        that must exist and be complete, else :class:`CheckpointError` says what is missing and lists the
        complete checkpoints under ``root``."""
        if resume == "disable":
            return None
        if resume == "auto":
            return self.latest()
        if not isinstance(resume, (str, os.PathLike)) or not os.fspath(resume):
            raise CheckpointError(f"trainer.resume must be 'auto', 'disable' or a checkpoint directory, got {resume!r}")
        path = Path(resume).expanduser()
        if not path.exists() and not path.is_absolute() and len(path.parts) == 1 and (self.root / path).exists():
            path = self.root / path
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        found = [str(checkpoint.path) for checkpoint in self.checkpoints()]
        raise CheckpointError(
            f"trainer.resume={os.fspath(resume)}: {path} {problem}. Complete checkpoints under {self.root}: "
            + (", ".join(found) if found else "none")
            + ". Use trainer.resume=auto for the newest, or trainer.resume=disable to start afresh"
        )

    def load_state(self, path: str | os.PathLike) -> dict[str, Any]:
        """``trainer_state.json`` of the complete checkpoint ``path``: the saved ``trainer_state`` plus
        ``format``, ``step`` and ``saved_at``. Raises :class:`CheckpointError` naming what is wrong."""
        path = Path(path)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise CheckpointError(f"cannot load checkpoint {path}: it {problem}")
        return json.loads((path / STATE_FILE).read_text())


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (a phrase after "it"), or None when it is one."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    if not (path / COMPLETE_MARKER).is_file():
        return f"has no {COMPLETE_MARKER} marker: its save did not finish (the process died or write() failed)"
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"has no {STATE_FILE}"
    except (OSError, ValueError) as error:
        return f"has an unreadable {STATE_FILE} ({error})"
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("saved_at"), str)):
        return f"has a {STATE_FILE} without the step and saved_at keys rlplat writes"
    if state.get("format") != FORMAT:
        return (
            f"has {STATE_FILE} format {state.get('format')!r}, this rlplat reads format {FORMAT}: "
            "use the rlplat version that wrote it"
        )
    return None


def read_complete(path: Path) -> dict[str, Any] | None:
    """The trainer state of ``path`` when it is a complete checkpoint, else None."""
    if checkpoint_problem(path) is not None:
        return None
    return json.loads((path / STATE_FILE).read_text())


# -- durable file operations ---------------------------------------------------------------------------


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_directory(path: Path) -> None:
    """fsync a directory, so that the renames and creations inside it survive a power loss."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under ``root`` (symlinks are not followed): the files that
    ``write`` produced, possibly in other processes, are on disk before the marker makes them count."""
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            if os.path.isfile(path) and not os.path.islink(path):
                descriptor = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(descriptor)
                finally:
                    os.close(descriptor)
        fsync_directory(Path(directory))


def remove_tree(path: Path) -> None:
    """Delete a file or directory tree; a failure is logged, not raised (it only leaves disk in use)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
    except OSError as error:
        logger.warning("could not delete %s: %s", path, error)


# -- the driver's random streams ------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The driver process's random streams as JSON-safe data: Python's ``random``, NumPy's global
    ``np.random`` and torch's CPU generator (base64 of its byte state). Workers keep their own streams;
    this covers only the calling process."""
    import numpy as np
    import torch

    version, internal, gauss_next = random.getstate()
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "name": name,
            "keys": keys.tolist(),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the streams of a :func:`capture_rng_state` (after a JSON round trip too): the draws that
    follow are those that followed the capture. Raises :class:`CheckpointError` on a malformed state."""
    import numpy as np
    import torch

    unknown = set(state) - {"python", "numpy", "torch_cpu"}
    if unknown:
        raise CheckpointError(
            f"the saved RNG state has unknown key(s) {sorted(unknown)}; it is not a capture_rng_state()"
        )
    try:
        if "python" in state:
            python = state["python"]
            random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
        if "numpy" in state:
            numpy_state = state["numpy"]
            np.random.set_state((
                numpy_state["name"],
                np.asarray(numpy_state["keys"], dtype=np.uint32),
                numpy_state["position"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            ))
        if "torch_cpu" in state:
            torch.set_rng_state(torch.tensor(list(base64.b64decode(state["torch_cpu"])), dtype=torch.uint8))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"the saved RNG state is malformed ({type(error).__name__}: {error})") from error


# -- Ctrl-C ---------------------------------------------------------------------------------------------


class InterruptRequest:
    """What :func:`graceful_interrupt` yields. ``requested``: a first Ctrl-C arrived (finish the step, save,
    stop). ``active``: the handler is installed (False outside the main thread)."""

    def __init__(self) -> None:
        self.requested = False
        self.active = False


@contextlib.contextmanager
def graceful_interrupt(signals: tuple[int, ...] = (signal.SIGINT,)) -> Iterator[InterruptRequest]:
    """Within the block, the first of ``signals`` (Ctrl-C) sets ``.requested`` instead of raising, so the
    trainer can finish its step, save and stop; the second raises ``KeyboardInterrupt`` at once. The
    previous handlers come back on exit, also when the block raises.

    Python delivers signals to the main thread only, so elsewhere this is a no-op: ``.active`` is False,
    ``.requested`` stays False and Ctrl-C keeps its previous behaviour.
    """
    request = InterruptRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum: int, frame: Any) -> None:
        if request.requested:
            raise KeyboardInterrupt
        request.requested = True
        logger.warning(
            "%s: finishing the current step, then saving a checkpoint and stopping; send it again to stop at once "
            "without saving", signal.Signals(signum).name,
        )

    previous = {number: signal.getsignal(number) for number in signals}
    try:
        for number in signals:
            signal.signal(number, handle)
        request.active = True
        yield request
    finally:
        for number, handler in previous.items():
            # None: the handler was installed from outside Python and cannot be reinstalled; default instead.
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        request.active = False
