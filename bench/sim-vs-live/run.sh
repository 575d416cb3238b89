#!/usr/bin/env bash
# Sim-vs-live agreement: replay the same trace slice through `kvrouter sim` and, live, through
# `kvrouter serve --mock-workers N` + `kvrouter bench`, then compare TTFT p50 and hit rate.
# Usage: bench/sim-vs-live/run.sh [MODE] [REQUESTS] [SPEEDUP] [WORKERS]
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-kv}
N=${2:-300}
SPEEDUP=${3:-4}
WORKERS=${4:-4}
TRACE=${TRACE:-../shared/traces/mooncake_conversation/conversation_trace.jsonl}
BIN=${BIN:-target/release/kvrouter}
OUT=${OUT:-target/sim-vs-live/$MODE}
mkdir -p "$OUT"
[ -x "$BIN" ] || cargo build --release -j2 -p kvrouter
"$BIN" serve --mock-workers "$WORKERS" --port 0 --router-mode "$MODE" >"$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 1 100); do
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$OUT/serve.log" | head -1 || true)
  [ -n "$URL" ] && break
  sleep 0.1
done
[ -n "$URL" ] || { echo "serve did not start; see $OUT/serve.log" >&2; exit 1; }
"$BIN" bench --url "$URL" --trace "$TRACE" --max-requests "$N" --arrival-speedup "$SPEEDUP" \
  --name live --out "$OUT/live" --quiet
"$BIN" sim --trace "$TRACE" --workers "$WORKERS" --max-requests "$N" --arrival-speedup "$SPEEDUP" \
  --router-mode "$MODE" --out "$OUT/sim" >/dev/null
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
live = json.load(open(f"{out}/live/summary.json"))[0]
sim = json.load(open(f"{out}/sim/summary.json"))[0]
for key in ("ttft_ms", "e2e_ms"):
    l, s = live[key]["p50"], sim[key]["p50"]
    print(f"{key} p50: live {l:.1f} sim {s:.1f} ({(s - l) / l * 100:+.1f} %)")
print(f"hit rate: live {live['hit_rate']:.3f} sim {sim['hit_rate']:.3f} "
      f"({(sim['hit_rate'] - live['hit_rate']) * 100:+.1f} points); ceiling {sim['hit_rate_ceiling']:.3f}")
PY
