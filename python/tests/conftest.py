"""Fixtures: a real ``kvrouter serve --mock-workers 2`` built from this checkout
(``KVROUTER_BIN``, e.g. ``target/debug/kvrouter``). A missing binary fails the tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvrouter import KvrouterServer, find_binary

TOKEN = "test-admin-token"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def kvrouter_bin() -> str:
    if not os.environ.get("KVROUTER_BIN"):
        pytest.fail("KVROUTER_BIN is not set: `cargo build -p kvrouter`, then KVROUTER_BIN=target/debug/kvrouter")
    return find_binary()


@pytest.fixture(scope="session")
def router(kvrouter_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvrouterServer]:
    """A router shared by tests that leave its versions and workers alone."""
    log = tmp_path_factory.mktemp("shared") / "provenance.jsonl"
    server = KvrouterServer(
        kvrouter_bin,
        mock_workers=2,
        mock_speedup_ratio=10,
        admin_token=TOKEN,
        args=["--provenance-log", str(log), "--router-session-affinity-ttl-secs", "60", "--expose-decisions"],
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def provenance_log(router: KvrouterServer) -> Path:
    return Path(router.command[router.command.index("--provenance-log") + 1])


ServerFactory = Callable[..., KvrouterServer]


@pytest.fixture
def serve(kvrouter_bin: str) -> Iterator[ServerFactory]:
    """Starts a router of its own for a test (``serve(args=[...], ...)``); stops it after."""
    started: list[KvrouterServer] = []

    def start(**kwargs: object) -> KvrouterServer:
        kwargs.setdefault("admin_token", TOKEN)
        server = KvrouterServer(kvrouter_bin, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()
