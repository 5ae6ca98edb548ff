"""rlplat.trainer.checkpoint: atomic saves, keep-last pruning, resume resolution, RNG streams, Ctrl-C."""

from __future__ import annotations

import fcntl
import json
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from rlplat.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    graceful_interrupt,
    restore_rng_state,
)


def write_actor(weights: bytes):
    """A ``write`` callback standing in for the workers: one engine file under ``actor/``."""

    def write(directory):
        (directory / "actor").mkdir()
        (directory / "actor" / "model.bin").write_bytes(weights)

    return write


def saved_steps(root) -> list[str]:
    return sorted(path.name for path in root.iterdir() if path.name.startswith("global_step_"))


def leftovers(root) -> list[str]:
    """Hidden entries a save leaves behind (the lock file is meant to stay)."""
    return sorted(path.name for path in root.iterdir() if path.name.startswith(".") and path.name != ".lock")


def run_in_subprocess(code: str, root) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(root)], capture_output=True, text=True, timeout=60
    )


# -- saving and loading ------------------------------------------------------------------------------------


def test_save_then_latest_then_load_state_round_trip(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")

    path = manager.save(7, write_actor(b"weights"), {"data": {"epoch": 0, "position": 56}})

    assert path == tmp_path / "checkpoints" / "global_step_7"
    assert manager.latest() == path
    state = manager.load_state(path)
    assert (state["step"], state["format"], state["data"]) == (7, 1, {"epoch": 0, "position": 56})
    assert isinstance(state["saved_at"], str)


def test_a_saved_checkpoint_holds_the_written_files_the_state_and_the_marker(tmp_path):
    manager = CheckpointManager(tmp_path)

    path = manager.save(3, write_actor(b"weights"), {})

    assert sorted(item.name for item in path.iterdir()) == ["COMPLETE", "actor", "trainer_state.json"]
    assert (path / "actor" / "model.bin").read_bytes() == b"weights"
    assert (tmp_path / "latest").read_text() == "global_step_3\n"
    assert leftovers(tmp_path) == []


def test_keep_last_prunes_exactly_the_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)

    for step in (10, 20, 30, 40):
        manager.save(step, write_actor(b"w"), {})

    assert saved_steps(tmp_path) == ["global_step_30", "global_step_40"]
    assert leftovers(tmp_path) == []


def test_keep_last_none_keeps_every_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)

    for step in (1, 2, 3, 4, 5):
        manager.save(step, None, {})

    assert len(saved_steps(tmp_path)) == 5


def test_saving_the_same_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(5, write_actor(b"first"), {"note": "first"})

    path = manager.save(5, write_actor(b"second"), {"note": "second"})

    assert manager.load_state(path)["note"] == "second"
    assert (path / "actor" / "model.bin").read_bytes() == b"second"
    assert saved_steps(tmp_path) == ["global_step_5"]
    assert leftovers(tmp_path) == []


def test_a_state_that_is_not_json_is_refused_before_write_runs(tmp_path):
    manager = CheckpointManager(tmp_path)
    calls = []

    with pytest.raises(ValueError, match="step 1 is not JSON-serialisable"):
        manager.save(1, calls.append, {"weights": torch.zeros(2)})

    assert calls == []


def test_load_state_refuses_a_newer_format(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, None, {})
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "format": 2}))

    with pytest.raises(CheckpointError, match="format 2, this rlplat reads format 1"):
        manager.load_state(path)


def test_a_second_process_saving_into_the_same_root_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, None, {})

    with open(tmp_path / ".lock", "a") as other_process_lock:
        fcntl.flock(other_process_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match="another process is saving checkpoints into"):
            manager.save(2, None, {})

    assert saved_steps(tmp_path) == ["global_step_1"]


# -- failures and crashes ----------------------------------------------------------------------------------


def test_a_write_that_raises_leaves_the_previous_checkpoint_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    previous = manager.save(1, write_actor(b"one"), {})

    def failing_write(directory):
        (directory / "actor").mkdir()
        (directory / "actor" / "shard0.bin").write_bytes(b"half")
        raise OSError("No space left on device")

    with pytest.raises(CheckpointError, match=r"saving checkpoint step 2 .* failed in write\(\)") as raised:
        manager.save(2, failing_write, {})

    assert isinstance(raised.value.__cause__, OSError)
    assert manager.latest() == previous
    assert saved_steps(tmp_path) == ["global_step_1"]
    assert leftovers(tmp_path) == []


def test_ctrl_c_during_write_propagates_unwrapped_and_removes_the_partial_directory(tmp_path):
    manager = CheckpointManager(tmp_path)

    def interrupted_write(directory):
        (directory / "actor").mkdir()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        manager.save(1, interrupted_write, {})

    assert manager.latest() is None
    assert leftovers(tmp_path) == []


def test_a_process_killed_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path):
    result = run_in_subprocess("""
        import os, sys
        from rlplat.trainer.checkpoint import CheckpointManager

        manager = CheckpointManager(sys.argv[1])
        manager.save(1, None, {"note": "first"})

        def write_then_die(directory):
            (directory / "actor").mkdir()
            (directory / "actor" / "shard0.bin").write_bytes(b"half")
            os._exit(9)

        manager.save(2, write_then_die, {"note": "second"})
    """, tmp_path)
    assert result.returncode == 9, result.stderr
    assert [name.split("-")[0] for name in leftovers(tmp_path)] == [".global_step_2.partial"]
    manager = CheckpointManager(tmp_path)

    assert manager.latest() == tmp_path / "global_step_1"
    assert manager.load_state(manager.latest())["note"] == "first"
    assert manager.save(2, write_actor(b"two"), {}) == tmp_path / "global_step_2"
    assert leftovers(tmp_path) == []


def test_a_process_killed_while_replacing_a_step_leaves_that_step_loadable(tmp_path):
    # Killed after the old global_step_1 moved aside and before the new one moved in: the worst moment.
    result = run_in_subprocess("""
        import os, sys
        from rlplat.trainer.checkpoint import CheckpointManager

        manager = CheckpointManager(sys.argv[1], keep_last=1)
        manager.save(1, None, {"note": "first"})
        rename = os.rename

        def die_before_moving_the_new_one_in(source, destination):
            if ".partial-" in str(source):
                os._exit(9)
            rename(source, destination)

        os.rename = die_before_moving_the_new_one_in
        manager.save(1, None, {"note": "second"})
    """, tmp_path)
    assert result.returncode == 9, result.stderr
    assert saved_steps(tmp_path) == []
    manager = CheckpointManager(tmp_path, keep_last=2)

    assert manager.load_state(manager.latest())["note"] == "first"
    manager.save(2, None, {})
    assert manager.load_state(tmp_path / "global_step_1")["note"] == "first"
    assert leftovers(tmp_path) == []


# -- finding the latest ------------------------------------------------------------------------------------


def test_latest_is_none_before_any_save(tmp_path):
    assert CheckpointManager(tmp_path / "not-created-yet").latest() is None


def test_a_missing_latest_pointer_falls_back_to_scanning(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, None, {})
    (tmp_path / "latest").unlink()

    assert manager.latest() == tmp_path / "global_step_2"


def test_a_latest_pointer_naming_a_deleted_checkpoint_falls_back_to_scanning(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, None, {})
    shutil.rmtree(tmp_path / "global_step_2")

    assert manager.latest() == tmp_path / "global_step_1"


def test_a_latest_pointer_naming_an_incomplete_checkpoint_falls_back_to_scanning(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, None, {})
    (tmp_path / "global_step_2" / "COMPLETE").unlink()

    assert manager.latest() == tmp_path / "global_step_1"


def test_scanning_ignores_incomplete_directories(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, None, {})
    (tmp_path / "global_step_9").mkdir()
    (tmp_path / ".global_step_8.partial-0123abcd").mkdir()
    (tmp_path / "latest").unlink()

    assert [checkpoint.step for checkpoint in manager.checkpoints()] == [1]
    assert manager.latest() == tmp_path / "global_step_1"


# -- trainer.resume ----------------------------------------------------------------------------------------


def test_resume_disable_is_a_fresh_run_even_with_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, None, {})

    assert manager.resolve("disable") is None


def test_resume_auto_without_checkpoints_is_a_fresh_run(tmp_path):
    assert CheckpointManager(tmp_path).resolve("auto") is None


def test_resume_auto_picks_the_latest_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, None, {})

    assert manager.resolve("auto") == tmp_path / "global_step_2"


def test_resume_from_an_explicit_path(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, None, {})

    assert manager.resolve(str(tmp_path / "global_step_1")) == tmp_path / "global_step_1"


def test_resume_from_a_checkpoint_name_under_root(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, None, {})

    assert manager.resolve("global_step_1") == tmp_path / "global_step_1"


def test_resume_from_a_missing_path_names_it_and_lists_the_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, None, {})
    missing = tmp_path / "global_step_5"

    with pytest.raises(CheckpointError) as raised:
        manager.resolve(str(missing))

    message = str(raised.value)
    assert f"{missing} does not exist" in message
    assert f"Complete checkpoints under {tmp_path}: {tmp_path / 'global_step_1'}" in message


def test_resume_from_an_incomplete_checkpoint_says_its_save_did_not_finish(tmp_path):
    manager = CheckpointManager(tmp_path)
    incomplete = tmp_path / "global_step_3"
    incomplete.mkdir(parents=True)

    with pytest.raises(CheckpointError, match=r"global_step_3 has no COMPLETE marker: its save did not finish.*: none"):
        manager.resolve(str(incomplete))


# -- random streams ----------------------------------------------------------------------------------------


def draw_everything() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist()


def test_restoring_the_rng_state_repeats_the_streams_after_a_json_round_trip():
    draw_everything()
    state = json.loads(json.dumps(capture_rng_state()))
    expected = [draw_everything() for _ in range(3)]

    restore_rng_state(state)

    assert [draw_everything() for _ in range(3)] == expected


# -- Ctrl-C ------------------------------------------------------------------------------------------------


def test_a_first_ctrl_c_sets_the_flag_without_raising():
    with graceful_interrupt() as interrupt:
        assert interrupt.active and not interrupt.requested
        signal.raise_signal(signal.SIGINT)  # delivered to this thread and handled before it returns
        assert interrupt.requested


def test_a_second_ctrl_c_raises_keyboard_interrupt():
    with pytest.raises(KeyboardInterrupt):
        with graceful_interrupt():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)


def test_the_previous_ctrl_c_handler_is_back_after_the_block():
    before = signal.getsignal(signal.SIGINT)
    with graceful_interrupt():
        assert signal.getsignal(signal.SIGINT) is not before

    assert signal.getsignal(signal.SIGINT) is before


def test_the_previous_ctrl_c_handler_is_back_when_the_block_raises():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError):
        with graceful_interrupt():
            raise RuntimeError("a failed step")

    assert signal.getsignal(signal.SIGINT) is before


def test_graceful_interrupt_outside_the_main_thread_is_a_no_op():
    seen = {}

    def run():
        with graceful_interrupt() as interrupt:
            seen["active"], seen["handler"] = interrupt.active, signal.getsignal(signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()

    assert seen == {"active": False, "handler": before}


# -- import cost -------------------------------------------------------------------------------------------


def test_importing_rlplat_checkpoint_imports_no_torch(python_run):
    result = python_run("""
        import sys
        import rlplat.trainer.checkpoint
        print("torch" in sys.modules)
    """)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
