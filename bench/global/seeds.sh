#!/usr/bin/env bash
# Global routing over five workload seeds, both block sizes (docs/global-routing.md):
# kvrouter sim --clusters FILE --workload seed002 --workload-args seed=S [--kv-cache-block-size 16]
# for S in SEEDS, every policy in POLICIES in one run per (seed, block size). Prints one line per
# run and policy (step mean s, hit, moves) to OUT/runs.txt, then per block size kv's change
# against least-loaded and static-split, per seed and mean.
# Usage: bench/global/seeds.sh   (env: BIN, CLUSTERS, SEEDS, BLOCKS, POLICIES, OUT, EXTRA)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/kvrouter}
CLUSTERS=${CLUSTERS:-bench/global/seed002.toml}
SEEDS=${SEEDS:-2 3 4 5 6}
BLOCKS=${BLOCKS:-16 64}
POLICIES=${POLICIES:-static-split,least-loaded,kv}
OUT=${OUT:-target/global-seeds}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
: >"$OUT/runs.txt"
for b in $BLOCKS; do
  for s in $SEEDS; do
    d="$OUT/b$b-s$s"
    # shellcheck disable=SC2086
    "$BIN" sim --clusters "$CLUSTERS" --workload seed002 --workload-args "seed=$s" \
      --kv-cache-block-size "$b" --global-policy "$POLICIES" --out "$d" --quiet $EXTRA >"$d.txt"
    python3 - "$d/summary.json" "$b" "$s" >>"$OUT/runs.txt" <<'PY'
import json, sys
for p in json.load(open(sys.argv[1])):
    print(sys.argv[2], sys.argv[3], p["policy"], f'{p["step_time_mean_s"]:.1f}',
          " ".join(f"{x:.1f}" for x in p["step_time_s"]), f'{p["hit_rate"]:.3f}', p["session_moves"])
PY
  done
done
python3 - "$OUT/runs.txt" <<'PY'
import sys, collections
rows = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    f = line.split()
    rows[(f[0], f[1])][f[2]] = float(f[3])
for b in sorted({k[0] for k in rows}, key=int):
    seeds = sorted((k for k in rows if k[0] == b), key=lambda k: int(k[1]))
    for ref in ("least-loaded", "static-split"):
        ch = [100 * (rows[k]["kv"] / rows[k][ref] - 1) for k in seeds if ref in rows[k] and "kv" in rows[k]]
        if ch:
            print(f"block {b}: kv vs {ref}: " + ", ".join(f"{c:+.1f}" for c in ch) + f" %, mean {sum(ch)/len(ch):+.1f} %")
PY
