"""``rlplat serve`` as a command: the conformance suite of commands, its refusals, and a real process the SDK
trains through and SIGTERM stops."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rlplat.testing import CommandConformance


class TestServeCommand(CommandConformance):
    @pytest.fixture
    def command(self):
        from rlplat_tinker.command import serve

        return serve

    @pytest.fixture
    def command_name(self):
        return "serve"


def rlplat(*arguments: str, **settings) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from rlplat.cli.main import main; main()", *arguments], capture_output=True, text=True, timeout=120, **settings)


def test_a_missing_model_a_bad_override_and_an_open_bind_without_a_key_are_refused(tmp_path, model_dir):
    cases = [
        (["--model", str(tmp_path / "nowhere")], "is not a local Hugging Face folder"),
        (["--model", model_dir, "optimizer.lr=1"], "is not engine.KEY=VALUE or rollout.KEY=VALUE"),
        (["--model", model_dir, "--host", "0.0.0.0"], "needs an API key"),
    ]
    for arguments, reason in cases:
        result = rlplat("serve", *arguments)
        assert result.returncode == 2 and reason in result.stderr, result.stderr


def test_what_start_checks_before_anything_starts(model_dir):
    """Engine and rollout names, the engine's features, build keys, the port and the snapshot count are refused
    before a worker or a server starts (not at a client's first call), and an address in use names itself."""
    import socket

    from rlplat_tinker.serve import start

    cases = [
        (dict(port=70000), "--port must be from 0"),
        (dict(max_snapshots=0), "--max-snapshots must be >= 1"),
        (dict(engine="nosuch"), "unknown engine 'nosuch'"),
        (dict(rollout="nosuch"), "unknown rollout 'nosuch'"),
        (dict(rollout_config={"temprature": 1.0}), "unknown config key 'rollout.temprature'"),
        (dict(engine_config={"micro_batch_size": 2}), "unknown config key 'engine.micro_batch_size'"),
    ]
    for settings, reason in cases:
        with pytest.raises(ValueError, match=re.escape(reason)):
            start(model_dir, **settings)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="cannot listen on 127.0.0.1"):
            start(model_dir, port=taken.getsockname()[1])


@pytest.mark.slow
def test_a_served_process_trains_through_the_sdk_and_stops_on_sigterm(model_dir, tmp_path):
    import tinker
    from tinker import types

    process = subprocess.Popen([sys.executable, "-c", "from rlplat.cli.main import main; main()", "serve", "--model", model_dir, "--port", "0",
                                "--state-dir", str(tmp_path / "states"), "engine.micro_batch_size_per_gpu=4"],
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "TINKER_TELEMETRY": "0"})
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            found = re.search(r"rlplat serve: (http://127\.0\.0\.1:\d+)", line)
            url = found.group(1) if found else None
            assert line or process.poll() is None, "rlplat serve exited before it served"
        service = tinker.ServiceClient(base_url=url, api_key="tml-test")
        client = service.create_lora_training_client(base_model=model_dir, rank=2).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 5, 6]), loss_fn_inputs={"target_tokens": [5, 6, 7], "weights": [1.0] * 3})
        loss = client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] < loss
        assert client.save_state("kept").result().path.endswith("/weights/kept")
        service.close("success").result()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert (tmp_path / "states").is_dir() and any((tmp_path / "states").rglob("kept"))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
