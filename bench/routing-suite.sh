#!/usr/bin/env bash
# Routing-quality suite (issue 16's Targets): every workload through `kvrouter sim` with default
# flags and seeds, one column per routing mode, written as ONE markdown table and a JSON.
#
# Usage: bench/routing-suite.sh [--quick] [EXTRA_MODES]
#   EXTRA_MODES  comma-separated `--compare` items added after round-robin,least-loaded,kv
#                (e.g. a new default mode, or kv:router_predicted_ttl_secs=30); also $MODES_EXTRA
#   --quick      cap every trace at $QUICK_REQUESTS requests (default 2000) and shrink the
#                generated RL workloads (see below), for a run of minutes on the debug binary
# Environment: BIN (default target/debug/kvrouter), OUT (default bench/routing-suite), TRACES
# (default ../shared/traces), SIM_FLAGS (more flags for every run).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
EXTRA=${MODES_EXTRA:-}
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    -*) echo "unknown flag $a" >&2; exit 2 ;;
    *) EXTRA=$a ;;
  esac
done
BIN=${BIN:-target/debug/kvrouter}
OUT=${OUT:-bench/routing-suite}
TRACES=${TRACES:-../shared/traces}
QUICK_REQUESTS=${QUICK_REQUESTS:-2000}
MODES="round-robin,least-loaded,kv${EXTRA:+,$EXTRA}"
[ -x "$BIN" ] || cargo build -p kvrouter
RUNS="$OUT/runs"
mkdir -p "$RUNS"
CAP=()
GRPO_ARGS=""
AGENTIC_RL_ARGS="steps=2,group_size=4"
if [ "$QUICK" = 1 ]; then
  CAP=(--max-requests "$QUICK_REQUESTS")
  GRPO_ARGS="prompts=16,"
  AGENTIC_RL_ARGS="steps=2,group_size=4,sessions=16"
fi
MOONCAKE="$TRACES/mooncake_conversation/conversation_trace.jsonl"
# name|workers|flags (word-split; no spaces inside a flag value)
WORKLOADS=(
  "seed001|4|--workload seed001"
  "mooncake-x1|8|--trace $MOONCAKE ${CAP[*]}"
  "mooncake-x4|8|--trace $MOONCAKE --arrival-speedup 4 ${CAP[*]}"
  "claude-code-sessions|8|--trace $TRACES/claude_code_sessions_dev ${CAP[*]}"
  "agentic|8|--workload agentic ${CAP[*]}"
  "agentic-rl|8|--workload agentic --workload-args $AGENTIC_RL_ARGS"
  "grpo-math|8|--workload grpo${GRPO_ARGS:+ --workload-args ${GRPO_ARGS%,}}"
  "grpo-2k-prompt|8|--workload grpo --workload-args ${GRPO_ARGS}problem_median=2000,problem_sigma=0.1"
)
START=$(date +%s)
for spec in "${WORKLOADS[@]}"; do
  IFS='|' read -r name workers flags <<<"$spec"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  "$BIN" sim $flags --workers "$workers" --compare "$MODES" ${SIM_FLAGS:-} \
    --out "$RUNS/$name" --quiet >"$RUNS/$name.txt"
  echo "$name: $(($(date +%s) - t0)) s" >&2
done
ELAPSED=$(($(date +%s) - START))
python3 - "$OUT" "$MODES" "$QUICK" "$ELAPSED" "$BIN" "${WORKLOADS[@]}" <<'PY'
import json, sys
out, modes, quick, elapsed, binary = sys.argv[1:6]
specs = [s.split("|") for s in sys.argv[6:]]
modes = modes.split(",")
rows, table = [], []
fmt = lambda v, d: "–" if v is None else f"{v:.{d}f}"
for name, workers, flags in specs:
    runs = {r["config"]: r for r in json.load(open(f"{out}/runs/{name}/summary.json"))}
    first = runs[modes[0]]
    rl = first.get("rl") is not None
    entry = {"workload": name, "workers": int(workers), "flags": flags.strip(),
             "requests": first["requests"],
             "hit_rate_ceiling": first["hit_rate_ceiling"],
             "hit_rate_ceiling_finite": first.get("hit_rate_ceiling_finite"),
             "hit_rate_lru_fleet": first.get("hit_rate_lru_fleet"), "modes": {}}
    for m in modes:
        r = runs[m]
        e = {"ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
             "ttft_mean_ms": r["ttft_ms"]["mean"], "hit_rate": r["hit_rate"],
             "hit_rate_ceiling_finite": r.get("hit_rate_ceiling_finite")}
        if r.get("rl"):
            e["step_time_s"] = r["rl"]["step_time_s"]["mean"]
            b = r["rl"].get("step_time_lower_bound_s")
            e["step_time_lower_bound_s"] = b and b["mean"]
        entry["modes"][m] = e
    rows.append(entry)
    best = lambda key, lower=True: (min if lower else max)(entry["modes"][m][key] for m in modes)
    def line(metric, key, d, limit, lower=True):
        b = best(key, lower)
        cells = []
        for m in modes:
            v = entry["modes"][m][key]
            s = fmt(v, d)
            cells.append(f"**{s}**" if v == b and len(modes) > 1 else s)
        table.append(f"| {name} ({workers} w) | {metric} | {limit} | " + " | ".join(cells) + " |")
    line("TTFT p50 ms", "ttft_p50_ms", 1, "")
    line("TTFT p99 ms", "ttft_p99_ms", 1, "")
    line("TTFT mean ms", "ttft_mean_ms", 1, "")
    lim = (f"ceiling {entry['hit_rate_ceiling']:.3f}; finite {fmt(entry['hit_rate_ceiling_finite'], 3)}"
           f" (LRU {fmt(entry['hit_rate_lru_fleet'], 3)})")
    line("hit rate", "hit_rate", 3, lim, lower=False)
    if rl:
        bounds = {entry["modes"][m].get("step_time_lower_bound_s") for m in modes}
        line("RL step s (mean)", "step_time_s", 1,
             "bound " + "/".join(fmt(b, 1) for b in sorted(bounds, key=lambda x: x or 0)))
head = [
    f"<!-- written by bench/routing-suite.sh{' --quick' if quick == '1' else ''}; {binary}; "
    f"{elapsed} s wall -->",
    "",
    "| workload | metric | limit | " + " | ".join(modes) + " |",
    "|---|---|---|" + "---|" * len(modes),
]
open(f"{out}/results.md", "w").write("\n".join(head + table) + "\n")
json.dump({"quick": quick == "1", "wall_s": int(elapsed), "modes": modes, "workloads": rows},
          open(f"{out}/results.json", "w"), indent=1)
print("\n".join(head + table))
PY
