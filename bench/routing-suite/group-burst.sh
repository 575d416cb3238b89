#!/usr/bin/env bash
# Issue 16 (c) in the simulator: the peer harness's GRPO burst (8 groups × 8 samples sharing a
# 2,000-token prefix, shuffled, closed loop at concurrency 8, 4 workers, 100 output tokens) with
# and without group headers. `--group-sizes` is what `--group-headers` sends (id AND size); a
# known size switches group placement to the fair-share cap of running siblings (bounded by
# --router-group-max-skew when > 0). Prints hit rate and distinct workers per group for each variant.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/debug/kvrouter}
OUT=${OUT:-target/group-burst}
mkdir -p "$OUT"
python3 - "$OUT/burst.jsonl" <<'PY'
import json, random, sys
rng, reqs = random.Random(1), []
for g in range(8):
    for s in range(8):
        reqs.append(dict(step=0, group=g, trajectory=g * 8 + s, turn=0,
                         prompt_blocks=[g * 1000 + k for k in range(31)] + [10000 + g * 100 + s],
                         prompt_tokens=2016, output_tokens=100))
rng.shuffle(reqs)
open(sys.argv[1], "w").write("".join(json.dumps(r) + "\n" for r in reqs))
PY
echo "| variant | hit rate | ceiling | TTFT p50 ms | workers per group |"
echo "|---|---|---|---|---|"
for v in "" "--group-sizes" "--router-group-max-skew 2" "--group-sizes --router-group-max-skew 2"; do
  # shellcheck disable=SC2086
  "$BIN" sim --trace "$OUT/burst.jsonl" --workers 4 --concurrency 8 --router-mode kv $v \
    --out "$OUT/run" --perfetto "$OUT/run.json" --quiet >/dev/null
  python3 - "$OUT" "kv ${v}" <<'PY'
import collections, json, sys
out, name = sys.argv[1], sys.argv[2]
d = json.load(open(f"{out}/run.json"))
ev = d["traceEvents"] if isinstance(d, dict) else d
groups = collections.defaultdict(set)
for e in ev:
    a = e.get("args", {})
    if "cached_tokens" in a:
        groups[a["group"]].add(e["pid"])
s = json.load(open(f"{out}/run/summary.json"))[0]
spread = sum(len(v) for v in groups.values()) / len(groups)
print(f"| {name} | {s['hit_rate']:.3f} | {s['hit_rate_ceiling']:.3f} | {s['ttft_ms']['p50']:.1f} | {spread:.2f} |")
PY
done
