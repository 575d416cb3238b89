#!/usr/bin/env bash
# kvrouter (one or two binaries) vs vllm-router 0.1.17 in the peer harness, interleaved per rep,
# streamed (python backend, 8 SSE chunks) and non-streamed (nginx static backend).
# Usage: bench/overhead/peer_ab.sh OUT_DIR NAME=KVROUTER_BIN [NAME=KVROUTER_BIN ...]
# Env: REPS (3), REQUESTS (4000), LAT_REQUESTS (300), WARMUP (1000), HARNESS
#      (../shared/peer-harness/overhead). Needs the harness's setup.sh to have run.
set -euo pipefail
OUT=$1; shift
HARNESS=${HARNESS:-../shared/peer-harness/overhead}
REPS=${REPS:-3}; N=${REQUESTS:-4000}; LAT=${LAT_REQUESTS:-300}; WARM=${WARMUP:-1000}
mkdir -p "$OUT"
run() {  # run LABEL ROUTER POLICY BIN MODE
  local label=$1 router=$2 pol=$3 bin=$4 mode=$5 extra=()
  [ "$mode" = stream ] && extra=(--backend python --stream) || extra=(--backend nginx)
  KVROUTER_BIN=$bin python3 "$HARNESS/bench_overhead.py" "${extra[@]}" --quiet-gate -1 \
    --requests "$N" --lat-requests "$LAT" --warmup "$WARM" --max-secs 60 \
    --routers "$router" --policies "$pol" --note "$label" --out "$OUT/$mode.jsonl" \
    2>>"$OUT/harness.log"
}
for rep in $(seq 1 "$REPS"); do
  for mode in stream plain; do
    for v in "$@"; do
      run "${v%%=*}" kvrouter round-robin "$(readlink -f "${v#*=}")" "$mode"
    done
    run vllm vllm round_robin none "$mode"
  done
done
