"""An RL rollout worker that keeps its own HTTP connections to the inference engines and asks
kvrouter only *where* to send each request (the pick API; no proxying through the router).

verl, SkyRL, OpenRLHF and slime rollout workers often hold connection pools to their vLLM
servers already. Here each sample asks ``POST /v1/pick`` for a worker (with the group's RL
headers, so the router's queue, sessions, groups and policy versions apply), streams the answer
straight from that engine over the worker's own keep-alive connection, and reports the first
token and the finish (with the engine's usage), so the router's load view stays right. A pick
never reported would expire after the router's ``--pick-lease-secs``.

The example checks that every sample got its tokens, that a group's later samples found its
prompt cached on the worker the router chose, and that no load is left outstanding.

    KVROUTER_BIN=target/debug/kvrouter python python/examples/own_connections.py
    python python/examples/own_connections.py --url http://router:8000
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from dataclasses import dataclass

import httpx

from _common import arguments, check, router
from kvrouter import AsyncKvrouterClient, Pick, RolloutHeaders

GROUPS = 4
SAMPLES = 4
MAX_TOKENS = 16


@dataclass(frozen=True)
class Sample:
    pick: Pick
    tokens: int


class Engines:
    """One keep-alive connection pool per engine, as a rollout worker holds them."""

    def __init__(self) -> None:
        self._pools: dict[str, httpx.AsyncClient] = {}

    def pool(self, url: str) -> httpx.AsyncClient:
        if url not in self._pools:
            self._pools[url] = httpx.AsyncClient(base_url=url, timeout=120.0)
        return self._pools[url]

    async def aclose(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()


async def sample(kv: AsyncKvrouterClient, engines: Engines, model: str, prompt: list[int], rl: RolloutHeaders) -> Sample:
    pick = await kv.pick(token_ids=prompt, rl=rl)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, int] = {}
    first = True
    try:
        async with engines.pool(pick.url).stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first:
                    await kv.report(pick, "first_token")
                    first = False
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, ValueError):
        await kv.report(pick, "finish", status="failed")
        raise
    await kv.report(
        pick,
        "finish",
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )
    return Sample(pick, int(usage.get("completion_tokens", 0)))


async def rollout(url: str, model: str) -> None:
    rng = random.Random(7)
    engines = Engines()
    async with AsyncKvrouterClient(url, model=model) as kv:
        try:
            for g in range(GROUPS):
                # A GRPO group: one prompt (a long shared prefix), SAMPLES samples of it.
                prompt = [rng.randrange(1000, 30_000) for _ in range(512)]
                rl = RolloutHeaders(group_id=f"group-{uuid.uuid4().hex[:8]}", group_size=SAMPLES)
                # The first sample warms the cache; the rest go together.
                head = await sample(kv, engines, model, prompt, rl)
                rest = await asyncio.gather(*(sample(kv, engines, model, prompt, rl) for _ in range(SAMPLES - 1)))
                for s in (head, *rest):
                    check(s.tokens == MAX_TOKENS, f"group {g}: a sample got {s.tokens} tokens")
                cached = [s.pick.cached_tokens for s in rest]
                hits = [s for s in rest if s.pick.worker_id == head.pick.worker_id]
                print(
                    f"group {g}: first sample on worker {head.pick.worker_id} ({head.pick.url}); "
                    f"{len(hits)}/{len(rest)} later samples on it, predicted cached tokens {cached}"
                )
                check(
                    all(s.pick.cached_tokens >= 256 for s in hits) and len(hits) >= 1,
                    f"group {g}: later samples found the prompt cached where the router sent them",
                )
        finally:
            await engines.aclose()
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(kv.base_url + "/metrics")).text
    outstanding = [line for line in metrics.splitlines() if line.startswith("kvrouter_picks_outstanding ")]
    check(outstanding == ["kvrouter_picks_outstanding 0"], f"no pick left outstanding: {outstanding}")
    active = [
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("kvrouter_worker_active_requests{")
    ]
    check(sum(active) == 0, f"every pick's load was released: {active}")
    print(f"{GROUPS * SAMPLES} samples sent over the rollout worker's own connections; no load left")


def main() -> None:
    args = arguments(__doc__).parse_args()
    with router(args) as r:
        asyncio.run(rollout(r.url, args.model))


if __name__ == "__main__":
    main()
