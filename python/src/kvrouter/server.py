"""Runs ``kvrouter serve`` as a subprocess, for tests and examples.

    with KvrouterServer(mock_workers=2, admin_token="t") as server:
        client = server.client()

The binary is ``binary=``, else ``$KVROUTER_BIN``, else ``kvrouter`` on ``PATH``. By default
the router binds port 0 and the helper reads the address it announces (no race with other
processes for a port); ``port=free_port()`` picks one up front instead. Every wait is bounded:
the announce line and ``/ready`` by ``startup_timeout_s``, the SIGTERM drain by
``stop_timeout_s`` (then SIGKILL).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import anyio.to_thread
import httpx

from .client import AsyncKvrouterClient
from .errors import ServerStartError

_ANNOUNCE = re.compile(r"listening on (http://\S+)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may take it before you bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def find_binary(binary: str | os.PathLike[str] | None = None) -> str:
    """``binary``, else ``$KVROUTER_BIN``, else ``kvrouter`` on ``PATH``; must be executable."""
    candidate = os.fspath(binary) if binary is not None else os.environ.get("KVROUTER_BIN") or shutil.which("kvrouter")
    if not candidate:
        raise ServerStartError("no kvrouter binary: pass binary=, set KVROUTER_BIN, or put kvrouter on PATH")
    if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
        raise ServerStartError(f"kvrouter binary {candidate!r} is not an executable file")
    return candidate


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Hands stdout lines to the waiting thread, then keeps draining so the pipe never fills."""
    with stream:
        for line in stream:
            lines.put(line)
    lines.put(None)


def _remove(path: str) -> None:
    """Removes a temporary log, if it is still there."""
    Path(path).unlink(missing_ok=True)


class KvrouterServer:
    """A ``kvrouter serve`` process.

    ``mock_workers``: embedded mock engines (``None``: give workers in ``args``).
    ``mock_speedup_ratio``: mock engines' speed-up. ``admin_token``: passed through the
    environment (``KVROUTER_ADMIN_TOKEN``), not the command line. ``args``: more flags.
    The router's stderr goes to :attr:`log_path` (a temporary file unless given, removed when
    this object is collected or the interpreter exits; :meth:`log` reads it until then).
    """

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        *,
        mock_workers: int | None = 2,
        mock_speedup_ratio: float | None = None,
        admin_token: str | None = None,
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        if isinstance(args, str):
            raise TypeError(f"args must be a sequence of flags, not one string: {args!r}")
        self.binary = find_binary(binary)
        self.admin_token = admin_token
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.command = [self.binary, "serve", "--host", host, "--port", str(port)]
        if mock_workers is not None:
            self.command += ["--mock-workers", str(mock_workers)]
        if mock_speedup_ratio is not None:
            self.command += ["--mock-speedup-ratio", str(mock_speedup_ratio)]
        self.command += list(args)
        self._env = dict(os.environ if env is None else env)
        if admin_token is not None:
            self._env["KVROUTER_ADMIN_TOKEN"] = admin_token
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="kvrouter-serve-", suffix=".log")
            os.close(fd)
            weakref.finalize(self, _remove, log_path)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[str] | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        """The router's root URL (``http://127.0.0.1:PORT``)."""
        if self._url is None:
            raise RuntimeError("the server is not started")
        return self._url

    @property
    def openai_base_url(self) -> str:
        """``base_url`` for the official ``openai`` client."""
        return self.url + "/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def log(self, limit_chars: int = 4000) -> str:
        """The router's stderr; past ``limit_chars``, its beginning and end (an error's message
        comes first, a backtrace after it)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        if len(text) <= limit_chars:
            return text
        half = limit_chars // 2
        return f"{text[:half]}\n[... {len(text) - limit_chars} characters ...]\n{text[-half:]}"

    def client(self, **kwargs: Any) -> AsyncKvrouterClient:
        """An :class:`kvrouter.AsyncKvrouterClient` for this router (with its admin token)."""
        kwargs.setdefault("admin_token", self.admin_token)
        return AsyncKvrouterClient(self.url, **kwargs)

    def start(self) -> KvrouterServer:
        """Starts the process; returns once ``/ready`` answers 200. Raises
        :class:`kvrouter.ServerStartError` (with the router's stderr) if it exits or is not
        ready within ``startup_timeout_s``; the process is stopped then."""
        if self._proc is not None:
            raise RuntimeError("already started")
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            with open(self.log_path, "w", encoding="utf-8") as log:
                self._proc = subprocess.Popen(
                    self.command,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    env=self._env,
                )
        except OSError as e:
            # Not an executable, or the log cannot be written: no process was started.
            raise ServerStartError(f"cannot start {self.command[0]} (log {self.log_path}): {e}") from e
        try:
            self._url = self._await_announce(deadline)
            self._await_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _fail(self, why: str) -> ServerStartError:
        return ServerStartError(f"kvrouter serve {why}: {' '.join(self.command)}\n--- stderr ---\n{self.log()}")

    def _await_announce(self, deadline: float) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(self._proc.stdout, lines), daemon=True).start()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"announced no address within {self.startup_timeout_s} s")
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                code = self._proc.wait(timeout=self.stop_timeout_s)
                raise self._fail(f"exited with status {code} before listening")
            if m := _ANNOUNCE.search(line):
                return m.group(1)

    def _await_ready(self, deadline: float) -> None:
        assert self._proc is not None
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self._proc.poll() is not None:
                    raise self._fail(f"exited with status {self._proc.returncode} before ready")
                try:
                    if http.get(self.url + "/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() >= deadline:
                    raise self._fail(f"was not ready within {self.startup_timeout_s} s")
                time.sleep(0.02)

    def stop(self) -> int | None:
        """SIGTERM (the router drains in-flight requests), then waits up to ``stop_timeout_s``;
        SIGKILL after that. Returns the exit status (``None`` if never started)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=self.stop_timeout_s)
        return proc.returncode

    def __enter__(self) -> KvrouterServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> KvrouterServer:
        return await anyio.to_thread.run_sync(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await anyio.to_thread.run_sync(self.stop)
