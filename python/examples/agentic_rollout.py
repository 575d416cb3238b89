"""A multi-turn agentic rollout through kvrouter (SWE-agent style, as SkyRL / verl multi-turn /
OpenRLHF agent workers run it): each trajectory is a conversation of model turns and tool
results, sent turn by turn with the official ``openai`` client, streamed, plus kvrouter's headers.

The trajectory id goes in ``x-session-id``: with ``--router-session-affinity-ttl-secs`` every
turn of a trajectory lands on the worker that holds its growing context, so each turn
prefills only what the last tool call added. The trajectories of one task share a group id
(``x-kvrouter-group-size``: fair-share placement of the task's siblings). When a trajectory
ends, ``POST /finish_session`` releases its binding. The example checks that every turn stayed
on its trajectory's worker and that later turns found their prefix cached.

    KVROUTER_BIN=target/debug/kvrouter python python/examples/agentic_rollout.py
    python python/examples/agentic_rollout.py --url http://router:8000
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import openai

from _common import arguments, check, router
from kvrouter import AsyncKvrouterClient, RolloutHeaders

HARNESS = (
    "You are a software engineering agent. You can call tools: `run(cmd)` runs a shell command "
    "in the repository and returns its output; `edit(path, text)` replaces a file. Work step by "
    "step, run the tests after every change, and stop when they pass. " * 4
)
TASKS = [
    "Issue: `parse_date('2024-02-30')` returns a date instead of raising ValueError.",
    "Issue: the CLI crashes with KeyError when the config file has no [server] section.",
]


def tool_result(rng: random.Random, turn: int) -> str:
    """A stand-in for the sandbox: what `run(...)` printed."""
    passed = rng.randint(10, 40)
    return f"$ pytest -q\n{passed} passed, {rng.randint(1, 5)} failed in {rng.uniform(0.5, 9):.2f}s (turn {turn})"


async def trajectory(
    llm: openai.AsyncOpenAI, kv: AsyncKvrouterClient, model: str, task: int, traj: str,
    group: str, group_size: int, turns: int, rng: random.Random,
) -> list[tuple[int, int, int]]:
    """Runs one trajectory; returns (worker, prompt tokens, cached tokens) per turn."""
    headers = RolloutHeaders(session_id=traj, group_id=group, group_size=group_size).to_headers()
    messages: list[Any] = [{"role": "system", "content": HARNESS}, {"role": "user", "content": TASKS[task]}]
    seen = []
    for turn in range(turns):
        raw = await llm.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=rng.randint(8, 24), stream=True,
            stream_options={"include_usage": True}, extra_headers=headers,
        )
        worker = int(raw.headers["x-kvrouter-worker"])
        reply, usage = "", None
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                reply += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        check(usage is not None, f"{traj} turn {turn}: no usage in the stream")
        assert usage is not None
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        seen.append((worker, usage.prompt_tokens, cached))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_result(rng, turn)}]
    check(await kv.release_session(traj), f"{traj}: no session binding to release")
    return seen


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--trajectories", type=int, default=4, help="trajectories per task")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    run = uuid.uuid4().hex[:8]

    with router(args, ["--router-session-affinity-ttl-secs", "600"]) as r:
        llm = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
        async with AsyncKvrouterClient(r.url, admin_token=r.admin_token) as kv:
            jobs = {
                f"{run}-task{t}-traj{g}": trajectory(
                    llm, kv, args.model, t, f"{run}-task{t}-traj{g}", f"{run}-task{t}",
                    args.trajectories, args.turns, random.Random(args.seed * 1000 + t * 100 + g),
                )
                for t in range(len(TASKS))
                for g in range(args.trajectories)
            }
            results = dict(zip(jobs, await asyncio.gather(*jobs.values())))

    for traj, turns in results.items():
        workers = {w for w, _, _ in turns}
        check(len(workers) == 1, f"{traj}: turns went to workers {[w for w, _, _ in turns]}")
        later = turns[1:]
        check(
            all(cached > 0 for _, _, cached in later),
            f"{traj}: a later turn found nothing cached: {turns}",
        )
        reuse = sum(c for _, _, c in later) / sum(p for _, p, _ in later)
        print(f"{traj}: worker {workers.pop()}, {len(turns)} turns, {reuse:.0%} of later prompts cached")
    print("agentic rollout: OK")


if __name__ == "__main__":
    asyncio.run(main())
