#!/usr/bin/env bash
# The replicas' GRPO burst in the simulator: 16 groups x 8 samples of 2,016-token prompts (a
# 12-block template shared by all, 113 blocks per group, 1 per sample), all at t = 0, 8 workers,
# one router against 3 replicas at several sync delays and without sync, with and without group
# sizes. Prints a markdown table (docs/scale-out.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/debug/kvrouter}
OUT=${OUT:-target/replicas-sim-burst}
mkdir -p "$OUT"
python3 - "$OUT/burst.jsonl" <<'PY'
import json, sys
reqs = []
for g in range(16):
    for s in range(8):
        blocks = list(range(900000, 900012)) + [g * 1000 + k for k in range(113)] + [10000 + g * 100 + s]
        reqs.append(dict(step=0, group=g, trajectory=g * 8 + s, turn=0, prompt_blocks=blocks,
                         prompt_tokens=2016, output_tokens=100))
open(sys.argv[1], "w").write("".join(json.dumps(r) + "\n" for r in reqs))
PY
echo "| replicas | sync delay | group sizes | hit rate | TTFT p50 ms | TTFT p99 ms |"
echo "|---|---|---|---|---|---|"
for v in "1 -" "3 0" "3 1" "3 10" "3 100" "3 none"; do
  set -- $v
  flags=(--router-replicas "$1")
  case $2 in -) ;; none) flags+=(--no-replica-sync) ;; *) flags+=(--replica-sync-delay-ms "$2") ;; esac
  for gs in yes no; do
    extra=(); [ $gs = yes ] && extra=(--group-sizes)
    "$BIN" sim --trace "$OUT/burst.jsonl" --workers 8 --router-mode kv --router-predicted-ttl-secs 5 \
      "${flags[@]}" "${extra[@]}" --out "$OUT/run" --quiet >/dev/null
    python3 - "$OUT/run/summary.json" "$1" "$2" "$gs" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))[0]
t = s["ttft_ms"]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {s['hit_rate']:.3f} | {t['p50']:.1f} | {t['p99']:.1f} |")
PY
  done
done
