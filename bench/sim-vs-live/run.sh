#!/usr/bin/env bash
# Sim-vs-live agreement: replay the same trace slice through `kvrouter sim` and, live, through
# `kvrouter serve --mock-workers N` + `kvrouter bench`, for one or more routing modes, and print
# one table of TTFT p50 and hit rate (live, sim, difference).
#
# Usage: bench/sim-vs-live/run.sh [MODES] [REQUESTS] [SPEEDUP] [WORKERS]
#   MODES: comma-separated router modes (default kv), e.g. kv,round-robin,least-loaded
# Environment:
#   TRACE      trace file (default: Mooncake conversation)
#   BIN        kvrouter binary (default target/release/kvrouter; target/debug/kvrouter is fine:
#              router overhead is ~1 ms against ~1 s TTFT)
#   REPEATS    live runs per mode (default 1); each is a fresh serve with fresh engines
#   SIM_FLAGS  flags that make the sim model this live setup (default below: the live path's
#              ~1 ms KV-event delay over loopback ZeroMQ and ~1 ms one-way router + HTTP hop)
#   OUT        output directory (default target/sim-vs-live)
# The sim also runs with --network-delay-ms 0 and 2, and with --ingress-us-per-token $INGRESS
# ("sim range"): on this trace a few long conversations decide the hit rate and their placement
# flips with a 1 ms timing change, and requests that share a trace timestamp reach a live router
# partly shortest first (a long body takes longer to send and read), which the ingress run models
# fully and the others not at all; the range shows how much of a difference is that.
#   INGRESS    µs per prompt token for the ingress run (default 0.05)
set -euo pipefail
cd "$(dirname "$0")/../.."
MODES=${1:-kv}
N=${2:-300}
SPEEDUP=${3:-4}
WORKERS=${4:-4}
TRACE=${TRACE:-../shared/traces/mooncake_conversation/conversation_trace.jsonl}
BIN=${BIN:-target/release/kvrouter}
REPEATS=${REPEATS:-1}
SIM_FLAGS=${SIM_FLAGS:---kv-event-delay-ms 1 --network-delay-ms 1}
OUT=${OUT:-target/sim-vs-live}
[ -x "$BIN" ] || cargo build --release -j2 -p kvrouter
SERVE=""
trap '[ -n "$SERVE" ] && kill $SERVE 2>/dev/null || true' EXIT
for MODE in ${MODES//,/ }; do
  for R in $(seq 1 "$REPEATS"); do
    D="$OUT/$MODE/live$R"
    mkdir -p "$D"
    "$BIN" serve --mock-workers "$WORKERS" --port 0 --router-mode "$MODE" >"$D/serve.log" 2>&1 &
    SERVE=$!
    URL=""
    for _ in $(seq 1 100); do
      URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$D/serve.log" | head -1 || true)
      [ -n "$URL" ] && break
      sleep 0.1
    done
    [ -n "$URL" ] || { echo "serve did not start; see $D/serve.log" >&2; exit 1; }
    "$BIN" bench --url "$URL" --trace "$TRACE" --max-requests "$N" --arrival-speedup "$SPEEDUP" \
      --name live --out "$D" --quiet >/dev/null
    kill "$SERVE" 2>/dev/null || true
    wait "$SERVE" 2>/dev/null || true
    SERVE=""
  done
  # shellcheck disable=SC2086
  "$BIN" sim --trace "$TRACE" --workers "$WORKERS" --max-requests "$N" \
    --arrival-speedup "$SPEEDUP" --router-mode "$MODE" $SIM_FLAGS --out "$OUT/$MODE/sim" \
    --quiet >/dev/null
  # shellcheck disable=SC2086
  "$BIN" sim --trace "$TRACE" --workers "$WORKERS" --max-requests "$N" \
    --arrival-speedup "$SPEEDUP" --router-mode "$MODE" $SIM_FLAGS \
    --ingress-us-per-token "${INGRESS:-0.05}" --out "$OUT/$MODE/sim-ingress" --quiet >/dev/null
  for NET in 0 2; do
    "$BIN" sim --trace "$TRACE" --workers "$WORKERS" --max-requests "$N" \
      --arrival-speedup "$SPEEDUP" --router-mode "$MODE" --kv-event-delay-ms 1 \
      --network-delay-ms "$NET" --out "$OUT/$MODE/sim-net$NET" --quiet >/dev/null
  done
done
python3 - "$OUT" "$MODES" "$REPEATS" <<'PY'
import json, sys
out, modes, repeats = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
load = lambda p: json.load(open(f"{p}/summary.json"))[0]
print("| mode | live TTFT p50 ms | sim TTFT p50 ms | Δ | sim range | live hit | sim hit | Δ points | sim range | ceiling |")
print("|---|---|---|---|---|---|---|---|---|---|")
for m in modes:
    lives = [load(f"{out}/{m}/live{r}") for r in range(1, repeats + 1)]
    sim = load(f"{out}/{m}/sim")
    rng = [load(f"{out}/{m}/sim-net{n}") for n in (0, 2)] + [sim, load(f"{out}/{m}/sim-ingress")]
    lt = sum(l["ttft_ms"]["p50"] for l in lives) / len(lives)
    lh = sum(l["hit_rate"] for l in lives) / len(lives)
    st, sh = sim["ttft_ms"]["p50"], sim["hit_rate"]
    each_t = " / ".join(f"{l['ttft_ms']['p50']:.0f}" for l in lives)
    each_h = " / ".join(f"{l['hit_rate']:.3f}" for l in lives)
    rt = [r["ttft_ms"]["p50"] for r in rng]
    rh = [r["hit_rate"] for r in rng]
    print(f"| {m} | {each_t} | {st:.0f} | {(st - lt) / lt * 100:+.1f} % | {min(rt):.0f}–{max(rt):.0f} "
          f"| {each_h} | {sh:.3f} | {(sh - lh) * 100:+.1f} | {min(rh):.3f}–{max(rh):.3f} "
          f"| {sim['hit_rate_ceiling']:.3f} |")
PY
