"""What the examples share: where the router is (``--url``, or one started from
``$KVROUTER_BIN`` with mock engines), and a check that exits non-zero when it fails."""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrouter import KvrouterServer


@dataclass(frozen=True)
class Router:
    url: str
    admin_token: str
    #: The provenance log, when this example started the router (else ``None``).
    provenance_log: Path | None


def arguments(doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running router (default: start `kvrouter serve --mock-workers` from $KVROUTER_BIN)")
    parser.add_argument("--admin-token", default="example-admin-token", help="the router's admin token")
    parser.add_argument("--model", default="mock-model")
    return parser


@contextmanager
def router(args: argparse.Namespace, serve_args: Sequence[str] = (), mock_workers: int = 2) -> Iterator[Router]:
    """The router to use: ``--url``, or a ``kvrouter serve`` started here and stopped after."""
    if args.url:
        yield Router(args.url, args.admin_token, None)
        return
    with tempfile.TemporaryDirectory(prefix="kvrouter-example-") as tmp:
        log = Path(tmp) / "provenance.jsonl"
        with KvrouterServer(
            mock_workers=mock_workers,
            mock_speedup_ratio=10,
            admin_token=args.admin_token,
            args=["--provenance-log", str(log), *serve_args],
        ) as server:
            yield Router(server.url, args.admin_token, log)


def check(ok: bool, what: str) -> None:
    """Ends the example with status 1 when ``ok`` is false (kept under ``python -O``)."""
    if not ok:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
