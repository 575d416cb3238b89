#!/usr/bin/env bash
# Router replicas over NATS: 3 `kvrouter serve` replicas with --replica-sync, 3 without, and one
# router alone, each in front of the same 8 mock engines (KV events on), on the GRPO-burst and the
# agentic workloads; `kvrouter bench` spreads requests over the replicas round-robin (--url x3).
# Writes bench/replicas/results.md: served hit rate, TTFT p50, and replica CPU per request (from
# /proc, user + system, summed over the replicas).
# Usage: bench/replicas/run.sh            (env: BIN, ENGINES, SPEEDUP, OUT, GRPO_ARGS, AGENTIC_ARGS)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/debug/kvrouter}
ENGINES=${ENGINES:-8}
SPEEDUP=${SPEEDUP:-10}
OUT=${OUT:-target/bench-replicas}
NATS=${NATS:-$(command -v nats-server || echo /usr/sbin/nats-server)}
# GRPO burst: 16 prompts x 8 samples, one step, each prompt ~2,000 tokens, the whole batch at once.
GRPO_ARGS=${GRPO_ARGS:-prompts=16,group_size=8,steps=1,template_tokens=200,problem_median=1800,problem_cap=1800,output_median=64,output_cap=128}
AGENTIC_ARGS=${AGENTIC_ARGS:-sessions=12,steps=1,group_size=4,output_median=48,turns_median=4}
# Bench flags for the GRPO run: a GRPO client knows its group size and sends it (x-kvrouter-group-size).
# GRPO_BENCH_FLAGS=--group-header sends the id only.
GRPO_BENCH_FLAGS=${GRPO_BENCH_FLAGS:---group-sizes}
# `kv` local routers: the mode of the figures in the docs (the default became `cost` in session 16).
ROUTER_FLAGS=(--router-mode kv --router-predicted-ttl-secs 5 --health-check-interval-secs 0)
[ -x "$BIN" ] || { echo "build $BIN first (cargo build -p kvrouter)" >&2; exit 1; }
[ -x "$NATS" ] || { echo "nats-server not found (apt-get install nats-server)" >&2; exit 1; }
mkdir -p "$OUT"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# start NAME ARGS...: starts kvrouter, waits for its address line, prints the URL.
start() {
  local name=$1; shift
  "$BIN" "$@" >"$OUT/$name.log" 2>"$OUT/$name.err" &
  PIDS+=($!)
  echo $! >"$OUT/$name.pid"
  for _ in $(seq 1 200); do
    url=$(grep -o 'http://127.0.0.1:[0-9]*' "$OUT/$name.log" | head -1 || true)
    [ -n "$url" ] && { echo "$url"; return; }
    sleep 0.05
  done
  echo "$name did not start" >&2; exit 1
}
cpu_ticks() { local t=0; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' /proc/"$p"/stat))); done; echo $t; }
stop_all_routers() { for f in "$OUT"/r*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; done; sleep 0.3; }

port=$(free_port)
"$NATS" -js -a 127.0.0.1 -p "$port" -sd "$OUT/js" >"$OUT/nats.log" 2>&1 &
PIDS+=($!)
NATS_URL="nats://127.0.0.1:$port"

# Fresh engines for every run: every run starts with cold caches.
start_engines() {
  WORKERS=()
  for i in $(seq 1 "$ENGINES"); do
    WORKERS+=(--worker "$(start "e$i" mock-engine --port 0 --speedup-ratio "$SPEEDUP" --kv-events-endpoint tcp://127.0.0.1:0)")
  done
}
stop_engines() { for f in "$OUT"/e*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; done; sleep 0.3; }

# run SETUP WORKLOAD ARGS: starts the routers of SETUP, replays WORKLOAD, records the figures.
run() {
  local setup=$1 workload=$2 wargs=$3 n urls=() pids=() extra=()
  case $setup in
    alone) n=1 ;;
    sync) n=3; extra=(--replica-sync "$NATS_URL" --replica-cluster "b$RANDOM") ;;
    nosync) n=3 ;;
  esac
  start_engines
  for i in $(seq 1 $n); do
    local id=() ; [ "$setup" = sync ] && id=(--replica-id "$i")
    urls+=(--url "$(start "r$i" serve --port 0 "${ROUTER_FLAGS[@]}" "${WORKERS[@]}" "${extra[@]}" "${id[@]}")")
    pids+=("$(cat "$OUT/r$i.pid")")
  done
  if [ "$setup" = sync ]; then
    # Every replica hears from the others before the run.
    for u in "${urls[@]}"; do
      [ "$u" = --url ] && continue
      for _ in $(seq 1 200); do
        curl -s "$u/metrics" | grep -q "^kvrouter_replica_peers_alive $((n - 1))" && break
        sleep 0.05
      done
    done
  fi
  local before; before=$(cpu_ticks "${pids[@]}")
  local gflags=(--group-header); [ "$workload" = grpo ] && read -ra gflags <<<"$GRPO_BENCH_FLAGS"
  "$BIN" bench "${urls[@]}" --workload "$workload" --workload-args "$wargs" --session-header \
    "${gflags[@]}" --name "$setup-$workload" --out "$OUT/$setup-$workload" --quiet >"$OUT/$setup-$workload.txt"
  local after; after=$(cpu_ticks "${pids[@]}")
  echo "$setup $workload $((after - before))" >>"$OUT/cpu.txt"
  stop_all_routers
  stop_engines
}

rm -f "$OUT/cpu.txt"
for w in grpo agentic; do
  args=$GRPO_ARGS; [ $w = agentic ] && args=$AGENTIC_ARGS
  for setup in alone sync nosync; do run $setup $w "$args"; done
done

python3 - "$OUT" "$(getconf CLK_TCK)" "$BIN" <<'PY' > bench/replicas/results.md
import json, sys
out, hz, binary = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cpu = {}
for line in open(f"{out}/cpu.txt"):
    s, w, t = line.split()
    cpu[(s, w)] = int(t) / hz
print("# Router replicas over NATS: results\n")
print(f"`bench/replicas/run.sh` (binary `{binary}`), 8 mock engines (speed-up 10, KV events on),")
print("`--router-predicted-ttl-secs 5`; `kvrouter bench --url` x3 round-robin over the replicas.")
print("Loopback, one small machine shared with other jobs: compare rows, not absolute figures.\n")
print("| workload | setup | requests | served hit rate | vs alone | TTFT p50 ms | vs alone | replica CPU ms/request |")
print("|---|---|---|---|---|---|---|---|")
for w in ("grpo", "agentic"):
    base = json.load(open(f"{out}/alone-{w}/summary.json"))[0]
    for s in ("alone", "sync", "nosync"):
        r = json.load(open(f"{out}/{s}-{w}/summary.json"))[0]
        n = max(r["completed"], 1)
        hit, ttft = r["hit_rate"], r["ttft_ms"]["p50"]
        rel_hit = hit / base["hit_rate"] if base["hit_rate"] else float("nan")
        rel_ttft = ttft / base["ttft_ms"]["p50"] if base["ttft_ms"]["p50"] else float("nan")
        name = {"alone": "1 router", "sync": "3 replicas, --replica-sync", "nosync": "3 replicas, no sync"}[s]
        print(f"| {w} | {name} | {r['completed']} | {hit:.3f} | {rel_hit:.2f}x | {ttft:.1f} | {rel_ttft:.2f}x | {cpu[(s, w)] * 1e3 / n:.2f} |")
print()
for w in ("grpo", "agentic"):
    s, n = cpu[("sync", w)], cpu[("nosync", w)]
    print(f"- {w}: replica CPU with sync / without = {s / n:.2f}x" if n else f"- {w}: no CPU measured")
PY
cat bench/replicas/results.md
