"""The pick API through the client against a real `kvrouter serve --mock-workers`: the caller
sends each request to the picked engine over its own connection and reports its lifecycle."""

from __future__ import annotations

import httpx
import pytest

from kvrouter import BadRequestError, KvrouterError, KvrouterServer, NotFoundError, OverloadedError, Pick, RolloutHeaders, report_entry

from conftest import ServerFactory

pytestmark = pytest.mark.anyio
MODEL = "mock-model"


def prompt(prefix: int, tail: int) -> list[int]:
    return [10_000 * (prefix + 1) + i for i in range(256)] + [900_000 + tail * 100 + i for i in range(20)]


def active(metrics: str, worker: int) -> float:
    key = f'kvrouter_worker_active_requests{{worker="{worker}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(key))


async def test_pick_then_send_yourself_then_report(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client, httpx.AsyncClient() as own:
        ids = prompt(0, 0)
        pick = await client.pick(token_ids=ids)
        assert isinstance(pick, Pick)
        assert pick.url.startswith("http://") and pick.worker_id in (0, 1)
        assert pick.prompt_tokens == len(ids) and pick.lease_ms > 0
        assert pick.decision["worker"] == pick.worker_id and pick.decision["candidates"]
        metrics = (await own.get(router.url + "/metrics")).text
        assert active(metrics, pick.worker_id) == 1
        answer = (await own.post(pick.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 3})).json()
        await client.report(pick, "first_token")
        usage = answer["usage"]
        await client.report(pick, "finish", prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"])
        metrics = (await own.get(router.url + "/metrics")).text
        assert active(metrics, pick.worker_id) == 0
        with pytest.raises(NotFoundError):
            await client.report(pick, "finish")


async def test_token_ids_go_in_binary_and_place_as_json_ids_do(router: KvrouterServer) -> None:
    from kvrouter.pick import binary_ids

    assert binary_ids([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert binary_ids([1, -1]) is None and binary_ids([2**32]) is None and binary_ids([1.5]) is None  # type: ignore[list-item]
    async with router.client(model=MODEL) as client, httpx.AsyncClient() as own:
        # The client's binary ids and the same ids as a JSON list read as one prompt.
        ids = prompt(4, 0) + [2**32 - 1]
        pick = await client.pick(token_ids=ids)
        raw = (await own.post(router.url + "/v1/pick", json={"token_ids": ids})).json()
        assert pick.prompt_tokens == raw["prompt_tokens"] == len(ids)
        await client.report(pick, "finish", status="cancelled")
        await client.report(raw["id"], "finish", status="cancelled")
        # An iterator with a bad id is refused whole (the router names the field), not sent cut.
        with pytest.raises(BadRequestError) as bad:
            await client.pick(token_ids=iter([-1, 5, 6]))
        assert bad.value.param == "token_ids"
        gen = await client.pick(token_ids=(t for t in ids), extra_headers={"X-Kvrouter-Json-Length": "1"})
        assert gen.prompt_tokens == len(ids)
        await client.report(gen, "finish", status="cancelled")


async def test_picks_take_chats_prompts_and_rl_headers(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client:
        rl = RolloutHeaders(session_id="pick-session-1")
        first = await client.pick(messages=[{"role": "user", "content": "hi"}], rl=rl)
        second = await client.pick(prompt="something else entirely", rl=rl)
        assert second.worker_id == first.worker_id, "the session keeps its worker"
        for p in (first, second):
            await client.report(p.id, "finish", status="cancelled")


async def test_bad_picks_raise_typed_errors(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client:
        with pytest.raises(ValueError):
            await client.pick()
        with pytest.raises(ValueError):
            await client.pick(token_ids=[1], prompt="x")
        with pytest.raises(BadRequestError) as bad:
            await client.pick(token_ids=[1, -1])
        assert bad.value.param == "token_ids"
        with pytest.raises(NotFoundError):
            await client.report("999999999", "first_token")


async def test_a_full_queue_refuses_a_pick_with_529(serve: ServerFactory) -> None:
    server = serve(mock_workers=1, args=["--router-queue-threshold", "0", "--router-queue-max-requests", "0"])
    async with server.client(model=MODEL) as client:
        first = await client.pick(token_ids=prompt(1, 0))
        with pytest.raises(OverloadedError) as refused:
            await client.pick(token_ids=prompt(2, 0))
        assert refused.value.status == 529
        assert isinstance(refused.value, KvrouterError)
        await client.report(first, "finish")


async def test_reports_ride_on_the_next_pick_and_in_batches(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client, httpx.AsyncClient() as own:
        first = await client.pick(token_ids=prompt(3, 0))
        assert first.reports == []
        done = report_entry(first, "finish", completion_tokens=3)
        second = await client.pick(token_ids=prompt(3, 1), reports=[report_entry(first, "first_token"), done])
        assert second.reports == [{"id": first.id, "status": "generating"}, {"id": first.id, "status": "released"}]
        # An id finished already is that report's error, not the pick's.
        third = await client.pick(token_ids=prompt(3, 2), reports=[done])
        assert third.reports[0]["error"]["code"] == 404
        outcomes = await client.report_batch([report_entry(p, "finish", status="cancelled") for p in (second, third)])
        assert [o["status"] for o in outcomes] == ["released", "released"]
        metrics = (await own.get(router.url + "/metrics")).text
        assert all(active(metrics, w) == 0 for w in (0, 1))
        with pytest.raises(ValueError):
            report_entry(first, "done")  # type: ignore[arg-type]


async def test_a_dead_router_and_odd_pick_ids_raise_the_clients_errors(serve: ServerFactory) -> None:
    from kvrouter import TransportError

    server = serve(mock_workers=1)
    async with server.client(model=MODEL) as client:
        pick = await client.pick(token_ids=prompt(5, 0))
        # An id is one path segment, whatever it holds: no other route is reached.
        for odd in ("nope/../../admin", "a?x=1", "a#b"):
            with pytest.raises(NotFoundError, match="pick"):
                await client.report(odd, "finish")
        await client.report(pick, "finish")
        server.stop()
        with pytest.raises(TransportError):
            await client.pick(token_ids=prompt(5, 1))
        with pytest.raises(TransportError):
            await client.chat([{"role": "user", "content": "hi"}])
        with pytest.raises(TransportError):
            async with client.chat_stream([{"role": "user", "content": "hi"}]) as stream:
                await stream.collect()
