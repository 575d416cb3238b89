#!/usr/bin/env bash
# Global routing, live: two local `kvrouter serve` (4 embedded mock engines each; DC "slow" has
# mock engines SLOW_SPEEDUP/FAST_SPEEDUP as fast) behind `kvrouter serve --global`, against one
# flat `kvrouter serve` over the same 8 engines (4 fast + 4 slow `kvrouter mock-engine`), on the
# agentic workload through `kvrouter bench --session-header`. Every run starts with cold caches.
# Then the simulator on the same workload: `kvrouter sim --clusters` with
# bench/global/live-mirror.toml (the same two DCs, at FAST_SPEEDUP / SLOW_SPEEDUP).
# Writes bench/global/results.md: served hit rate, TTFT p50, share of requests per DC, and the
# simulator's TTFT p50 beside the live one per policy.
# Speeds: 1 / 0.4 by default, so each request's model time (prefill, decode steps of ~10-25 ms)
# dominates its latency, as on real engines (speed-up 1); at speed-up 10 a request's model time
# was 2-6 ms and the live TTFT measured the host's CPU queueing, not routing. Use the release
# binary: a debug build's router CPU is itself tens of ms per request on a loaded host.
# The host's load average and the kvrouter processes' CPU are sampled every 2 s (OUT/cpu.txt).
# Usage: bench/global/run.sh   (env: BIN, FAST_SPEEDUP, SLOW_SPEEDUP, POLICIES, OUT, AGENTIC_ARGS,
#        BENCH_FLAGS: more `kvrouter bench` flags, e.g. --end-sessions)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/kvrouter}
FAST_SPEEDUP=${FAST_SPEEDUP:-1}
SLOW_SPEEDUP=${SLOW_SPEEDUP:-0.4}
POLICIES=${POLICIES:-kv least-loaded static-split}
OUT=${OUT:-target/bench-global}
AGENTIC_ARGS=${AGENTIC_ARGS:-sessions=16,steps=1,group_size=4,turns_median=5,output_median=48,tool_latency_median_s=0.3,tool_latency_sigma=0.5,seed=7}
# `kv` local routers: the mode of the figures in the docs (the default became `cost` in session 16).
ROUTER_FLAGS=(--router-mode kv --router-predicted-ttl-secs 5 --health-check-interval-secs 0)
TOKEN=bench-global
[ -x "$BIN" ] || { echo "build $BIN first (cargo build --release -p kvrouter)" >&2; exit 1; }
mkdir -p "$OUT"
rm -f "$OUT/cpu.txt"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# start NAME ARGS...: starts kvrouter, waits (bounded) for its address line, prints the URL.
start() {
  local name=$1; shift
  "$BIN" "$@" >"$OUT/$name.log" 2>"$OUT/$name.err" &
  PIDS+=($!)
  echo $! >"$OUT/$name.pid"
  for _ in $(seq 1 400); do
    url=$(grep -o 'http://127.0.0.1:[0-9]*' "$OUT/$name.log" 2>/dev/null | head -1 || true)
    [ -n "$url" ] && { echo "$url"; return; }
    sleep 0.05
  done
  echo "$name did not start" >&2; exit 1
}
stop() { for f in "$OUT"/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; done; sleep 0.3; }
# The host's load while a bench runs, every 2 s: label, time s, 1-min load average, CPU seconds
# used so far by this run's serving processes (routers, engines; the report takes their rate:
# cores busy).
sample_cpu() {
  while :; do
    echo "$1 $(date +%s.%N) $(cut -d' ' -f1 /proc/loadavg) $(ps -o times= -p "$(cat "$OUT"/*.pid | paste -sd,)" | awk '{s+=$1} END {print s+0}')" >>"$OUT/cpu.txt"
    sleep 2
  done
}
bench() {
  sample_cpu "$2" &
  local sampler=$!
  PIDS+=("$sampler")
  # shellcheck disable=SC2086
  "$BIN" bench --url "$1" --workload agentic --workload-args "$AGENTIC_ARGS" --session-header \
    ${BENCH_FLAGS:-} --name "$2" --out "$OUT/$2" --quiet >"$OUT/$2.txt"
  kill "$sampler" 2>/dev/null || true
}
nproc >"$OUT/nproc.txt"

SECONDS=0
# Flat: one router over 4 fast + 4 slow engines.
WORKERS=()
for i in 1 2 3 4; do
  WORKERS+=(--worker "$(start "f$i" mock-engine --port 0 --speedup-ratio "$FAST_SPEEDUP" --kv-events-endpoint tcp://127.0.0.1:0)")
  WORKERS+=(--worker "$(start "s$i" mock-engine --port 0 --speedup-ratio "$SLOW_SPEEDUP" --kv-events-endpoint tcp://127.0.0.1:0)")
done
flat=$(start flat serve --port 0 "${ROUTER_FLAGS[@]}" "${WORKERS[@]}")
bench "$flat" flat
# Requests per engine speed class, from the flat router's metrics.
curl -s "$flat/metrics" >"$OUT/flat.metrics"
stop

for policy in $POLICIES; do
  fast=$(start fast serve --port 0 "${ROUTER_FLAGS[@]}" --mock-workers 4 --mock-speedup-ratio "$FAST_SPEEDUP" \
    --admin-token "$TOKEN" --cluster-name fast --cluster-summary-refresh-ms 200)
  slow=$(start slow serve --port 0 "${ROUTER_FLAGS[@]}" --mock-workers 4 --mock-speedup-ratio "$SLOW_SPEEDUP" \
    --admin-token "$TOKEN" --cluster-name slow --cluster-summary-refresh-ms 200)
  global=$(KVROUTER_CLUSTER_TOKEN=$TOKEN start global serve --port 0 --global --global-policy "$policy" \
    --cluster "fast=$fast" --cluster "slow=$slow" --global-refresh-ms 200)
  for _ in $(seq 1 200); do
    curl -s "$global/health" | grep -q '"available_clusters":2' && break
    sleep 0.05
  done
  bench "$global" "global-$policy"
  curl -s "$global/metrics" >"$OUT/global-$policy.metrics"
  curl -s "$fast/metrics" >"$OUT/fast-$policy.metrics"
  curl -s "$slow/metrics" >"$OUT/slow-$policy.metrics"
  stop
done
echo "$SECONDS" >"$OUT/seconds.txt"

# The simulator's counterpart: the mirror file at this run's speeds, the same workload and
# local-router flags, every policy in one run.
sed -e "/^name = \"fast\"/,/^$/ s/^speed = .*/speed = $FAST_SPEEDUP/" \
    -e "/^name = \"slow\"/,/^$/ s/^speed = .*/speed = $SLOW_SPEEDUP/" \
    bench/global/live-mirror.toml >"$OUT/live-mirror.toml"
"$BIN" sim --clusters "$OUT/live-mirror.toml" --workload agentic --workload-args "$AGENTIC_ARGS" \
  --global-policy "$(echo $POLICIES | tr ' ' ,)" --router-predicted-ttl-secs 5 --kv-event-delay-ms 1 \
  --out "$OUT/sim" --quiet >"$OUT/sim.txt"

python3 - "$OUT" "$BIN" "$FAST_SPEEDUP" "$SLOW_SPEEDUP" "$AGENTIC_ARGS" "$POLICIES" <<'PY' > bench/global/results.md
import json, re, sys
out, binary, fast, slow, args, policies = sys.argv[1:7]
policies = policies.split()
def summary(name):
    return json.load(open(f"{out}/{name}/summary.json"))[0]
def shares(name):
    n = {}
    for line in open(f"{out}/{name}.metrics"):
        m = re.match(r'kvrouter_global_requests_total\{cluster="(\w+)",reason="\w+"\} (\d+)', line)
        if m:
            n[m[1]] = n.get(m[1], 0) + int(m[2])
    moves = sum(int(l.split()[-1]) for l in open(f"{out}/{name}.metrics") if l.startswith("kvrouter_global_session_moves_total{"))
    total = sum(n.values()) or 1
    return n.get("fast", 0) / total, n.get("slow", 0) / total, moves
seconds = open(f"{out}/seconds.txt").read().strip()
print("# Global routing, live: results\n")
print(f"`bench/global/run.sh` (binary `{binary}`, {seconds} s in all). Two local `kvrouter serve` with 4")
print(f"embedded mock engines each, DC `fast` at speed-up {fast} and DC `slow` at {slow}, behind")
print("`kvrouter serve --global` (summaries every 200 ms); against one flat `kvrouter serve` over 4 + 4")
print(f"`kvrouter mock-engine` at the same speeds. Workload: `kvrouter bench --workload agentic")
print(f"--workload-args {args} --session-header`. Loopback, one small machine shared with other")
print("jobs: compare rows, not absolute figures.\n")
print("| setup | requests | served hit rate | vs flat | TTFT p50 ms | vs flat | share fast | share slow | session moves |")
print("|---|---|---|---|---|---|---|---|---|")
base = summary("flat")
print(f"| flat, 8 engines | {base['completed']} | {base['hit_rate']:.3f} | 1.00x | {base['ttft_ms']['p50']:.1f} | 1.00x | | | |")
for p in policies:
    r = summary(f"global-{p}")
    f, s, moves = shares(f"global-{p}")
    rh = r["hit_rate"] / base["hit_rate"] if base["hit_rate"] else float("nan")
    rt = r["ttft_ms"]["p50"] / base["ttft_ms"]["p50"] if base["ttft_ms"]["p50"] else float("nan")
    print(f"| global, --global-policy {p} | {r['completed']} | {r['hit_rate']:.3f} | {rh:.2f}x | {r['ttft_ms']['p50']:.1f} | {rt:.2f}x | {f:.2f} | {s:.2f} | {moves} |")
print()
print(f"Capacity share of DC `fast` by engine speed: {float(fast) / (float(fast) + float(slow)):.2f}.")
print()
print("Simulator, same workload: `kvrouter sim --clusters` with bench/global/live-mirror.toml at")
print(f"speeds {fast} / {slow} (`{out}/live-mirror.toml`), `--router-predicted-ttl-secs 5 --kv-event-delay-ms 1`.\n")
print("| policy | sim TTFT p50 ms | live TTFT p50 ms | live / sim | sim hit | live hit | sim share slow | live share slow |")
print("|---|---|---|---|---|---|---|---|")
sim = {p["policy"]: p for p in json.load(open(f"{out}/sim/summary.json"))}
for p in policies:
    s, r = sim[p], summary(f"global-{p}")
    n = sum(c["requests"] for c in s["clusters"]) or 1
    share = next((c["requests"] for c in s["clusters"] if c["name"] == "slow"), 0) / n
    _, live_slow, _ = shares(f"global-{p}")
    st, lt = s["ttft_ms"]["p50"], r["ttft_ms"]["p50"]
    ratio = lt / st if st else float("nan")
    print(f"| {p} | {st:.1f} | {lt:.1f} | {ratio:.2f}x | {s['hit_rate']:.3f} | {r['hit_rate']:.3f} | {share:.2f} | {live_slow:.2f} |")
print()
print(f"Host during each bench ({open(f'{out}/nproc.txt').read().strip()} cores; samples every 2 s): the serving")
print("processes' CPU (routers and engines, cores busy on average) and the 1-minute load average.\n")
print("| run | seconds | serving processes, cores | load average max |")
print("|---|---|---|---|")
runs = {}
for line in open(f"{out}/cpu.txt"):
    label, t, load, cpu = line.split()
    runs.setdefault(label, []).append((float(t), float(load), float(cpu)))
for label, r in runs.items():
    dt = r[-1][0] - r[0][0]
    cores = (r[-1][2] - r[0][2]) / dt if dt > 0 else float("nan")
    print(f"| {label} | {dt:.0f} | {cores:.2f} | {max(x[1] for x in r):.2f} |")
PY
cat bench/global/results.md
