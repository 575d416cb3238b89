#!/usr/bin/env bash
# Peer comparison: kvrouter vs sglang-router vs vllm-router, all in front of the same
# `kvrouter mock-engine` processes on loopback, driven by `kvrouter bench`.
#
# Usage: bench/peers/run.sh            (full run; see README.md for the knobs)
#        SCALE=small bench/peers/run.sh (reduced counts, a few minutes)
#
# Env knobs (defaults in brackets):
#   ENGINES [4]            mock engines per config
#   SPEEDUP [10]           mock-engine --speedup-ratio for the agentic and GRPO workloads
#   OVERHEAD_SPEEDUP [1000] mock-engine --speedup-ratio for the overhead workload
#   CONFIGS [all]          space-separated subset of the config names below
#   WORKLOADS [agentic grpo overhead]
#   SCALE [full|small]     request counts / durations
#   OUT [bench/peers/out]  where summary.json files go (one dir per workload/config)
#   THINK_SCALE [0.1]      multiply the agentic trace's think_time by this (a scaled copy of the
#                          trace is written under target/peers-traces; 1 = replay as recorded)
#   BIN [target/release/kvrouter], VENV [target/peers-venv]
#   KVROUTER_EXTRA []      more `kvrouter serve` flags for every kvrouter config, e.g.
#                          `--expose-decisions` (each decision then lands in requests.jsonl)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BIN=${BIN:-target/release/kvrouter}
VENV=${VENV:-target/peers-venv}
ENGINES=${ENGINES:-4}
SPEEDUP=${SPEEDUP:-10}
OVERHEAD_SPEEDUP=${OVERHEAD_SPEEDUP:-1000}
OUT=${OUT:-bench/peers/out}
SCALE=${SCALE:-full}
TRACE=${TRACE:-/work/shared/traces/claude_code_sessions_dev}
ALL_CONFIGS="kvrouter-cost kvrouter-cost-session kvrouter-cost-fit kvrouter-kv kvrouter-kv-pred kvrouter-kv-group kvrouter-rr sglang-cache_aware sglang-rr vllm-kv_aware vllm-cache_aware vllm-consistent_hash vllm-rr"
CONFIGS=${CONFIGS:-$ALL_CONFIGS}
WORKLOADS=${WORKLOADS:-agentic grpo overhead}
MODEL=mock-model
THINK_SCALE=${THINK_SCALE:-0.1}
if [ "$THINK_SCALE" != 1 ]; then
  SCALED="target/peers-traces/$(basename "$TRACE")-think$THINK_SCALE"
  python3 - "$TRACE" "$SCALED" "$THINK_SCALE" <<'PY'
import json, os, sys
src, dst, k = sys.argv[1], sys.argv[2], float(sys.argv[3])
os.makedirs(dst, exist_ok=True)
def scale(x):
    if isinstance(x, dict):
        return {a: (b * k if a == "think_time" and isinstance(b, (int, float)) else scale(b)) for a, b in x.items()}
    if isinstance(x, list):
        return [scale(v) for v in x]
    return x
files = sorted(f for f in os.listdir(src) if f.endswith(".json")) if os.path.isdir(src) else [os.path.basename(src)]
for f in files:
    path = os.path.join(src, f) if os.path.isdir(src) else src
    json.dump(scale(json.load(open(path))), open(os.path.join(dst, f), "w"))
PY
  TRACE=$SCALED
fi

if [ "$SCALE" = small ]; then
  AGENTIC_ARGS=(--trace "$TRACE" --session-gap-s 1 --max-requests 200 --duration-s 40)
  GRPO_ARGS=(--workload grpo --workload-args "prompts=4,group_size=12,steps=2,template_tokens=53,problem_median=1950,problem_sigma=0.05,problem_cap=2048,output_median=64,output_sigma_between=0.3,output_sigma_within=0.3,output_cap=256,sync_pause_s=0.2" --max-requests 0 --duration-s 60)
  OVERHEAD_N=${OVERHEAD_N:-200}
  OVERHEAD_CONC=${OVERHEAD_CONC:-"1 8 32"}
else
  AGENTIC_ARGS=(--trace "$TRACE" --session-gap-s 1 --max-requests 200 --duration-s 120)
  GRPO_ARGS=(--workload grpo --workload-args "prompts=8,group_size=16,steps=2,template_tokens=53,problem_median=1950,problem_sigma=0.05,problem_cap=2048,output_median=128,output_sigma_between=0.5,output_sigma_within=0.5,output_cap=512,sync_pause_s=0.5" --max-requests 0 --duration-s 120)
  OVERHEAD_N=${OVERHEAD_N:-1000}
  OVERHEAD_CONC=${OVERHEAD_CONC:-"1 8 32"}
fi
# Fixed 128-token prompts, 16 output tokens, no shared prefix (seed001 with shared_fraction=0).
overhead_args() {
  echo "--workload seed001 --workload-args requests=$OVERHEAD_N,rate_per_s=1000,shared_fraction=0,document_tokens=128,output_tokens=16 --max-requests 0 --duration-s 60 --concurrency $1"
}

[ -x "$BIN" ] || { echo "missing $BIN (cargo build --release -p kvrouter)" >&2; exit 1; }
LOGS="$OUT/logs"
mkdir -p "$LOGS"

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  for p in "${PIDS[@]:-}"; do
    [ -n "$p" ] && wait "$p" 2>/dev/null || true
  done
  PIDS=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

ENGINE_URLS=()
ENGINE_KV=()
start_engines() { # $1 = speedup ratio, $2 = log tag
  ENGINE_URLS=(); ENGINE_KV=()
  for i in $(seq 0 $((ENGINES - 1))); do
    local log="$LOGS/$2-engine$i.log"
    "$BIN" mock-engine --port 0 --kv-events-endpoint tcp://127.0.0.1:0 --speedup-ratio "$1" \
      --model-name "$MODEL" --seed "$i" >"$log" 2>&1 &
    PIDS+=($!)
  done
  for i in $(seq 0 $((ENGINES - 1))); do
    local log="$LOGS/$2-engine$i.log" line=""
    for _ in $(seq 1 100); do
      line=$(grep -m1 'listening on http://' "$log" || true)
      [ -n "$line" ] && break
      sleep 0.1
    done
    [ -n "$line" ] || { echo "mock engine $i did not start; see $log" >&2; return 1; }
    ENGINE_URLS+=("$(echo "$line" | grep -o 'http://127.0.0.1:[0-9]*')")
    ENGINE_KV+=("$(echo "$line" | grep -o 'kv_events=tcp://127.0.0.1:[0-9]*' | cut -d= -f2)")
  done
}

# sglang-router's OpenAI frontend takes no token ids (HTTP 422 on "prompt": [ints]); it gets the
# same prompts as text (`kvrouter bench --prompt-format text`, one token per two-letter word with
# the mock engines' built-in tokenizer). PROMPT_FORMAT=text sends text to every router.
prompt_format() { case $1 in sglang-*) echo text ;; *) echo "${PROMPT_FORMAT:-tokens}" ;; esac; }
probe_prompt() { [ "$(prompt_format "$1")" = text ] && echo '" ab cd ef gh"' || echo '[1,2,3,4]'; }

ROUTER_URL=""
ROUTER_FLAGS=""
start_router() { # $1 = config name, $2 = log file
  local cfg=$1 log=$2 port
  ROUTER_FLAGS=""
  port=$(free_port)
  ROUTER_URL="http://127.0.0.1:$port"
  local cmd=()
  case $cfg in
    kvrouter-kv|kvrouter-kv-pred|kvrouter-kv-group|kvrouter-cost|kvrouter-cost-session|kvrouter-cost-fit|kvrouter-rr)
      local mode=kv; [ "$cfg" = kvrouter-rr ] && mode=round-robin
      # cost: the cost model in seconds (issue 16), default flags otherwise.
      [ "${cfg#kvrouter-cost}" != "$cfg" ] && mode=cost
      cmd=("$BIN" serve --host 127.0.0.1 --port "$port" --router-mode "$mode" --model-name "$MODEL")
      # cost: told the engines' speed-up ($speed, from run_one: they run dynamo-poly that much
      # faster), as an operator gives real engines' profile; cost-fit: fitted online from the
      # TTFT and ITL it observes instead.
      # cost-session: the same, and the bench sends each request's session (x-session-id).
      case $cfg in kvrouter-cost|kvrouter-cost-session) cmd+=(--router-cost-speedup-ratio "$speed") ;; esac
      [ "$cfg" = kvrouter-cost-fit ] && cmd+=(--router-cost-fit)
      # KVROUTER_EXTRA: more serve flags for every kvrouter config (word-split).
      # shellcheck disable=SC2206
      cmd+=(${KVROUTER_EXTRA:-})
      # kv-pred: also count placements the router just made, before the engines' KV events arrive.
      [ "$cfg" = kvrouter-kv-pred ] && cmd+=(--router-predicted-ttl-secs 10)
      # kv-group: GRPO siblings (x-kvrouter-group-id, sent by the bench) follow their group.
      [ "$cfg" = kvrouter-kv-group ] && cmd+=(--router-group-max-skew 8)
      for u in "${ENGINE_URLS[@]}"; do cmd+=(--worker "$u"); done ;;
    sglang-cache_aware|sglang-rr)
      local pol=cache_aware; [ "$cfg" = sglang-rr ] && pol=round_robin
      [ -x "$VENV/bin/sglang-router" ] || { echo "sglang-router not installed" >&2; return 2; }
      cmd=("$VENV/bin/sglang-router" launch --host 127.0.0.1 --port "$port" --policy "$pol"
        --log-level warn --worker-urls "${ENGINE_URLS[@]}") ;;
    vllm-kv_aware|vllm-cache_aware|vllm-consistent_hash|vllm-rr)
      local pol=${cfg#vllm-}; [ "$pol" = rr ] && pol=round_robin
      [ -x "$VENV/bin/vllm-router" ] || { echo "vllm-router not installed" >&2; return 2; }
      cmd=("$VENV/bin/vllm-router" --host 127.0.0.1 --port "$port" --policy "$pol"
        --log-level warning --worker-startup-check-interval 1 --worker-urls "${ENGINE_URLS[@]}")
      if [ "$pol" = kv_aware ]; then
        cmd+=(--kv-event-block-size 64 --kv-event-model "$MODEL")
        for i in "${!ENGINE_URLS[@]}"; do cmd+=(--kv-event-source "${ENGINE_URLS[$i]}=${ENGINE_KV[$i]}"); done
      fi ;;
    *) echo "unknown config $cfg" >&2; return 2 ;;
  esac
  # Record the flags with engine addresses abstracted (they change on every restart).
  ROUTER_FLAGS=$(printf '%s ' "${cmd[@]}" | sed -E "s#$ROOT/##g; s#--port $port#--port P#g; s#127.0.0.1:[0-9]+#127.0.0.1:P#g")
  "${cmd[@]}" >"$log" 2>&1 &
  PIDS+=($!)
  local rpid=$!
  for _ in $(seq 1 300); do # at most ~60 s
    kill -0 "$rpid" 2>/dev/null || { echo "$cfg exited during startup; see $log" >&2; tail -5 "$log" >&2; return 1; }
    if curl -sf -m 2 "$ROUTER_URL/v1/models" >/dev/null 2>&1; then
      # One tiny token-id completion to be sure the data path works before timing anything.
      local code
      code=$(curl -s -m 10 -o "$log.probe" -w '%{http_code}' "$ROUTER_URL/v1/completions" \
        -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL\",\"prompt\":$(probe_prompt "$cfg"),\"max_tokens\":1}" 2>/dev/null || true)
      [ "$code" = 200 ] && return 0
      case $code in 4*) # the router refuses a token-id prompt: no point waiting
        echo "$cfg: POST /v1/completions with a token-id prompt -> HTTP $code: $(head -c 300 "$log.probe")" >&2
        return 1 ;;
      esac
    fi
    sleep 0.2
  done
  echo "$cfg not ready after 60 s; see $log" >&2
  return 1
}

run_one() { # $1 = workload tag, $2 = config, $3 = engine speedup, rest = bench args
  local tag=$1 cfg=$2 speed=$3; shift 3
  local dir="$OUT/$tag/$cfg"
  rm -rf "$dir"; mkdir -p "$dir"
  cleanup
  if ! start_engines "$speed" "$tag-$cfg"; then echo "FAIL $tag $cfg: engines" | tee "$dir/error.txt"; cleanup; return 0; fi
  if ! start_router "$cfg" "$LOGS/$tag-$cfg-router.log" 2>"$dir/error.txt"; then
    [ -n "$ROUTER_FLAGS" ] && echo "$ROUTER_FLAGS" >"$dir/router_cmd.txt"
    echo "FAIL $tag $cfg: router: $(cat "$dir/error.txt" | tr '\n' ' ')"; cleanup; return 0
  fi
  echo "$ROUTER_FLAGS" >"$dir/router_cmd.txt"
  local fmt; fmt=$(prompt_format "$cfg")
  local extra=(); [ "$cfg" = kvrouter-kv-group ] && extra=(--group-header)
  [ "$cfg" = kvrouter-cost-session ] && extra=(--session-header)
  echo "kvrouter bench $* --prompt-format $fmt (mock-engine --speedup-ratio $speed, $ENGINES engines)" >"$dir/bench_cmd.txt"
  local t0=$SECONDS
  if timeout 300 "$BIN" bench --url "$ROUTER_URL" --model "$MODEL" --name "$cfg" --out "$dir" --quiet --prompt-format "$fmt" "${extra[@]}" "$@" \
      >"$LOGS/$tag-$cfg-bench.log" 2>&1; then
    rm -f "$dir/error.txt"
    echo "ok   $tag $cfg ($((SECONDS - t0)) s)"
  else
    echo "FAIL $tag $cfg: bench rc=$? ($(tail -3 "$LOGS/$tag-$cfg-bench.log" | tr '\n' ' '))" | tee "$dir/error.txt"
  fi
  cleanup
}

for w in $WORKLOADS; do
  for cfg in $CONFIGS; do
    case $w in
      agentic) run_one agentic "$cfg" "$SPEEDUP" "${AGENTIC_ARGS[@]}" ;;
      grpo) run_one grpo "$cfg" "$SPEEDUP" "${GRPO_ARGS[@]}" ;;
      overhead)
        for c in $OVERHEAD_CONC; do
          # shellcheck disable=SC2046
          run_one "overhead-c$c" "$cfg" "$OVERHEAD_SPEEDUP" $(overhead_args "$c")
        done ;;
    esac
  done
done
"${PYTHON:-python3}" bench/peers/table.py "$OUT" bench/peers/results.md
echo "wrote bench/peers/results.md"
