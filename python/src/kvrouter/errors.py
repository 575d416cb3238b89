"""Typed errors. Every error carries the OpenAI-shaped body ``{"error": {"message", "type",
"param", "code"}}``: the router's own when it answered with one, else one built here that says
what went wrong on the client's side (a timeout, a failed weight update, a server that did not
start)."""

from __future__ import annotations

import json
from typing import Any


class KvrouterError(Exception):
    """An error from kvrouter or from this client, with the OpenAI-shaped error it carries.

    ``status`` is the HTTP status (``None`` when no HTTP answer was involved); ``message``,
    ``type``, ``param`` and ``code`` are the fields of ``body["error"]``.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str = "kvrouter_error",
        param: str | None = None,
        code: int | str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message if status is None else f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.body: dict[str, Any] = body or {
            "error": {"message": message, "type": type, "param": param, "code": code}
        }


class TransportError(KvrouterError):
    """No answer from the router: the connection was refused or broke, the client's timeout
    passed, or the client was closed. ``status`` is ``None``; the cause is ``__cause__``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, type="transport_error")


class BadRequestError(KvrouterError):
    """400: a malformed body field or routing header; ``param`` names it."""


class AuthenticationError(KvrouterError):
    """401: the admin token is missing or wrong."""


class NotFoundError(KvrouterError):
    """404: unknown model, route or worker (or the admin API is off: no ``--admin-token``)."""


class ConflictError(KvrouterError):
    """409: a weight update is already running, or a worker URL is already registered."""


class ServiceUnavailableError(KvrouterError):
    """503: no eligible worker (or none serves the model's pool), or the request waited too
    long in the router queue, or the router is draining."""


class OverloadedError(KvrouterError):
    """529: refused under overload, before any work: the router queue or the pick table is
    full. The answer's ``Retry-After`` says when to try again."""


class GatewayTimeoutError(KvrouterError):
    """504: the request's ``x-kvrouter-deadline-ms`` passed before a worker took it."""


class UpstreamError(KvrouterError):
    """502 (every worker attempt failed), or an in-band error event that ended a stream."""


class WeightUpdateError(KvrouterError):
    """A weight-update cycle ended with failed workers (left ``paused`` with their old
    weights), or the router reports a different cycle than the one waited for."""

    def __init__(self, message: str, *, status: dict[str, Any] | None = None) -> None:
        super().__init__(message, type="weight_update_failed")
        #: The last ``GET /admin/policy`` answer.
        self.policy_status = status


class WeightUpdateTimeout(KvrouterError):
    """A weight-update cycle was still running when the caller's timeout passed."""

    def __init__(self, message: str, *, status: dict[str, Any] | None = None) -> None:
        super().__init__(message, type="timeout")
        #: The last ``GET /admin/policy`` answer.
        self.policy_status = status


class ServerStartError(KvrouterError):
    """``kvrouter serve`` could not be started, exited, or was not ready in time."""

    def __init__(self, message: str) -> None:
        super().__init__(message, type="server_start_failed")


_BY_STATUS: dict[int, type[KvrouterError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    502: UpstreamError,
    503: ServiceUnavailableError,
    504: GatewayTimeoutError,
    529: OverloadedError,
}


def error_from_body(status: int | None, raw: bytes | str | dict[str, Any]) -> KvrouterError:
    """The typed error for an HTTP status and an answer body (or a stream's error event).

    A body that is not OpenAI-shaped is kept whole as the message.
    """
    body: Any = raw
    if not isinstance(raw, dict):
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        text = raw if isinstance(raw, str) else (
            raw.decode("utf-8", "replace") if isinstance(raw, bytes) else json.dumps(raw)
        )
        err = {"message": text.strip() or "(empty body)", "type": "http_error"}
        body = {"error": err}
    code = err.get("code")
    if status is None and isinstance(code, int):
        status = code
    cls = _BY_STATUS.get(status or 0, KvrouterError)
    if status is None:
        cls = UpstreamError
    return cls(
        str(err.get("message", "")),
        status=status,
        type=str(err.get("type", "kvrouter_error")),
        param=err.get("param") if isinstance(err.get("param"), str) else None,
        code=code if isinstance(code, (int, str)) else None,
        body=body,
    )
