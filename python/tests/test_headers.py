"""RolloutHeaders: the header names the router reads, and its rules checked before sending."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvrouter import RolloutHeaders
from kvrouter import headers as h

ROUTER_HEADERS = Path(__file__).resolve().parents[2] / "crates" / "server" / "src" / "headers.rs"


def test_every_field_maps_to_the_router_header() -> None:
    sent = RolloutHeaders(
        group_id="step3-prompt7",
        group_size=16,
        group_need=12,
        session_id="traj-1",
        policy_version=3,
        min_policy_version=2,
        max_policy_staleness=1,
        priority=9,
        deadline_ms=5000,
    ).to_headers()
    assert sent == {
        "x-kvrouter-group-id": "step3-prompt7",
        "x-kvrouter-group-size": "16",
        "x-kvrouter-group-need": "12",
        "x-session-id": "traj-1",
        "x-kvrouter-policy-version": "3",
        "x-kvrouter-min-policy-version": "2",
        "x-kvrouter-max-policy-staleness": "1",
        "x-kvrouter-priority": "9",
        "x-kvrouter-deadline-ms": "5000",
    }


def test_unset_fields_send_nothing() -> None:
    assert RolloutHeaders().to_headers() == {}
    assert RolloutHeaders(policy_version=0).to_headers() == {"x-kvrouter-policy-version": "0"}


def test_header_names_are_the_ones_the_router_source_reads() -> None:
    source = ROUTER_HEADERS.read_text(encoding="utf-8")
    quoted = set(re.findall(r'"(x-[a-z-]+)"', source))
    for name in RolloutHeaders(
        group_id="g", group_size=2, group_need=1, session_id="s", policy_version=1,
        min_policy_version=1, max_policy_staleness=1, priority=1, deadline_ms=1,
    ).to_headers():
        assert name in quoted, f"{name} is not read by {ROUTER_HEADERS}"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"group_size": 4}, h.GROUP_ID),
        ({"group_id": "g", "group_size": 4, "group_need": 5}, h.GROUP_NEED),
        ({"group_id": "g", "group_size": 0}, h.GROUP_SIZE),
        ({"policy_version": -1}, h.POLICY_VERSION),
        ({"priority": 10}, h.PRIORITY),
        ({"deadline_ms": 0}, h.DEADLINE_MS),
        ({"session_id": "two words\n"}, h.SESSION_ID),
        ({"min_policy_version": True}, h.MIN_POLICY_VERSION),
        # Values the router or HTTP itself would refuse after the request was built.
        ({"group_id": " a"}, h.GROUP_ID),
        ({"group_id": "a" * 100_000}, h.GROUP_ID),
        ({"group_id": "g", "group_size": 2**40}, h.GROUP_SIZE),
        ({"policy_version": 2**64}, h.POLICY_VERSION),
        ({"deadline_ms": 2**70}, h.DEADLINE_MS),
    ],
)
def test_bad_values_raise_naming_the_header(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        RolloutHeaders(**fields)  # type: ignore[arg-type]
