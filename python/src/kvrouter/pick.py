"""The pick API: ask kvrouter where to send a request, send it yourself, report how it went.

``POST /v1/pick`` places the request exactly as the router would place a proxied one (the
same queue, busy filters, sessions, groups and policy versions) and answers the chosen worker;
nothing is forwarded. The caller reports the first token and the finish, so the router's load
view stays right; a pick reported neither way within its lease expires and its load is
released.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: A pick's lifecycle events (``client.report(pick, event)``).
PickEvent = Literal["first_token", "finish"]
#: How a pick ended: completed, abandoned by the caller, or failed on the worker (the failure
#: counts toward the worker's health).
PickStatus = Literal["ok", "cancelled", "failed"]


@dataclass(frozen=True)
class Pick:
    """Where to send one request: the worker the router chose, and why."""

    #: The pick's id (for :meth:`kvrouter.AsyncKvrouterClient.report`).
    id: str
    #: The chosen worker's id and base URL (its OpenAI API is ``url + "/v1/..."``).
    worker_id: int
    url: str
    #: The data-parallel rank of the worker the router counted the request on.
    dp_rank: int
    #: The policy (weight) version the chosen worker serves.
    policy_version: int
    #: Prompt tokens as the router counted them, and those it expects the worker to have cached.
    prompt_tokens: int
    cached_tokens: int
    #: Milliseconds before an unreported pick expires.
    lease_ms: int
    #: The decision and every candidate's score breakdown.
    decision: dict[str, Any] = field(default_factory=dict)
    #: The outcome of each report sent with this pick (``pick(reports=...)``), in order:
    #: ``{"id", "status"}``, or ``{"id", "error": {...}}`` for an unknown, finished or expired id.
    reports: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Pick:
        worker = body.get("worker") or {}
        return cls(
            id=str(body["id"]),
            worker_id=int(worker["id"]),
            url=str(worker["url"]),
            dp_rank=int(worker.get("dp_rank") or 0),
            policy_version=int(body.get("policy_version") or 0),
            prompt_tokens=int(body.get("prompt_tokens") or 0),
            cached_tokens=int(body.get("cached_tokens") or 0),
            lease_ms=int(body.get("lease_ms") or 0),
            decision=dict(body.get("decision") or {}),
            reports=list(body.get("reports") or []),
        )


def finish_body(
    status: PickStatus,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    cached_tokens: int | None,
) -> dict[str, Any]:
    """The body of a finish report (the fields given)."""
    body: dict[str, Any] = {"status": status}
    for key, value in (
        ("prompt_tokens", prompt_tokens),
        ("completion_tokens", completion_tokens),
        ("cached_tokens", cached_tokens),
    ):
        if value is not None:
            body[key] = value
    return body


def binary_ids(token_ids: Sequence[int]) -> bytes | None:
    """``token_ids`` as 4-byte little-endian words, the pick API's binary ids; ``None`` when one
    is no integer from 0 to 4294967295 (or this platform's ``array('I')`` is not 4 bytes)."""
    ids = array("I")
    if ids.itemsize != 4:
        return None
    try:
        ids.extend(token_ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def report_entry(
    pick: Pick | str,
    event: PickEvent,
    *,
    status: PickStatus = "ok",
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """One report for ``pick(reports=[...])`` or ``report_batch([...])``: a pick's
    ``first_token``, or its ``finish`` with its status and the token counts given."""
    if event not in ("first_token", "finish"):
        raise ValueError(f"event must be 'first_token' or 'finish', not {event!r}")
    entry: dict[str, Any] = {"id": pick.id if isinstance(pick, Pick) else pick, "event": event}
    if event == "finish":
        entry.update(finish_body(status, prompt_tokens, completion_tokens, cached_tokens))
    return entry
