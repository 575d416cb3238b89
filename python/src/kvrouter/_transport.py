"""The HTTP transport the client's parts share: one ``httpx.AsyncClient``, the base URL and the
mapping of error answers to typed errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from .errors import KvrouterError, TransportError, error_from_body


def transport_error(e: Exception, what: str) -> TransportError:
    """``e`` (an ``httpx`` network error) as the client's own error, naming what was being
    done."""
    return TransportError(f"{what}: {type(e).__name__}: {e}")


def decoded(text: str, what: str) -> Any:
    """``text`` as JSON, else a :class:`KvrouterError` naming what it was."""
    import json

    try:
        return json.loads(text)
    except ValueError as e:
        raise KvrouterError(f"{what} is not JSON ({e}): {text[:200]!r}") from e


def root_url(base_url: str) -> str:
    """The router's root from a base URL given with or without ``/v1`` (the ``openai`` client's
    ``base_url`` ends in ``/v1``)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class Transport:
    """Sends requests to one router; non-2xx answers become typed errors."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, api_key: str | None = None) -> None:
        self.root = root_url(base_url)
        self.http = http
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def with_auth(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        """``headers`` with the data plane's key (``serve --api-key``), unless they carry an
        ``authorization`` of their own (the admin API's token)."""
        out = dict(self._auth)
        for k, v in (headers or {}).items():
            if k.lower() == "authorization":
                out.pop("authorization", None)
            out[k] = v
        return out

    def check_open(self, what: str) -> None:
        """A :class:`TransportError` if the client was closed (httpx raises a bare
        ``RuntimeError`` then)."""
        if self.http.is_closed:
            raise TransportError(f"{what}: the client is closed")

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        self.check_open(f"{method} {path}")
        try:
            response = await self.http.request(
                method, self.root + path, json=json, content=content, headers=self.with_auth(headers)
            )
        except httpx.HTTPError as e:
            raise transport_error(e, f"{method} {path}") from e
        if response.is_error:
            raise error_from_body(response.status_code, response.content)
        return response

    async def json(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        response = await self.request(method, path, json=json, content=content, headers=headers)
        body = decoded(response.text, f"the answer to {method} {path}")
        if not isinstance(body, dict):
            raise error_from_body(response.status_code, f"expected a JSON object, got: {response.text[:200]}")
        return body
