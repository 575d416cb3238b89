"""A streamed answer: server-sent events parsed into chunk dicts, with the provenance the router
attached and the text, finish reason and usage gathered on the way."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import httpx

from ._transport import decoded, transport_error
from .errors import error_from_body
from .provenance import Provenance


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event (``data:`` lines joined), up to ``[DONE]``."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line == "" and data:
            payload = "\n".join(data)
            data = []
            if payload == "[DONE]":
                return
            yield payload
    if data and "\n".join(data) != "[DONE]":
        yield "\n".join(data)


class Stream:
    """``async with client.chat_stream(...) as stream: async for chunk in stream: ...``

    On entering, an error answer raises its typed error and :attr:`provenance` holds the
    router's headers. Iterating yields each chunk as a dict; an in-band error event (a stream
    the router could not finish) raises :class:`kvrouter.UpstreamError`. After iterating:
    :attr:`text` (the first choice's content), :attr:`finish_reason`, :attr:`usage`, and the
    ``system_fingerprint`` versions in :attr:`provenance`.
    """

    def __init__(self, opening: AbstractAsyncContextManager[httpx.Response]) -> None:
        self._opening = opening
        self._response: httpx.Response | None = None
        self.provenance = Provenance()
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.chunks = 0

    async def __aenter__(self) -> Stream:
        try:
            response = await self._opening.__aenter__()
        except httpx.HTTPError as e:
            raise transport_error(e, "opening the stream") from e
        if response.is_error:
            try:
                body = await response.aread()
            except httpx.HTTPError as e:
                raise transport_error(e, "reading an error answer") from e
            finally:
                await self._opening.__aexit__(None, None, None)
            raise error_from_body(response.status_code, body)
        self._response = response
        self.provenance = Provenance.from_headers(response.headers)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._response = None
        await self._opening.__aexit__(exc_type, exc, tb)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        if self._response is None:
            raise RuntimeError("use the stream inside `async with`")
        try:
            async for chunk in self._chunks(self._response):
                yield chunk
        except httpx.HTTPError as e:
            # Only the network's errors: httpx's StreamError (a stream read twice) is the
            # caller's, and stays as it is.
            raise transport_error(e, "reading the stream") from e

    async def _chunks(self, response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        async for payload in sse_data(response.aiter_lines()):
            chunk = decoded(payload, "a stream event")
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                raise error_from_body(None, chunk)
            self._gather(chunk)
            yield chunk

    def _gather(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        self.provenance = self.provenance.seen(chunk.get("system_fingerprint"))
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str):
                self.text += piece
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    async def collect(self) -> Stream:
        """Reads the stream to its end; returns itself with the gathered fields."""
        async for _ in self:
            pass
        return self
