"""The async client: OpenAI-compatible calls with kvrouter's RL headers, the answers'
provenance, and (``client.admin``) the admin API."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from .admin import AdminClient
from .headers import RolloutHeaders
from .pick import Pick, PickEvent, PickStatus, binary_ids, finish_body
from .provenance import Provenance
from .stream import Stream
from ._transport import Transport, decoded
from .errors import KvrouterError

#: Default seconds for one call (connect, and each read of the answer).
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Completion:
    """A non-streamed answer: the body as the router returned it, and its provenance."""

    body: dict[str, Any]
    provenance: Provenance

    @property
    def choice(self) -> dict[str, Any]:
        choices = self.body.get("choices") or [{}]
        first: dict[str, Any] = choices[0]
        return first

    @property
    def text(self) -> str:
        """The first choice's content (chat) or text (completion)."""
        message = self.choice.get("message")
        value = message.get("content") if isinstance(message, dict) else self.choice.get("text")
        return value if isinstance(value, str) else ""

    @property
    def finish_reason(self) -> str | None:
        """``stop``, ``length``, or ``abort`` (ended by first-N-of-M)."""
        reason = self.choice.get("finish_reason")
        return reason if isinstance(reason, str) else None

    @property
    def usage(self) -> dict[str, Any] | None:
        usage = self.body.get("usage")
        return usage if isinstance(usage, dict) else None


def _headers(rl: RolloutHeaders | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    out = rl.to_headers() if rl is not None else {}
    out.update(extra or {})
    return out


class AsyncKvrouterClient:
    """An async client for one kvrouter.

    ``base_url``: the router (``http://host:8000``, with or without ``/v1``). ``model``: the
    default model of calls that name none. ``api_key``: sent as ``Authorization: Bearer`` on the
    data plane, for a router started with ``--api-key``. ``admin_token``: for :attr:`admin`.
    Every call takes
    ``rl=RolloutHeaders(...)`` and/or ``extra_headers={...}``; every other keyword goes into the
    request body unchanged (``max_tokens=``, ``temperature=``, ``stream_options=`` ...).
    Error answers raise :class:`kvrouter.KvrouterError` subclasses.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        admin_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self._own_http = http is None
        self._transport = Transport(base_url, http or httpx.AsyncClient(timeout=timeout_s), api_key)
        self.model = model
        self.admin = AdminClient(self._transport, admin_token)

    @property
    def base_url(self) -> str:
        """The router's root URL (append ``/v1`` for the ``openai`` client)."""
        return self._transport.root

    async def aclose(self) -> None:
        if self._own_http:
            await self._transport.http.aclose()

    async def __aenter__(self) -> AsyncKvrouterClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _body(self, model: str | None, params: dict[str, Any]) -> dict[str, Any]:
        model = model or self.model
        if model is None:
            raise ValueError("no model: pass model= to the call or to AsyncKvrouterClient")
        return {"model": model, **params}

    async def _unary(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Completion:
        response = await self._transport.request("POST", path, json=body, headers=headers)
        answer = decoded(response.text, f"the answer to POST {path}")
        if not isinstance(answer, dict):
            raise KvrouterError(f"the answer to POST {path} is not a JSON object: {response.text[:200]!r}")
        provenance = Provenance.from_headers(response.headers).seen(answer.get("system_fingerprint"))
        return Completion(answer, provenance)

    def _stream(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Stream:
        self._transport.check_open(f"POST {path}")
        http = self._transport.http
        return Stream(
            http.stream(
                "POST",
                self._transport.root + path,
                json={**body, "stream": True},
                headers=self._transport.with_auth(headers),
            )
        )

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        model: str | None = None,
        rl: RolloutHeaders | None = None,
        extra_headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> Completion:
        """``POST /v1/chat/completions``, not streamed."""
        body = self._body(model, {"messages": list(messages), **params})
        return await self._unary("/v1/chat/completions", body, _headers(rl, extra_headers))

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        model: str | None = None,
        rl: RolloutHeaders | None = None,
        extra_headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> Stream:
        """``POST /v1/chat/completions`` streamed: ``async with client.chat_stream(...) as s``."""
        body = self._body(model, {"messages": list(messages), **params})
        return self._stream("/v1/chat/completions", body, _headers(rl, extra_headers))

    async def completion(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        rl: RolloutHeaders | None = None,
        extra_headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> Completion:
        """``POST /v1/completions``, not streamed (``prompt``: text or token ids)."""
        body = self._body(model, {"prompt": prompt if isinstance(prompt, str) else list(prompt), **params})
        return await self._unary("/v1/completions", body, _headers(rl, extra_headers))

    def completion_stream(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        rl: RolloutHeaders | None = None,
        extra_headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> Stream:
        """``POST /v1/completions`` streamed."""
        body = self._body(model, {"prompt": prompt if isinstance(prompt, str) else list(prompt), **params})
        return self._stream("/v1/completions", body, _headers(rl, extra_headers))

    async def models(self) -> list[str]:
        """``GET /v1/models``: the model ids served."""
        body = await self._transport.json("GET", "/v1/models")
        return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]

    async def ready(self) -> bool:
        """``GET /ready``: workers are known and the router is not draining for shutdown
        (``False`` when it does not answer; a closed client is a :class:`TransportError`)."""
        self._transport.check_open("GET /ready")
        try:
            response = await self._transport.http.get(self._transport.root + "/ready")
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def release_session(self, session_id: str) -> bool:
        """``POST /finish_session``: forgets a trajectory's worker binding (the admin token is
        sent when the client has one, for ``--session-release-auth admin``). True when one was
        bound."""
        body = await self._transport.json(
            "POST", "/finish_session", json={"session_id": session_id}, headers=self.admin.auth_headers()
        )
        return bool(body.get("released"))

    async def pick(
        self,
        *,
        token_ids: Iterable[int] | None = None,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        model: str | None = None,
        rl: RolloutHeaders | None = None,
        extra_headers: Mapping[str, str] | None = None,
        reports: Sequence[Mapping[str, Any]] | None = None,
        **params: Any,
    ) -> Pick:
        """``POST /v1/pick``: where to send a request (give one of ``token_ids``, ``prompt`` or
        ``messages``), without sending it. Send it to ``pick.url`` yourself, then
        :meth:`report` its first token and its finish. Raises what a proxied request would
        (an ``OverloadedError``, ``status`` 529, when refused under overload,
        ``ServiceUnavailableError`` ...); may wait in the router
        queue as a proxied request would.

        ``reports``: reports of earlier picks (:func:`kvrouter.report_entry`), applied before
        this pick is placed, so a steady client pays one HTTP exchange per pick; each one's
        outcome is in ``pick.reports`` (an unknown or expired id is that report's error, never
        the pick's). They are applied once the body is read, also when the pick is refused."""
        given = [name for name, v in (("token_ids", token_ids), ("prompt", prompt), ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of token_ids, prompt or messages (got {given or 'none'})")
        body: dict[str, Any] = dict(params)
        if token_ids is not None and not isinstance(token_ids, Sequence):
            # An iterator is read once: into a list, for the JSON fallback to see every id.
            token_ids = list(token_ids)
        binary = None if token_ids is None else binary_ids(token_ids)
        if token_ids is not None and binary is None:
            # Not all 32-bit token ids: sent as JSON, for the router to name what is wrong.
            body["token_ids"] = list(token_ids)
        elif prompt is not None:
            body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        elif messages is not None:
            body["messages"] = list(messages)
        if model or self.model:
            body["model"] = model or self.model
        if reports:
            body["reports"] = [dict(r) for r in reports]
        headers = _headers(rl, extra_headers)
        if binary is None:
            answer = await self._transport.json("POST", "/v1/pick", json=body, headers=headers)
        else:
            # The ids after the JSON part as 4-byte little-endian words (x-kvrouter-json-length):
            # no JSON list to write here or to read in the router.
            import json

            part = json.dumps(body, separators=(",", ":")).encode()
            # The client's own framing headers replace any the caller gave, in any case.
            framing = {"content-type": "application/octet-stream", "x-kvrouter-json-length": str(len(part))}
            headers = {k: v for k, v in headers.items() if k.lower() not in framing} | framing
            answer = await self._transport.json("POST", "/v1/pick", content=part + binary, headers=headers)
        return Pick.from_body(answer)

    async def report(
        self,
        pick: Pick | str,
        event: PickEvent,
        *,
        status: PickStatus = "ok",
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Reports a pick's ``first_token`` (its lease then runs to the router's
        ``--pick-max-duration-secs``) or its ``finish`` (``status``: ``ok``, ``cancelled`` or
        ``failed``, with the answer's token counts when known), which releases its load.
        Raises :class:`kvrouter.NotFoundError` for a pick finished or expired already.
        ``extra_headers``: e.g. ``{"Authorization": "Bearer ..."}`` for a router run with
        ``--pick-auth admin`` (as for :meth:`pick`)."""
        pick_id = pick.id if isinstance(pick, Pick) else pick
        headers = dict(extra_headers or {})
        if event == "first_token":
            await self._transport.json("POST", f"/v1/pick/{quote(pick_id, safe='')}/first-token", json={}, headers=headers)
        elif event == "finish":
            body = finish_body(status, prompt_tokens, completion_tokens, cached_tokens)
            await self._transport.json("POST", f"/v1/pick/{quote(pick_id, safe='')}/finish", json=body, headers=headers)
        else:
            raise ValueError(f"event must be 'first_token' or 'finish', not {event!r}")

    async def report_batch(
        self, reports: Sequence[Mapping[str, Any]], *, extra_headers: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """``POST /v1/pick/reports``: several reports (:func:`kvrouter.report_entry`) in one
        exchange, applied in order; each one's outcome, in the same order (``{"id", "status"}``,
        or ``{"id", "error": {...}}`` for an unknown, finished or expired id)."""
        answer = await self._transport.json(
            "POST", "/v1/pick/reports", json={"reports": [dict(r) for r in reports]}, headers=dict(extra_headers or {})
        )
        return list(answer.get("reports") or [])
