"""Provenance: which worker served a request under which policy version.

Two sources, both written by the router:

- every answer a worker served carries ``x-kvrouter-worker`` and ``x-kvrouter-policy-version``
  headers (for a stream, the version it started on) and ``system_fingerprint: "policy-N"`` in the
  body (a stream: on its first event, on the first event after it was continued elsewhere, and on
  its finishing events); with ``--expose-decisions`` also ``x-kvrouter-decision``;
- ``--provenance-log PATH`` writes one JSON line per finished request (:class:`ProvenanceRecord`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from . import headers as h

_FINGERPRINT = re.compile(r"^policy-(\d+)$")


def fingerprint_version(fingerprint: object) -> int | None:
    """The policy version in a ``system_fingerprint`` (``"policy-N"``), if it is one."""
    if isinstance(fingerprint, str) and (m := _FINGERPRINT.match(fingerprint)):
        return int(m.group(1))
    return None


def _int_header(headers: Mapping[str, str], name: str) -> int | None:
    value = headers.get(name)
    return int(value) if value is not None and value.strip().isdigit() else None


@dataclass(frozen=True)
class Provenance:
    """What the router said about one answer.

    ``worker`` and ``policy_version`` come from the response headers (``None`` when the router
    answered itself, e.g. a first-N-of-M sibling ended before it started); ``fingerprint_versions``
    are the versions in ``system_fingerprint``, in the order seen (a stream continued after a
    weight update shows the old version, then the new one); ``decision`` is the parsed
    ``x-kvrouter-decision`` (``--expose-decisions``).
    """

    worker: int | None = None
    policy_version: int | None = None
    fingerprint_versions: tuple[int, ...] = ()
    decision: dict[str, Any] | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Provenance:
        raw = headers.get(h.DECISION)
        try:
            decision = json.loads(raw) if raw else None
        except ValueError:
            decision = None
        return cls(
            worker=_int_header(headers, h.WORKER),
            policy_version=_int_header(headers, h.POLICY_VERSION),
            decision=decision if isinstance(decision, dict) else None,
        )

    def seen(self, fingerprint: object) -> Provenance:
        """This provenance with one more ``system_fingerprint`` (repeats of the last one dropped)."""
        v = fingerprint_version(fingerprint)
        if v is None or (self.fingerprint_versions and self.fingerprint_versions[-1] == v):
            return self
        return Provenance(self.worker, self.policy_version, (*self.fingerprint_versions, v), self.decision)

    @property
    def final_policy_version(self) -> int | None:
        """The version that finished the answer: the last fingerprint, else the header's."""
        return self.fingerprint_versions[-1] if self.fingerprint_versions else self.policy_version


@dataclass(frozen=True)
class ProvenanceRecord:
    """One line of ``--provenance-log`` (fields as in ``docs/serve.md``)."""

    request_id: int
    session: str | None
    group: str | None
    worker: int | None
    dp_rank: int
    policy_version: int
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    queue_ms: float
    ttft_ms: float | None
    decode_ms: float | None
    e2e_ms: float
    migrations: int
    update_aborts: int
    #: ``ok``, ``cancelled``, ``failed`` or ``aborted``.
    status: str
    #: ``group-satisfied`` (first-N-of-M) when ended early.
    abort_reason: str | None
    ts_ms: int
    #: The whole line, including fields this version of the client does not know.
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, line: Mapping[str, Any]) -> ProvenanceRecord:
        known: dict[str, Any] = {k: line.get(k) for k in cls.__dataclass_fields__ if k != "raw"}
        return cls(**known, raw=dict(line))


def read_provenance_log(path: str | Path) -> list[ProvenanceRecord]:
    """The complete lines of a provenance log (a partly written last line is skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        out.append(ProvenanceRecord.from_json(json.loads(line)))
    return out


async def wait_for_provenance(
    path: str | Path,
    until: Callable[[list[ProvenanceRecord]], bool],
    *,
    timeout_s: float = 10.0,
    poll_s: float = 0.02,
) -> list[ProvenanceRecord]:
    """Reads the log until ``until(records)`` holds (the router writes it from a background
    thread, shortly after each answer ends); ``TimeoutError`` with the last records after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_provenance_log(path)
        if until(records):
            return records
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"provenance log {path}: condition not met within {timeout_s} s "
                f"({len(records)} records: {[r.raw for r in records[-5:]]})"
            )
        await anyio.sleep(poll_s)
