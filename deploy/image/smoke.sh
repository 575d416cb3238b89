#!/usr/bin/env bash
# CI check of the container image: builds it FROM scratch (build.sh) from BINARY, starts it with
# podman (rootful, host network) as `serve --mock-workers 2`, sends one chat request from the
# host, checks the answer, that the process runs as the non-root user, and that SIGTERM stops it
# cleanly. Every step is bounded. Fails (never skips) when buildah, podman or runc is missing.
#
# What this sandbox allows (checked when written): no docker daemon; podman's default runtime
# crun fails here ("cgroups in hybrid mode not supported", and raising RLIMIT_NOFILE/NPROC above
# the hard limits is refused), so the container runs with runc and rlimits at or below ours.
#
#   deploy/image/smoke.sh [BINARY]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${1:-target/debug/kvrouter}"
tag=localhost/kvrouter:ci
name="kvrouter-smoke-$$"
for tool in buildah podman runc curl python3; do
    command -v "$tool" >/dev/null || { echo "smoke.sh: $tool not found (.ci/run installs it)" >&2; exit 1; }
done
timeout 300 "$here/build.sh" "$bin" "$tag"
timeout 60 podman image prune -f >/dev/null 2>&1 || true   # earlier builds' layers
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# At or below this shell's hard limits (raising them is refused here; NPROC even at the hard
# limit), enough for the router.
nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] || [ "$nofile" -gt 16384 ] && nofile=16384
nproc=$(ulimit -Hu); [ "$nproc" = unlimited ] || [ "$nproc" -gt 4096 ] && nproc=4096
log="$(dirname "$bin")/image-smoke.log"
cleanup() { timeout 30 podman rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT
timeout 60 podman run -d --name "$name" --runtime runc --network host \
    --ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc" \
    "$tag" serve --mock-workers 2 --port "$port" --shutdown-grace-secs 5 >/dev/null
# Wait (at most 60 s) for the router's startup lines.
for _ in $(seq 1 120); do
    if timeout 10 podman logs "$name" 2>/dev/null | grep -q "worker 1:"; then break; fi
    if [ "$(timeout 10 podman inspect -f '{{.State.Running}}' "$name")" != true ]; then
        echo "smoke.sh: the container stopped:" >&2; timeout 10 podman logs "$name" >&2; exit 1
    fi
    sleep 0.5
done
timeout 10 podman logs "$name" >"$log" 2>&1
grep -q "listening on http://0.0.0.0:$port" "$log" || { echo "smoke.sh: no startup line:" >&2; cat "$log" >&2; exit 1; }
grep -q "worker 1:" "$log" || { echo "smoke.sh: the workers were not listed:" >&2; cat "$log" >&2; exit 1; }
resp=$(curl -sS -m 20 -D - "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"Hello from the smoke test"}],"max_tokens":4}')
echo "$resp" | head -1 | grep -q " 200" || { echo "smoke.sh: request failed: $resp" >&2; exit 1; }
echo "$resp" | grep -qi "^x-kvrouter-worker:" || { echo "smoke.sh: no x-kvrouter-worker header: $resp" >&2; exit 1; }
echo "$resp" | grep -q '"completion_tokens":4' || { echo "smoke.sh: unexpected body: $resp" >&2; exit 1; }
user=$(timeout 10 podman top "$name" user | tail -n +2 | sort -u | tr -d ' ')
[ "$user" = kvrouter ] || { echo "smoke.sh: runs as '$user', not kvrouter" >&2; exit 1; }
timeout 30 podman stop -t 10 "$name" >/dev/null
code=$(timeout 10 podman inspect -f '{{.State.ExitCode}}' "$name")
[ "$code" = 0 ] || { echo "smoke.sh: exit code $code after SIGTERM:" >&2; timeout 10 podman logs "$name" >&2; exit 1; }
echo "smoke.sh: $tag answered a chat request on port $port as user kvrouter and stopped cleanly on SIGTERM"
