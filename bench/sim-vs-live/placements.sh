#!/usr/bin/env bash
# Request-by-request agreement of the simulator with a live router: the agentic slice of
# bench/peers (Claude Code dev sessions, think time x 0.1, 40 s) through 4 separate
# `kvrouter mock-engine` processes at x10 behind `kvrouter serve`, and through `kvrouter sim`
# with the same flags; both write Perfetto timelines, and the script prints, per request, the
# worker and cached prefix each chose, then how many requests the two placed differently.
#
# Usage: bench/sim-vs-live/placements.sh [MODE] [extra serve/sim routing flags...]
# Environment:
#   BIN    kvrouter binary (default target/release/kvrouter)
#   PROBE  1 = send one 4-token completion before the bench, as bench/peers/run.sh does to
#          check the data path (it takes one tie-break draw under `kv`; see docs/sim.md)
#   OUT    output directory (default target/sim-vs-live/placements)
# The trace copy is the one bench/peers/run.sh writes (run it once, or any SCALE=small run).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-kv}
shift || true
BIN=${BIN:-target/release/kvrouter}
OUT=${OUT:-target/sim-vs-live/placements}/$MODE
TRACE=target/peers-traces/claude_code_sessions_dev-think0.1
[ -d "$TRACE" ] || { echo "missing $TRACE: run bench/peers/run.sh once (it writes the scaled copy)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "missing $BIN (cargo build --release -p kvrouter)" >&2; exit 1; }
SLICE=(--trace "$TRACE" --session-gap-s 1 --max-requests 200 --duration-s 40)
rm -rf "$OUT"; mkdir -p "$OUT"

PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

WORKERS=()
for i in 0 1 2 3; do
  "$BIN" mock-engine --port 0 --kv-events-endpoint tcp://127.0.0.1:0 --speedup-ratio 10 \
    --model-name mock-model --seed "$i" >"$OUT/engine$i.log" 2>&1 &
  PIDS+=($!)
done
for i in 0 1 2 3; do
  line=""
  for _ in $(seq 1 100); do line=$(grep -m1 'listening on http://' "$OUT/engine$i.log" || true); [ -n "$line" ] && break; sleep 0.1; done
  [ -n "$line" ] || { echo "mock engine $i did not start; see $OUT/engine$i.log" >&2; exit 1; }
  WORKERS+=(--worker "$(echo "$line" | grep -o 'http://127.0.0.1:[0-9]*')")
done
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
"$BIN" serve --host 127.0.0.1 --port "$PORT" --router-mode "$MODE" --model-name mock-model "$@" \
  "${WORKERS[@]}" >"$OUT/router.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do curl -sf "$URL/v1/models" >/dev/null && break; sleep 0.2; done
if [ "${PROBE:-0}" = 1 ]; then
  curl -sf "$URL/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"mock-model","prompt":[1,2,3,4],"max_tokens":1}' >/dev/null
fi
"$BIN" bench --url "$URL" --model mock-model --name "live-$MODE" --out "$OUT/live" --quiet \
  --prompt-format tokens "${SLICE[@]}" --perfetto "$OUT/live.json" >"$OUT/bench.log" 2>&1
cleanup; PIDS=()

SPEEDS=(); for i in 0 1 2 3; do SPEEDS+=(--slow-worker "$i@10"); done
"$BIN" sim "${SLICE[@]}" --workers 4 "${SPEEDS[@]}" --kv-event-delay-ms 1 --network-delay-ms 1 \
  --ingress-us-per-token 0.08 --router-mode "$MODE" "$@" --out "$OUT/sim" --perfetto "$OUT/sim.json" \
  --quiet >"$OUT/sim.log" 2>&1

python3 - "$OUT/live.json" "$OUT/sim.json" <<'PY'
import json, sys
def placements(path):
    d = json.load(open(path))
    rows = {}
    for e in d["traceEvents"] if isinstance(d, dict) else d:
        if e.get("name") == "prefill":
            a = e["args"]
            rows[a["request"]] = (e["pid"], a["session"], a["prompt_tokens"], a["cached_tokens"] or 0)
    return rows
live, sim = placements(sys.argv[1]), placements(sys.argv[2])
differ = 0
print("request session prompt | live worker cached | sim worker cached")
for i in sorted(set(live) | set(sim)):
    l, s = live.get(i), sim.get(i)
    same = l is not None and s is not None and l[0] == s[0] and l[3] == s[3]
    differ += not same
    ref = l or s
    show = lambda r: f"w{r[0]} {r[3]:>8}" if r else "      -   "
    print(f"{i:7} {ref[1]:7} {ref[2]:6} | {show(l)} | {show(s)}{'' if same else '  <-'}")
print(f"live {len(live)} requests, sim {len(sim)}; placed differently (worker or cached prefix): {differ}")
PY
