"""The subprocess helper: start, readiness, SIGTERM, and start failures that say why."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from kvrouter import KvrouterServer, ServerStartError, free_port


def test_sigterm_drains_and_exits_zero(kvrouter_bin: str) -> None:
    server = KvrouterServer(kvrouter_bin, mock_workers=1).start()
    assert httpx.get(server.url + "/ready").status_code == 200
    pid = server.pid
    assert server.stop() == 0
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "SIGTERM: draining" in server.log()


def test_a_port_picked_up_front_is_used(kvrouter_bin: str) -> None:
    port = free_port()
    with KvrouterServer(kvrouter_bin, mock_workers=1, port=port) as server:
        assert server.url == f"http://127.0.0.1:{port}"
        assert server.openai_base_url == f"http://127.0.0.1:{port}/v1"


def test_a_missing_binary_is_a_start_error() -> None:
    with pytest.raises(ServerStartError, match="not an executable file"):
        KvrouterServer("/nonexistent/kvrouter")


def test_a_bad_flag_is_a_start_error_with_the_routers_message(kvrouter_bin: str) -> None:
    server = KvrouterServer(kvrouter_bin, args=["--no-such-flag"], startup_timeout_s=10)
    with pytest.raises(ServerStartError, match="no-such-flag") as caught:
        server.start()
    assert "exited with status" in str(caught.value)


def fake_router(tmp_path: Path, body: str) -> str:
    """An executable standing in for `kvrouter` (the helper's deadlines, without a real router)."""
    script = tmp_path / "fake-kvrouter"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return str(script)


def test_a_router_that_never_announces_is_stopped_after_the_deadline(tmp_path: Path) -> None:
    binary = fake_router(tmp_path, "import time\ntime.sleep(600)\n")
    server = KvrouterServer(binary, startup_timeout_s=1, stop_timeout_s=5)
    began = time.monotonic()
    with pytest.raises(ServerStartError, match="announced no address within 1"):
        server.start()
    assert time.monotonic() - began < 10
    assert server.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


def test_a_router_never_ready_is_stopped_after_the_deadline(tmp_path: Path) -> None:
    binary = fake_router(
        tmp_path,
        """
        import http.server
        class NotReady(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(503)
                self.end_headers()
            def log_message(self, *args):
                pass
        server = http.server.HTTPServer(("127.0.0.1", 0), NotReady)
        print(f"kvrouter serve listening on http://127.0.0.1:{server.server_port} mode=kv workers=0", flush=True)
        server.serve_forever()
        """,
    )
    server = KvrouterServer(binary, startup_timeout_s=1, stop_timeout_s=5)
    began = time.monotonic()
    with pytest.raises(ServerStartError, match="not ready within 1"):
        server.start()
    assert time.monotonic() - began < 10
    assert server.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


def test_start_failures_before_the_process_runs_are_start_errors(tmp_path: Path) -> None:
    # Not a binary (exec format error), and a log that cannot be opened: both escaped as OSError.
    fake = tmp_path / "kvrouter"
    fake.write_text("not a program")
    fake.chmod(0o755)
    with pytest.raises(ServerStartError):
        KvrouterServer(str(fake)).start()
    with pytest.raises(ServerStartError, match="log"):
        KvrouterServer(str(fake), log_path=tmp_path / "none" / "x.log").start()
    with pytest.raises(TypeError):
        KvrouterServer(str(fake), args="--foo")


def test_the_temporary_log_is_removed_when_the_server_object_goes(kvrouter_bin: str) -> None:
    import gc

    server = KvrouterServer(kvrouter_bin, mock_workers=1).start()
    log = server.log_path
    server.stop()
    assert log.exists() and "SIGTERM" in server.log()
    del server
    gc.collect()
    assert not log.exists()
