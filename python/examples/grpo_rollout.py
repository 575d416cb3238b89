"""A GRPO rollout loop through kvrouter, written the way verl / SkyRL / OpenRLHF rollout workers
are: the official ``openai`` client against an OpenAI-compatible endpoint, plus kvrouter's headers.

Each step samples M completions per prompt. The samples of one prompt share a group id with
``x-kvrouter-group-size: M`` and ``x-kvrouter-group-need: N``: once N of them have completed,
the router ends the stragglers (``finish_reason: "abort"``), and the step does not wait for
its longest sample. Rewards and group-relative advantages are computed over the completed
samples; then the trainer "updates" the policy and the router runs the weight-update cycle
(drain in-flight requests, load, resume) before the next step, whose requests accept only the
new version (``x-kvrouter-min-policy-version``). Every answer's provenance must show it.

    KVROUTER_BIN=target/debug/kvrouter python python/examples/grpo_rollout.py
    python python/examples/grpo_rollout.py --url http://router:8000 --admin-token $TOKEN
"""

from __future__ import annotations

import asyncio
import random
import statistics
import uuid
from dataclasses import dataclass

import openai

from _common import Router, arguments, check, router
from kvrouter import AsyncKvrouterClient, RolloutHeaders, fingerprint_version, wait_for_provenance

PROMPTS = [
    "Compute 17 * 23. Think step by step.",
    "What is the sum of the first 40 odd numbers?",
    "Solve for x: 3x + 7 = 52.",
    "How many primes are below 50?",
]


@dataclass(frozen=True)
class Sample:
    text: str
    finish_reason: str
    worker: int
    policy_version: int
    fingerprint: int | None


async def sample(
    llm: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, headers: dict[str, str]
) -> Sample:
    """One rollout: a plain chat completion, with the group's headers as ``extra_headers``."""
    raw = await llm.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=1.0,
        extra_headers=headers,
    )
    completion = raw.parse()
    choice = completion.choices[0]
    return Sample(
        text=choice.message.content or "",
        finish_reason=choice.finish_reason,
        # A sibling ended before it started has no worker: the router answered it itself.
        worker=int(raw.headers.get("x-kvrouter-worker", "-1")),
        policy_version=int(raw.headers.get("x-kvrouter-policy-version", "-1")),
        fingerprint=fingerprint_version(completion.system_fingerprint),
    )


def advantages(rewards: list[float]) -> list[float]:
    """GRPO: each sample's reward against its group's mean, in units of the group's spread."""
    mean = statistics.fmean(rewards)
    spread = statistics.pstdev(rewards) or 1.0
    return [(r - mean) / spread for r in rewards]


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8, help="M samples per prompt")
    parser.add_argument("--need", type=int, default=6, help="N: samples per prompt the step waits for")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    m, n = args.group_size, args.need
    rng = random.Random(args.seed)
    run = uuid.uuid4().hex[:8]

    with router(args, ["--mock-weight-load-ms", "2000"]) as r:
        llm = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
        async with AsyncKvrouterClient(r.url, admin_token=r.admin_token) as kv:
            version = (await kv.admin.policy()).newest_policy_version
            for step in range(args.steps):
                groups = []
                for i, prompt in enumerate(PROMPTS):
                    headers = RolloutHeaders(
                        group_id=f"{run}-step{step}-prompt{i}",  # a new id every step
                        group_size=m,
                        group_need=n,
                        min_policy_version=version,
                    ).to_headers()
                    # Output lengths vary; the last M - N samples of each group are stragglers.
                    lengths = [rng.randint(4, 32) for _ in range(n)] + [3000] * (m - n)
                    groups.append([sample(llm, args.model, prompt, t, headers) for t in lengths])
                results = await asyncio.gather(*(asyncio.gather(*g) for g in groups))

                for i, samples in enumerate(results):
                    done = [s for s in samples if s.finish_reason != "abort"]
                    check(len(done) >= n, f"step {step} prompt {i}: {len(done)} samples completed, fewer than {n}")
                    check(
                        all(s.finish_reason == "abort" for s in samples[n:]),
                        f"step {step} prompt {i}: stragglers not ended: {[s.finish_reason for s in samples[n:]]}",
                    )
                    served = [s for s in samples if s.worker >= 0]
                    check(
                        all(s.policy_version == version and s.fingerprint in (version, None) for s in served),
                        f"step {step} prompt {i}: served by versions "
                        f"{[(s.policy_version, s.fingerprint) for s in served]}, not {version}",
                    )
                    check(all(s.fingerprint == version for s in done), f"step {step}: fingerprints of completed samples")
                    rewards = [-abs(len(s.text.split()) - 16) for s in done]  # a toy verifier
                    adv = advantages([float(x) for x in rewards])
                    print(f"step {step} prompt {i}: {len(done)}/{m} completed, advantages {[round(a, 2) for a in adv]}")

                # The trainer takes its optimizer step here; then every engine loads the new
                # weights, in-flight requests drained first.
                version += 1
                status = await kv.admin.update_weights(version, mode="drain", timeout_s=120)
                check(
                    set(status.versions().values()) == {version},
                    f"after the update, workers serve {status.versions()}, not {version}",
                )
                print(f"weights updated to version {version} in {status.update.elapsed_ms if status.update else 0:.0f} ms")

            final = await kv.chat(
                [{"role": "user", "content": PROMPTS[0]}], model=args.model, max_tokens=2,
                rl=RolloutHeaders(min_policy_version=version),
            )
            check(final.provenance.policy_version == version, f"provenance says {final.provenance}, not {version}")

        if r.provenance_log is not None:
            wanted = args.steps * len(PROMPTS) * m
            records = await wait_for_provenance(
                r.provenance_log, lambda rs: sum((x.group or "").startswith(run) for x in rs) >= wanted
            )
            for x in records:
                if x.group and x.group.startswith(run):
                    step = int(x.group.split("-step")[1].split("-")[0])
                    check(
                        x.status in ("ok", "aborted") and (x.worker is None or x.policy_version == step),
                        f"provenance record {x.raw}",
                    )
            ended = sum(x.abort_reason == "group-satisfied" for x in records)
            print(f"provenance log: {len(records)} records, {ended} ended early by first-N-of-M")
    print("grpo rollout: OK")


if __name__ == "__main__":
    asyncio.run(main())
