#!/usr/bin/env bash
# Create target/peers-venv with the peer routers compared by bench/peers/run.sh.
# Pinned to the versions that installed and were tested (Python 3.11, linux x86_64 wheels):
#   sglang-router==0.3.2  (entry point `sglang-router launch`, the "smg" gateway)
#   vllm-router==0.1.17   (entry point `vllm-router`)
# Override with SGLANG_ROUTER_SPEC / VLLM_ROUTER_SPEC (e.g. SGLANG_ROUTER_SPEC=sglang-router
# for the latest). A package that fails to install is reported and skipped; run.sh then marks
# its configs as failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-target/peers-venv}
SGLANG_ROUTER_SPEC=${SGLANG_ROUTER_SPEC:-sglang-router==0.3.2}
VLLM_ROUTER_SPEC=${VLLM_ROUTER_SPEC:-vllm-router==0.1.17}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || { echo "cannot create venv $VENV" >&2; exit 1; }
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

status=0
for spec in "$SGLANG_ROUTER_SPEC" "$VLLM_ROUTER_SPEC"; do
  if "$VENV/bin/python" -m pip install -q "$spec"; then
    echo "installed $spec"
  else
    echo "FAILED to install $spec (continuing; its configs will be skipped)" >&2
    status=1
  fi
done
echo "--- installed router versions"
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(sglang-router|vllm-router) ' || true
exit $status
