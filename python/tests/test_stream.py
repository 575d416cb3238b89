"""Stream parsing and error mapping without a router (an httpx mock transport stands in for
answers the mock engines do not produce: in-band error events, non-JSON error bodies)."""

from __future__ import annotations

import httpx
import pytest

from kvrouter import AsyncKvrouterClient, KvrouterError, ServiceUnavailableError, UpstreamError
from kvrouter.errors import error_from_body

pytestmark = pytest.mark.anyio


def client_answering(status: int, body: bytes, headers: dict[str, str] | None = None) -> AsyncKvrouterClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers=headers or {})

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return AsyncKvrouterClient("http://router.test/v1", model="m", http=http)


async def test_an_in_band_error_event_raises_upstream_error_after_the_tokens_before_it() -> None:
    events = (
        b'data: {"choices":[{"index":0,"delta":{"content":" a"},"finish_reason":null}],"system_fingerprint":"policy-3"}\r\n\r\n'
        b'data: {"choices":[{"index":0,"delta":{"content":" b"},"finish_reason":null}]}\n\n'
        b'data: {"error":{"message":"worker 1 stream broke: connection reset","type":"upstream_error","param":null,"code":502}}\n\n'
        b"data: [DONE]\n\n"
    )
    client = client_answering(200, events, {"x-kvrouter-worker": "1", "x-kvrouter-policy-version": "3"})
    async with client.chat_stream([{"role": "user", "content": "hi"}]) as stream:
        with pytest.raises(UpstreamError) as caught:
            await stream.collect()
    assert caught.value.status == 502 and "connection reset" in caught.value.message
    assert stream.text == " a b" and stream.chunks == 2
    assert stream.provenance.worker == 1 and stream.provenance.fingerprint_versions == (3,)


async def test_a_multi_line_event_is_joined_and_done_ends_the_stream() -> None:
    events = b'data: {"choices":[{"index":0,\ndata: "text":" x","finish_reason":"stop"}]}\n\ndata: [DONE]\n\ndata: {"late":1}\n\n'
    client = client_answering(200, events)
    async with client.completion_stream("p") as stream:
        chunks = [c async for c in stream]
    assert len(chunks) == 1 and stream.text == " x" and stream.finish_reason == "stop"


async def test_a_non_json_error_body_keeps_its_text() -> None:
    client = client_answering(503, b"<html>503 Service Unavailable</html>")
    with pytest.raises(ServiceUnavailableError) as caught:
        await client.chat([{"role": "user", "content": "hi"}])
    assert caught.value.status == 503 and "Service Unavailable" in caught.value.message
    assert caught.value.body["error"]["message"] == caught.value.message


async def test_a_malformed_decision_header_is_ignored() -> None:
    client = client_answering(200, b'{"choices":[]}', {"x-kvrouter-decision": "{not json", "x-kvrouter-worker": "2"})
    answer = await client.chat([{"role": "user", "content": "hi"}])
    assert answer.provenance.decision is None and answer.provenance.worker == 2
    assert answer.text == "" and answer.finish_reason is None


def test_an_unknown_status_is_the_base_error() -> None:
    err = error_from_body(418, b'{"error":{"message":"teapot","type":"odd","param":"x","code":418}}')
    assert type(err) is KvrouterError and err.param == "x" and err.code == 418
