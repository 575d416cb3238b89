"""The async client against a real `kvrouter serve --mock-workers 2`: calls, streams,
provenance, typed errors, first-N-of-M and sessions."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import pytest

from kvrouter import (
    AsyncKvrouterClient,
    BadRequestError,
    Completion,
    GatewayTimeoutError,
    KvrouterServer,
    NotFoundError,
    RolloutHeaders,
    wait_for_provenance,
)

pytestmark = pytest.mark.anyio
MODEL = "mock-model"
HELLO = [{"role": "user", "content": "Say hello."}]


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def test_chat_answer_carries_worker_and_policy_version(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client:
        answer = await client.chat(HELLO, max_tokens=5)
    assert answer.finish_reason == "length"
    assert answer.text
    assert answer.usage is not None and answer.usage["completion_tokens"] == 5
    assert answer.provenance.worker in (0, 1)
    assert answer.provenance.policy_version == 0
    assert answer.provenance.fingerprint_versions == (0,)
    decision = answer.provenance.decision
    assert decision is not None and decision["worker"] == answer.provenance.worker


async def test_chat_stream_gathers_text_usage_and_fingerprint(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client:
        async with client.chat_stream(HELLO, max_tokens=6, stream_options={"include_usage": True}) as stream:
            assert stream.provenance.worker in (0, 1)
            assert stream.provenance.policy_version == 0
            chunks = [c async for c in stream]
    assert len(chunks) == stream.chunks >= 6
    assert stream.finish_reason == "length"
    assert len(stream.text.split()) == 6, stream.text
    assert stream.usage is not None and stream.usage["completion_tokens"] == 6
    assert stream.provenance.fingerprint_versions == (0,)


async def test_completion_takes_text_and_token_ids(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client:
        text = await client.completion("Once upon a time", max_tokens=4)
        async with client.completion_stream([101, 102, 103, 104], max_tokens=3) as stream:
            await stream.collect()
    assert text.text and text.usage is not None and text.usage["completion_tokens"] == 4
    assert stream.finish_reason == "length" and len(stream.text.split()) == 3


async def test_a_malformed_router_header_is_a_bad_request_naming_it(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client:
        with pytest.raises(BadRequestError) as caught:
            await client.chat(HELLO, max_tokens=1, extra_headers={"x-kvrouter-group-need": "1"})
        with pytest.raises(BadRequestError) as in_stream:
            async with client.chat_stream(HELLO, max_tokens=1, extra_headers={"x-kvrouter-priority": "10"}):
                pass
    err = caught.value
    assert err.status == 400 and err.param == "x-kvrouter-group-id"
    assert err.body["error"]["type"] == "invalid_request_error" == err.type
    assert in_stream.value.param == "x-kvrouter-priority"


async def test_unknown_model_is_not_found(router: KvrouterServer) -> None:
    async with router.client() as client:
        with pytest.raises(NotFoundError) as caught:
            await client.chat(HELLO, model="no-such-model", max_tokens=1)
    assert caught.value.status == 404 and "no-such-model" in caught.value.message


async def test_a_version_no_worker_serves_times_out_at_the_deadline(router: KvrouterServer) -> None:
    async with router.client(model=MODEL) as client:
        with pytest.raises(GatewayTimeoutError) as caught:
            await client.chat(HELLO, max_tokens=1, rl=RolloutHeaders(policy_version=99, deadline_ms=200))
    assert caught.value.status == 504


async def test_first_n_of_m_ends_later_siblings_unstarted(router: KvrouterServer, provenance_log: Path) -> None:
    group = RolloutHeaders(group_id=uid("grpo"), group_size=4, group_need=2)
    async with router.client(model=MODEL) as client:
        answers = [await client.chat(HELLO, max_tokens=3, rl=group) for _ in range(4)]
    assert [a.finish_reason for a in answers] == ["length", "length", "abort", "abort"]
    assert answers[2].provenance.worker is None and answers[2].text == ""
    records = await wait_for_provenance(
        provenance_log, lambda rs: sum(r.group == group.group_id for r in rs) == 4
    )
    mine = [r for r in records if r.group == group.group_id]
    assert sorted(r.status for r in mine) == ["aborted", "aborted", "ok", "ok"]
    assert {r.abort_reason for r in mine if r.status == "aborted"} == {"group-satisfied"}


async def test_first_n_of_m_aborts_the_long_samples_in_flight(router: KvrouterServer) -> None:
    group = RolloutHeaders(group_id=uid("grpo"), group_size=4, group_need=2)
    lengths = [2, 3000, 2, 3000]
    results: dict[int, tuple[str | None, int]] = {}

    async with router.client(model=MODEL) as client:

        async def sample(i: int) -> None:
            async with client.chat_stream(
                HELLO, max_tokens=lengths[i], rl=group, stream_options={"include_usage": True}
            ) as stream:
                await stream.collect()
            tokens = stream.usage["completion_tokens"] if stream.usage else -1
            results[i] = (stream.finish_reason, tokens)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(sample, i)
    assert results[0] == ("length", 2) and results[2] == ("length", 2), results
    for i in (1, 3):
        reason, tokens = results[i]
        assert reason == "abort" and 0 <= tokens < 3000, results


async def test_a_sessions_turns_stay_on_one_worker(router: KvrouterServer, provenance_log: Path) -> None:
    sessions = [uid("traj") for _ in range(3)]
    workers: dict[str, set[int | None]] = {s: set() for s in sessions}
    async with router.client(model=MODEL) as client:
        for turn in range(4):
            for s in sessions:
                answer: Completion = await client.chat(
                    [{"role": "user", "content": f"turn {turn} of {s}"}], max_tokens=2, rl=RolloutHeaders(session_id=s)
                )
                workers[s].add(answer.provenance.worker)
        released = [await client.release_session(s) for s in sessions]
        assert not await client.release_session(uid("never-seen"))
    assert all(len(w) == 1 for w in workers.values()), workers
    assert released == [True, True, True]
    records = await wait_for_provenance(
        provenance_log, lambda rs: sum(r.session in sessions for r in rs) == 12
    )
    assert {r.session for r in records if r.session in sessions} == set(sessions)


async def test_ready_and_models(router: KvrouterServer) -> None:
    async with AsyncKvrouterClient(router.openai_base_url) as client:
        assert client.base_url == router.url
        assert await client.ready()
        assert await client.models() == [MODEL]
    async with AsyncKvrouterClient("http://127.0.0.1:9") as nobody:
        assert not await nobody.ready()


async def test_a_closed_client_and_a_stream_misused_raise_what_they_are(router: KvrouterServer) -> None:
    import httpx

    from kvrouter import TransportError

    client = router.client(model=MODEL)
    async with client.chat_stream(HELLO, max_tokens=2) as stream:
        await stream.collect()
        # Read twice: the caller's mistake (httpx's), not a network failure.
        with pytest.raises(httpx.StreamError):
            await stream.collect()
    with pytest.raises(RuntimeError, match="async with"):
        await stream.collect()
    await client.aclose()
    for call in (client.ready(), client.models()):
        with pytest.raises(TransportError, match="closed"):
            await call
    with pytest.raises(TransportError, match="closed"):
        client.chat_stream(HELLO)
