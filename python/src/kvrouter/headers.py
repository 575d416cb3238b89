"""The request headers kvrouter reads for RL rollouts (see ``docs/rl.md`` and ``docs/serve.md``).

``RolloutHeaders(...).to_headers()`` gives a plain ``dict`` to pass as ``extra_headers=`` to the
official ``openai`` client, or as ``rl=`` to :class:`kvrouter.AsyncKvrouterClient` (``dataclasses.replace`` makes variants). Values are
checked here with the router's own rules, so a mistake is a ``ValueError`` naming the header
before any request is sent (the router would answer 400 naming it).
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_ID = "x-kvrouter-group-id"
GROUP_SIZE = "x-kvrouter-group-size"
GROUP_NEED = "x-kvrouter-group-need"
SESSION_ID = "x-session-id"
POLICY_VERSION = "x-kvrouter-policy-version"
MIN_POLICY_VERSION = "x-kvrouter-min-policy-version"
MAX_POLICY_STALENESS = "x-kvrouter-max-policy-staleness"
PRIORITY = "x-kvrouter-priority"
DEADLINE_MS = "x-kvrouter-deadline-ms"

#: Response headers: the worker that served a request, the policy version it served, and (with
#: ``--expose-decisions``) the routing decision as compact JSON.
WORKER = "x-kvrouter-worker"
DECISION = "x-kvrouter-decision"

#: The highest ``x-kvrouter-priority`` the router accepts.
MAX_PRIORITY = 9

#: The router reads group counts as 32-bit and versions and budgets as 64-bit integers.
_U32 = 2**32 - 1
_U64 = 2**64 - 1

#: The longest group or session id sent (the router refuses header blocks past its limit).
MAX_ID_CHARS = 4096


@dataclass(frozen=True)
class RolloutHeaders:
    """What one rollout request tells the router.

    - ``group_id``: the GRPO group (one prompt of one step; use a new id every step).
    - ``group_size``: samples in the group (M); turns on fair-share placement.
    - ``group_need``: first N of M; when the N-th sample completes, the router ends the others
      (``finish_reason: "abort"``).
    - ``session_id``: a multi-turn trajectory (``x-session-id``); with
      ``--router-session-affinity-ttl-secs`` its turns stay on one worker.
    - ``policy_version`` (exactly), ``min_policy_version`` (or newer), ``max_policy_staleness``
      (at most K versions behind the newest worker): the versions this request accepts.
    - ``priority`` (0 to 9) and ``deadline_ms`` (a budget; 504 after it).
    """

    group_id: str | None = None
    group_size: int | None = None
    group_need: int | None = None
    session_id: str | None = None
    policy_version: int | None = None
    min_policy_version: int | None = None
    max_policy_staleness: int | None = None
    priority: int | None = None
    deadline_ms: int | None = None

    def __post_init__(self) -> None:
        for name, value, least, most in (
            (GROUP_SIZE, self.group_size, 1, _U32),
            (GROUP_NEED, self.group_need, 1, _U32),
            (POLICY_VERSION, self.policy_version, 0, _U64),
            (MIN_POLICY_VERSION, self.min_policy_version, 0, _U64),
            (MAX_POLICY_STALENESS, self.max_policy_staleness, 0, _U64),
            (PRIORITY, self.priority, 0, _U64),
            (DEADLINE_MS, self.deadline_ms, 1, _U64),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most
            ):
                raise ValueError(f"{name} must be an integer from {least} to {most}, got {value!r}")
        if self.priority is not None and self.priority > MAX_PRIORITY:
            raise ValueError(f"{PRIORITY} must be at most {MAX_PRIORITY}, got {self.priority}")
        if self.group_id is None and (self.group_size is not None or self.group_need is not None):
            raise ValueError(f"{GROUP_SIZE} and {GROUP_NEED} need {GROUP_ID}")
        if self.group_size is not None and self.group_need is not None and self.group_need > self.group_size:
            raise ValueError(
                f"{GROUP_NEED} ({self.group_need}) is more than {GROUP_SIZE} ({self.group_size})"
            )
        for name, text in ((GROUP_ID, self.group_id), (SESSION_ID, self.session_id)):
            if text is None:
                continue
            # HTTP drops a header value's outer spaces (httpx refuses to send them).
            visible = text.isascii() and text.isprintable() and text == text.strip()
            if not text or not visible or len(text) > MAX_ID_CHARS:
                raise ValueError(
                    f"{name} must be visible ASCII text of 1 to {MAX_ID_CHARS} characters without "
                    f"leading or trailing spaces, got {text[:100]!r}"
                )

    def to_headers(self) -> dict[str, str]:
        """The headers to send, only those set."""
        pairs = (
            (GROUP_ID, self.group_id),
            (GROUP_SIZE, self.group_size),
            (GROUP_NEED, self.group_need),
            (SESSION_ID, self.session_id),
            (POLICY_VERSION, self.policy_version),
            (MIN_POLICY_VERSION, self.min_policy_version),
            (MAX_POLICY_STALENESS, self.max_policy_staleness),
            (PRIORITY, self.priority),
            (DEADLINE_MS, self.deadline_ms),
        )
        return {name: str(value) for name, value in pairs if value is not None}
