#!/usr/bin/env bash
# Placement quality of the pick API against proxy mode on the GRPO burst workload (every
# sample of a step released at once): the same router configuration, a fresh router per run,
# `kvrouter bench` proxying through it or driving its pick API (--pick). Prints both hit rates.
#
#   scripts/bench/picker_quality.sh [path/to/kvrouter]    (bounded: 2 x 1,024 requests)
set -euo pipefail
bin="${1:-target/debug/kvrouter}"
out="$(mktemp -d)"
trap 'rm -rf "$out"; [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true' EXIT
workload="prompts=32,group_size=16,steps=2,output_median=200,output_cap=512,sync_pause_s=0.2,seed=7"
for mode in proxy pick; do
    "$bin" serve --port 0 --mock-workers 4 --mock-speedup-ratio 20 >"$out/$mode.serve" 2>/dev/null &
    pid=$!
    for _ in $(seq 1 100); do grep -q listening "$out/$mode.serve" 2>/dev/null && break; sleep 0.1; done
    url="$(grep -o 'http://[^ ]*' "$out/$mode.serve")"
    flag=()
    [ "$mode" = pick ] && flag=(--pick)
    timeout 600 "$bin" bench --url "$url" --workload grpo --workload-args "$workload" \
        --group-sizes --max-requests 0 --name "$mode" --out "$out/$mode" --quiet "${flag[@]}" >/dev/null
    python3 -c "import json,sys; s=json.load(open(sys.argv[1]))[0]; print(f\"{sys.argv[2]}: requests {s['requests']} completed {s['completed']} hit_rate {s['hit_rate']:.4f} ttft_p50_ms {s['ttft_ms']['p50']:.1f}\")" "$out/$mode/summary.json" "$mode"
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
done
