"""The rollout server helper against a real HTTP server started on loopback."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rlplat.kits.rollout_server import ServerError, ServerProcess, cli_flags, free_port, python_module_argv, request_json

SERVER = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            # not ready for the first half second, as a real server loading a model
            self.answer(200 if time.monotonic() - started > 0.5 else 503, {"path": self.path})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            if self.path.startswith("/fail"):
                self.answer(400, {"error": "bad sampling key 'topk'"})
            else:
                self.answer(200, {"path": self.path, "body": body})

    print("serving", flush=True)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
''')


@pytest.fixture
def server(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    process = ServerProcess([sys.executable, str(script), str(port)], base_url=f"http://127.0.0.1:{port}", health_path="/health",
                            log_path=tmp_path / "server.log", name="test server")
    process.wait_ready(timeout_s=30)
    yield process
    process.stop()


def test_json_requests_round_trip_with_query_and_body(server):
    answer = request_json(server.base_url + "/sleep?level=2", {"tags": ["weights"]}, timeout=10)
    assert answer == {"path": "/sleep?level=2", "body": {"tags": ["weights"]}}
    assert request_json(server.base_url + "/reset", method="POST", timeout=10) == {"path": "/reset", "body": None}


def test_an_error_answer_carries_the_servers_message(server):
    with pytest.raises(ServerError, match=r"POST .*/fail answered 400: .*bad sampling key 'topk'"):
        request_json(server.base_url + "/fail", {"x": 1}, timeout=10)


def test_stop_ends_the_server_and_requests_then_fail(server):
    server.stop()
    assert server.process.poll() is not None
    with pytest.raises(ServerError, match="failed"):
        request_json(server.base_url + "/health", timeout=5)


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path):
    process = ServerProcess([sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"],
                            base_url=f"http://127.0.0.1:{free_port()}", health_path="/health", log_path=tmp_path / "log")
    with pytest.raises(ServerError, match=r"(?s)exited with code 3 before it was ready.*CUDA out of memory"):
        process.wait_ready(timeout_s=30)


@pytest.mark.slow
def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    process = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], base_url=f"http://127.0.0.1:{free_port()}",
                            health_path="/health", log_path=tmp_path / "log")
    with pytest.raises(ServerError, match="was not ready after 2 s"):
        process.wait_ready(timeout_s=2)
    assert process.process.poll() is not None


def test_cli_flags_follow_argparse_conventions():
    flags = cli_flags({"max_model_len": 512, "enforce_eager": True, "enable_prefix_caching": False, "seed": None, "config": {"a": 1}})
    assert flags == ["--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching", "--config", '{"a": 1}']
    assert cli_flags({"disable_cuda_graph": False, "tp_size": 2}, boolean_style="store_true") == ["--tp-size", "2"]
    assert python_module_argv("pkg.mod", ["--x"]) == [sys.executable, "-m", "pkg.mod", "--x"]


def test_cli_flags_can_write_list_items_as_separate_arguments():
    assert cli_flags({"cuda_graph_bs": [1, 2, 4]}, list_style="separate") == ["--cuda-graph-bs", "1", "2", "4"]


def test_server_settings_start_a_server_module_or_attach_to_a_url(tmp_path):
    from rlplat.kits.rollout_server import ServerSettings

    (tmp_path / "fake_rollout_server.py").write_text(SERVER)
    settings = ServerSettings(server_startup_timeout_s=30)
    base_url, process = settings.start_or_attach("fake_rollout_server", lambda host, port: [str(port)], health_path="/health",
                                                 env={"PYTHONPATH": str(tmp_path)}, name="fake server")
    try:
        assert base_url.startswith("http://127.0.0.1:") and process.process.poll() is None
        assert request_json(base_url + "/ping", {}, timeout=10) == {"path": "/ping", "body": {}}
        attached_url, none = ServerSettings(server_url=base_url + "/").start_or_attach("unused", lambda host, port: [], health_path="/health", name="x")
        assert (attached_url, none) == (base_url, None)
    finally:
        process.stop()


def test_server_settings_problems_are_sentences():
    from rlplat.kits.rollout_server import ServerSettings

    assert ServerSettings().server_problems("hybrid", "/m") == []
    assert ServerSettings().server_problems("hybrid", None) == ["model_path is required (a local Hugging Face directory)"]
    assert ServerSettings(server_url="http://x").server_problems("hybrid", "/m") == ["server_url is a server-mode key; set mode=server to use it"]
    assert ServerSettings(server_port=70000).server_problems("server", "/m") == ["server_port must be in 0..65535, got 70000"]


def test_a_server_whose_owner_is_killed_is_stopped_with_it(tmp_path):
    """The process that started a server is SIGKILLed (no atexit, no stop()): the server and its own children
    are gone soon after, not left holding their memory."""
    import os
    import signal
    import subprocess
    import time

    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f'''
        import subprocess, sys, time
        from rlplat.kits.rollout_server import ServerProcess, free_port
        port = free_port()
        grandchild = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
        server = ServerProcess([sys.executable, "-c", grandchild], base_url=f"http://127.0.0.1:{{port}}", health_path="/h",
                               log_path={str(tmp_path / "log")!r})
        print(server.process.pid, flush=True)
        time.sleep(300)
    ''')], stdout=subprocess.PIPE, text=True)
    group = int(owner.stdout.readline())
    time.sleep(1.0)  # the server and its child are up
    assert os.killpg(group, 0) is None
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)
    pytest.fail("the server's process group outlived its owner by 20 s")
