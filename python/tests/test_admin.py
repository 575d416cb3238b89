"""Weight updates and the admin API through the client, each against a router of its own
(they change its versions)."""

from __future__ import annotations

import time
from typing import cast

import anyio
import pytest

from conftest import TOKEN, ServerFactory
from kvrouter import (
    AsyncKvrouterClient,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    RolloutHeaders,
    UpdateMode,
    WeightUpdateError,
    WeightUpdateTimeout,
)

pytestmark = pytest.mark.anyio
MODEL = "mock-model"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.mark.parametrize("mode", ["drain", "rolling"])
async def test_update_weights_returns_once_every_worker_loaded(serve: ServerFactory, mode: UpdateMode) -> None:
    server = serve(mock_workers=2, args=["--mock-weight-load-ms", "300"])
    async with server.client(model=MODEL) as client:
        began = time.monotonic()
        status = await client.admin.update_weights(1, mode=mode, batch=1, timeout_s=30)
        waited = time.monotonic() - began
        answer = await client.chat(HELLO, max_tokens=2, rl=RolloutHeaders(min_policy_version=1))
    cycle = status.update
    assert cycle is not None and not cycle.running and cycle.mode == mode
    assert cycle.done == cycle.total == 2 and set(cycle.phases.values()) == {"done"}
    assert status.versions() == {0: 1, 1: 1} and status.newest_policy_version == 1
    assert waited >= 0.3, f"returned after {waited:.3f} s, before a 300 ms load could finish"
    assert answer.provenance.policy_version == 1 and answer.provenance.fingerprint_versions == (1,)


async def test_waiting_past_the_timeout_raises_and_the_cycle_goes_on(serve: ServerFactory) -> None:
    server = serve(mock_workers=2, args=["--mock-weight-load-ms", "1500"])
    async with server.client(model=MODEL) as client:
        await client.admin.start_weight_update(4, mode="drain")
        with pytest.raises(WeightUpdateTimeout) as timed_out:
            await client.admin.wait_weight_update(4, timeout_s=0.2)
        assert timed_out.value.policy_status is not None
        assert timed_out.value.policy_status["update"]["running"] is True
        with pytest.raises(ConflictError) as conflict:
            await client.admin.start_weight_update(5)
        assert conflict.value.status == 409
        status = await client.admin.wait_weight_update(4, timeout_s=30)
    assert status.versions() == {0: 4, 1: 4}
    with pytest.raises(WeightUpdateError, match="version 5"):
        async with server.client() as again:
            await again.admin.wait_weight_update(5, timeout_s=1)


async def test_abort_mode_continues_a_stream_in_flight_on_the_new_version(serve: ServerFactory) -> None:
    server = serve(mock_workers=1, args=["--mock-weight-load-ms", "100"])
    async with server.client(model=MODEL) as client:
        async with client.chat_stream(HELLO, max_tokens=300, stream_options={"include_usage": True}) as stream:
            chunks = stream.__aiter__()
            await chunks.__anext__()
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: client.admin.update_weights(1, mode="abort", timeout_s=30))
                    async for _ in chunks:
                        pass
    assert stream.finish_reason == "length"
    assert stream.usage is not None and stream.usage["completion_tokens"] == 300
    assert len(stream.text.split()) == 300
    assert stream.provenance.policy_version == 0
    assert stream.provenance.fingerprint_versions == (0, 1)
    assert stream.provenance.final_policy_version == 1


async def test_a_failed_load_raises_naming_the_workers(serve: ServerFactory) -> None:
    server = serve(mock_workers=2)
    async with server.client() as client:
        with pytest.raises(WeightUpdateError, match=r"workers \[0, 1\] failed") as caught:
            await client.admin.update_weights(2, load_path="/no-such-load-endpoint", timeout_s=30)
        assert caught.value.policy_status is not None
        status = await client.admin.policy()
    assert {w.state for w in status.workers} == {"paused"}
    assert status.versions() == {0: 0, 1: 0}


async def test_admin_errors_are_typed_and_name_the_field(serve: ServerFactory) -> None:
    server = serve(mock_workers=2)
    async with server.client() as client:
        with pytest.raises(BadRequestError) as mode:
            await client.admin.start_weight_update(1, mode=cast(UpdateMode, "sideways"))
        with pytest.raises(BadRequestError) as workers:
            await client.admin.start_weight_update(1, workers=[7])
        with pytest.raises(NotFoundError):
            await client.admin.pause_worker(7)
    assert mode.value.param == "mode" and "sideways" in mode.value.message
    assert workers.value.param == "workers"
    async with AsyncKvrouterClient(server.url, admin_token="wrong") as wrong:
        with pytest.raises(AuthenticationError) as denied:
            await wrong.admin.policy()
    assert denied.value.status == 401 and denied.value.type == "authentication_error"
    async with AsyncKvrouterClient(server.url) as tokenless:
        with pytest.raises(AuthenticationError, match="no admin token"):
            await tokenless.admin.policy()
    closed = serve(mock_workers=1, admin_token=None)
    async with AsyncKvrouterClient(closed.url, admin_token=TOKEN) as client:
        with pytest.raises(NotFoundError):
            await client.admin.policy()


async def test_pause_resume_and_set_policy_version(serve: ServerFactory) -> None:
    server = serve(mock_workers=2)
    async with server.client(model=MODEL) as client:
        await client.admin.pause_worker(0)
        states = {w.id: w.state for w in (await client.admin.policy()).workers}
        served = {(await client.chat(HELLO, max_tokens=1)).provenance.worker for _ in range(4)}
        await client.admin.resume_worker(0)
        await client.admin.set_policy_version(0, 5)
        status = await client.admin.policy()
        pinned = await client.chat(HELLO, max_tokens=1, rl=RolloutHeaders(policy_version=5))
        workers = await client.admin.workers()
    assert states == {0: "paused", 1: "serving"}
    assert served == {1}
    assert status.versions() == {0: 5, 1: 0} and status.newest_policy_version == 5
    assert pinned.provenance.worker == 0 and pinned.provenance.policy_version == 5
    assert sorted(w["id"] for w in workers) == [0, 1]


async def test_workers_are_removed_and_registered_by_url(serve: ServerFactory) -> None:
    server = serve(mock_workers=2)
    async with server.client(model=MODEL) as client:
        urls = {w["id"]: w["url"] for w in await client.admin.workers()}
        await client.admin.remove_worker(1)
        left = [w["id"] for w in await client.admin.workers()]
        again = await client.admin.add_worker(urls[1])
        with pytest.raises(ConflictError):
            await client.admin.add_worker(urls[1])
        after = {w["id"]: w["url"] for w in await client.admin.workers()}
        served = {(await client.chat(HELLO, max_tokens=1, extra_headers={"x-kvrouter-worker-id": str(again)})).provenance.worker}
    assert left == [0]
    assert after[again] == urls[1] and again != 1
    assert served == {again}


async def test_an_api_key_goes_with_every_data_plane_call(serve: ServerFactory) -> None:
    server = serve(mock_workers=1, mock_speedup_ratio=10, args=["--api-key", "data-key"])
    async with server.client(model="mock-model", api_key="data-key") as client:
        answer = await client.completion("hello", max_tokens=2)
        assert answer.usage is not None and answer.usage["completion_tokens"] == 2
        async with client.completion_stream("hello", max_tokens=3) as stream:
            chunks = [c async for c in stream]
        assert chunks and stream.finish_reason == "length"
        assert await client.models() == ["mock-model"]
        # The admin API keeps its own token.
        assert await client.admin.workers()
    async with server.client(model="mock-model") as keyless:
        with pytest.raises(AuthenticationError):
            await keyless.completion("hello", max_tokens=2)
